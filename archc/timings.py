"""Per-phase timings of a run — load, compile, prefill, decode — as llama.cpp reports them: one
line on standard error after every run (never wrapped, so a log keeps it whole), or JSON.

Prefill is the time from the start of generation to the first new token (the prompt's forward
pass and the first sampling); decode, from the first new token to the last, covers the tokens
after the first.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

PHASES = ("load", "compile", "prefill", "decode")
STOPS = {"eos": "stopped at end-of-sequence", "length": "stopped at the token limit",
         "interrupted": "interrupted"}


@dataclass
class Timings:
    seconds: dict[str, float] = field(default_factory=dict)   # phase → seconds
    prompt_tokens: int = 0
    generated: int = 0           # new tokens, the first of them from the prefill
    stop: str | None = None      # eos, length, interrupted
    stop_token: str | None = None   # the end-of-sequence token's text

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def tokens_per_second(self) -> dict[str, float]:
        out = {}
        if self.seconds.get("prefill") and self.prompt_tokens:
            out["prefill"] = self.prompt_tokens / self.seconds["prefill"]
        if self.seconds.get("decode") and self.generated > 1:
            out["decode"] = (self.generated - 1) / self.seconds["decode"]
        return out

    def line(self) -> str:
        """`load 0.41 s · compile 0.02 s · prefill 37 tokens in 0.80 s (46.3 tokens/s) · …`"""
        rates = self.tokens_per_second()
        parts = []
        for name in PHASES:
            if name not in self.seconds:
                continue
            s = self.seconds[name]
            if name in ("prefill", "decode"):
                n = self.prompt_tokens if name == "prefill" else max(self.generated - 1, 0)
                text = f"{name} {n} token{'' if n == 1 else 's'} in {s:.2f} s"
            else:
                text = f"{name} {s:.2f} s"
            if name in rates:
                text += f" ({rates[name]:.3g} tokens/s)"
            parts.append(text)
        if self.stop is not None:
            stop = STOPS[self.stop]
            if self.stop == "eos" and self.stop_token:
                stop += f" ({self.stop_token})"
            parts.append(stop)
        return " · ".join(parts)

    def as_dict(self) -> dict[str, Any]:
        return {"seconds": {k: self.seconds[k] for k in PHASES if k in self.seconds},
                "prompt_tokens": self.prompt_tokens, "generated_tokens": self.generated,
                "tokens_per_second": self.tokens_per_second(), "stop": self.stop}
