"""PyTorch counterparts of one generated kernel, on the kernel's own input tensors: what a
PyTorch user would run instead.

- ``torch.matmul`` on the same GEMM ([M, K] × [K, N], the weight as stored) for ``fused_linear``;
- ``scaled_dot_product_attention`` (``is_causal`` or an equivalent mask, ``enable_gqa``) for
  ``attention``;
- for every kernel, the *unfused sequence*: the ops the fusion replaced, each run by the op
  table's eager semantics in the model dtype — a folded norm is its norm op again (gain ones: it
  was folded into the weight), a merged projection one matmul whose column ranges later ops read
  as views, an epilogue step the ops it was, attention repeat_kv → scores → … → softmax →
  weighted_sum → merge_heads, a recurrent kernel the ops lowering emits for it, on the recurrent
  state the kernel read.

Each counterpart that computes the kernel's function is checked against the kernel's output
(``result`` brings what it returns to the kernel's layout, untimed); a kernel without one gets an
``Unavailable`` with the reason.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import groupby
from typing import Any

import torch
import torch.nn.functional as F

import archc.ir.expr as E
from archc.errors import ArchcError
from archc.ir.attrs import Attrs, Call
from archc.ir.graph import Graph
from archc.ir.modifiers import SOFTMAX, evaluate
from archc.ir.ops import OP_TABLE, VIEW, Args, Op, bind, full_attrs
from archc.ir.ops.attention import ROPE_ATTRS
from archc.ir.ops.core import activations, selected_experts
from archc.ir.ops.modifiers import (
    eager_values,
    modifier_roles,
    modifiers_of,
    query_key_positions,
    t5_bias,
)
from archc.ir.ops.steps import STEPS, step_expr, unpair
from archc.runtime.eager import EagerContext

Store = Mapping[tuple[int, str], torch.Tensor]    # (layer, k|v or state kind) → tensor


@dataclass
class Counterpart:
    name: str                                   # "torch.matmul", "sdpa", "unfused", …
    run: Callable[[], Any]                      # the timed call
    result: Callable[[Any], torch.Tensor] | None = None   # → the kernel's output, untimed
    what: str = ""                              # what it runs, for the report
    ops: int | None = None                      # torch ops per call (unfused sequences)


@dataclass(frozen=True)
class Unavailable:
    name: str
    reason: str


class Unsupported(Exception):
    """This kernel has no counterpart of this kind; the message says why."""


class _CounterpartContext(EagerContext):
    """The eager interpreter's context for a counterpart's unfused ops: KV-cache writes go into
    `scratch` at offset P (tensors the caller sized, so the kernel's cache is left as the kernel
    wrote it); the recurrent state is read from `states`, the state the kernel read (zeros at
    P = 0), and written aside, so every timed run reads the same."""

    def __init__(self, dims: Mapping[str, int], scratch: Store, states: Store) -> None:
        super().__init__(dims)
        self.scratch = scratch
        self.state.store.update(states)
        self.written: dict[tuple[int, str], torch.Tensor] = {}

    def state_write(self, layer: int, kind: str, value: torch.Tensor) -> None:
        self.written[(layer, kind)] = value

    def cache_append(self, layer: int, kind: str, x: torch.Tensor,
                     quant: str | None = None) -> torch.Tensor:
        if quant is not None:
            raise ArchcError(f"the PyTorch baseline keeps a plain KV cache, not {quant}")
        past, buf = self.dims["P"], self.scratch[(layer, kind)]
        buf[:, :, past:past + x.shape[2]] = x
        return buf[:, :, :past + x.shape[2]]

    def cache_read(self, layer: int, kind: str) -> torch.Tensor:
        return self.scratch[(layer, kind)][:, :, :self.dims["P"] + self.dims["T"]]


@dataclass
class _Recorder:
    """Runs unfused ops by their eager semantics, recording which ran until `ops` is None."""

    ctx: _CounterpartContext
    ops: list[str] | None = field(default_factory=list)

    def __call__(self, op: Op, *xs: torch.Tensor, **attrs: Any) -> torch.Tensor:
        if self.ops is not None and op not in VIEW:
            self.ops.append(op.value)
        full = full_attrs(op, Attrs({k: v for k, v in attrs.items() if v is not None}))
        return OP_TABLE[op].eager(self.ctx, bind(op, full, xs), full)


def _unfused(rec: _Recorder, body: Callable[[], Any]) -> Counterpart:
    """The unfused sequence `body` runs; one run outside any timing records its ops."""
    body()
    ops, rec.ops = rec.ops or [], None
    runs = [(name, len(list(run))) for name, run in groupby(ops)]
    what = " → ".join(name if k == 1 else f"{name} ×{k}" for name, k in runs)
    return Counterpart("unfused", body, _output, what, len(ops))


# ---- epilogue steps --------------------------------------------------------------------------

@dataclass(frozen=True)
class _Seg:
    """Columns [start, stop) of the output: flat [..., w], or split into heads [B, h, T, D] —
    or dims [a, b) of each of those heads (`dims`: a rope over their last dims rotated part)."""

    start: int
    stop: int
    value: torch.Tensor
    heads: int | None = None
    dims: tuple[int, int] | None = None


def _joined(pieces: list[_Seg]) -> torch.Tensor:
    """One segment's value, or the dims pieces of the same heads joined along the head dim."""
    pieces = sorted(pieces, key=lambda s: s.dims or (0, 0))
    return pieces[0].value if len(pieces) == 1 else torch.cat([s.value for s in pieces], -1)


def _output(y: torch.Tensor | list[_Seg]) -> torch.Tensor:
    """What a counterpart returned, in the kernel's layout: segments joined, heads merged."""
    if isinstance(y, torch.Tensor):
        return y
    parts = [list(g) for _, g in groupby(sorted(y, key=lambda s: (s.start, s.dims or (0, 0))),
                                         key=lambda s: s.start)]
    return torch.cat([_joined(g) if g[0].heads is None else _joined(g).transpose(1, 2).flatten(2)
                      for g in parts], dim=-1)


def _split(rec: _Recorder, segs: list[_Seg], cuts: Sequence[int]) -> list[_Seg]:
    """Flat segments cut at `cuts` (views)."""
    out = []
    for s in segs:
        inner = [] if s.heads is not None else sorted({c for c in cuts if s.start < c < s.stop})
        edges = [s.start, *inner, s.stop]
        out += [s] if not inner else [
            _Seg(a, b, rec(Op.SLICE, s.value, start=a - s.start, stop=b - s.start))
            for a, b in zip(edges, edges[1:])]
    return out


def _columns(rec: _Recorder, segs: list[_Seg], start: int, stop: int) -> torch.Tensor:
    """Columns [start, stop) as one unfused result or a view of one (or its heads' dims
    pieces joined)."""
    pieces = [s for s in _split(rec, segs, (start, stop)) if (s.start, s.stop) == (start, stop)]
    if pieces:
        return _joined(pieces)
    raise Unsupported(f"columns [{start}, {stop}) are not one unfused result (two, or part of "
                      "rotated heads)")


def _head_rows(rec: _Recorder, segs: list[_Seg], start: int, stop: int, heads: int
               ) -> torch.Tensor:
    """Columns [start, stop) split into `heads` heads [B, heads, T, D]; one head may join
    adjacent pieces (a latent row: its normalized columns, then its rotated ones)."""
    def split(x: torch.Tensor) -> torch.Tensor:
        return rec(Op.SPLIT_HEADS, x, heads=heads) if x.dim() == 3 else x
    try:
        return split(_columns(rec, segs, start, stop))
    except Unsupported:
        pieces = sorted((s for s in _split(rec, segs, (start, stop))
                         if start <= s.start and s.stop <= stop), key=lambda s: s.start)
        if heads != 1 or sum(s.stop - s.start for s in pieces) != stop - start:
            raise
        return torch.cat([split(s.value) for s in pieces], -1)


def _epilogue_step(rec: _Recorder, segs: list[_Seg], st: Call, xs: Sequence[torch.Tensor],
                   later: Sequence[Call]) -> list[_Seg]:
    fn = st.fn
    width = max(s.stop for s in segs)
    if STEPS[fn].prologue is not None:      # a folded norm's step: it ran before the matmul
        return segs
    if STEPS[fn].elementwise:                # the pointwise op of its expression
        if any(s.heads is not None for s in segs):
            raise Unsupported("an elementwise epilogue step after rotary heads")
        start, stop, expr = st.kw("start", 0), st.kw("stop", width), step_expr(st)

        def apply(s: _Seg) -> _Seg:     # the step's inputs at the segment's columns
            ins = (x[..., s.start:s.stop] for x in xs)
            return _Seg(s.start, s.stop, rec(Op.POINTWISE, s.value, *ins, expr=expr))
        return [apply(s) if start <= s.start and s.stop <= stop else s
                for s in _split(rec, segs, (start, stop))]
    if fn == "glu":
        half = width // 2
        gate, up = _columns(rec, segs, 0, half), _columns(rec, segs, half, width)
        if st.kw("gate") is not None:   # the expressions of each half first, as lowered
            gate = rec(Op.POINTWISE, gate, expr=st.kw("gate"))
        if st.kw("up") is not None:
            up = rec(Op.POINTWISE, up, expr=st.kw("up"))
        return [_Seg(0, half, rec(Op.MUL, rec(Op.ACT, gate, fn=st.kw("fn")), up))]
    if fn == "rope":
        hd, start_dim = st.kw("head_dim"), st.kw("rotary_start", 0)
        cols = st.kw("heads") * hd
        # q and k are rotated as the separate tensors they were: cut where k starts
        cuts = [0, cols] + [c.kw("k_start") for c in later if c.fn == "kv_write"
                            and 0 < c.kw("k_start") < cols]
        rotate = {d.name: st.kw(d.name) for d in ROPE_ATTRS}
        if st.kw("heads") == 1 and start_dim:     # one head: the row's columns [a, D) rotate
            return [_Seg(s.start, s.stop, rec(Op.ROPE, rec(Op.SPLIT_HEADS, s.value, heads=1),
                                              xs[0], xs[1], **rotate), 1)
                    if start_dim <= s.start and s.stop <= cols and s.heads is None else s
                    for s in _split(rec, segs, cuts + [start_dim])]
        out = []
        for s in _split(rec, segs, cuts):
            if s.stop <= cols and s.heads is None:
                heads = (s.stop - s.start) // hd
                x = rec(Op.SPLIT_HEADS, s.value, heads=heads)    # the step's attrs are rope's
                if not start_dim:
                    out.append(_Seg(s.start, s.stop, rec(Op.ROPE, x, xs[0], xs[1], **rotate),
                                    heads))
                    continue
                # dims [a, D) of each head rotate (latent attention's RoPE parts), [0, a) not
                tail = rec(Op.SLICE, x, start=start_dim, stop=hd)
                out += [_Seg(s.start, s.stop, rec(Op.SLICE, x, start=0, stop=start_dim), heads,
                             (0, start_dim)),
                        _Seg(s.start, s.stop, rec(Op.ROPE, tail, xs[0], xs[1], **rotate), heads,
                             (start_dim, hd))]
                continue
            out.append(s)
        return out
    if fn == "head_norm":
        # each head of the first `heads` normalized over its dims, then × gain + shift (the
        # gains of q's heads, then of k's, tiled), as the norm ops of split heads were
        hd, cols = st.kw("head_dim"), st.kw("heads") * st.kw("head_dim")
        out = []
        for s in _split(rec, segs, [0, cols]):
            if s.stop <= cols and s.heads is None:
                x = rec(Op.SPLIT_HEADS, s.value, heads=(s.stop - s.start) // hd)
                unit = torch.ones(hd, dtype=x.dtype, device=x.device)
                y = rec(Op.MERGE_HEADS, rec(Op.NORM, x, unit, kind=st.kw("kind"),
                                            eps=st.kw("eps")))
                y = rec(Op.ADD, rec(Op.MUL, y, xs[0][s.start:s.stop]), xs[1][s.start:s.stop])
                s = _Seg(s.start, s.stop, y)
            out.append(s)
        return out
    if fn == "kv_write":
        hd, kv = st.kw("head_dim"), st.kw("kv_heads")
        for kind in _cached_kinds(st):
            start = st.kw(f"{kind}_start")
            x = _head_rows(rec, segs, start, start + kv * hd, kv)
            rec(Op.KV_CACHE, x, layer=st.kw("layer"), kind=kind)
        return segs
    raise Unsupported(f"no unfused form of the {fn}() epilogue step")


def _epilogue(rec: _Recorder, y: torch.Tensor | list[_Seg], a: Attrs, got: Args) -> list[_Seg]:
    """The node's epilogue on `y` (or on its column segments), step by step as the ops it was
    (its inputs by role)."""
    steps = a["epilogue"]
    segs = [_Seg(0, y.shape[-1], y)] if isinstance(y, torch.Tensor) else y
    for k, st in enumerate(steps):
        ins = [got[f"{name}{k}"] for name in STEPS[st.fn].inputs]
        segs = _epilogue_step(rec, segs, st, ins, steps[k + 1:])
    return segs


# ---- the unfused sequence of each kernel: (recorder, attributes, inputs) → the timed call ----

def _fused_linear(rec: _Recorder, a: Attrs, got: Args) -> Callable[[], list[_Seg]]:
    xs = [got[r] for r in activations(got)]
    # the weight's columns that multiply each operand (a merged K: two matmuls, then add)
    weight = got["weight"]
    if a["paired"]:   # rows in the pairing step's order: the unfused matmul's in column order
        weight = unpair(weight.transpose(0, 1), a["epilogue"]).transpose(0, 1)
    ws = [w.contiguous() for w in weight.split([x.shape[-1] for x in xs], dim=1)]
    gain = torch.ones(xs[0].shape[-1], dtype=xs[0].dtype, device=xs[0].device)

    def body() -> list[_Seg]:
        h = xs[0]
        if a["prologue"] is not None:
            h = rec(Op.NORM, h, gain, kind=a["prologue"], eps=a["eps"])
        y = rec(Op.MATMUL, h, ws[0])
        if len(xs) == 2:
            y = rec(Op.ADD, y, rec(Op.MATMUL, xs[1], ws[1]))
        return _epilogue(rec, y, a, got)
    return body


def _attention(rec: _Recorder, a: Attrs, got: Args) -> Callable[[], torch.Tensor]:
    q, k, v = got["q"], got["k"], got["v"]
    groups = q.shape[1] // k.shape[1]
    bias, padding, prefix = a["bias"], got.get("padding"), got.get("prefix_len")

    def body() -> torch.Tensor:
        kk, vv = (k, v) if groups == 1 else (rec(Op.REPEAT_KV, x, groups=groups) for x in (k, v))
        s = rec(Op.SCORES, q, kk)
        if a["second_score"]:       # + q2·k2ᵀ (latent attention's RoPE part)
            k2 = got["k2"] if groups == 1 else rec(Op.REPEAT_KV, got["k2"], groups=groups)
            s = rec(Op.ADD, s, rec(Op.SCORES, got["q2"], k2))
        s = rec(Op.POINTWISE, s, expr=E.call("scale", E.x(0), by=a["scale"]))
        if a["softcap"] is not None:
            s = rec(Op.POINTWISE, s, expr=E.call("softcap", E.x(0), cap=a["softcap"]))
        if bias is not None and bias.fn == "alibi":
            s = rec(Op.ALIBI, s, got["slopes"])
        elif bias is not None:      # t5(...) carries rel_bias's attributes
            s = rec(Op.REL_BIAS, s, got["rel_table"], **dict(bias.kwargs))
        if a["score"] is not None:
            s = rec(Op.SCORE_MOD, s, *(got[r] for r in modifier_roles(Attrs(score=a["score"]))),
                    score=a["score"], kv_heads=k.shape[1])
        mask = Attrs(causal=a["causal"], window=a["window"], global_tokens=a["global_tokens"],
                     padding=padding is not None, prefix=prefix is not None, mask=a["mask"])
        s = rec(Op.MASK, s, *(got[r] for r in modifier_roles(mask)), **dict(mask),
                kv_heads=k.shape[1])
        nz = a["normalizer"]
        p = rec(Op.SOFTMAX, s) if nz == SOFTMAX else \
            rec(Op.NORMALIZE, s, *([got[nz.kw("sinks")]] if nz.kw("sinks") else []),
                normalizer=nz)
        return rec(Op.MERGE_HEADS, rec(Op.WEIGHTED_SUM, p, vv))
    return body


def _norm(rec: _Recorder, a: Attrs, got: Args) -> Callable[[], list[_Seg]]:
    def body() -> list[_Seg]:
        x = got["x"] if "residual" not in got else rec(Op.ADD, got["x"], got["residual"])
        kw = dict(kind=a["kind"], eps=a["eps"], unit_offset=a["unit_offset"])
        if a["spans"] is None:
            return _epilogue(rec, rec(Op.NORM, x, got["weight"], **kw), a, got)
        # spans: a norm over each span's columns (q's, k's) as lowering emitted them, the
        # columns after them (v's) as they were
        segs, start, width = [], 0, x.shape[-1]
        for span in a["spans"]:
            part = rec(Op.SLICE, x, start=start, stop=start + span)
            segs.append(_Seg(start, start + span, rec(
                Op.NORM, part, got["weight"][start:start + span], **kw)))
            start += span
        if start < width:
            segs.append(_Seg(start, width, rec(Op.SLICE, x, start=start, stop=width)))
        return _epilogue(rec, segs, a, got)
    return body


def _pointwise(rec: _Recorder, a: Attrs, got: Args) -> Callable[[], torch.Tensor]:
    xs = list(got.values())

    def ev(e: Call) -> torch.Tensor:
        """One unfused op per function application."""
        if e.fn == "x":
            return xs[e.args[0]]
        calls = [x for x in e.args if isinstance(x, Call)]
        leaves = iter(E.x(k) for k in range(len(calls)))
        expr = Call(e.fn, tuple(next(leaves) if isinstance(x, Call) else x for x in e.args),
                    e.kwargs)
        return rec(Op.POINTWISE, *(ev(c) for c in calls), expr=expr)
    return lambda: ev(a["expr"])


def _router(rec: _Recorder, a: Attrs, got: Args) -> Callable[[], torch.Tensor]:
    def body() -> torch.Tensor:
        logits = rec(Op.MATMUL, got["x"], got["weight"])
        if "bias" in got:
            logits = rec(Op.ADD, logits, got["bias"])
        choice = [got["choice_bias"]] if "choice_bias" in got else []
        return rec(Op.ROUTER, logits, *choice, **a)
    return body


def _causal_conv(rec: _Recorder, a: Attrs, got: Args) -> Callable[[], torch.Tensor]:
    def body() -> torch.Tensor:
        y = rec(Op.CAUSAL_CONV, got["x"], got["weight"], layer=a["layer"])
        if a["bias"]:
            y = rec(Op.ADD, y, got["bias"])
        return rec(Op.ACT, y, fn=a["act"])
    return body


def _ssm_scan(rec: _Recorder, a: Attrs, got: Args) -> Callable[[], torch.Tensor]:
    def body() -> torch.Tensor:
        b, c = got["b"], got["c"]
        if a["norm_eps"] is not None:
            b = rec(Op.NORM, b, got["b_gain"], kind="rms", eps=a["norm_eps"])
            c = rec(Op.NORM, c, got["c_gain"], kind="rms", eps=a["norm_eps"])
        y = rec(Op.SSM_SCAN, got["x"], got["dt"], got["a"], b, c, layer=a["layer"])
        if not a["gate"]:
            return y
        y = rec(Op.ADD, y, rec(Op.MUL, got["x"], got["skip"]))
        return rec(Op.MUL, y, rec(Op.ACT, got["z"], fn="silu"))
    return body


def _linear_attention(rec: _Recorder, a: Attrs, got: Args) -> Callable[[], torch.Tensor]:
    return lambda: rec(Op.LINEAR_ATTENTION, *(rec(Op.ACT, got[r], fn=a["feature"])
                                              for r in ("q", "k")), got["v"], layer=a["layer"])


def _head_linear(rec: _Recorder, a: Attrs, got: Args) -> Callable[[], torch.Tensor]:
    def body() -> torch.Tensor:
        y = rec(Op.HEAD_LINEAR, got["x"], got["weight"])
        return rec(Op.MERGE_HEADS, y) if a["merged"] else y
    return body


def _delta_rule(rec: _Recorder, a: Attrs, got: Args) -> Callable[[], torch.Tensor]:
    # the op's eager form (PyTorch's chunked or recurrent delta rule, q and k normalized)
    return lambda: rec(Op.DELTA_RULE, *(got[r] for r in ("q", "k", "v", "g", "beta")), **{
        k: a[k] for k in ("layer", "heads", "key_heads", "algorithm", "chunk", "eps", "scale")})


_UNFUSED: dict[Op, Callable[[_Recorder, Attrs, Args], Callable[[], Any]]] = {
    Op.FUSED_LINEAR: _fused_linear, Op.ATTENTION: _attention, Op.NORM: _norm,
    Op.POINTWISE: _pointwise, Op.ROUTER: _router, Op.CAUSAL_CONV: _causal_conv,
    Op.SSM_SCAN: _ssm_scan, Op.LINEAR_ATTENTION: _linear_attention,
    Op.HEAD_LINEAR: _head_linear, Op.DELTA_RULE: _delta_rule}


# ---- what PyTorch offers for the whole kernel ------------------------------------------------

def _matmul(got: Args) -> Counterpart:
    """The same GEMM through torch.matmul: [M, K] × [K, N], the weight as stored ([N, K])."""
    w = got["weight"]
    x = torch.cat([got[r] for r in activations(got)], dim=-1).reshape(-1, w.shape[1])
    m, k = x.shape
    return Counterpart("torch.matmul", lambda: torch.matmul(x, w.t()),
                       what=f"[{m}, {k}] × [{k}, {w.shape[0]}]", ops=1)


def _sdpa(a: Attrs, got: Args) -> Counterpart | Unavailable:
    if a["softcap"] is not None:
        return Unavailable("sdpa", "scaled_dot_product_attention has no soft-capping")
    if a["score"] is not None or a["normalizer"] != SOFTMAX:
        return Unavailable("sdpa", "scaled_dot_product_attention takes no score expression "
                           "and normalizes by softmax alone")
    q, k, v = got["q"], got["k"], got["v"]
    if a["second_score"]:           # q·kᵀ + q2·k2ᵀ = [q ‖ q2]·[k ‖ k2]ᵀ
        q, k = torch.cat([q, got["q2"]], -1), torch.cat([k, got["k2"]], -1)
    (b, h, t, _), d = q.shape, v.shape[-1]
    length, groups, bias = k.shape[2], h // k.shape[1], a["bias"]
    plain = (a["window"] is None and bias is None and "prefix_len" not in got
             and "padding" not in got and a["mask"] is None)
    mask: torch.Tensor | None = None
    if not plain or (a["causal"] and t != length and min(t, length) > 1):
        mods, (qp, kp) = modifiers_of(a), query_key_positions(t, length, q.device)
        mask = evaluate(mods.mask, mods.env, eager_values(mods, got, qp, kp, h, k.shape[1]))
        mask = mask.expand(mask.shape[0], mask.shape[1], t, length)
        if bias is not None:
            add = t5_bias(got["rel_table"], qp, kp, dict(bias.kwargs)) if bias.fn == "t5" \
                else got["slopes"].float()[:, None, None] * (kp[None, :] - qp[:, None])[None]
            mask = add[None].to(q.dtype).masked_fill(~mask, float("-inf"))
    kwargs: dict[str, Any] = {"attn_mask": mask, "scale": a["scale"],
                              "is_causal": mask is None and a["causal"] and t == length > 1}
    what = ("is_causal" if kwargs["is_causal"] else "no mask" if mask is None else
            f"{'bool' if mask.dtype == torch.bool else 'additive'} mask")
    if groups > 1 and torch.__version__ >= "2.5":
        kwargs["enable_gqa"] = True
        what += ", enable_gqa"
    elif groups > 1:                             # a torch without enable_gqa
        k, v = (x.repeat_interleave(groups, dim=1) for x in (k, v))
        what += ", k/v repeated to all heads before timing"
    return Counterpart("sdpa", lambda: F.scaled_dot_product_attention(q, k, v, **kwargs),
                       lambda o: o.transpose(1, 2).reshape(b, t, h * d), what, 1)


def _moe_linear(a: Attrs, got: Args, rec: _Recorder) -> Counterpart:
    """Expert by expert over the tokens routed to it, as a PyTorch MoE layer runs, then the
    epilogue's ops (not counted: the ops per expert vary with the routing)."""
    x, gates, w = got["x"], got["gates"], got["weight"]
    top_k = a["top_k"]
    if any(st.fn == "glu" and st.kw("interleaved", False) for st in a["epilogue"]):
        # gate and up rows as a PyTorch MoE stores them (gate rows, then up rows): the glu below
        # takes the two halves
        w = w.unflatten(1, (w.shape[1] // 2, 2)).transpose(1, 2).flatten(1, 2)
    flat_idx = selected_experts(gates, top_k).reshape(-1, top_k)
    flat_gates = gates.reshape(-1, gates.shape[-1])

    up = a["stage"] == "up"     # up: [..., K] → [..., top_k, N]; down: [..., top_k, K] → [..., N]
    rows = x.shape[:-1] if up else x.shape[:-2]

    bias = got.get("bias")
    if bias is not None and any(st.fn == "glu" and st.kw("interleaved", False)
                                for st in a["epilogue"]):
        bias = bias.unflatten(1, (bias.shape[1] // 2, 2)).transpose(1, 2).flatten(1, 2)
    gate_input = a["gate_input"]

    def stage() -> torch.Tensor:
        flat = x.reshape(-1, *x.shape[len(rows):])
        out = x.new_zeros(flat.shape[0], *([top_k] if up else []), w.shape[1])
        for e in range(w.shape[0]):
            tok, slot = torch.nonzero(flat_idx == e, as_tuple=True)
            if not tok.numel():
                continue
            picked = flat[tok] if up else flat[tok, slot]
            if up and gate_input:     # the gate scales the expert's input
                picked = picked * flat_gates[tok, e, None]
            y = F.linear(picked, w[e], None if bias is None else bias[e])
            if up:
                out[tok, slot] = y
            else:
                out.index_add_(0, tok, y if gate_input else y * flat_gates[tok, e, None])
        return out.reshape(*rows, *out.shape[1:])

    rec.ops = None
    what = "per expert: routed tokens " + ("× gate → " if up and gate_input else "") + \
        "linear" + ("" if up or gate_input else " → × gate") + ("" if up else " → index_add")
    if a["epilogue"]:
        what += " → " + ", ".join(st.fn for st in a["epilogue"])
    return Counterpart("unfused", lambda: _epilogue(rec, stage(), a, got), _output, what)


def counterparts(g: Graph, i: int, xs: Sequence[torch.Tensor], dims: Mapping[str, int],
                 caches: Store, scratch: Store, states: Store | None = None,
                 ) -> list[Counterpart | Unavailable]:
    """PyTorch counterparts of node i of kernel-level graph `g`, on its input tensors `xs`.
    Attention reads `caches` (the kernel's KV cache); unfused KV-cache writes go to `scratch`,
    whose tensors the caller sized, so the kernel's cache is left as the kernel wrote it. A
    recurrent kernel's counterpart reads `states`, the state the kernel read (zeros at P = 0),
    and writes its new state aside, so every timed run reads the same."""
    n = g.nodes[i]
    a = full_attrs(n.op, n.attrs)
    got = bind(n.op, a, xs)
    rec = _Recorder(_CounterpartContext(dims, scratch, states or {}))
    if n.op == Op.EMBEDDING:
        return [Counterpart("torch", lambda: F.embedding(got["ids"], got["table"]), _output,
                            "F.embedding", 1)]
    if n.op == Op.MOE_LINEAR:
        return [_moe_linear(a, got, rec)]
    if n.op not in _UNFUSED:
        return [Unavailable("unfused", f"no counterpart for {n.op.value}")]
    out: list[Counterpart | Unavailable] = []
    if n.op == Op.FUSED_LINEAR:
        out.append(_matmul(got))
    if n.op == Op.ATTENTION:
        if a["cache_layer"] is not None and a["second_score"]:   # rows [k ‖ k2], v = k
            row = caches[(a["cache_layer"], "k")][:, :, :dims["P"] + dims["T"]]
            d = got["q"].shape[-1]
            got["k"], got["v"], got["k2"] = row[..., :d], row[..., :d], row[..., d:]
        elif a["cache_layer"] is not None:        # the keys and values the kernel read
            got["k"], got["v"] = (caches[(a["cache_layer"], kind)][:, :, :dims["P"] + dims["T"]]
                                  for kind in ("k", "v"))
        got["q"] = got["q"].contiguous()
        out.append(_sdpa(a, got))
    try:
        out.append(_unfused(rec, _UNFUSED[n.op](rec, a, got)))
    except Unsupported as err:
        out.append(Unavailable("unfused", str(err)))
    return out


def scratch_caches(g: Graph, i: int, dims: Mapping[str, int], dtype: torch.dtype,
                   device: torch.device) -> dict[tuple[int, str], torch.Tensor]:
    """KV-cache tensors for the unfused writes of node i (its kv_write steps), P + T long."""
    length = dims["P"] + dims["T"]
    return {(st.kw("layer"), kind): torch.zeros(dims["B"], st.kw("kv_heads"), length,
                                                st.kw("head_dim"), dtype=dtype, device=device)
            for st in g.nodes[i].attr("epilogue", ()) if st.fn == "kv_write"
            for kind in _cached_kinds(st)}


def _cached_kinds(st: Call) -> tuple[str, ...]:
    """What a kv_write() step caches: k and v, or the key rows alone (latent attention's values
    are their first columns)."""
    return ("k", "v") if st.kw("values", True) else ("k",)
