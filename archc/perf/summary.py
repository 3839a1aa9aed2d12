"""A short text summary of `archc bench` JSON reports — what the GPU check prints at the end:
``python -m archc.perf.summary results/*.json``. For each report: the model and shapes, then
the headline — decode at each measured context (archc's tokens/s and fraction of the bandwidth
bound, its speed-up over each torch.compile mode, decode attention against a copy of the same KV
bytes), the prefill kernels (the slowest fused matmul against torch.matmul and the unfused
sequence, attention against sdpa and FlashAttention-3's published TFLOP/s), the autotune
cache's first-run cost, and the goals —, then the sections that did not finish (and why),
every runner's prefill and decode with archc's speed-up over it, and the kernels where archc is
slowest against a PyTorch counterpart. A missing or unreadable file is named, not fatal.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from archc.versions import software_text


def fmt_seconds(seconds: float | None) -> str:
    return ("—" if seconds is None else f"{seconds * 1e3:.3f} ms" if seconds >= 1e-3 else
            f"{seconds * 1e6:.1f} µs")


def fmt_ratio(r: float | None) -> str:
    return "—" if r is None else f"{r:.2f}×"


def fmt_percent(r: float | None) -> str:
    return "—" if r is None else f"{100 * r:.0f}%"


def summarize(data: dict[str, Any], *, worst: int = 4) -> list[str]:
    shapes = data.get("shapes", {})
    layers = data.get("layers")
    kept = (f", first {layers} of {data.get('spec_layers')} blocks"
            if layers != data.get("spec_layers") else "")
    env = data.get("environment", {})
    lines = [f"{data.get('spec')}{kept}, {data.get('dtype')}, batch {shapes.get('batch')}, "
             f"prompt {shapes.get('prompt')}, decode {shapes.get('decode')} — "
             f"{env.get('device_name')}{' (DRY RUN)' if data.get('dry_run') else ''}"]
    if "torch" in env:      # the versions that produced the numbers
        lines.append("  " + software_text({k: env.get(k) for k in ("triton", "torch", "python")}))
    lines += headline(data)
    unfinished = {k: v for k, v in data.get("status", {}).items() if v != "done"}
    if unfinished:
        lines.append("  NOT DONE: " + ", ".join(f"{k} ({v})" for k, v in unfinished.items()))
    for e in data.get("errors", []):
        where = e.get("section", "") + (f" {e['kernel']}" if "kernel" in e else "")
        lines.append(f"  error in {where}: {e.get('error')}")
    dec = data.get("model", {}).get("decode", {})
    if data.get("quantize") and dec.get("dense_floor"):
        lines.append("  " + quant_line(data["quantize"], data["dtype"], dec, dec["dense_floor"]))
    c = data.get("ceilings")
    if c:
        lines.append(f"  ceilings: copy {c['copy_bandwidth'] / 1e12:.2f} TB/s, "
                     f"{c['matmul_dtype']} matmul {c['matmul_flops'] / 1e12:.0f} TFLOP/s")
    for phase, key in (("prefill", "seconds"), ("decode", "step_seconds")):
        for r in data.get("model", {}).get(phase, {}).get("runs", []):
            if r.get(key) is None:
                lines.append(f"  {phase} {r['name']}: no result")
                continue
            what = (f"{fmt_seconds(r['seconds'])}, {r['flops_per_second'] / 1e12:.1f} TFLOP/s "
                    f"({fmt_percent(r['peak_fraction'])} of peak)" if phase == "prefill" else
                    f"{r['tokens_per_second']:,.1f} tokens/s, "
                    f"{fmt_percent(r['floor_fraction'])} of the bandwidth floor")
            lines.append(f"  {phase} {r['name']}: {what}, archc speed-up "
                         f"{fmt_ratio(r.get('archc_speedup'))}")
    ratios = []     # a kernel that failed is among the errors above
    for k in data.get("kernels", []):
        for b in k.get("baselines", []):
            if b.get("archc_speedup") is not None:
                ratios.append((b["archc_speedup"], k, b))
            if b.get("agrees") is False:
                lines.append(f"  MISMATCH: {k['phase']} {k['kernel']} vs {b['name']}: "
                             f"relative error {b.get('max_rel_error')}")
    for ratio, k, b in sorted(ratios, key=lambda r: r[0])[:worst]:
        lines.append(f"  slow: {k['phase']} {k['kernel']} ({k['shape']}) "
                     f"{fmt_seconds(k['archc_seconds'])} vs {b['name']} "
                     f"{fmt_seconds(b['seconds'])}: {fmt_ratio(ratio)}")
    return lines


def quant_line(scheme: str, dtype: str, decode: dict[str, Any], dense: dict[str, Any]) -> str:
    """The decode floor the quantized weights buy, beside the dense model's."""
    return (f"weights quantized to {scheme}: decode floor {fmt_seconds(decode['floor_seconds'])}"
            f"/step ({decode['weight_bytes'] / 2**30:.2f} GiB of weights) against "
            f"{fmt_seconds(dense['floor_seconds'])}/step with {dtype} weights "
            f"({dense['weight_bytes'] / 2**30:.2f} GiB): "
            f"{fmt_ratio(dense['floor_seconds'] / decode['floor_seconds'])}")


def headline(data: dict[str, Any]) -> list[str]:
    """Decode at each context, the prefill kernels and autotuning, then the goals: what the
    run was for."""
    lines = []
    for c in data.get("model", {}).get("contexts", []):
        runs = {r["name"]: r for r in c.get("runs", [])}
        archc = next((r for name, r in runs.items() if name.startswith("archc")), None)
        if archc is None or archc.get("step_seconds") is None:
            lines.append(f"  decode at context {c['context']}: no archc result")
            continue
        parts = [f"archc {archc['tokens_per_second']:,.1f} tokens/s, "
                 f"{fmt_percent(archc['floor_fraction'])} of the bandwidth bound"]
        parts += [f"archc speed-up {fmt_ratio(r.get('archc_speedup'))} over {name}"
                  for name, r in runs.items() if name.startswith("torch.compile")]
        parts += [f"attention {fmt_ratio(a.get('copy_fraction'))} a copy of its KV bytes"
                  for a in c.get("attention", [])]
        lines.append(f"  decode at context {c['context']}: " + "; ".join(parts))
    lines += prefill_headline(data)
    if data.get("dry_run") and data.get("goals"):
        lines.append("  goals: not judged in a dry run")
    for g in data.get("goals", []):
        if not g.get("applies"):
            continue
        met = "—" if g.get("met") is None else "met" if g["met"] else "NOT met"
        value = fmt_ratio(g["measured"]) if g["unit"] == "×" else fmt_percent(g["measured"])
        lines.append(f"  goal {met}: {g['goal']} — {value} ({g.get('note')})")
    return lines


def _slowest(data: dict[str, Any], op: str, baseline: str) -> tuple[float, str] | None:
    """archc's lowest speed-up over `baseline` among the prefill kernels of `op`, and the
    kernel's name; None when none was timed beside it."""
    found = [(b["archc_speedup"], k["kernel"]) for k in data.get("kernels", [])
             if k.get("phase") == "prefill" and k.get("op") == op
             for b in k.get("baselines", [])
             if b.get("name") == baseline and b.get("archc_speedup") is not None]
    return min(found) if found else None


def prefill_headline(data: dict[str, Any]) -> list[str]:
    """The prefill kernels against their bounds — the slowest fused matmul beside torch.matmul
    and the unfused sequence, attention beside sdpa and FlashAttention-3's published TFLOP/s —
    and the autotune cache's first-run cost."""
    lines = []
    parts = []
    for baseline, what in (("torch.matmul", "torch.matmul"), ("unfused", "the unfused sequence")):
        found = _slowest(data, "fused_linear", baseline)
        if found is not None:
            parts.append(f"{fmt_ratio(found[0])} {what} ({found[1]})")
    if parts:
        lines.append("  prefill matmuls, the slowest: " + "; ".join(parts))
    goals = {g.get("key"): g for g in data.get("goals", [])}
    for k in data.get("kernels", []):
        if k.get("phase") != "prefill" or k.get("op") != "attention":
            continue
        sdpa = next((b.get("archc_speedup") for b in k.get("baselines", [])
                     if b.get("name") == "sdpa"), None)
        parts = [f"{fmt_ratio(sdpa)} sdpa"]
        if k.get("fa_flops_per_second") is not None:
            parts.append(f"{k['fa_flops_per_second'] / 1e12:.1f} TFLOP/s")
        fa3 = goals.get("prefill_attention_vs_fa3", {}).get("measured")
        if fa3 is not None:
            parts.append(f"{fmt_ratio(fa3)} FlashAttention-3's published figure")
        lines.append(f"  prefill attention ({k.get('kernel')}): " + ", ".join(parts))
    lines += autotune_headline(data.get("autotune"))
    return lines


def autotune_headline(entry: dict[str, Any] | None) -> list[str]:
    """The autotune cache's first-run cost: each run's seconds and tuning statistics, or why
    it was not measured."""
    if not entry:
        return []
    if not entry.get("applicable"):
        return [f"  autotune: {entry.get('reason')}"]
    runs = entry.get("runs", [])
    if len(runs) < 2 or any(r.get("seconds") is None for r in runs):
        return ["  autotune: not measured (the section did not finish)"]

    def stats(r: dict[str, Any]) -> str:
        t = r.get("tuning")
        if t is None:
            return ""
        return (f" (tuning {t.get('seconds', 0):.1f} s, {t.get('kernels_tuned')} kernels tuned, "
                f"cache {t.get('cache_hits')} hits / {t.get('cache_misses')} misses)")
    first, second = runs[:2]
    line = (f"  autotune first run: {first['seconds']:.1f} s to build and prefill"
            f"{stats(first)}; second run {second['seconds']:.1f} s{stats(second)}")
    if first.get("tuning") is None:
        line += f"; {entry.get('tuning_stats')}"
    return [line]


def main(argv: list[str] | None = None) -> int:
    paths = [Path(p) for p in (sys.argv[1:] if argv is None else argv)]
    for path in paths:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            print(f"{path.name}: no report ({type(err).__name__}: {err})")
            continue
        print(f"{path.name}:")      # which run: the file names the stage that made it
        print("\n".join(summarize(data)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
