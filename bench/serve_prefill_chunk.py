"""Chunked prefill measured: the inter-token latency of running streams while a long prompt is
admitted, with the prompt prefilled in one step and in chunks of --chunk tokens between the
batch's decode steps (``archc.serve.scheduler``, in one process, the HTTP layer left out).

    .venv/bin/python bench/serve_prefill_chunk.py                     # tiny-llama3, eager, CPU
    .venv/bin/python bench/serve_prefill_chunk.py llama3-8b --layers 4 --backend triton \\
        --device cuda --dtype bf16 --long-prompt 8192 --chunk 512

--streams streams (short prompts, --new-tokens each) run; once every one has its first tokens,
a request with a --long-prompt-token prompt arrives (--arrivals of them, each a few decode
steps after the last one's first token).
Reported per run: the p50, p99 and largest gap between consecutive tokens of the running
streams from the first long prompt's arrival on, and the long prompts' time to first token. A
zoo spec runs on seeded random weights, its context raised to hold the long prompt
(--max-seq-len); the prefix cache is off, so that both runs compute every prompt token. With -o
the numbers are written as JSON, with the machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import queue
import random
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

import archc
from archc.perf.bench import keep_layers
from archc.serve.engine import engine_for
from archc.serve.scheduler import Event, Request, Scheduler
from archc.spec import load_spec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_load import machine, percentile  # noqa: E402  (the serving benchmark's own)


class Stream:
    """One request and the times its tokens came (perf_counter seconds)."""

    def __init__(self, prompt: list[int], new_tokens: int) -> None:
        self.times: list[float] = []
        self.done: queue.Queue[Event] = queue.Queue()
        self.first: queue.Queue[None] = queue.Queue()
        self.request = Request(prompt, new_tokens, self._heard)

    def _heard(self, event: Event) -> None:
        if event.token is not None:
            self.times.append(time.perf_counter())
            if len(self.times) == 2:
                self.first.put(None)
        if event.finish is not None:
            self.first.put(None)
            self.done.put(event)

    def wait(self) -> None:
        event = self.done.get()
        if event.finish != "length":
            sys.exit(f"a request ended with {event.finish}: {event.error or ''}")


def run(scheduler: Scheduler, prompts: list[list[int]], longs: list[list[int]],
        new_tokens: int) -> dict[str, Any]:
    """The streams, and the long prompts arriving one after another once they all run."""
    streams = [Stream(p, new_tokens) for p in prompts]
    for s in streams:
        scheduler.submit(s.request)
    for s in streams:
        s.first.get()
    ttft, start = [], time.perf_counter()
    for prompt in longs:
        long = Stream(prompt, 1)
        long.request.arrived = time.perf_counter()
        scheduler.submit(long.request)
        long.wait()
        ttft.append(long.times[0] - long.request.arrived)
        seen = len(streams[0].times)        # the streams run a few steps before the next one
        while len(streams[0].times) < min(seen + 4, new_tokens):
            time.sleep(0.001)
    for s in streams:
        s.wait()
    # the gaps once every stream runs: from the first long prompt's arrival on
    gaps = [b - a for s in streams for a, b in zip(s.times, s.times[1:]) if b > start]
    return {"itl_s": {"p50": percentile(gaps, 50), "p99": percentile(gaps, 99),
                      "max": max(gaps, default=float("nan"))}, "gaps": len(gaps),
            "long_ttft_s": {"p50": percentile(ttft, 50), "max": max(ttft)},
            "prefill_steps": scheduler.metrics.value("archc_prefill_chunks_total")}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", nargs="?", default="tiny-llama3")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--long-prompt", type=int, default=1536)
    parser.add_argument("--arrivals", type=int, default=3)
    parser.add_argument("--chunk", type=int, default=128)
    parser.add_argument("--max-seq-len", type=int, default=2048)
    parser.add_argument("--backend", default="eager", choices=("eager", "triton"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="f32")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, help="keep the first N blocks of a zoo spec")
    parser.add_argument("-o", "--output", type=Path, help="write the results as JSON here")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    spec = load_spec(args.source)
    if args.layers is not None:
        spec = keep_layers(spec, args.layers)
    spec = replace(spec, max_seq_len=max(spec.max_seq_len, args.max_seq_len))
    model = archc.from_spec(spec, seed=args.seed, dtype=args.dtype)
    compiled = model.compile(args.backend, dtype=args.dtype, device=args.device)
    rng = random.Random(args.seed)
    vocab = spec.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)]
               for _ in range(args.streams)]
    results = {}
    for name, chunk in (("whole", None), (f"chunks of {args.chunk}", args.chunk)):
        engine = engine_for(compiled, max_batch=args.streams + 1, block_size=args.block_size,
                            prefix_cache=False)
        scheduler = Scheduler(engine, max_seq_len=spec.max_seq_len, prefill_chunk=chunk).start()
        longs = [[rng.randrange(vocab) for _ in range(args.long_prompt)]
                 for _ in range(args.arrivals)]
        try:
            run(scheduler, prompts[:1], longs[:1], 4)       # warm-up
            results[name] = run(scheduler, prompts, longs, args.new_tokens)
        finally:
            scheduler.stop()

    print(f"{spec.name} · {args.backend} on {args.device} ({args.dtype}) · {args.streams} "
          f"streams of {args.new_tokens} tokens · {args.arrivals} × a {args.long_prompt}-token "
          "prompt arriving while they run")
    print(f"{'prefill':>16} {'ITL p50':>9} {'p99':>8} {'max':>8} {'long TTFT':>10}")
    for name, r in results.items():
        ms = {k: 1000 * v for k, v in r["itl_s"].items()}
        print(f"{name:>16} {ms['p50']:7.1f}ms {ms['p99']:6.1f}ms {ms['max']:6.1f}ms "
              f"{1000 * r['long_ttft_s']['p50']:8.0f}ms")
    if args.output is not None:
        data = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "source": args.source, "layers": args.layers, "backend": args.backend,
                "device": args.device, "dtype": args.dtype, "streams": args.streams,
                "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                "long_prompt": args.long_prompt, "arrivals": args.arrivals,
                "chunk": args.chunk, "block_size": args.block_size, "results": results,
                "machine": machine(args.threads, load_before)}
        args.output.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
