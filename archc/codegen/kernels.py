"""The kernel registry: for each kernel-level op, how a node becomes a rendered kernel.

A builder reads one node — its attributes, the layouts of its inputs, the static sizes — checks
everything it will print (integers are ints, floats are finite, names come from fixed tables) and
returns a ``Unit``: the template to render, the values to render it with, the Triton kernels the
unit defines (with their argument types, for autotuning and AOT compiles) and the launch call of
this node. Anything a builder cannot render faithfully is refused with a ``CodegenError`` naming
the node — never rendered as something else.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import sympy

from archc.codegen.layout import CodegenError, Layout
from archc.codegen.options import CodegenOptions
from archc.codegen.printer import pexpr, texpr
from archc.ir import expr as E
from archc.ir.attrs import Attrs, Call
from archc.ir.graph import Graph, Node
from archc.ir.ops import Op, full_attrs, roles_of
from archc.ir.ops.steps import STEPS, step_expr
from archc.ir.shapes import S, numel
from archc.ir.text import format_node

TRITON_TYPES = {"f32": "fp32", "f16": "fp16", "bf16": "bf16", "i64": "i64", "i32": "i32",
                "bool": "i1"}


@dataclass
class JitKernel:
    """One @triton.jit function of a unit: its name suffix, block-size family, static sizes,
    and the Triton type of every runtime argument (pointers and ints), by parameter name."""

    suffix: str
    family: str
    sizes: dict[str, int]
    types: dict[str, str]


@dataclass
class Unit:
    """What one node renders to: a template and its values, the kernels it defines and the
    launch call `<name>(d, <call>)` in the graph's run function."""

    family: str
    template: str
    context: dict[str, Any]
    kernels: list[JitKernel]
    call: str


@dataclass
class NodeCtx:
    g: Graph
    i: int
    lays: Sequence[Layout]
    opts: CodegenOptions
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def node(self) -> Node:
        return self.g.nodes[self.i]

    @property
    def attrs(self) -> Attrs:
        """The node's attributes with its op's defaults filled in."""
        return full_attrs(self.node.op, self.node.attrs)

    @property
    def roles(self) -> dict[str, int]:
        """Input slot of each operand role."""
        return {r: k for k, r in enumerate(roles_of(self.node.op, self.attrs,
                                                     len(self.node.inputs)))}

    def input(self, k: int) -> Node:
        return self.g.nodes[self.node.inputs[k]]

    def lay(self, k: int) -> Layout:
        return self.lays[self.node.inputs[k]]

    def ref(self, k: int) -> str:
        """The launch expression of input k's root buffer."""
        return f"v[{self.lay(k).root}]"

    def ptr_type(self, k: int) -> str:
        return "*" + TRITON_TYPES[self.g.nodes[self.lay(k).root].dtype]

    def out_type(self) -> str:
        return "*" + TRITON_TYPES[self.node.dtype]

    def fail(self, problem: str) -> CodegenError:
        return CodegenError(f"codegen: graph {self.g.name}: {format_node(self.i, self.node)}: "
                            f"{problem}")

    @property
    def reads_encoder_len(self) -> bool:
        """Does the node's row space or an input's layout depend on S (a view of a cross-attention
        tensor), so that its kernel takes the encoder length?"""
        exprs = list(self.node.shape)
        for k in range(len(self.node.inputs)):
            lay = self.lay(k)
            exprs += [lay.offset, *lay.strides, *lay.shape]
        return any(S in sympy.sympify(e).free_symbols for e in exprs)

    @property
    def dot_kw(self) -> str:
        """f32 models multiply in IEEE f32 (TF32 would not match eager to f32 rounding)."""
        return ', input_precision="ieee"' if (self.node.dtype == "f32"
                                               and self.opts.exact_f32_dot) else ""


# ---- values that reach generated code ------------------------------------------------------

def lit_int(c: NodeCtx, value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise c.fail(f"{what} must be an integer, got {value!r}")
    return value


def lit_float(c: NodeCtx, value: Any, what: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise c.fail(f"{what} must be a finite number, got {value!r}")
    return repr(float(value))


def lit_act(c: NodeCtx, fn: Any) -> str:
    if fn not in E.ACTIVATIONS:
        raise c.fail(f"unknown activation {fn!r} (known: {', '.join(E.ACTIVATIONS)})")
    return str(fn)


def static(c: NodeCtx, d: sympy.Expr | int, what: str) -> int:
    d = sympy.sympify(d)
    if not d.is_Integer:
        raise c.fail(f"{what} is {d}: it must be a static size")
    return int(d)


def row_offset(lay: Layout, rows: str) -> str:
    """Device expression: the element offset of flat row `rows` (an i64 vector) over the leading
    dims of `lay`, plus its static offset."""
    r = sympy.Symbol("r", integer=True, nonnegative=True)
    lead, strides = lay.shape[:-1], lay.strides[:-1]
    expr: sympy.Expr = lay.offset
    if lead and lay.contiguous_rows:
        expr += r * strides[-1]
    elif lead:
        inner: sympy.Expr = sympy.Integer(1)
        for k in reversed(range(len(lead))):
            idx = sympy.floor(r / inner) if inner != 1 else r
            if k > 0:
                idx = sympy.Mod(idx, lead[k])
            expr += idx * strides[k]
            inner = inner * lead[k]
    if not expr.has(r):  # broadcast along every row: still a per-row vector
        return f"0 * {rows}" + (f" + {texpr(expr)}" if expr != 0 else "")
    return texpr(expr, {"r": rows})


def col_mul(c: NodeCtx, lay: Layout) -> str:
    """` * stride` for a last dim that is not contiguous ('' when it is)."""
    s = lay.strides[-1]
    if s == 1:
        return ""
    return f" * {texpr(s)}"


def rows_of(shape: Sequence[sympy.Expr]) -> str:
    """Host expression: the number of rows (product of the leading dims)."""
    return pexpr(numel(shape[:-1]))


# ---- epilogue steps ---------------------------------------------------------------------------

ACC = "__ACC__"   # where an elementwise step's code names the accumulator


def elementwise_step(c: NodeCtx, st: Call, idx: int, slot: int, width: int,
                     pointer: Callable[[str, int, str], str]) -> dict[str, Any]:
    """An elementwise epilogue step for the `elementwise` macro (templates/steps.j2): its
    inputs' loads — a [width] vector along the columns, or rows read through their layout —
    and its Triton code over the accumulator and the loaded values, on columns [start, stop)."""
    loads = []
    for k, name in enumerate(STEPS[st.fn].inputs):
        lay = c.lay(slot + k)
        var = f"{name}{idx}"
        vector = lay.rank == 1
        loads.append(dict(var=var, vector=vector, row_off="" if vector else row_offset(
            lay, "rows"), col_mul=col_mul(c, lay), ptr=pointer(
            var, slot + k, f"[{width}] {name}" if vector else f"[M, {width}] {name} rows")))
    start, stop = st.kw("start", 0), st.kw("stop", width)
    code = E.triton(step_expr(st), [ACC, *(ld["var"] for ld in loads)])
    return dict(fn="elementwise", name=st.fn, loads=loads, code=code, start=start, stop=stop,
                full=start == 0 and stop == width)


# ---- fused_linear --------------------------------------------------------------------------

PAIRING = ("glu", "rope")


def build_fused_linear(c: NodeCtx) -> Unit:
    n, a = c.node, c.attrs
    n_ops = 2 if a.get("concat_k") else 1
    w_lay = c.lay(n_ops)
    if w_lay.rank != 2 or w_lay.strides[1] != 1:
        raise c.fail("the weight must be a row-major [N, K] matrix")
    n_rows = static(c, w_lay.shape[0], "the weight's N")
    k_total = static(c, w_lay.shape[1], "the weight's K")
    types: dict[str, str] = {"out_ptr": c.out_type(), "M": "i32", "T": "i32"}
    if c.reads_encoder_len:
        types["S"] = "i32"
    launch: list[tuple[str, str, str]] = []   # (launcher param, call expr, kernel arg expr)

    operands = []
    k0 = 0
    for j in range(n_ops):
        lay = c.lay(j)
        kj = static(c, lay.shape[-1], f"operand {j}'s K")
        name = f"x{j + 1}" if n_ops == 2 else "x"
        operands.append(dict(name=name, ptr=f"{name}_ptr", K=kj, k0=k0, w_base=k0,
                             row_off=row_offset(lay, "rows"), k_mul=col_mul(c, lay),
                             k_mul_scalar=col_mul(c, lay),
                             comment=(f"operand {j + 1} [M, {kj}]" if n_ops == 2 else
                                      f"activations [M, {kj}]")))
        types[f"{name}_ptr"] = c.ptr_type(j)
        launch.append((name, c.ref(j), name))
        k0 += kj
    if k0 != k_total:
        raise c.fail(f"operands give K = {k0}, the weight has {k_total}")
    types["w_ptr"] = c.ptr_type(n_ops)
    launch.append(("w", c.ref(n_ops), "w"))

    prologue = a.get("prologue")
    if prologue not in (None, "rms", "layer"):
        raise c.fail(f"unknown prologue {prologue!r}")
    eps = lit_float(c, a["eps"], "eps") if prologue else ""

    extra_args: list[dict[str, str]] = []

    def pointer(name: str, k: int, comment: str) -> str:
        param = f"{name}_ptr"
        extra_args.append(dict(name=param, comment=comment))
        types[param] = c.ptr_type(k)
        launch.append((name, c.ref(k), name))
        return param

    width = n_rows
    steps_pre: list[dict[str, Any]] = []
    steps_post: list[dict[str, Any]] = []
    pair: dict[str, Any] | None = None
    kv: dict[str, Any] | None = None
    needs_t = False
    head_norms: list[dict[str, Any]] = []
    nxt = n_ops + 1
    for idx, st in enumerate(a.get("epilogue", ())):
        if not isinstance(st, Call) or st.fn not in STEPS:
            raise c.fail(f"unknown epilogue step {st!r}")
        target = steps_post if pair is not None else steps_pre
        fn = st.fn
        if fn == "rms_scale":
            if prologue != "rms":
                raise c.fail("rms_scale() needs the rms prologue")
            target.append(dict(fn=fn))
        elif fn == "ln_scale":
            if prologue != "layer":
                raise c.fail("ln_scale() needs the layer prologue")
            target.append(dict(fn=fn, ptr=pointer(f"colsum{idx}", nxt,
                                                  f"[{width}] column sums Σ_k W'[n, k]")))
            nxt += 1
        elif STEPS[fn].elementwise:
            target.append(elementwise_step(c, st, idx, nxt, width, pointer))
            nxt += len(STEPS[fn].inputs)
        elif fn == "kv_write":
            if kv is not None:
                raise c.fail("more than one kv_write() step")
            hd = lit_int(c, st.kw("head_dim"), "head_dim")
            kv_heads = lit_int(c, st.kw("kv_heads"), "kv_heads")
            layer = lit_int(c, st.kw("layer"), "layer")
            max_len = c.opts.max_seq_len
            kv = dict(stride_b=kv_heads * max_len * hd, stride_l=hd, layer=layer,
                      kv_heads=kv_heads, head_dim=hd)
            k_start = lit_int(c, st.kw("k_start"), "k_start")
            v_start = lit_int(c, st.kw("v_start"), "v_start")
            target.append(dict(fn=fn, k_start=k_start, v_start=v_start, width=kv_heads * hd,
                               head_dim=hd, stride_h=max_len * hd, run_terms=(hd, k_start,
                                                                              v_start)))
            c.extras.setdefault("kv", []).append((layer, kv_heads, hd))
            needs_t = True
        elif fn == "head_norm":
            kind = st.kw("kind")
            if kind not in ("rms", "layer"):
                raise c.fail(f"head_norm() kind must be rms or layer, got {kind!r}")
            heads = lit_int(c, st.kw("heads"), "head_norm heads")
            hd = lit_int(c, st.kw("head_dim"), "head_norm head_dim")
            if hd < 2 or heads * hd > width:
                raise c.fail(f"head_norm() over {heads} heads of {hd}: needs a head_dim ≥ 2 "
                             f"and the heads within the width {width}")
            target.append(dict(fn=fn, kind=kind, heads=heads, head_dim=hd,
                               eps=lit_float(c, st.kw("eps"), "head_norm eps"),
                               gain_ptr=pointer(f"gain{idx}", nxt, f"[{heads * hd}] head gains"),
                               shift_ptr=pointer(f"shift{idx}", nxt + 1,
                                                 f"[{heads * hd}] head shifts")))
            nxt += 2
            head_norms.append(target[-1])
        elif fn in PAIRING:
            if pair is not None:
                raise c.fail(f"{fn}() after {pair['fn']}(): one pairing step per kernel")
            if fn == "glu":
                if width % 2:
                    raise c.fail(f"glu() needs an even width, got {width}")
                pair = dict(fn=fn, act=lit_act(c, st.kw("fn")), NP=width // 2)
                width //= 2
            else:
                heads = lit_int(c, st.kw("heads"), "rope heads")
                hd = lit_int(c, st.kw("head_dim"), "rope head_dim")
                rot = lit_int(c, st.kw("rotary_dim"), "rotary_dim")
                if rot % 2 or hd % 2 or not 2 <= rot <= hd or heads * hd > width:
                    raise c.fail(f"rope() of {heads} heads × {hd} (rotary {rot}) in width "
                                 f"{width}")
                interleaved = st.kw("interleaved")
                if not isinstance(interleaved, bool):
                    raise c.fail(f"rope() interleaved must be true or false, got {interleaved!r}")
                tail = width - heads * hd
                tail_half = (tail + 1) // 2
                # pairs in aligned runs of `run` map to contiguous columns (half-split only)
                run = 0
                if not interleaved and tail % 2 == 0:
                    run = math.gcd(rot // 2, hd // 2 - rot // 2, heads * hd // 2, tail_half)
                    run = run & -run  # the largest power of two dividing it
                pair = dict(fn=fn, heads=heads, head_dim=hd, per_head=hd // 2, run=run,
                            rot_pairs=rot // 2, interleaved=interleaved, tail=tail,
                            tail_half=tail_half, NP=heads * hd // 2 + tail_half,
                            mscale=lit_float(c, st.kw("mscale", 1.0), "mscale"),
                            dynamic=dynamic_rope(c, st.kw("dynamic"), rot),
                            pos_ptr=pointer(f"pos{idx}", nxt, "[T] positions"),
                            freq_ptr=pointer(f"freq{idx}", nxt + 1,
                                             f"[{rot // 2}] inverse frequencies"))
                nxt += 2
                needs_t = True
        else:  # pragma: no cover - STEPS and this table must agree
            raise c.fail(f"epilogue step {fn}() has no Triton rendering")
    if nxt != len(n.inputs):
        raise c.fail(f"{len(n.inputs) - nxt} inputs left over after the epilogue")
    for st_ctx in steps_pre + steps_post:  # kv_write: how many columns land contiguously
        if st_ctx["fn"] == "kv_write":
            cols_run = 1 << 16 if pair is None else (pair.get("run", 0) if pair["fn"] == "rope"
                                                      else 1 << 16)
            run = math.gcd(cols_run, *st_ctx.pop("run_terms"))
            st_ctx["run"] = run & -run if run else 0
            assert kv is not None
            kv["run"] = st_ctx["run"]
    # Tiles hold whole heads. A power-of-two head is a reshape of the tile; any other size
    # (phi-2's 80) makes the tiles head-aligned: each covers ⌊TILE_N / group⌋ whole heads and
    # masks its last lanes, and the per-head sums are taken head by head.
    align = 16
    head_group: int | None = None
    for hn in head_norms:
        hd = hn["head_dim"]
        align = max(align, _pow2(hd))
        if pair is None:
            hn["group"] = hd
        elif pair["fn"] == "rope" and pair["head_dim"] == hd and hn["heads"] <= pair["heads"]:
            hn["group"] = hd // 2   # a head's pairs: half its columns in each accumulator
        else:
            raise c.fail("head_norm() needs its heads to be the rotated heads of rope() (same "
                         "head_dim), and no glu()")
        if hn["group"] & (hn["group"] - 1):
            head_group = hn["group"]
    for hn in head_norms:
        if head_group is not None and hn["group"] != head_group:
            raise c.fail(f"head_norm() steps over heads of {head_group} and {hn['group']} "
                         "columns: head-aligned tiles take one head size")
        hn["pow2"] = head_group is None
    out_w = static(c, n.shape[-1], "the output width")
    if out_w != width:
        raise c.fail(f"epilogue gives width {width}, the node says {out_w}")
    if kv is not None:
        extra_args += [dict(name="k_cache_ptr", comment="key cache "
                            f"[B, {kv['kv_heads']}, {c.opts.max_seq_len}, {kv['head_dim']}]"),
                       dict(name="v_cache_ptr", comment="value cache, same shape"),
                       dict(name="past_ptr", comment="P, the tokens already cached")]
        types.update(k_cache_ptr=c.out_type(), v_cache_ptr=c.out_type(), past_ptr="*i32")
        launch += [("k_cache", f'd.kv({kv["layer"]}, "k")', "k_cache"),
                   ("v_cache", f'd.kv({kv["layer"]}, "v")', "v_cache"),
                   ("", "", "d.past")]
    if pair is None:
        wsets = [dict(name="w", ptrs="w_ptrs", cols="cols", acc="acc")]
        accs_pre = accs_post = [dict(acc="acc", cols="cols")]
    else:
        wsets = [dict(name="w1", ptrs="w1_ptrs", cols="cols1", acc="acc1"),
                 dict(name="w2", ptrs="w2_ptrs", cols="cols2", acc="acc2")]
        accs_pre = [dict(acc="acc1", cols="cols1"), dict(acc="acc2", cols="cols2")]
        accs_post = [dict(acc="acc", cols="cols")] if pair["fn"] == "glu" else accs_pre
    w_off = int(w_lay.offset) if w_lay.offset.is_Integer else None
    if w_off is None:
        raise c.fail("the weight's offset must be static")
    for x in operands:  # where each operand's K columns start in the weight's rows
        base = w_off + x["w_base"]
        x["w_base"] = f"{base} + " if base else ""
    context = dict(
        operands=operands, N=n_rows, K=k_total, n_out=width, prologue=prologue, eps=eps,
        pair=pair, steps_pre=steps_pre, steps_post=steps_post, extra_args=extra_args,
        wsets=wsets, accs_pre=accs_pre, accs_post=accs_post, kv=kv, needs_t=needs_t,
        w_row_stride=texpr(w_lay.strides[0]),
        dot_kw=c.dot_kw, M=rows_of(n.shape), align=align, has_head_norm=int(bool(head_norms)),
        head_group=head_group, seq_s="S" in types,
        layer_norm=int(prologue == "layer"),
        launch_params=", ".join(p for p, _, _ in launch if p),
        kernel_call_args="".join(f"{k}, " for _, _, k in launch))
    call = ", ".join([f"v[{c.i}]"] + [e for p, e, _ in launch if p])
    sizes = dict(N=n_rows, K=k_total, paired=int(pair is not None), align=align,
                 head_norm=int(bool(head_norms)), layer_norm=int(prologue == "layer"))
    return Unit("fused_linear", "matmul.py.j2", context,
                [JitKernel("_kernel", "matmul", sizes, types)], call)


# ---- attention -----------------------------------------------------------------------------

LOG2E = 1.4426950408889634


def t5_thresholds(buckets: int, bidirectional: bool, max_distance: int) -> dict[str, Any]:
    """T5's bucket of a key − query distance, as integer thresholds computed with the eager
    function itself (so rounding in log() cannot move a boundary): the magnitude bucket is
    `exact + #{th : dist ≥ th}` for distances ≥ exact."""
    import torch

    from archc.ir.ops.attention import t5_buckets
    nb = buckets // 2 if bidirectional else buckets
    exact = nb // 2
    dist = torch.arange(0, 2 * max_distance + 2)
    mag = t5_buckets(-dist, False, nb, max_distance)
    thresholds = [int(dist[mag >= v][0]) for v in range(exact + 1, nb) if bool((mag >= v).any())]
    return dict(nb=nb, exact=exact, thresholds=thresholds, bidirectional=bidirectional)


def build_attention(c: NodeCtx) -> Unit:
    a = c.attrs
    slot = c.roles
    b_sym, h_sym, kv_sym = (sympy.Symbol(s, integer=True, nonnegative=True)
                            for s in ("b", "h", "kv_h"))
    q_lay = c.lay(0)
    if q_lay.rank != 4 or q_lay.strides[3] != 1:
        raise c.fail("q must be [B, H, T, D] with contiguous head dims")
    heads = static(c, q_lay.shape[1], "query heads")
    hd = static(c, q_lay.shape[3], "head_dim")
    cached = a.get("cache_layer") is not None
    types: dict[str, str] = {"out_ptr": c.out_type(), "q_ptr": c.ptr_type(0), "B": "i32",
                             "T": "i32", "S": "i32"}
    q = dict(base=texpr(q_lay.offset + b_sym * q_lay.strides[0] + h_sym * q_lay.strides[1]),
             batch=texpr(q_lay.offset + b_sym * q_lay.strides[0]),
             stride_h=texpr(q_lay.strides[1]), stride_t=texpr(q_lay.strides[2]))
    max_len = c.opts.max_seq_len
    kvd: dict[str, dict[str, Any]] = {}
    if cached:
        layer = lit_int(c, a["cache_layer"], "cache_layer")
        kv_heads = lit_int(c, a.get("kv_heads"), "kv_heads")
        for kind in ("k", "v"):
            kvd[kind] = dict(base=texpr(b_sym * (kv_heads * max_len * hd) +
                                        kv_sym * (max_len * hd)),
                             stride_l=str(hd),
                             comment=f"{kind} cache [B, {kv_heads}, {max_len}, {hd}]",
                             call=f'd.kv({layer}, "{kind}")')
            types[f"{kind}_ptr"] = c.out_type()
        length_host = ""
        length = ""
    else:
        k_lay, v_lay = c.lay(1), c.lay(2)
        kv_heads = static(c, k_lay.shape[1], "KV heads")
        for kind, lay, k in (("k", k_lay, 1), ("v", v_lay, 2)):
            if lay.rank != 4 or lay.strides[3] != 1:
                raise c.fail(f"{kind} must be [B, H_kv, L, D] with contiguous head dims")
            kvd[kind] = dict(base=texpr(lay.offset + b_sym * lay.strides[0] +
                                        kv_sym * lay.strides[1]),
                             stride_l=texpr(lay.strides[2]),
                             comment=f"[B, {kv_heads}, L, {hd}], read through strides",
                             call=c.ref(k))
            types[f"{kind}_ptr"] = c.ptr_type(k)
        length = texpr(k_lay.shape[2])
        length_host = pexpr(k_lay.shape[2])
    if heads % kv_heads:
        raise c.fail(f"{heads} query heads over {kv_heads} KV heads")
    group = heads // kv_heads
    scale = a["scale"]
    lit_float(c, scale, "scale")
    softcap = a.get("softcap")
    extra_args: list[dict[str, str]] = []
    launch: list[tuple[str, str]] = []
    ctx: dict[str, Any] = dict(H=heads, KVH=kv_heads, G=group, D=hd, BLOCK_D=max(16, _pow2(hd)),
                               q=q, k=kvd["k"], v=kvd["v"], cached=cached, L=length,
                               L_host=length_host, dot_kw=c.dot_kw,
                               causal=bool(a["causal"]), padding=bool(a["padding"]),
                               prefix=bool(a["prefix"]), softcap=softcap is not None,
                               qk_scale=repr(float(scale) * LOG2E), bias=None, t5=None,
                               window=None, global_tokens=None)
    window = a.get("window")
    if window is not None:
        ctx["window"] = lit_int(c, window, "window")
        if ctx["window"] < 1:
            raise c.fail(f"window must be ≥ 1, got {window}")
    global_tokens = a.get("global_tokens")
    if global_tokens is not None:
        ctx["global_tokens"] = lit_int(c, global_tokens, "global_tokens")
        if ctx["global_tokens"] < 1 or window is None or ctx["prefix"]:
            raise c.fail(f"global_tokens={global_tokens} needs to be ≥ 1, beside a window, "
                         "without a prefix")
    if softcap is not None:
        cap = float(lit_float(c, softcap, "softcap"))
        ctx.update(cap_log2=repr(cap * LOG2E), pre_cap=repr(float(scale) / cap))
    if ctx["padding"]:
        k = slot["padding"]
        lay = c.lay(k)
        ctx.update(pad_stride_b=texpr(lay.strides[0]), pad_stride_l=texpr(lay.strides[1]))
        extra_args.append(dict(name="pad_ptr", comment="[B, L] 1 = key present"))
        types["pad_ptr"] = c.ptr_type(k)
        launch.append(("pad", c.ref(k)))
    if ctx["prefix"]:
        k = slot["prefix_len"]
        extra_args.append(dict(name="prefix_ptr", comment="prefix length"))
        types["prefix_ptr"] = c.ptr_type(k)
        launch.append(("prefix", c.ref(k)))
    bias = a.get("bias")
    if bias is not None:
        if not isinstance(bias, Call) or bias.fn not in ("alibi", "t5"):
            raise c.fail(f"unknown attention bias {bias!r}")
        ctx["bias"] = bias.fn
        if bias.fn == "alibi":
            k = slot["slopes"]
            extra_args.append(dict(name="slopes_ptr", comment=f"[{heads}] ALiBi slopes"))
            types["slopes_ptr"] = c.ptr_type(k)
            launch.append(("slopes", c.ref(k)))
        else:
            k = slot["rel_table"]
            lay = c.lay(k)
            buckets = static(c, lay.shape[0], "relative buckets")
            bidir = bias.kw("bidirectional")
            if not isinstance(bidir, bool):
                raise c.fail(f"t5() bidirectional must be true or false, got {bidir!r}")
            t5 = t5_thresholds(buckets, bidir,
                               lit_int(c, bias.kw("max_distance"), "max_distance"))
            t5.update(stride_bucket=texpr(lay.strides[0]), stride_head=texpr(lay.strides[1]))
            ctx["t5"] = t5
            extra_args.append(dict(name="table_ptr", comment=f"[{buckets}, "
                                   f"{heads}] relative-position bias"))
            types["table_ptr"] = c.ptr_type(k)
            launch.append(("table", c.ref(k)))
    if cached:
        extra_args.append(dict(name="past_ptr", comment="P, the tokens already cached"))
        types["past_ptr"] = "*i32"
    decode = cached or c.g.name == "decoder"
    ctx.update(decode=decode, extra_args=extra_args,
               launch_params="".join(f", {p}" for p, _ in launch),
               kernel_call_args="".join(f"{p}, " for p, _ in launch) +
               ("d.past, " if cached else ""))
    call = ", ".join([f"v[{c.i}]", c.ref(0), kvd["k"]["call"], kvd["v"]["call"]] +
                     [e for _, e in launch])
    prefill_types = dict(types)
    kernels = [JitKernel("_prefill", "attention", dict(D=hd), prefill_types)]
    if decode:
        dec = {k: v for k, v in types.items() if k != "out_ptr"}
        dec.update(part_acc_ptr="*fp32", part_ml_ptr="*fp32", SPLIT="i32", SPLITS="i32")
        kernels.append(JitKernel("_decode", "attention_decode", dict(D=hd), dec))
        kernels.append(JitKernel("_combine", "attention_combine", dict(D=hd),
                                 dict(out_ptr=c.out_type(), part_acc_ptr="*fp32",
                                      part_ml_ptr="*fp32", T="i32", ROWS="i32",
                                      SPLITS="i32")))
    return Unit("attention", "attention.py.j2", ctx, kernels, call)


def dynamic_rope(c: NodeCtx, dynamic: Any, rotary_dim: int) -> dict[str, Any] | None:
    """The checked literals of a rope's dynamic NTK scaling: ntk(factor, original_max_seq_len)
    → factor, factor − 1, the trained context and 2/(d − 2), the exponent step per pair."""
    if dynamic is None:
        return None
    if not isinstance(dynamic, Call) or dynamic.fn != "ntk" or dynamic.args or \
            {k for k, _ in dynamic.kwargs} != {"factor", "original_max_seq_len"}:
        raise c.fail(f"rope() dynamic must be ntk(factor=…, original_max_seq_len=…), got "
                     f"{dynamic!r}")
    factor = float(lit_float(c, dynamic.kw("factor"), "ntk() factor"))
    original = lit_int(c, dynamic.kw("original_max_seq_len"), "ntk() original_max_seq_len")
    if factor < 1.0 or original < 1 or rotary_dim < 4:
        raise c.fail(f"ntk(factor={factor}, original_max_seq_len={original}) over {rotary_dim} "
                     "rotary dims: needs factor ≥ 1, a context ≥ 1 and ≥ 4 rotary dims")
    return dict(factor=repr(factor), factor_less_one=repr(factor - 1.0),
                original=repr(float(original)), step=repr(2.0 / (rotary_dim - 2)))


def _pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


# ---- embedding, norm, pointwise ------------------------------------------------------------

def build_embedding(c: NodeCtx) -> Unit:
    n = c.node
    table, ids = c.lay(0), c.lay(1)
    if table.rank != 2 or table.strides[1] != 1:
        raise c.fail("the table must be a row-major [V, D] matrix")
    if c.input(1).dtype not in ("i64", "i32"):
        raise c.fail(f"ids must be integers, got {c.input(1).dtype}")
    vocab, width = static(c, table.shape[0], "table rows"), static(c, table.shape[1], "width")
    # ids are [..] with no column dim: view them as rows of one column
    ids_rows = Layout(ids.root, ids.offset, (*ids.shape, sympy.Integer(1)),
                      (*ids.strides, sympy.Integer(1)))
    off = table.offset
    ctx = dict(V=vocab, D=width, ids_off=row_offset(ids_rows, "rows"),
               table_stride=texpr(table.strides[0]),
               table_base=f"{texpr(off)} + " if off != 0 else "", R=rows_of(n.shape))
    types = {"out_ptr": c.out_type(), "table_ptr": c.ptr_type(0), "ids_ptr": c.ptr_type(1),
             "R": "i32", "T": "i32"}
    return Unit("embedding", "embedding.py.j2", ctx,
                [JitKernel("_kernel", "embedding", dict(C=width), types)],
                f"v[{c.i}], {c.ref(0)}, {c.ref(1)}")


def build_norm(c: NodeCtx) -> Unit:
    n, a = c.node, c.attrs
    width = static(c, n.shape[-1], "the norm width")
    types = {"out_ptr": c.out_type(), "R": "i32", "T": "i32"}
    if c.reads_encoder_len:
        types["S"] = "i32"
    args = [dict(name="x_ptr", comment=f"[R, {width}] rows to normalize"),
            dict(name="weight_ptr", comment=f"[{width}] gain")]
    launch = ["x", "weight"]
    for k, name in enumerate(launch):
        types[f"{name}_ptr"] = c.ptr_type(k)
    ctx: dict[str, Any] = dict(N=width, kind=a["kind"], eps=lit_float(c, a["eps"], "eps"),
                               seq_s="S" in types, unit_offset=a["unit_offset"],
                               add_before=a["add_before"], R=rows_of(n.shape),
                               x=dict(row_off=row_offset(c.lay(0), "rows"),
                                      col_mul=col_mul(c, c.lay(0))))
    if c.lay(1).rank != 1 or c.lay(1).strides[0] != 1 or c.lay(1).offset != 0:
        raise c.fail("the gain must be a contiguous vector")
    slot = 2
    if a["add_before"]:
        lay = c.lay(2)
        args.append(dict(name="residual_ptr", comment=f"[R, {width}] residual, added before "
                         "the norm"))
        types["residual_ptr"] = c.ptr_type(2)
        launch.append("residual")
        ctx["residual"] = dict(row_off=row_offset(lay, "rows"), col_mul=col_mul(c, lay))
        slot = 3

    def pointer(name: str, k: int, comment: str) -> str:
        args.append(dict(name=f"{name}_ptr", comment=comment))
        types[f"{name}_ptr"] = c.ptr_type(k)
        launch.append(name)
        return f"{name}_ptr"

    steps = []
    for idx, st in enumerate(a["epilogue"]):
        steps.append(elementwise_step(c, st, idx, slot, width, pointer))
        slot += len(STEPS[st.fn].inputs)
    ctx.update(args=args, steps=steps, launch_params=", ".join(launch))
    call = ", ".join([f"v[{c.i}]"] + [c.ref(k) for k in range(len(n.inputs))])
    return Unit("norm", "norm.py.j2", ctx,
                [JitKernel("_kernel", "norm", dict(N=width), types)], call)


def pointwise_code(c: NodeCtx, e: Any, n_inputs: int) -> str:
    """A pointwise expression as one Triton expression over loaded inputs x0, x1, …"""
    try:
        E.check(e, n_inputs)
    except E.ExprError as err:
        raise c.fail(str(err)) from None
    return E.triton(e, [f"x{k}" for k in range(n_inputs)])


def build_pointwise(c: NodeCtx) -> Unit:
    n = c.node
    out_shape = n.shape
    rank = len(out_shape)
    if rank == 0:
        raise c.fail("a scalar pointwise node has no Triton rendering")
    width = static(c, out_shape[-1], "the output width")
    types = {"out_ptr": c.out_type(), "R": "i32", "B": "i32", "T": "i32", "S": "i32"}
    inputs = []
    for k in range(len(n.inputs)):
        lay = c.lay(k)
        strides: list[sympy.Expr] = []
        for dim in range(rank):  # align from the right; broadcast dims read with stride 0
            src = dim - (rank - lay.rank)
            if src < 0 or (lay.shape[src] == 1 and out_shape[dim] != 1):
                strides.append(sympy.Integer(0))
            else:
                strides.append(lay.strides[src])
        view = Layout(lay.root, lay.offset, out_shape, tuple(strides))
        dims = ", ".join(str(x) for x in lay.shape)
        inputs.append(dict(name=f"x{k}", ptr=f"x{k}_ptr",
                           comment=f"x({k}) [{dims}], read through its strides",
                           row_off=row_offset(view, "rows"), col_mul=col_mul(c, view)))
        types[f"x{k}_ptr"] = c.ptr_type(k)
    ctx = dict(C=width, inputs=inputs, expr=pointwise_code(c, n.attr("expr"), len(n.inputs)),
               R=rows_of(out_shape), launch_params=", ".join(x["name"] for x in inputs))
    call = ", ".join([f"v[{c.i}]"] + [c.ref(k) for k in range(len(n.inputs))])
    return Unit("pointwise", "pointwise.py.j2", ctx,
                [JitKernel("_kernel", "pointwise", dict(C=width), types)], call)


# ---- mixture of experts ----------------------------------------------------------------------

def build_router(c: NodeCtx) -> Unit:
    n, a = c.node, c.attrs
    if len(n.inputs) != 2:
        raise c.fail("the router kernel computes its logits: it takes x and the router weight "
                     "(fuse-moe joins a router to the matmul before it)")
    x, w = c.lay(0), c.lay(1)
    if w.rank != 2 or w.strides[1] != 1 or w.offset != 0 or x.strides[-1] != 1:
        raise c.fail("the router needs contiguous rows of x and of its [E, K] weight")
    experts = static(c, w.shape[0], "experts")
    k = static(c, w.shape[1], "router K")
    top_k = lit_int(c, a["top_k"], "top_k")
    if not 1 <= top_k <= experts:
        raise c.fail(f"top_k {top_k} of {experts} experts")
    ctx = dict(kind="router", E=experts, K=k, BLOCK_E=max(16, _pow2(experts)), top_k=top_k,
               normalize=bool(a["normalize"]), x=dict(row_off=row_offset(x, "rows")),
               w_row_stride=texpr(w.strides[0]), dot_kw=c.dot_kw, M=rows_of(n.shape))
    types = {"out_ptr": c.out_type(), "x_ptr": c.ptr_type(0), "w_ptr": c.ptr_type(1),
             "M": "i32", "T": "i32"}
    return Unit("topk_router", "moe.py.j2", ctx,
                [JitKernel("_kernel", "router", dict(N=experts, K=k), types)],
                f"v[{c.i}], {c.ref(0)}, {c.ref(1)}")


def build_moe_linear(c: NodeCtx) -> Unit:
    n, a = c.node, c.attrs
    x, gates, w = c.lay(0), c.lay(1), c.lay(2)
    if w.rank != 3 or w.offset != 0 or w.strides != tuple(
            sympy.sympify(s) for s in (w.shape[1] * w.shape[2], w.shape[2], 1)):
        raise c.fail("expert weights must be a contiguous [E, N, K] tensor")
    if x.strides[-1] != 1 or gates.strides[-1] != 1:
        raise c.fail("x and the gates must have contiguous rows")
    stage = a["stage"]
    top_k = lit_int(c, a["top_k"], "top_k")
    experts = static(c, w.shape[0], "experts")
    nw, k = static(c, w.shape[1], "expert rows"), static(c, w.shape[2], "expert K")
    steps = [st.fn for st in a["epilogue"]]
    allowed = [[], ["glu"], ["act"]] if stage == "up" else [[], ["residual"]]
    if steps not in allowed:
        raise c.fail(f"the {stage} expert template renders an epilogue of "
                     f"{' or '.join(', '.join(x) or 'nothing' for x in allowed)}, not "
                     f"{', '.join(steps)}")
    gated = steps == ["glu"]
    residual = steps == ["residual"]
    width = nw // 2 if gated else nw
    if gated and nw % 2:
        raise c.fail(f"gated experts need an even row count, got {nw}")
    token_rows = numel(n.shape[:-2]) if stage == "up" else numel(n.shape[:-1])
    ctx: dict[str, Any] = dict(kind="experts", stage=stage, E=experts, K=k, N=width, NW=nw,
                               top_k=top_k, gated=gated, dot_kw=c.dot_kw, M=pexpr(token_rows),
                               act_fn=a["epilogue"][0].kw("fn") if steps else "identity",
                               residual=residual,
                               gates_row_off=row_offset(gates, "token"))
    ctx["x"] = dict(row_off=row_offset(x, "token" if stage == "up" else "pair"))
    if gated:
        ctx["wsets"] = [dict(name="w1", ptrs="w1_ptrs", cols="cols", acc="acc1"),
                        dict(name="w2", ptrs="w2_ptrs", cols=f"cols + {width}", acc="acc2")]
    else:
        ctx["wsets"] = [dict(name="w", ptrs="w_ptrs", cols="cols", acc="acc")]
    types = {"out_ptr": c.out_type() if stage == "up" else "*fp32", "x_ptr": c.ptr_type(0),
             "gates_ptr": c.ptr_type(1), "w_ptr": c.ptr_type(2), "pairs_ptr": "*i32",
             "block_expert_ptr": "*i32", "T": "i32"}
    kernels = [JitKernel("_kernel", "moe", dict(N=nw, K=k), types)]
    call = f"v[{c.i}], {c.ref(0)}, {c.ref(1)}, {c.ref(2)}"
    if stage == "down":
        sum_types = {"out_ptr": c.out_type(), "part_ptr": "*fp32"}
        if residual:
            res = c.lay(3)
            ctx["res"] = dict(row_off=row_offset(res, "token"), col_mul=col_mul(c, res))
            sum_types["res_ptr"] = c.ptr_type(3)
            call += f", {c.ref(3)}"
        kernels.append(JitKernel("_sum", "moe_sum", dict(C=width), sum_types))
    return Unit("moe_linear", "moe.py.j2", ctx, kernels, call)


# The recurrent kernels' builders use the helpers above: imported once they exist.
from archc.codegen.recurrent import (  # noqa: E402
    build_causal_conv,
    build_linear_attention,
    build_ssm_scan,
)

BUILDERS: dict[Op, Callable[[NodeCtx], Unit]] = {
    Op.CAUSAL_CONV: build_causal_conv,
    Op.SSM_SCAN: build_ssm_scan,
    Op.LINEAR_ATTENTION: build_linear_attention,
    Op.ROUTER: build_router,
    Op.MOE_LINEAR: build_moe_linear,
    Op.FUSED_LINEAR: build_fused_linear,
    Op.ATTENTION: build_attention,
    Op.EMBEDDING: build_embedding,
    Op.NORM: build_norm,
    Op.POINTWISE: build_pointwise,
}


def build(c: NodeCtx) -> Unit:
    builder = BUILDERS.get(c.node.op)
    if builder is None:
        known = ", ".join(op.value for op in BUILDERS)
        raise c.fail(f"no Triton template for {c.node.op.value} (kernel-level ops with "
                     f"templates: {known}); run the default pass pipeline first")
    return builder(c)

