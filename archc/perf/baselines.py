"""PyTorch counterparts of one generated kernel, on the kernel's own input tensors.

For a kernel-level node, what a PyTorch user would run instead:
- ``torch.matmul`` on the same GEMM ([M, K] × [K, N], the weight as stored) for ``fused_linear``;
- ``scaled_dot_product_attention`` (``is_causal`` or an equivalent mask, ``enable_gqa``) for
  ``attention``;
- the *unfused sequence* for every kernel: the unfused ops the fusion replaced, each run by its
  eager semantics (the op table's, ``archc.perf.torch_program.eager_fn``), one after another,
  in the model dtype — a folded norm is its norm op again (gain folded into the weight, so the
  norm's gain is ones), a merged projection is one matmul whose column ranges the later ops
  read as views, an elementwise epilogue step is the pointwise op of its expression, the
  other steps the ops they were (act and mul, rope, kv_cache), attention is repeat_kv → scores →
  scale → … → mask → softmax → weighted_sum → merge_heads, and the recurrent kernels are the ops
  lowering emits for them (causal_conv → add → act; norms → ssm_scan → mul, add → act → mul;
  act → linear_attention), reading the recurrent state the kernel read.

Every counterpart that computes the kernel's function is checked against the kernel's output
(``result`` turns what it returns into the kernel's layout, outside the timed call); a kernel
without a counterpart gets an ``Unavailable`` with the reason.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

import archc.ir.expr as E
from archc.ir.attrs import Attrs, Call
from archc.ir.cost import node_states
from archc.ir.graph import Graph
from archc.ir.ops import VIEW, Op, bind, full_attrs
from archc.ir.ops.attention import alibi_bias, relative_bias, visible
from archc.ir.ops.core import selected_experts
from archc.ir.ops.steps import STEPS, step_expr
from archc.perf.torch_program import Store, TorchContext, eager_fn


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


@dataclass
class _Recorder:
    """Runs unfused ops by their eager semantics; the first run records which ops ran."""

    ctx: TorchContext
    ops: list[str] | None = field(default_factory=list)

    def __call__(self, op: Op, *xs: torch.Tensor, **attrs: Any) -> torch.Tensor:
        if self.ops is not None and op not in VIEW:
            self.ops.append(op.value)
        full = full_attrs(op, Attrs({k: v for k, v in attrs.items() if v is not None}))
        return eager_fn(op)(self.ctx, bind(op, full, xs), full)

    def torch(self, name: str, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        """A step with no unfused op of its own (a subtraction in a pointwise chain)."""
        if self.ops is not None:
            self.ops.append(name)
        return fn()

    def summary(self) -> tuple[str, int]:
        ops = self.ops or []
        self.ops = None
        runs: list[tuple[str, int]] = []
        for name in ops:
            if runs and runs[-1][0] == name:
                runs[-1] = (name, runs[-1][1] + 1)
            else:
                runs.append((name, 1))
        text = " → ".join(name if k == 1 else f"{name} ×{k}" for name, k in runs)
        return text, len(ops)


def _unfused(name: str, rec: _Recorder, body: Callable[[], Any],
             result: Callable[[Any], torch.Tensor]) -> Counterpart:
    out = body()                     # records the ops once, outside any timing
    what, count = rec.summary()
    del out
    return Counterpart(name, body, result, what, count)


# ---- fused_linear ----------------------------------------------------------------------------

@dataclass(frozen=True)
class _Seg:
    """Columns [start, stop) of the output: flat [..., w], or split into heads [B, h, T, D]."""

    start: int
    stop: int
    value: torch.Tensor
    heads: int | None = None


def _flat(seg: _Seg) -> torch.Tensor:
    if seg.heads is None:
        return seg.value
    b, h, t, d = seg.value.shape
    return seg.value.transpose(1, 2).reshape(b, t, h * d)


def _columns(rec: _Recorder, segs: list[_Seg], start: int, stop: int) -> torch.Tensor:
    """Columns [start, stop) as a view of the one segment that holds them."""
    for s in segs:
        if s.start <= start and stop <= s.stop:
            if s.heads is not None:
                if (s.start, s.stop) != (start, stop):
                    raise Unsupported("an epilogue step reads part of rotated heads")
                return s.value
            if (s.start, s.stop) == (start, stop):
                return s.value
            return rec(Op.SLICE, s.value, start=start - s.start, stop=stop - s.start)
    raise Unsupported(f"columns [{start}, {stop}) span two unfused results")


def _split(rec: _Recorder, segs: list[_Seg], cuts: Sequence[int]) -> list[_Seg]:
    """Flat segments cut at `cuts` (views)."""
    out = []
    for s in segs:
        inner = sorted(c for c in set(cuts) if s.start < c < s.stop)
        if s.heads is not None or not inner:
            out.append(s)
            continue
        edges = [s.start, *inner, s.stop]
        for a, b in zip(edges, edges[1:]):
            out.append(_Seg(a, b, rec(Op.SLICE, s.value, start=a - s.start, stop=b - s.start)))
    return out


def _map_flat(segs: list[_Seg], fn: Callable[[_Seg], torch.Tensor]) -> list[_Seg]:
    out = []
    for s in segs:
        if s.heads is not None:
            raise Unsupported("an elementwise epilogue step after rotary heads")
        out.append(_Seg(s.start, s.stop, fn(s)))
    return out


def _epilogue_step(rec: _Recorder, segs: list[_Seg], st: Call, xs: Sequence[torch.Tensor],
                   later: Sequence[Call]) -> list[_Seg]:
    fn = st.fn
    if fn in ("rms_scale", "ln_scale"):      # the norm ran before the matmul
        return segs
    if STEPS[fn].elementwise:                # the pointwise op of its expression
        width = max(s.stop for s in segs)
        start, stop = st.kw("start", 0), st.kw("stop", width)
        expr = step_expr(st)

        def apply(s: _Seg) -> torch.Tensor:
            ins = [x[s.start:s.stop] if x.dim() == 1 else x[..., s.start:s.stop] for x in xs]
            return rec(Op.POINTWISE, s.value, *ins, expr=expr)
        segs = _map_flat(_split(rec, segs, (start, stop)), lambda s: s.value)
        return [_Seg(s.start, s.stop, apply(s)) if start <= s.start and s.stop <= stop else s
                for s in segs]
    if fn == "glu":
        width = max(s.stop for s in segs)
        half = width // 2
        gate, up = _columns(rec, segs, 0, half), _columns(rec, segs, half, width)
        return [_Seg(0, half, rec(Op.MUL, rec(Op.ACT, gate, fn=st.kw("fn")), up))]
    if fn == "rope":
        hd = st.kw("head_dim")
        cols = st.kw("heads") * hd
        # q and k are rotated as the separate tensors they were: cut where k starts
        cuts = [0, cols] + [c.kw("k_start") for c in later if c.fn == "kv_write"
                            and 0 < c.kw("k_start") < cols]
        segs = _split(rec, segs, cuts)
        out = []
        for s in segs:
            if s.stop <= cols and s.heads is None:
                heads = (s.stop - s.start) // hd
                x = rec(Op.SPLIT_HEADS, s.value, heads=heads)
                out.append(_Seg(s.start, s.stop, rec(
                    Op.ROPE, x, xs[0], xs[1], rotary_dim=st.kw("rotary_dim"),
                    interleaved=st.kw("interleaved"), mscale=st.kw("mscale", 1.0),
                    dynamic=st.kw("dynamic")), heads))
            else:
                out.append(s)
        return out
    if fn == "kv_write":
        hd, kv = st.kw("head_dim"), st.kw("kv_heads")
        for kind in ("k", "v"):
            start = st.kw(f"{kind}_start")
            x = _columns(rec, segs, start, start + kv * hd)
            if x.dim() == 3:
                x = rec(Op.SPLIT_HEADS, x, heads=kv)
            rec(Op.KV_CACHE, x, layer=st.kw("layer"), kind=kind)
        return segs
    raise Unsupported(f"no unfused form of the {fn}() epilogue step")


def _fused_linear(g: Graph, i: int, xs: Sequence[torch.Tensor], rec: _Recorder,
                  ) -> list[Counterpart | Unavailable]:
    a = full_attrs(g.nodes[i].op, g.nodes[i].attrs)
    concat = bool(a["concat_k"])
    ops = 2 if concat else 1
    x, w = xs[0], xs[ops]
    out: list[Counterpart | Unavailable] = []
    # the same GEMM through torch.matmul: [M, K] × [K, N], the weight as stored ([N, K])
    x2d = (torch.cat([xs[0], xs[1]], dim=-1) if concat else x).reshape(-1, w.shape[1])
    x2d = x2d.contiguous()
    m, k = x2d.shape
    out.append(Counterpart("torch.matmul", lambda: torch.matmul(x2d, w.t()),
                           what=f"[{m}, {k}] × [{k}, {w.shape[0]}]", ops=1))

    prologue = a["prologue"]
    width = x.shape[-1]
    gain = torch.ones(width, dtype=x.dtype, device=x.device)
    w_parts = (w[:, :width].contiguous(), w[:, width:].contiguous()) if concat else (w,)
    steps = list(a["epilogue"])
    taken = _step_inputs(steps, xs[ops + 1:])

    def body() -> list[_Seg]:
        h = x
        if prologue is not None:
            h = rec(Op.NORM, x, gain, kind=prologue, eps=a["eps"])
        y = rec(Op.MATMUL, h, w_parts[0])
        if concat:
            y = rec(Op.ADD, y, rec(Op.MATMUL, xs[1], w_parts[1]))
        segs = [_Seg(0, y.shape[-1], y)]
        for k_, (st, ins) in enumerate(zip(steps, taken)):
            segs = _epilogue_step(rec, segs, st, ins, steps[k_ + 1:])
        return segs

    def result(segs: list[_Seg]) -> torch.Tensor:
        return torch.cat([_flat(s) for s in sorted(segs, key=lambda s: s.start)], dim=-1)

    try:
        out.append(_unfused("unfused", rec, body, result))
    except Unsupported as err:
        out.append(Unavailable("unfused", str(err)))
    return out


# ---- attention -------------------------------------------------------------------------------

def _attention(g: Graph, i: int, xs: Sequence[torch.Tensor], rec: _Recorder,
               caches: Store) -> list[Counterpart | Unavailable]:
    a = full_attrs(g.nodes[i].op, g.nodes[i].attrs)
    got = bind(Op.ATTENTION, a, xs)
    q = got["q"].contiguous()                                  # [B, H, T, D]
    layer = a["cache_layer"]
    if layer is not None:
        length = rec.ctx.dims["P"] + rec.ctx.dims["T"]
        k, v = (caches[(layer, kind)][:, :, :length] for kind in ("k", "v"))
    else:
        k, v = got["k"], got["v"]
    b, h, t, d = q.shape
    groups = h // k.shape[1]
    length = k.shape[2]
    bias = a["bias"]
    prefix = int(got["prefix_len"]) if "prefix_len" in got else None
    padding = got.get("padding")

    def merged(o: torch.Tensor) -> torch.Tensor:
        return o.transpose(1, 2).reshape(b, t, h * d)

    out: list[Counterpart | Unavailable] = []
    if a["softcap"] is not None:
        out.append(Unavailable("sdpa", "scaled_dot_product_attention has no soft-capping"))
    else:
        causal = a["causal"]
        plain = a["window"] is None and bias is None and prefix is None and padding is None
        mask: torch.Tensor | None = None
        is_causal = False
        if plain and (not causal or length == 1 or t == 1):
            pass                                     # every key is visible
        elif plain and causal and t == length:
            is_causal = True
        else:
            keep = visible(t, length, causal, a["window"], prefix, a["global_tokens"],
                           device=q.device)[None, None]
            if padding is not None:
                keep = keep & padding.bool()[:, None, None, :]
            if bias is None:
                mask = keep
            else:
                add = (alibi_bias(got["slopes"], t, length) if bias.fn == "alibi" else
                       relative_bias(got["rel_table"].float(), t, length,
                                     bias.kw("bidirectional"), bias.kw("max_distance")))
                mask = add[None].to(q.dtype).masked_fill(~keep, float("-inf"))
        kk, vv, gqa = k, v, groups > 1
        kwargs: dict[str, Any] = {"attn_mask": mask, "is_causal": is_causal, "scale": a["scale"]}
        what = ("is_causal" if is_causal else "no mask" if mask is None else
                f"{'bool' if mask.dtype == torch.bool else 'additive'} mask")
        try:
            F.scaled_dot_product_attention(q[:, :, :1], k[:, :, :1], v[:, :, :1],
                                           enable_gqa=gqa)
            kwargs["enable_gqa"] = gqa
            what += ", enable_gqa" if gqa else ""
        except TypeError:                            # a torch without enable_gqa
            kk, vv = (x.repeat_interleave(groups, dim=1) for x in (k, v))
            what += ", k/v repeated to all heads before timing" if gqa else ""
        out.append(Counterpart(
            "sdpa", lambda: F.scaled_dot_product_attention(q, kk, vv, **kwargs), merged,
            what, 1))

    def body() -> torch.Tensor:
        kk, vv = k, v
        if groups > 1:
            kk = rec(Op.REPEAT_KV, k, groups=groups)
            vv = rec(Op.REPEAT_KV, v, groups=groups)
        s = rec(Op.POINTWISE, rec(Op.SCORES, q, kk), expr=E.call("scale", E.x(0), by=a["scale"]))
        if a["softcap"] is not None:
            s = rec(Op.POINTWISE, s, expr=E.call("softcap", E.x(0), cap=a["softcap"]))
        if bias is not None and bias.fn == "alibi":
            s = rec(Op.ALIBI, s, got["slopes"])
        elif bias is not None:
            s = rec(Op.REL_BIAS, s, got["rel_table"], bidirectional=bias.kw("bidirectional"),
                    max_distance=bias.kw("max_distance"))
        extra = [x for x in (padding, got.get("prefix_len")) if x is not None]
        s = rec(Op.MASK, s, *extra, causal=a["causal"], window=a["window"],
                global_tokens=a["global_tokens"], padding=padding is not None,
                prefix=prefix is not None)
        return rec(Op.MERGE_HEADS, rec(Op.WEIGHTED_SUM, rec(Op.SOFTMAX, s), vv))

    out.append(_unfused("unfused", rec, body, lambda o: o))
    return out


# ---- the other kernels -----------------------------------------------------------------------

def _step_inputs(steps: Sequence[Call], rest: Sequence[torch.Tensor]
                 ) -> list[Sequence[torch.Tensor]]:
    """The inputs of each epilogue step, in order."""
    out, left = [], list(rest)
    for st in steps:
        k = len(STEPS[st.fn].inputs)
        out.append(left[:k])
        left = left[k:]
    return out


def _elementwise_steps(rec: _Recorder, y: torch.Tensor, steps: Sequence[Call],
                       inputs: Sequence[torch.Tensor]) -> torch.Tensor:
    segs = [_Seg(0, y.shape[-1], y)]
    for k, (st, ins) in enumerate(zip(steps, _step_inputs(steps, inputs))):
        segs = _epilogue_step(rec, segs, st, ins, steps[k + 1:])
    return torch.cat([_flat(s) for s in segs], dim=-1) if len(segs) > 1 else segs[0].value


def _norm(g: Graph, i: int, xs: Sequence[torch.Tensor], rec: _Recorder) -> Counterpart:
    a = full_attrs(Op.NORM, g.nodes[i].attrs)
    got = bind(Op.NORM, a, xs)
    rest = [v for k, v in got.items() if k not in ("x", "weight", "residual")]

    def body() -> torch.Tensor:
        x = got["x"]
        if "residual" in got:
            x = rec(Op.ADD, x, got["residual"])
        y = rec(Op.NORM, x, got["weight"], kind=a["kind"], eps=a["eps"],
                unit_offset=a["unit_offset"])
        return _elementwise_steps(rec, y, a["epilogue"], rest)

    return _unfused("unfused", rec, body, lambda y: y)


def _pointwise(g: Graph, i: int, xs: Sequence[torch.Tensor], rec: _Recorder) -> Counterpart:
    expr: Call = g.nodes[i].attr("expr")

    def ev(e: Call) -> torch.Tensor:
        """One unfused op per function application."""
        if e.fn == "x":
            return xs[e.args[0]]
        calls = [a for a in e.args if isinstance(a, Call)]
        args = [ev(a) for a in calls]
        leaves = iter(E.x(k) for k in range(len(args)))
        expr1 = Call(e.fn, tuple(next(leaves) if isinstance(a, Call) else a for a in e.args),
                     e.kwargs)
        return rec(Op.POINTWISE, *args, expr=expr1)

    return _unfused("unfused", rec, lambda: ev(expr), lambda y: y)


def _router(g: Graph, i: int, xs: Sequence[torch.Tensor], rec: _Recorder) -> Counterpart:
    a = g.nodes[i].attrs
    return _unfused("unfused", rec, lambda: rec(
        Op.ROUTER, rec(Op.MATMUL, xs[0], xs[1]), top_k=a["top_k"], normalize=a["normalize"]),
        lambda y: y)


def _moe_linear(g: Graph, i: int, xs: Sequence[torch.Tensor], rec: _Recorder) -> Counterpart:
    """Expert by expert over the tokens routed to it, as a PyTorch MoE layer runs, then the
    epilogue's ops."""
    a = full_attrs(Op.MOE_LINEAR, g.nodes[i].attrs)
    x, gates, w = xs[:3]
    top_k = a["top_k"]
    flat_idx = selected_experts(gates, top_k).reshape(-1, top_k)
    flat_gates = gates.reshape(-1, gates.shape[-1])

    def up() -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        out = torch.zeros(flat.shape[0], top_k, w.shape[1], dtype=x.dtype, device=x.device)
        for e in range(w.shape[0]):
            tok, slot = torch.nonzero(flat_idx == e, as_tuple=True)
            if tok.numel():
                out[tok, slot] = F.linear(flat[tok], w[e])
        return out.reshape(*x.shape[:-1], top_k, w.shape[1])

    def down() -> torch.Tensor:
        flat = x.reshape(-1, top_k, x.shape[-1])
        out = torch.zeros(flat.shape[0], w.shape[1], dtype=x.dtype, device=x.device)
        for e in range(w.shape[0]):
            tok, slot = torch.nonzero(flat_idx == e, as_tuple=True)
            if tok.numel():
                out.index_add_(0, tok, F.linear(flat[tok, slot], w[e]) * flat_gates[tok, e, None])
        return out.reshape(*x.shape[:-2], w.shape[1])

    stage = up if a["stage"] == "up" else down
    what = ("per expert: routed tokens → linear" if a["stage"] == "up" else
            "per expert: routed tokens → linear → × gate → index_add")
    steps = ", ".join(st.fn for st in a["epilogue"])
    quiet = _Recorder(rec.ctx, None)
    return Counterpart("unfused", lambda: _elementwise_steps(quiet, stage(), a["epilogue"],
                                                             xs[3:]),
                       lambda y: y, what + (f" → {steps}" if steps else ""))


# ---- the recurrent kernels ------------------------------------------------------------------

def _causal_conv(g: Graph, i: int, xs: Sequence[torch.Tensor], rec: _Recorder) -> Counterpart:
    a = full_attrs(Op.CAUSAL_CONV, g.nodes[i].attrs)

    def body() -> torch.Tensor:
        y = rec(Op.CAUSAL_CONV, xs[0], xs[1], layer=a["layer"])
        if a["bias"]:
            y = rec(Op.ADD, y, xs[2])
        return rec(Op.ACT, y, fn=a["act"])

    return _unfused("unfused", rec, body, lambda y: y)


def _ssm_scan(g: Graph, i: int, xs: Sequence[torch.Tensor], rec: _Recorder) -> Counterpart:
    a = full_attrs(Op.SSM_SCAN, g.nodes[i].attrs)
    got = bind(Op.SSM_SCAN, a, xs)

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

    return _unfused("unfused", rec, body, lambda y: y)


def _linear_attention(g: Graph, i: int, xs: Sequence[torch.Tensor], rec: _Recorder
                      ) -> Counterpart:
    a = full_attrs(Op.LINEAR_ATTENTION, g.nodes[i].attrs)
    q, k, v = xs

    def body() -> torch.Tensor:
        phi_q, phi_k = (rec(Op.ACT, t, fn=a["feature"]) for t in (q, k))
        return rec(Op.LINEAR_ATTENTION, phi_q, phi_k, v, layer=a["layer"])

    return _unfused("unfused", rec, body, lambda y: y)


def state_keys(g: Graph, i: int) -> list[tuple[int, str]]:
    """The (layer, kind) of each recurrent state node i reads and updates (none for most)."""
    return [(g.nodes[i].attr("layer"), d.kind) for d in node_states(g, i)]


def counterparts(g: Graph, i: int, xs: Sequence[torch.Tensor], dims: Mapping[str, int],
                 caches: Store, scratch: Store, states: Store | None = None,
                 ) -> list[Counterpart | Unavailable]:
    """PyTorch counterparts of node i of kernel-level graph `g`, on its input tensors `xs`.
    Attention reads `caches` (the kernel's KV cache); unfused KV-cache writes go to `scratch`,
    whose tensors the caller sized, so the kernel's cache is left as the kernel wrote it. A
    recurrent kernel's counterpart reads `states`, the state the kernel read (zeros at P = 0),
    and writes its new state aside, so every timed run reads the same."""
    n = g.nodes[i]
    rec = _Recorder(TorchContext(dims, scratch, dict(states or {}), {}))
    if n.op == Op.CAUSAL_CONV:
        return [_causal_conv(g, i, xs, rec)]
    if n.op == Op.SSM_SCAN:
        return [_ssm_scan(g, i, xs, rec)]
    if n.op == Op.LINEAR_ATTENTION:
        return [_linear_attention(g, i, xs, rec)]
    if n.op == Op.FUSED_LINEAR:
        return _fused_linear(g, i, xs, rec)
    if n.op == Op.ATTENTION:
        return _attention(g, i, xs, rec, caches)
    if n.op == Op.NORM:
        return [_norm(g, i, xs, rec)]
    if n.op == Op.POINTWISE:
        return [_pointwise(g, i, xs, rec)]
    if n.op == Op.ROUTER:
        return [_router(g, i, xs, rec)]
    if n.op == Op.MOE_LINEAR:
        return [_moe_linear(g, i, xs, rec)]
    if n.op == Op.EMBEDDING:
        table, ids = xs
        return [Counterpart("torch", lambda: F.embedding(ids, table), lambda y: y,
                            "F.embedding", 1)]
    return [Unavailable("unfused", f"no counterpart for {n.op.value}")]


def scratch_caches(g: Graph, i: int, dims: Mapping[str, int], dtype: torch.dtype,
                   device: torch.device) -> dict[tuple[int, str], torch.Tensor]:
    """KV-cache tensors for the unfused writes of node i (its kv_write steps), P + T long."""
    out = {}
    length = dims["P"] + dims["T"]
    for st in g.nodes[i].attr("epilogue", ()):
        if st.fn == "kv_write":
            for kind in ("k", "v"):
                out[(st.kw("layer"), kind)] = torch.zeros(
                    dims["B"], st.kw("kv_heads"), length, st.kw("head_dim"), dtype=dtype,
                    device=device)
    return out
