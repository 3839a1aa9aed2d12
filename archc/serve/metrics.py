"""The server's counters, gauges and histograms, written in Prometheus' text format
(``GET /metrics``). Updated from the scheduler's thread and the HTTP handlers alike, so every
change holds one lock."""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

# seconds: time to first token spans a prefill (a queue wait too); inter-token latency one step
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass
class Histogram:
    """Observations counted into cumulative buckets (upper bounds), as Prometheus keeps them."""

    bounds: Sequence[float]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.bounds)

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1
        self.total += value
        self.n += 1

    def lines(self, name: str) -> list[str]:
        out = [f'{name}_bucket{{le="{_number(b)}"}} {c}' for b, c in zip(self.bounds, self.counts)]
        return out + [f'{name}_bucket{{le="+Inf"}} {self.n}', f"{name}_sum {_number(self.total)}",
                      f"{name}_count {self.n}"]


def _number(x: float) -> str:
    """A sample value as Prometheus writes one: whole numbers without a fraction."""
    if isinstance(x, int) or (math.isfinite(x) and x == int(x) and abs(x) < 1e15):
        return str(int(x))
    return repr(float(x))


# name → (type, help); the order they are written in
METRICS = {
    "archc_requests_received_total": ("counter", "generation requests accepted into the queue"),
    "archc_requests_finished_total": ("counter", "requests that left the server, by how they "
                                      "ended (stop, length, cancelled, error)"),
    "archc_requests_rejected_total": ("counter", "requests refused with an error status, by "
                                      "status"),
    "archc_prompt_tokens_total": ("counter", "prompt tokens prefilled (or embedded)"),
    "archc_embedding_requests_total": ("counter", "embeddings requests answered"),
    "archc_generation_tokens_total": ("counter", "tokens generated"),
    "archc_queue_depth": ("gauge", "requests waiting for admission (a batch row and KV blocks)"),
    "archc_batch_size": ("gauge", "sequences in the running batch"),
    "archc_batch_size_max": ("gauge", "the most rows one decode step has run"),
    "archc_decode_batch_size": ("histogram", "rows per decode step"),
    "archc_time_to_first_token_seconds": ("histogram", "from a request's arrival to its first "
                                          "token"),
    "archc_inter_token_latency_seconds": ("histogram", "between consecutive tokens of a "
                                          "request"),
    "archc_kv_blocks_free": ("gauge", "KV-cache blocks neither held nor reserved"),
    "archc_kv_blocks_total": ("gauge", "KV-cache blocks in the pool"),
    "archc_kv_blocks_cached": ("gauge", "KV-cache blocks holding a cached full block of a prefix "
                               "(held or idle; idle ones count as free)"),
    "archc_prefill_chunks_total": ("counter", "prefill steps run (a prompt in chunks of "
                                   "--prefill-chunk tokens takes several)"),
    "archc_prefix_cache_queries_tokens_total": ("counter", "prompt tokens looked up in the "
                                                "prefix cache"),
    "archc_prefix_cache_hits_tokens_total": ("counter", "prompt tokens found in the prefix "
                                             "cache (not computed)"),
    "archc_prefix_cache_queries_blocks_total": ("counter", "full prompt blocks looked up in the "
                                                "prefix cache"),
    "archc_prefix_cache_hits_blocks_total": ("counter", "full prompt blocks found in the prefix "
                                             "cache"),
}


class Metrics:
    """Everything ``/metrics`` shows."""

    def __init__(self, blocks_total: int = 0) -> None:
        self.lock = threading.Lock()
        self.counts: dict[str, dict[tuple[tuple[str, str], ...], float]] = {
            name: {} for name, (kind, _) in METRICS.items() if kind != "histogram"}
        self.hist = {"archc_decode_batch_size": Histogram(BATCH_BUCKETS),
                     "archc_time_to_first_token_seconds": Histogram(LATENCY_BUCKETS),
                     "archc_inter_token_latency_seconds": Histogram(LATENCY_BUCKETS)}
        for name in ("archc_requests_received_total", "archc_prompt_tokens_total",
                     "archc_embedding_requests_total",
                     "archc_generation_tokens_total", "archc_queue_depth", "archc_batch_size",
                     "archc_batch_size_max", "archc_prefill_chunks_total", "archc_kv_blocks_cached",
                     "archc_prefix_cache_queries_tokens_total",
                     "archc_prefix_cache_hits_tokens_total",
                     "archc_prefix_cache_queries_blocks_total",
                     "archc_prefix_cache_hits_blocks_total"):
            self.counts[name][()] = 0
        self.counts["archc_kv_blocks_total"][()] = blocks_total
        self.counts["archc_kv_blocks_free"][()] = blocks_total

    def add(self, name: str, value: float = 1, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        with self.lock:
            self.counts[name][key] = self.counts[name].get(key, 0) + value

    def set(self, name: str, value: float) -> None:
        with self.lock:
            self.counts[name][()] = value

    def peak(self, name: str, value: float) -> None:
        """Raise gauge `name` to `value` if it is lower (a maximum seen)."""
        with self.lock:
            self.counts[name][()] = max(self.counts[name].get((), 0), value)

    def observe(self, name: str, value: float) -> None:
        with self.lock:
            self.hist[name].observe(value)

    def value(self, name: str, **labels: str) -> float:
        """A counter's or gauge's current value (0 when never set)."""
        with self.lock:
            return self.counts[name].get(tuple(sorted(labels.items())), 0)

    def text(self) -> str:
        """Every metric in Prometheus' text exposition format (version 0.0.4)."""
        lines = []
        with self.lock:
            for name, (kind, help_) in METRICS.items():
                lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
                if kind == "histogram":
                    lines += self.hist[name].lines(name)
                    continue
                for labels, value in sorted(self.counts[name].items()):
                    spelled = ",".join(f'{k}="{v}"' for k, v in labels)
                    lines.append(f"{name}{{{spelled}}} {_number(value)}" if labels else
                                 f"{name} {_number(value)}")
        return "\n".join(lines) + "\n"


def parse(text: str) -> dict[str, float]:
    """Samples of a Prometheus text page: `name` or `name{labels}` → value (for tests and
    tools reading ``/metrics``)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out
