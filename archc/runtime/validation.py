"""Validating the generated kernels against the eager interpreter, kernel by kernel.

Three runs on the same weights and inputs:
1. eager on the unfused program — the reference the model's outputs must match;
2. eager on the kernel-level program, every node's value kept;
3. triton on the kernel-level program, buffers not reused, so every node's value can be read.

Each kernel's output, KV-cache write and recurrent-state update in (3) is compared with (2); the
first past its tolerance is the first diverging kernel. A decoder is checked on a prefill and one
decode step (different kernels: the split-KV attention), an encoder-decoder on every graph (the
cross-KV graph on a prefill of its own).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from archc.ir.cost import state_keys
from archc.ir.graph import CROSS_KV
from archc.ir.ops.attention import kv_dequantize
from archc.ir.text import format_node
from archc.runtime.eager import EagerSession, Trace

if TYPE_CHECKING:
    from archc.runtime.launch import StaticStore

# Relative to each output's largest magnitude. f32: kernels and eager both accumulate in f32 and
# differ in summation order; errors grow a little through the layers, so 1e-4 rather than the
# 1e-5 of a single kernel. f16: each rounding is 2^-11 ≈ 4.9e-4, a few compound per layer.
TOLERANCE = {"f32": 1e-4, "f16": 1e-2, "bf16": 5e-2}


@dataclass
class Check:
    max_error: float      # the largest |triton − eager|
    scale: float          # the largest |eager|

    @property
    def relative(self) -> float:
        return self.max_error / self.scale if self.scale else self.max_error


@dataclass
class KernelCheck(Check):
    phase: str
    graph: str
    node: int
    text: str             # the IR node
    kernel: str           # the generated unit that implements it
    what: str = "output"  # or "k cache", "v cache", "conv state", …


@dataclass
class PhaseCheck(Check):
    phase: str
    output: str           # of the program, against eager on the unfused program


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
        return next((k for k in self.kernels if k.relative > self.tolerance), None)

    @property
    def ok(self) -> bool:
        return self.first_divergence is None and all(p.relative <= self.tolerance
                                                     for p in self.phases)


def error_and_scale(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """The largest |got − want|, and the largest |want| (the scale)."""
    got, want = got.detach().float().cpu(), want.detach().float().cpu()
    if got.shape != want.shape:
        return float("inf"), 1.0
    if not want.numel():
        return 0.0, 0.0
    return float((got - want).abs().max()), float(want.abs().max())


def cache_rows(cache: StaticStore, layer: int, kind: str, length: int) -> torch.Tensor:
    """The first `length` positions of a triton session's k or v cache as attention reads them:
    a quantized cache's codes times their row scales (in f32, as the comparison is)."""
    rows = cache.get(layer, kind)[:, :, :length]
    if (layer, f"{kind}_scale") not in cache.store:
        return rows
    return kv_dequantize(rows, cache.get(layer, f"{kind}_scale")[:, :, :length], torch.float32)


def validate(model: object, *, dtype: str = "f32", batch: int = 2, tokens: int = 7,
             seed: int = 0, device: str = "cpu", cache_dir: Path | None = None,
             autotune: bool | None = None, kv_cache: str | None = None) -> Report:
    """Run `model` (an archc.Model) three ways and compare; see the module docstring.
    `autotune`: let the triton session tune its kernels on a GPU (None: ``TritonOptions``'s
    default);
    `kv_cache`: int8 or fp8 to hold every session's KV cache quantized."""
    from archc.devices import check_compilable
    from archc.ir.lower import lower
    from archc.runtime.triton_backend import TritonOptions, TritonSession
    spec = model.spec  # type: ignore[attr-defined]
    weights = model.weights  # type: ignore[attr-defined]
    check_compilable("triton", dtype, torch.device(device), kv_cache)
    unfused = lower(spec, dtype, model.quant, kv_cache=kv_cache)  # type: ignore[attr-defined]
    tuning = {} if autotune is None else {"autotune": autotune}
    triton = TritonSession(unfused, weights, max_seq_len=spec.max_seq_len, dtype=dtype,
                           device=device, options=TritonOptions(reuse_buffers=False,
                                                                cuda_graphs=False,
                                                                cache_dir=cache_dir, **tuning))
    reference = EagerSession(unfused, weights, max_seq_len=spec.max_seq_len, device=device)
    fused = EagerSession(triton.program, weights, max_seq_len=spec.max_seq_len, device=device)
    sessions = (reference, fused, triton)
    units = {(graph, i): u.name for u in triton.generated.units for graph, i, _ in u.uses}
    report = Report(spec.name, dtype, TOLERANCE[dtype], module_path=str(triton.module_path))
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, spec.vocab_size, (batch, tokens), generator=gen)
    # per-token inputs of the attention's expressions: non-decreasing ids in 0 … 2 per row (a
    # few packed documents), so that a mask over them is not everywhere alike
    given = {name: torch.randint(0, 3, (batch, tokens), generator=gen).sort(dim=1).values
             for name in reference.token_inputs.declared}

    def phase(name: str, graph: str, run: Callable[[Any], torch.Tensor],
              output: str | None = None) -> None:
        fused.trace = Trace(graph=graph)
        outs = [run(s) for s in sessions]
        g = triton.program.graph(graph)
        runner = triton.runners[graph]
        dims = runner.last_dims
        length = dims["P"] + dims["T"]
        # (what, triton, eager) beside each kernel's output: the recurrent state it updates, the
        # KV cache it writes
        more = {i: [(f"{kind} state", triton.states.get(layer, kind),
                     fused.state.store[(layer, kind)]) for layer, kind in state_keys(g, i)]
                for i in g.compute_ids()}
        writer = {st.kw("layer"): i for i in g.compute_ids()
                  for st in g.nodes[i].attr("epilogue", ()) or () if st.fn == "kv_write"}
        for layer, kind in fused.cache.store:   # the values each holds, code·scale if quantized
            if layer in writer:
                more[writer[layer]].append((f"{kind} cache", cache_rows(
                    triton.cache, layer, kind, length), fused.cache.read(layer, kind, length)))
        for i in g.compute_ids():
            if i not in fused.trace.values:
                continue
            at = (name, graph, i, format_node(i, g.nodes[i]), units[(graph, i)])
            for what, got, want in [("output", runner.value(i, dims), fused.trace.values[i]),
                                    *more[i]]:
                report.kernels.append(KernelCheck(*error_and_scale(got, want), *at, what))
        report.phases.append(PhaseCheck(*error_and_scale(outs[2], outs[0]), name,
                                        output or list(g.outputs)[0]))
        fused.trace = None

    if spec.family == "encoder":
        mask = torch.ones(batch, tokens, dtype=torch.long)
        if batch > 1:
            mask[-1, max(1, tokens - 2):] = 0  # the last row padded
        phase("encode", "encoder", lambda s: s.encode(ids, mask, inputs=given))
        return report
    hidden: dict[int, torch.Tensor] = {}     # each session's encoder states
    prompt, last = ids, ids[:, -1:]
    if spec.family == "encoder-decoder":
        phase("encode", "encoder", lambda s: hidden.setdefault(id(s), s.encode(ids)))
        prompt = torch.cat([torch.zeros(batch, 1, dtype=torch.long), ids[:, :2]], 1)
        last = ids[:, 2:3]

    def step(s: Any, x: torch.Tensor, inputs: Any = None) -> torch.Tensor:
        return s.step(x, encoder_hidden=hidden.get(id(s)), inputs=inputs)
    if CROSS_KV in triton.runners:
        for s in sessions:
            s.reset()
        phase("cross-kv", CROSS_KV, lambda s: step(s, prompt), output="logits")
    for s in sessions:
        s.reset()
    phase("prefill", "decoder", lambda s: step(s, prompt, given))
    phase("decode", "decoder", lambda s: step(s, last))
    return report
