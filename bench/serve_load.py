"""Continuous batching measured: N streams served together against the same N one at a time,
through the scheduler `archc serve` runs (``archc.serve.scheduler``) over the model's batch
engine (``archc.serve.engine.engine_for``), in one process — the HTTP layer left out, so that
what is measured is the batching.

    .venv/bin/python bench/serve_load.py                          # tiny-llama3, eager, CPU
    .venv/bin/python bench/serve_load.py llama3-8b --backend triton --device cuda --dtype bf16 \\
        --streams 32 --prompt-len 512 --new-tokens 128

A zoo spec runs on seeded random weights (prompts are token ids, so no tokenizer is needed);
a checkpoint runs on its own. Every request asks for exactly --new-tokens tokens (no
end-of-sequence stop, so both runs do the same work), prompt lengths spread over ½ … 1½ ×
--prompt-len. Each run reports the throughput (tokens generated per second of wall time), and
per request the p50 and p99 of its latency (arrival to last token), its time to first token, and
its inter-token latency. One warm-up request runs first. With -o the numbers are written as JSON,
with the machine, the engine and the load average before and after.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import queue
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

import archc
from archc.perf.bench import keep_layers
from archc.serve.engine import engine_for
from archc.serve.scheduler import Event, Request, Scheduler
from archc.spec import load_spec


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0 … 100), linearly interpolated; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    at = (len(ordered) - 1) * q / 100
    low = int(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


class Timed:
    """One request and the times its tokens came (perf_counter seconds)."""

    def __init__(self, prompt: list[int], new_tokens: int) -> None:
        self.done: queue.Queue[Event] = queue.Queue()
        self.times: list[float] = []
        self.request = Request(prompt, new_tokens, self._heard)

    def _heard(self, event: Event) -> None:
        if event.token is not None:
            self.times.append(time.perf_counter())
        if event.finish is not None:
            self.done.put(event)

    def wait(self) -> None:
        event = self.done.get()
        if event.finish != "length":
            sys.exit(f"a request ended with {event.finish}: {event.error or ''}")


def run(scheduler: Scheduler, prompts: list[list[int]], new_tokens: int,
        together: bool) -> dict[str, Any]:
    """Serve every prompt, all submitted at once (`together`) or each after the last ended."""
    timed = [Timed(p, new_tokens) for p in prompts]
    start = time.perf_counter()
    if together:
        for t in timed:
            t.request.arrived = time.perf_counter()
            scheduler.submit(t.request)
        for t in timed:
            t.wait()
    else:
        for t in timed:
            t.request.arrived = time.perf_counter()
            scheduler.submit(t.request)
            t.wait()
    wall = time.perf_counter() - start
    latency = [t.times[-1] - t.request.arrived for t in timed]
    ttft = [t.times[0] - t.request.arrived for t in timed]
    itl = [b - a for t in timed for a, b in zip(t.times, t.times[1:])]
    generated = sum(len(t.times) for t in timed)
    out: dict[str, Any] = {"wall_s": wall, "tokens": generated,
                           "tokens_per_s": generated / wall}
    for name, values in (("latency_s", latency), ("ttft_s", ttft), ("itl_s", itl)):
        out[name] = {"p50": percentile(values, 50), "p99": percentile(values, 99)}
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", nargs="?", default="tiny-llama3")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=24)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--backend", default="eager", choices=("eager", "triton"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="f32")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int,
                        help="keep the first N blocks of a zoo spec (a GPU-sized run of a big "
                             "spec: llama3-8b's shapes, fewer layers)")
    parser.add_argument("-o", "--output", type=Path, help="write the results as JSON here")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()

    if args.layers is None:
        model = archc.load(args.source, dtype=args.dtype, seed=args.seed)
    else:
        spec = keep_layers(load_spec(args.source), args.layers)
        model = archc.from_spec(spec, seed=args.seed, dtype=args.dtype)
    compiled = model.compile(args.backend, dtype=args.dtype, device=args.device)
    engine = engine_for(compiled, max_batch=args.streams, block_size=args.block_size)
    scheduler = Scheduler(engine, max_seq_len=model.spec.max_seq_len).start()
    rng = random.Random(args.seed)
    lengths = [rng.randint(max(1, args.prompt_len // 2), args.prompt_len * 3 // 2)
               for _ in range(args.streams)]
    if max(lengths) + args.new_tokens > scheduler.max_seq_len:
        sys.exit(f"prompts of up to {max(lengths)} tokens + {args.new_tokens} new exceed "
                 f"{model.spec.name}'s max_seq_len = {scheduler.max_seq_len}")
    prompts = [[rng.randrange(model.spec.vocab_size) for _ in range(n)] for n in lengths]
    try:
        run(scheduler, prompts[:1], args.new_tokens, together=False)    # warm-up
        results = {"one_at_a_time": run(scheduler, prompts, args.new_tokens, together=False),
                   "together": run(scheduler, prompts, args.new_tokens, together=True)}
    finally:
        scheduler.stop()
    batch_max = scheduler.metrics.value("archc_batch_size_max")

    print(f"{model.spec.name} · {args.backend} on {args.device} ({args.dtype}) · "
          f"{args.streams} streams · prompts {min(lengths)}–{max(lengths)} tokens · "
          f"{args.new_tokens} new tokens each · engine {type(engine).__name__}, decode batches "
          f"up to {batch_max:g} rows")
    print(f"{'':>14} {'tokens/s':>9} {'latency p50':>12} {'p99':>8} {'TTFT p50':>9} "
          f"{'p99':>8} {'ITL p50':>8} {'p99':>8}")
    for name, r in results.items():
        ms = {k: {q: 1000 * v for q, v in r[k].items()} for k in ("latency_s", "ttft_s", "itl_s")}
        print(f"{name.replace('_', ' '):>14} {r['tokens_per_s']:9.1f} "
              f"{ms['latency_s']['p50']:10.0f}ms {ms['latency_s']['p99']:6.0f}ms "
              f"{ms['ttft_s']['p50']:7.0f}ms {ms['ttft_s']['p99']:6.0f}ms "
              f"{ms['itl_s']['p50']:6.1f}ms {ms['itl_s']['p99']:6.1f}ms")
    speedup = results["together"]["tokens_per_s"] / results["one_at_a_time"]["tokens_per_s"]
    print(f"throughput together / one at a time: {speedup:.2f}×")
    if args.output is not None:
        data = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "source": args.source, "layers": args.layers, "backend": args.backend,
                "device": args.device,
                "dtype": args.dtype, "streams": args.streams, "prompt_lengths": lengths,
                "new_tokens": args.new_tokens, "block_size": args.block_size,
                "engine": f"{type(engine).__module__}.{type(engine).__name__}",
                "decode_batch_max": batch_max, "results": results, "speedup": speedup,
                "machine": machine(args.threads, load_before)}
        args.output.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.output}")


def machine(threads: int | None, load_before: tuple[float, float, float]) -> dict[str, Any]:
    """What a result file says of the machine it was measured on."""
    return {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "threads": threads, "load_average_before": load_before,
            "load_average_after": os.getloadavg(), "torch": torch.__version__}


if __name__ == "__main__":
    main()
