"""A short text summary of `archc bench` JSON reports — what the GPU check prints at the end:
``python -m archc.perf.summary results/*.json``. For each report: the model and shapes, then
the headline — decode at each measured context (archc's tokens/s and fraction of the bandwidth
bound, its speed-up over each torch.compile mode, decode attention against a copy of the same KV
bytes) and the goals —, then the sections that did not finish (and why), every runner's prefill
and decode with archc's speed-up over it, and the kernels where archc is slowest against a
PyTorch counterpart. A missing or unreadable file is named, not fatal.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


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
    lines += headline(data)
    unfinished = {k: v for k, v in data.get("status", {}).items() if v != "done"}
    if unfinished:
        lines.append("  NOT DONE: " + ", ".join(f"{k} ({v})" for k, v in unfinished.items()))
    for e in data.get("errors", []):
        where = e.get("section", "") + (f" {e['kernel']}" if "kernel" in e else "")
        lines.append(f"  error in {where}: {e.get('error')}")
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


def headline(data: dict[str, Any]) -> list[str]:
    """Decode at each context, then the goals: what the run was for."""
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
    if data.get("dry_run") and data.get("goals"):
        lines.append("  goals: not judged in a dry run")
    for g in data.get("goals", []):
        if not g.get("applies"):
            continue
        met = "—" if g.get("met") is None else "met" if g["met"] else "NOT met"
        value = fmt_ratio(g["measured"]) if g["unit"] == "×" else fmt_percent(g["measured"])
        lines.append(f"  goal {met}: {g['goal']} — {value} ({g.get('note')})")
    return lines


def main(argv: list[str] | None = None) -> int:
    paths = [Path(p) for p in (sys.argv[1:] if argv is None else argv)]
    for path in paths:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            print(f"{path.name}: no report ({type(err).__name__}: {err})")
            continue
        print("\n".join(summarize(data)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
