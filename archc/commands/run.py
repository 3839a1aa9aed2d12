"""Run a model: generate text from a prompt, or summarize its next-token logits.

With --prompt or --chat it generates text, streamed to the terminal as tokens come; without, it
summarizes the next-token logits of a random prompt. Either way it ends with the time of each
phase (load, compile, prefill, decode) on standard error, or, with --json, prints everything as
one JSON document."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch

from archc.commands.chat import Conversation, add_sampling_arguments, answer, load_for_text
from archc.commands.common import Run
from archc.commands.defaults import fit_lengths
from archc.commands.vocabulary import add
from archc.errors import ArchcError
from archc.ui import console, table

TEXT_NEW_TOKENS = 128
SUMMARY_PROMPT_LEN, SUMMARY_NEW_TOKENS = 8, 4      # a random prompt, then greedy steps


def add_arguments(p: argparse.ArgumentParser) -> None:
    add(p, "source", detail="a spec gets random weights")
    add(p, "backend", default="eager")
    add(p, "device", "dtype")
    add(p, "seed", default=0)
    add(p, "threads", detail="default: torch's choice; 1 is often fastest for decoding small "
        "models on a busy machine")
    add(p, "cache_dir")
    add(p, "tp", default=1, detail="see docs/distributed.md")
    add(p, "cp", "timeout", detail="see docs/distributed.md")
    add(p, "quantize", "group", "dequantize", "kv_cache")
    add(p, "no_autotune", detail="with --backend triton")
    add(p, "new_tokens", detail=f"default {TEXT_NEW_TOKENS} with --prompt or --chat, "
        f"{SUMMARY_NEW_TOKENS} greedy steps in the logits summary")
    add(p, "quiet", "json")
    text = p.add_argument_group("text generation (a checkpoint with a tokenizer)")
    what = text.add_mutually_exclusive_group()
    add(what, "prompt", "chat")
    add(text, "system", detail="with --chat")
    add_sampling_arguments(text)
    logits = p.add_argument_group("logits summary (without --prompt or --chat)")
    add(logits, "prompt_len", detail=f"of the random prompt (default {SUMMARY_PROMPT_LEN}, less "
        "where max_seq_len is shorter)")
    add(logits, "batch", detail="default 1")


def run(args: argparse.Namespace) -> int:
    # flags that do not go together are refused before anything is read
    text = args.prompt is not None or args.chat is not None
    if args.system is not None and args.chat is None:
        raise ArchcError("--system goes with --chat")
    if text:
        wrong = {"--prompt-len": args.prompt_len, "--batch": args.batch}
        why = "sizes the random prompt of the logits summary; with --prompt or --chat the " \
              "prompt is the text"
    else:
        wrong = {"--top-k": args.top_k, "--top-p": args.top_p,
                 "--temperature": args.temperature or None, "--ignore-eos": args.ignore_eos or None}
        why = "applies to text generation (--prompt or --chat); the logits summary decodes " \
              "greedily"
    given = [flag for flag, value in wrong.items() if value is not None]
    if given:
        raise ArchcError(f"{given[0]} {why}")
    args.batch = args.batch or 1
    if text:   # new tokens past max_seq_len are left out, and said so (`chat.answer`)
        if args.new_tokens is None:
            args.new_tokens = TEXT_NEW_TOKENS
        return _generate_text(args, *load_for_text(
            args, "--prompt" if args.chat is None else "--chat", chat=args.chat is not None))
    run_ = Run(args)
    decodes = run_.spec.family == "decoder"     # the others summarize the prefill alone
    args.prompt_len, new = fit_lengths(run_.spec, args.prompt_len,
                                       args.new_tokens if decodes else None,
                                       (SUMMARY_PROMPT_LEN, SUMMARY_NEW_TOKENS), quiet=args.quiet)
    args.new_tokens = new if decodes else args.new_tokens or 0
    run_.check_lengths(args.prompt_len, args.new_tokens)
    return _summarize(args, run_, run_.load())


def _print_json(args: argparse.Namespace, run_: Run, body: dict[str, Any]) -> None:
    data = {"source": args.source, "model": run_.spec.name, "backend": args.backend,
            "device": str(run_.device), "dtype": run_.dtype,
            "random_weights": run_.source.random_weights, **body, "timings": run_.timings.as_dict()}
    sys.stdout.write(json.dumps(data, indent=2) + "\n")


def _generate_text(args: argparse.Namespace, run_: Run, model: Any) -> int:
    tok = model.tokenizer
    ids = tok.encode(args.prompt) if args.chat is None else \
        Conversation(tok, model.spec.max_seq_len, args.system).prompt(args.chat, room=0)[0]
    if not ids:
        raise ArchcError("the prompt encodes to no tokens")
    compiled = run_.compile(model)
    if not args.json and args.prompt is not None and model.spec.family == "decoder":
        print(args.prompt, end="", flush=True)
    new = answer(compiled, ids, args, run_.timings)
    if args.json:
        _print_json(args, run_, {"prompt": args.prompt, "chat": args.chat, "system": args.system,
                                 "text": tok.decode(new), "tokens": new})
    else:
        print(flush=True)
        run_.timings.report(args.quiet)
    return 130 if run_.timings.stop == "interrupted" else 0


def _summarize(args: argparse.Namespace, run_: Run, model: Any) -> int:
    spec, timings = model.spec, run_.timings
    compiled = run_.compile(model)
    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, spec.vocab_size, (args.batch, args.prompt_len), generator=gen)
    timings.prompt_tokens = args.prompt_len
    with timings.phase("prefill"):
        out = compiled(ids, decoder_input_ids=ids[:, :1]) \
            if spec.family == "encoder-decoder" else compiled(ids)
    last = out[0, -1].float().cpu()
    stats = {what: float(getattr(last, what)()) for what in ("mean", "std", "min", "max")}
    body: dict[str, Any] = {"prompt_tokens": args.prompt_len, "batch": args.batch,
                            "prompt_ids": ids.tolist(), "output_shape": list(out.shape),
                            "last_position": stats}
    if spec.family != "encoder":
        top = last.softmax(-1).topk(5)
        body["top5"] = [{"token": i, "logit": float(last[i]), "probability": p}
                        for p, i in zip(top.values.tolist(), top.indices.tolist())]
    if args.new_tokens > 0 and spec.family == "decoder":
        # generate() prefills again; decode is timed from its first new token to its last
        seen: list[float] = []
        seq = compiled.generate(ids, args.new_tokens, eos_token_id=(),
                                on_token=lambda _: seen.append(time.perf_counter()))
        body["greedy_continuation"] = seq[0, args.prompt_len:].tolist()
        timings.generated = len(seen)
        if len(seen) > 1:
            timings.seconds["decode"] = seen[-1] - seen[0]
    if args.json:
        _print_json(args, run_, body)
        return 0
    weights = f"random weights (seed {args.seed})" if run_.source.random_weights else \
        f"weights from {model.source}"
    console.print(f"[bold]{spec.name}[/] on {args.backend} ({run_.dtype}, {run_.device}), "
                  f"{weights}, a prompt of {args.prompt_len} random tokens")
    console.print(f"output [B, T, {'d' if spec.family == 'encoder' else 'vocab'}] = "
                  f"{list(out.shape)}; last position: "
                  + ", ".join(f"{what} {v:.4f}" for what, v in stats.items()))
    if "top5" in body:
        console.print(table("next token (top 5)", ("token id", "logit", "probability"), [
            (str(e["token"]), f"{e['logit']:.4f}", f"{e['probability']:.4f}")
            for e in body["top5"]]))
    if "greedy_continuation" in body:
        carried = " and ".join(what for what, held in (
            ("the KV cache", spec.softmax_attends),
            ("the recurrent state", not set(spec.all_mixers) <= {"attention"})) if held)
        console.print(f"greedy continuation: {body['greedy_continuation']} (prefill + "
                      f"{args.new_tokens - 1} decode steps with {carried})")
    timings.report(args.quiet)
    return 0
