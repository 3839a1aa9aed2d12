"""Validating the generated kernels against the eager interpreter, kernel by kernel.

Three runs on the same weights and inputs:
1. eager on the unfused program — the reference the model's outputs must match;
2. eager on the kernel-level program, every node's value kept;
3. triton on the kernel-level program, buffers not reused, so every node's value can be read.

Each kernel's output in (3) is compared with the same node in (2), each KV-cache write with
the eager cache of its layer, and each recurrent state a kernel updates (Mamba's conv window and
SSM state, linear attention's sums) with the eager state; the first node past its tolerance is
the first diverging kernel, reported with the IR nodes it implements. A decoder is checked on a
prefill and then on one decode step (different kernels: the split-KV attention), an
encoder-decoder on every graph (the cross-KV graph, which runs at a generation's first step, on
a prefill of its own).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from archc.errors import ArchcError
from archc.ir.graph import CROSS_KV, Graph
from archc.ir.text import format_node
from archc.perf.baselines import state_keys
from archc.runtime.eager import EagerSession, Trace

# Relative to each output's largest magnitude. f32: kernels and eager both accumulate in f32 and
# differ in summation order; errors grow a little through the layers, so 1e-4 rather than the
# 1e-5 of a single kernel. f16: each rounding is 2^-11 ≈ 4.9e-4, a few compound per layer.
TOLERANCE = {"f32": 1e-4, "f16": 1e-2, "bf16": 5e-2}


@dataclass
class KernelCheck:
    phase: str
    graph: str
    node: int
    text: str             # the IR node
    kernel: str           # the generated unit that implements it
    max_error: float
    scale: float
    what: str = "output"  # or "k cache", "v cache", "conv state", …

    @property
    def relative(self) -> float:
        return self.max_error / self.scale if self.scale else self.max_error


@dataclass
class PhaseCheck:
    phase: str
    output: str
    max_error: float       # triton vs eager on the unfused program
    scale: float

    @property
    def relative(self) -> float:
        return self.max_error / self.scale if self.scale else self.max_error


@dataclass
class Report:
    model: str
    dtype: str
    tolerance: float
    kernels: list[KernelCheck] = field(default_factory=list)
    phases: list[PhaseCheck] = field(default_factory=list)
    module_path: str = ""

    @property
    def first_divergence(self) -> KernelCheck | None:
        for k in self.kernels:
            if k.relative > self.tolerance:
                return k
        return None

    @property
    def ok(self) -> bool:
        return self.first_divergence is None and all(p.relative <= self.tolerance
                                                     for p in self.phases)


def _err(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    a, b = a.detach().float().cpu(), b.detach().float().cpu()
    if a.shape != b.shape:
        return float("inf"), 1.0
    return float((a - b).abs().max()) if a.numel() else 0.0, float(b.abs().max()) if b.numel() \
        else 0.0


def _compare(report: Report, phase: str, g: Graph, eager: Mapping[int, torch.Tensor],
             triton: object, units: Mapping[int, str], dims: Mapping[str, int],
             caches: list[tuple[int, str, torch.Tensor, torch.Tensor]],
             states: list[tuple[int, str, torch.Tensor, torch.Tensor]] = ()) -> None:
    writer: dict[int, int] = {}
    for i in g.compute_ids():
        for st in g.nodes[i].attr("epilogue", ()) or ():
            if getattr(st, "fn", "") == "kv_write":
                writer[st.kw("layer")] = i
    by_node: dict[int, list[KernelCheck]] = {}
    for layer, kind, want, got in caches:
        i = writer.get(layer)
        if i is None:
            continue
        e, s = _err(got, want)
        by_node.setdefault(i, []).append(KernelCheck(
            phase, g.name, i, format_node(i, g.nodes[i]), units[i], e, s, f"{kind} cache"))
    for i, kind, want, got in states:
        e, s = _err(got, want)
        by_node.setdefault(i, []).append(KernelCheck(
            phase, g.name, i, format_node(i, g.nodes[i]), units[i], e, s, f"{kind} state"))
    for i in g.compute_ids():
        if i not in eager:
            continue
        e, s = _err(triton.value(i, dims), eager[i])  # type: ignore[attr-defined]
        report.kernels.append(KernelCheck(phase, g.name, i, format_node(i, g.nodes[i]),
                                          units[i], e, s))
        report.kernels += by_node.get(i, [])


def validate(model: object, *, dtype: str = "f32", batch: int = 2, tokens: int = 7,
             seed: int = 0, device: str = "cpu", cache_dir: Path | None = None) -> Report:
    """Run `model` (an archc.Model) three ways and compare; see the module docstring."""
    from archc.ir.lower import lower
    from archc.runtime.triton_backend import TritonOptions, TritonSession
    spec = model.spec  # type: ignore[attr-defined]
    weights = model.weights  # type: ignore[attr-defined]
    unfused = lower(spec, dtype)
    triton = TritonSession(unfused, weights, max_seq_len=spec.max_seq_len, dtype=dtype,
                           device=device, options=TritonOptions(reuse_buffers=False,
                                                                cuda_graphs=False,
                                                                cache_dir=cache_dir))
    reference = EagerSession(unfused, weights, max_seq_len=spec.max_seq_len, device=device)
    fused = EagerSession(triton.program, weights, max_seq_len=spec.max_seq_len, device=device)
    units = {}
    for u in triton.generated.units:
        for graph, i, _ in u.uses:
            units[(graph, i)] = u.name
    report = Report(spec.name, dtype, TOLERANCE[dtype], module_path=str(triton.module_path))
    gen = torch.Generator().manual_seed(seed)
    if tokens + 1 > spec.max_seq_len:
        raise ArchcError(f"{tokens} tokens + 1 decode step exceed max_seq_len = "
                         f"{spec.max_seq_len}")
    ids = torch.randint(0, spec.vocab_size, (batch, tokens), generator=gen)

    def phase(name: str, graph: str, run: object, output: str | None = None) -> None:
        fused.trace = Trace(graph=graph)
        outs = [run(s) for s in (reference, fused, triton)]  # type: ignore[operator]
        g = triton.program.graph(graph)
        runner = triton.runners[graph]
        dims = runner.last_dims
        caches = []
        for (layer, kind), buf in fused.cache.store.items():
            length = dims["P"] + dims["T"]
            caches.append((layer, kind, buf[:, :, :length],
                           triton.cache.get(layer, kind)[:, :, :length]))
        states = [(i, kind, fused.state.store[(layer, kind)], triton.states.get(layer, kind))
                  for i in g.compute_ids() for layer, kind in state_keys(g, i)]
        _compare(report, name, g, fused.trace.values, runner,
                 {i: units[(graph, i)] for i in g.compute_ids()}, dims, caches, states)
        e, s = _err(outs[2], outs[0])
        report.phases.append(PhaseCheck(name, output or list(g.outputs)[0], e, s))
        fused.trace = None

    if spec.family == "encoder":
        mask = torch.ones(batch, tokens, dtype=torch.long)
        if batch > 1:
            mask[-1, max(1, tokens - 2):] = 0  # the last row padded
        phase("encode", "encoder", lambda s: s.encode(ids, mask))
        return report
    extra: dict[str, torch.Tensor] = {}
    if spec.family == "encoder-decoder":
        hidden = {}
        phase("encode", "encoder", lambda s: hidden.setdefault(id(s), s.encode(ids)))
        start = torch.zeros(batch, 1, dtype=torch.long)

        def step(s: object, x: torch.Tensor) -> torch.Tensor:
            return s.step(x, encoder_hidden=hidden[id(s)])  # type: ignore[attr-defined]
        prompt = torch.cat([start, ids[:, :2]], 1)
        if CROSS_KV in triton.runners:
            for s in (reference, fused, triton):
                s.reset()
            phase("cross-kv", CROSS_KV, lambda s: step(s, prompt), output="logits")
        for s in (reference, fused, triton):
            s.reset()
        phase("prefill", "decoder", lambda s: step(s, prompt))
        phase("decode", "decoder", lambda s: step(s, ids[:, 2:3]))
        return report
    for s in (reference, fused, triton):
        s.reset()
    phase("prefill", "decoder", lambda s: s.step(ids, **extra))
    phase("decode", "decoder", lambda s: s.step(ids[:, -1:], **extra))
    return report
