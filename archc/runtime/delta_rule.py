"""The gated delta rule on Triton kernels (``archc/codegen/delta_rule.py`` renders them).

    gated_delta_rule(q, k, v, g, beta, initial_state, scale=..., form=..., chunk=...)

q, k: [B, T, H, Dk] (L2-normalized, expanded to the value heads); v: [B, T, H, Dv]; g (log decay,
≤ 0) and beta: [B, T, H]; initial_state: [B, H, Dk, Dv] f32 or None (zeros). Returns o
[B, T, H, Dv] in q's dtype and the final state [B, H, Dk, Dv] f32. form "recurrent" steps token by
token (decode); "chunked" takes `chunk` tokens at a time with tensor-core products (prefill).
"""

from __future__ import annotations

import torch

from archc.codegen.delta_rule import DeltaRuleKernels, launch_constexprs, write
from archc.codegen.render import load_module
from archc.errors import ArchcError
from archc.kernel_cache import default_cache_dir
from archc.runtime.triton_backend import prepare_triton

DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
           beta: torch.Tensor, initial_state: torch.Tensor | None) -> None:
    """One line naming the first argument whose shape, dtype or device does not fit."""
    if q.dim() != 4:
        raise ArchcError(f"gated_delta_rule: q must be [B, T, H, Dk], not {list(q.shape)}")
    b, t, h, dk = q.shape
    dv = v.shape[-1] if v.dim() == 4 else -1
    want = {"k": (k, (b, t, h, dk)), "v": (v, (b, t, h, dv)), "g": (g, (b, t, h)),
            "beta": (beta, (b, t, h))}
    if initial_state is not None:
        want["initial_state"] = (initial_state, (b, h, dk, dv))
    for name, (x, shape) in want.items():
        if tuple(x.shape) != shape:
            raise ArchcError(f"gated_delta_rule: {name} is {list(x.shape)}, expected "
                             f"{list(shape)} from q {list(q.shape)} and v's last dim")
        if x.device != q.device:
            raise ArchcError(f"gated_delta_rule: {name} is on {x.device}, q on {q.device}")
    if q.dtype not in DTYPES:
        raise ArchcError(f"gated_delta_rule: q is {q.dtype}; float32, float16 or bfloat16 only")
    for name, x in (("k", k), ("v", v), ("g", g), ("beta", beta)):
        if x.dtype != q.dtype:
            raise ArchcError(f"gated_delta_rule: {name} is {x.dtype}, q {q.dtype}")
    if initial_state is not None and initial_state.dtype != torch.float32:
        raise ArchcError(f"gated_delta_rule: initial_state must be float32, not "
                         f"{initial_state.dtype}")


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, initial_state: torch.Tensor | None, *, scale: float,
                     form: str, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, final_state) of the gated delta rule over the T tokens (see the module's doc); the
    kernels' module is written under archc's kernel cache."""
    _check(q, k, v, g, beta, initial_state)
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    target = prepare_triton(q.device)
    kernels = DeltaRuleKernels(h, dk, dv, DTYPES[q.dtype])
    cfg = launch_constexprs(kernels, form, target, chunk=chunk, initial=initial_state is not None)
    path = write(kernels, default_cache_dir() / "delta_rule",
                 chunk=cfg.get("CHUNK", 64))
    module = load_module(path, "delta_rule")
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    o = torch.empty((b, t, h, dv), dtype=q.dtype, device=q.device)
    final = torch.empty((b, h, dk, dv), dtype=torch.float32, device=q.device)
    s0 = final if initial_state is None else initial_state.contiguous()   # unread without one
    grid = (b * h, -(-dv // cfg["BLOCK_DV"]))
    if b * h and t:
        getattr(module, kernels.kernel(form))[grid](
            o, q, k, v, g, beta, s0, final, t, float(scale), PDL=False, **cfg)
    elif b * h:     # no tokens: the state passes through
        final.copy_(s0 if initial_state is not None else torch.zeros_like(final))
    return o, final
