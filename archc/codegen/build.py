"""How a kernel-level node becomes a rendered kernel: one builder, driven by the node's operands.

1. The op's declaration names its template (``OpDef.template``) and its operands by role.
2. Every operand becomes a kernel argument ``<role>_ptr`` — the root buffer it is read from, typed
   for ahead-of-time compiles, commented with its shape — and a parameter of the unit's launcher;
   so do the runtime objects a kernel reads (the KV cache, a recurrent state, P on the device).
3. The template's context function (``CONTEXTS``) adds what that family prints: static sizes,
   the index expressions of each operand's layout, the epilogue.

The program is verified first, so attributes are of their declared types and allowed values; what
a template cannot read (a layout, a symbolic static size) is refused with a ``CodegenError``
naming the node — never rendered as something else.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import sympy

import archc.ir.expr as E
from archc.codegen.blocks import (
    DECODE_DEAL,
    DOT_MIN,
    ROW_TILED_D,
    TARGETS,
    delta_rule_block_dk,
    next_pow2,
)
from archc.codegen.layout import CodegenError, Layout
from archc.codegen.printer import pexpr, texpr
from archc.dtypes import KV_CODES, triton_pointer
from archc.ir.attrs import Attrs, Call
from archc.ir.cost import node_states
from archc.ir.graph import Graph, Node
from archc.ir.modifiers import Modifiers, leaves, triton, var
from archc.ir.modifiers.tiles import TileCode, triton_classify
from archc.ir.ops import OP_TABLE, Op, full_attrs, roles_of
from archc.ir.ops.core import kept_groups
from archc.ir.ops.modifiers import modifiers_of
from archc.ir.ops.steps import STEPS, epilogue_docs, glu_triton, step_expr
from archc.ir.shapes import DTYPE_BYTES, B, P, S, numel
from archc.ir.text import format_node
from archc.quant.schemes import is_quantized, scheme

LOG2E = 1.4426950408889634
TMA_ALIGN = 16   # bytes: a tensor descriptor's base address and row strides are multiples of it
# Index symbols kernels define: the sequence, the query head, the KV head.
BATCH, HEAD, KV_HEAD = (sympy.Symbol(s, integer=True, nonnegative=True) for s in ("b", "h", "kv_h"))


@dataclass(frozen=True)
class CodegenOptions:
    """What a compile depends on besides the graph: an options object, passed explicitly."""

    target: str = "interpret"        # "gpu" (compiled) or "interpret" (Triton's CPU interpreter)
    max_seq_len: int = 2048          # KV-cache length: static, baked into cache strides
    autotune: bool = False           # on a GPU: triton.autotune over blocks.autotune_configs

    def __post_init__(self) -> None:
        if self.target not in TARGETS:
            raise ValueError(f"unknown target {self.target!r} (known: {', '.join(TARGETS)})")
        if not isinstance(self.max_seq_len, int) or self.max_seq_len < 1:
            raise ValueError(f"max_seq_len must be a positive int, got {self.max_seq_len!r}")

    def key(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


@dataclass
class JitKernel:
    """One @triton.jit function of a unit: its name suffix, block-size family, static sizes,
    and the Triton type of every runtime argument (pointers and ints), by parameter name.
    `static`: the sizes among `sizes` that are constexpr parameters of the kernel, passed by its
    launcher — the kernel's text does not change with them, so nodes that differ only there
    share one kernel (Triton compiles one specialization per value)."""

    suffix: str
    family: str
    sizes: dict[str, int]
    types: dict[str, str]
    static: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Arg:
    """A buffer a kernel reads or writes: its kernel parameter (`x_ptr`), Triton type, comment,
    the launcher's parameter (`x`) and what the graph's run function passes (`v[3]`)."""

    param: str
    type: str
    comment: str
    value: str

    @property
    def name(self) -> str:
        return f"{self.param}_ptr"


PAST = Arg("past", "*i32", "P, the tokens already cached", "d.past")


@dataclass
class Unit:
    """What one node renders to: a template and its values, the kernels it defines and the
    launch call `<name>(d, <call>)` in the graph's run function."""

    family: str
    template: str
    context: dict[str, Any]
    kernels: list[JitKernel]
    call: str
    # module-level @triton.jit helpers its kernels call (templates/<helper>.py.j2), emitted once
    helpers: tuple[str, ...] = ()


@dataclass
class NodeCtx:
    g: Graph
    i: int
    lays: Sequence[Layout]
    opts: CodegenOptions
    # what the runtime allocates for the kernel: ("cache" | "state", layer, kind, shape after
    # B, IR dtype) of each KV cache and recurrent state it reads or writes
    stored: list[tuple[str, int, str, tuple[int, ...], str]] = field(default_factory=list)
    args: list[Arg] = field(default_factory=list)
    # operand role → {axis: name}: dims its argument's comment names by a kernel's constexpr
    # size (`[B, T, K]`), where the value is the kernel's and so not part of its text
    dim_names: dict[str, dict[int, str]] = field(default_factory=dict)
    helpers: list[str] = field(default_factory=list)   # see Unit.helpers

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

    def lay(self, role: str | int) -> Layout:
        k = role if isinstance(role, int) else self.roles[role]
        return self.lays[self.node.inputs[k]]

    def arg(self, role: str) -> Arg:
        return next(a for a in self.args if a.param == role)

    def types(self, args: Sequence[Arg] | None = None, **ints: str) -> dict[str, str]:
        """Argument types of a kernel: out_ptr, the args (all by default), then `ints`."""
        return {"out_ptr": triton_pointer(self.node.dtype),
                **{a.name: a.type for a in (self.args if args is None else args)}, **ints}

    def fail(self, problem: str) -> CodegenError:
        return CodegenError(f"codegen: graph {self.g.name}: {format_node(self.i, self.node)}: "
                            f"{problem}")

    def static(self, d: sympy.Expr | int, what: str) -> int:
        d = sympy.sympify(d)
        if not d.is_Integer:
            raise self.fail(f"{what} is {d}: it must be a static size")
        return int(d)

    @property
    def reads_encoder_len(self) -> bool:
        """Does the node's row space or an input's layout depend on S (a view of a cross-attention
        tensor), so that its kernel takes the encoder length?"""
        lays = [self.lay(k) for k in range(len(self.node.inputs))]
        exprs = [*self.node.shape, *(e for lay in lays for e in (lay.offset, *lay.strides,
                                                                  *lay.shape))]
        return any(S in sympy.sympify(e).free_symbols for e in exprs)

    @property
    def dot_kw(self) -> str:
        """f32 models multiply in IEEE f32 (TF32 would not match eager to f32 rounding)."""
        return ', input_precision="ieee"' if self.node.dtype == "f32" else ""


# ---- reading an operand through its layout -----------------------------------------------------

# A kernel's constexpr sizes (JitKernel.static), as index expressions print them
N_SIZE, K_SIZE = (sympy.Symbol(s, integer=True, positive=True) for s in ("N", "K"))
Named = Mapping[int, sympy.Expr]   # a static size → the constexpr expression that names it


def row_offset(lay: Layout, rows: str, named: Named | None = None) -> str:
    """Device expression: the element offset of flat row `rows` (an i64 vector) over the leading
    dims of `lay`, plus its static offset. A row stride of contiguous rows that `named` holds
    prints as its constexpr expression (`K * rows`)."""
    r = sympy.Symbol("r", integer=True, nonnegative=True)
    lead, strides = lay.shape[:-1], lay.strides[:-1]
    expr: sympy.Expr = lay.offset
    if lead and lay.contiguous_rows:
        stride = sympy.sympify(strides[-1])
        expr += r * (named.get(int(stride), stride) if named and stride.is_Integer else stride)
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


def rows(lay: Layout, named: Named | None = None) -> dict[str, str]:
    """Rows of contiguous-or-strided columns: each row's offset, and ` * stride` for columns
    that are not contiguous ('' when they are)."""
    s = lay.strides[-1]
    return dict(row_off=row_offset(lay, "rows", named),
                col_mul="" if s == 1 else f" * {texpr(s)}")


def by_sequence(c: NodeCtx, role: str, head: sympy.Symbol | None = None) -> dict[str, str]:
    """A [B, T, W] operand (or a [B, H, T, D] head view, at head `head`) read token by token with
    contiguous columns: where sequence b's rows start, and the stride from one token to the
    next."""
    lay = c.lay(role)
    rank = 3 if head is None else 4
    if lay.rank != rank or lay.strides[-1] != 1:
        raise c.fail(f"{role} must be {'[B, T, W]' if head is None else '[B, H, T, D]'} with "
                     "contiguous columns")
    base = lay.offset + BATCH * lay.strides[0] + (0 if head is None else head * lay.strides[1])
    return dict(base=texpr(base), stride_t=texpr(lay.strides[-2]),
                batch=texpr(lay.offset + BATCH * lay.strides[0]),
                stride_h=texpr(lay.strides[1]))


def contiguous(c: NodeCtx, role: str, *dims: int) -> None:
    """Refuse unless `role` is a contiguous tensor of exactly `dims`."""
    lay = c.lay(role)
    want = [sympy.Integer(d) for d in dims]
    strides = [sympy.Integer(math.prod(dims[k + 1:])) for k in range(len(dims))]
    if lay.offset != 0 or list(lay.shape) != want or list(lay.strides) != strides:
        raise c.fail(f"{role} must be a contiguous {list(dims)} tensor")


# ---- epilogue steps ---------------------------------------------------------------------------

ACC = "__ACC__"   # where an elementwise step's code names the accumulator


def elementwise_step(c: NodeCtx, st: Call, idx: int, width: int,
                     named: Named | None = None) -> dict[str, Any]:
    """An elementwise epilogue step for the `elementwise` macro (templates/steps.j2): its
    inputs' loads — a [width] vector along the columns, or rows read through their layout (row
    strides in `named` by their constexpr names) — and its Triton code over the accumulator
    and the loaded values, on columns [start, stop)."""
    if not STEPS[st.fn].elementwise:
        raise c.fail(f"the {c.node.op.value} template renders elementwise epilogue steps here, "
                     f"not {st.fn}()")
    loads = [dict(var=role, vector=c.lay(role).rank == 1, ptr=c.arg(role).name,
                  **rows(c.lay(role), named))
             for role in (f"{name}{idx}" for name in STEPS[st.fn].inputs)]
    start, stop = st.kw("start", 0), st.kw("stop", width)
    code = E.triton(step_expr(st), [ACC, *(ld["var"] for ld in loads)])
    return dict(fn="elementwise", name=st.fn, loads=loads, code=code, start=start, stop=stop,
                full=start == 0 and stop == width)


# ---- quantized weights ------------------------------------------------------------------------

def _whole(c: NodeCtx, role: str) -> Layout:
    """The layout of a quantized operand, refused unless it is the whole contiguous tensor (its
    parts are indexed by row: no view of a quantized tensor reaches a kernel)."""
    lay = c.lay(role)
    root = c.g.nodes[lay.root]
    if (lay.offset != 0 or tuple(lay.shape) != tuple(root.shape) or not lay.contiguous_rows
            or lay.strides[-1] != 1):
        raise c.fail(f"the quantized {role} ({root.dtype}) must be read whole, not through a "
                     "view")
    return lay


def quant_args(c: NodeCtx, role: str, dtype: str, dims: str, doc: str) -> list[Arg]:
    """The arguments of a quantized operand: a pointer to each stored part (`<role>_<part>`)."""
    lay = _whole(c, role)
    n, k = (c.static(d, f"the quantized {role}'s size") for d in lay.shape[-2:])
    return [Arg(f"{role}_{part}", triton_pointer(pdt), f"{dtype} [{dims}] {doc}: part {part} "
                f"[.., {rows}, {cols}] {pdt}", f'v[{lay.root}].parts["{part}"]')
            for part, ((rows, cols), pdt) in scheme(dtype).part_shapes(n, k).items()]


def quant_weight(c: NodeCtx, role: str) -> dict[str, Any] | None:
    """What templates/dequant.j2 reads of a quantized operand — its scheme's facts, each part's
    kernel pointer and static row stride (elements) — or None for a plain tensor."""
    lay = c.lay(role)
    dtype = c.g.nodes[lay.root].dtype
    if not is_quantized(dtype):
        return None
    s = scheme(dtype)
    n, k = (c.static(d, f"the quantized {role}'s size") for d in _whole(c, role).shape[-2:])
    parts = s.part_shapes(n, k)
    return dict(name=s.name, bits=s.bits, group=s.group, zero=s.zero, scale=s.scale,
                two_level=s.two_level, signed_sc=s.signed_sc, offset=s.offset,
                high_bits=s.high_bits, per_row=s.group >= k,
                ptr={p: f"{role}_{p}_ptr" for p in parts},
                stride={p: cols for p, ((_, cols), _) in parts.items()})


# ---- the builder ------------------------------------------------------------------------------

def build(c: NodeCtx) -> Unit:
    template = OP_TABLE[c.node.op].template
    if template is None or (c.node.op.value == "router" and "weight" not in c.roles):
        known = ", ".join(sorted(op.value for op, d in OP_TABLE.items() if d.template))
        raise c.fail(f"no Triton template for {c.node.op.value} of these operands (kernel-level "
                     f"ops: {known}); run the default pass pipeline first")
    docs = {**OP_TABLE[c.node.op].docs, **epilogue_docs(c.attrs)}

    def dims(role: str, names: dict[int, str]) -> str:
        lay = c.lay(role)
        return ", ".join(names.get(axis - lay.rank, str(d).replace(" ", ""))
                         for axis, d in enumerate(lay.shape))

    def comment(role: str, names: dict[int, str]) -> str:
        read = "" if c.lay(role).root == c.node.inputs[c.roles[role]] else \
            ", read through strides"
        return f"[{dims(role, names)}] {docs.get(role, role)}{read}"

    for role, k in c.roles.items():
        lay = c.lay(k)
        root = c.g.nodes[lay.root]
        if is_quantized(root.dtype):   # one argument per stored part of the quantized tensor
            c.args += quant_args(c, role, root.dtype, dims(role, {}), docs.get(role, role))
            continue
        c.args.append(Arg(role, triton_pointer(root.dtype), comment(role, {}), f"v[{lay.root}]"))
    _states(c)
    context, kernels = CONTEXTS[template](c)
    c.args = [replace(a, comment=comment(a.param, c.dim_names[a.param]))
              if a.param in c.dim_names else a for a in c.args]
    # the constexpr sizes the launcher passes to its kernels: parameters of the launcher, whose
    # call in the run function names their values
    static = {name: v for k in kernels for name, v in k.static.items()}
    params = ", ".join(a.param for a in c.args)
    context.update(args=c.args, params=params, params_=f"{params}, " if params else "",
                   static_="".join(f", {name}" for name in static), seq_s=c.reads_encoder_len)
    call = ", ".join([f"v[{c.i}]", *(a.value for a in c.args),
                      *(f"{name}={v}" for name, v in static.items())])
    return Unit(c.node.op.value, f"{template}.py.j2", context, kernels, call, tuple(c.helpers))


def collective_call(c: NodeCtx) -> str:
    """The host step a collective node becomes in a graph's run function: no kernel, but
    ``d.collective(op, out, x, group=…, ranks=…, dim=…)``, which records the exchange through
    the rank's communicator between the launches before and after it (on a GPU, NCCL
    collectives on the launch stream, captured into the CUDA graph with the kernels). Both
    the value sent and the one received must be whole buffers (their own roots): the
    communicator reads and writes plain tensors, not strided views."""
    x = c.node.inputs[0]
    for what, i in (("its input", x), ("its output", c.i)):
        if c.lays[i].root != i:
            raise c.fail(f"{what} is a view of %{c.lays[i].root}; a collective exchanges whole "
                         "buffers")
    a = c.attrs
    dim = f", dim={int(a['dim'])}" if "dim" in a else ""
    return (f"d.collective({c.node.op.value!r}, v[{c.i}], v[{x}], group={a['group']!r}, "
            f"ranks={int(a['ranks'])}{dim})")


# ---- the families -----------------------------------------------------------------------------

def _embedding(c: NodeCtx) -> tuple[dict[str, Any], list[JitKernel]]:
    table, ids = c.lay("table"), c.lay("ids")
    if table.rank != 2 or table.strides[1] != 1:
        raise c.fail("the table must be a row-major [V, D] matrix")
    vocab, width = c.static(table.shape[0], "table rows"), c.static(table.shape[1], "width")
    # ids are [..] with no column dim: view them as rows of one column
    ids_rows = Layout(ids.root, ids.offset, (*ids.shape, sympy.Integer(1)),
                      (*ids.strides, sympy.Integer(1)))
    ctx = dict(V=vocab, D=width, ids_off=row_offset(ids_rows, "rows"),
               quant=quant_weight(c, "table"),
               table_stride=texpr(table.strides[0]),
               table_base=f"{texpr(table.offset)} + " if table.offset != 0 else "",
               R=pexpr(numel(c.node.shape[:-1])),
               # vocabulary-parallel: the launcher passes this tp rank's first row (LO)
               parts=int(c.attrs.get("parts", 1)) > 1)
    lo = {"LO": "i32"} if ctx["parts"] else {}
    return ctx, [JitKernel("_kernel", "embedding", dict(C=width),
                           c.types(R="i32", T="i32", **lo))]


def _norm(c: NodeCtx) -> tuple[dict[str, Any], list[JitKernel]]:
    a = c.attrs
    width = c.static(c.node.shape[-1], "the norm width")
    spans, normed = None, width
    if a["spans"] is not None:   # [start, stop) of each span, from column 0
        ends = [sum(a["spans"][:k + 1]) for k in range(len(a["spans"]))]
        spans, normed = list(zip([0, *ends[:-1]], ends)), ends[-1]
    contiguous(c, "weight", normed)
    steps: list[dict[str, Any]] = []
    kv = None
    for k, st in enumerate(a["epilogue"]):
        if st.fn == "rope":
            rope = _rope_pair(st, width, k, c)
            # the rotated columns: all normalized (a partner is normalized again in the
            # kernel) or all passed through (a partner is its input)
            rotated = [h * rope["head_dim"] + rope["rot_start"] + e for h in range(rope["heads"])
                       for e in range(2 * rope["rot_pairs"])]
            rope["passthrough"] = min(rotated) >= normed
            if max(rotated) >= normed and not rope["passthrough"]:
                raise c.fail("rope() over columns the norm normalizes and columns it passes "
                             "through")
            if a["add_before"]:
                raise c.fail("rope() after a residual added before the norm")
            steps.append(rope)
        elif st.fn in ("kv_write", "paged_kv_write"):
            if kv is not None:
                raise c.fail("more than one kv_write() step")
            kv = _kv_step(c, st, k)
            if kv["quant"] is not None and k != len(a["epilogue"]) - 1:
                raise c.fail("a quantized KV cache is written from the norm's stored rows: "
                             "kv_write() must be the epilogue's last step")
            steps.append(kv)
        else:
            steps.append(elementwise_step(c, st, k, width))
    if kv is not None:
        _kv_args(c, kv, 1 << 16)   # the lanes are the columns, in order
    ctx = dict(N=width, kind=a["kind"], eps=repr(a["eps"]), unit_offset=a["unit_offset"],
               add_before=a["add_before"], R=pexpr(numel(c.node.shape[:-1])),
               x=rows(c.lay("x")), residual=rows(c.lay("residual")) if a["add_before"] else {},
               spans=spans, normed=normed, steps=steps, kv=kv,
               needs_t=kv is not None or any(s["fn"] == "rope" for s in steps))
    ints = dict(R="i32", T="i32", **({"S": "i32"} if c.reads_encoder_len else {}))
    kernels = [JitKernel("_kernel", "norm", dict(N=width), c.types(**ints))]
    if kv is not None and kv["quant"] is not None:   # the quantized cache rows' post-pass
        kernels.append(_kv_quant_kernel(c, kv))
    return ctx, kernels


def _pointwise(c: NodeCtx) -> tuple[dict[str, Any], list[JitKernel]]:
    out = c.node.shape
    rank = len(out)
    if rank == 0:
        raise c.fail("a scalar pointwise node has no Triton rendering")
    width = c.static(out[-1], "the output width")
    inputs = []
    for role in c.roles:   # inputs aligned from the right; broadcast dims read with stride 0
        lay = c.lay(role)
        lead = rank - lay.rank
        strides = tuple(sympy.Integer(0) if d < lead or (lay.shape[d - lead] == 1 and out[d] != 1)
                        else lay.strides[d - lead] for d in range(rank))
        inputs.append(dict(name=role, ptr=c.arg(role).name,
                           **rows(Layout(lay.root, lay.offset, out, strides))))
    ctx = dict(C=width, inputs=inputs, R=pexpr(numel(out[:-1])),
               expr=E.triton(c.attrs["expr"], list(c.roles)))
    return ctx, [JitKernel("_kernel", "pointwise", dict(C=width),
                           c.types(R="i32", B="i32", T="i32", S="i32"))]


def _k_loop(c: NodeCtx, weight: Layout, rows_n: int, k: int, cols: Sequence[str] = ("cols",)
            ) -> dict[str, Any]:
    """The weight-tile loads of a K loop (templates/kloop.j2): an accumulator for each set of
    weight rows `cols` (two for a paired epilogue)."""
    suffixes = [""] if len(cols) == 1 else ["1", "2"]   # one set: "acc"; two: "acc1", "acc2"
    return dict(wsets=[dict(name=f"w{j}", ptrs=f"w{j}_ptrs", acc=f"acc{j}", cols=col)
                       for j, col in zip(suffixes, cols)],
                w_row_stride=texpr(weight.strides[-2]), dot_kw=c.dot_kw, N=rows_n, K=k,
                quant=quant_weight(c, "weight"))


def _routes_experts(c: NodeCtx, top_k: int) -> bool:
    """Does an expert matmul read these gates — the router's own buffer, routed to as many
    experts? Then the router's last program routes the pairs for it (the expert matmuls find
    the routing of that buffer done)."""
    if c.lays[c.i].root != c.i:
        return False
    return any(c.g.nodes[u].op == Op.MOE_LINEAR and c.g.nodes[u].inputs[1] == c.i
               and full_attrs(c.g.nodes[u].op, c.g.nodes[u].attrs)["top_k"] == top_k
               for u in c.g.users()[c.i])


def _moe(c: NodeCtx) -> tuple[dict[str, Any], list[JitKernel]]:
    a, n = c.attrs, c.node
    if n.op.value == "router":
        x, w = c.lay("x"), c.lay("weight")
        if w.rank != 2 or w.strides[1] != 1 or w.offset != 0 or x.strides[-1] != 1:
            raise c.fail("the router needs contiguous rows of x and of its [E, K] weight")
        experts, k = c.static(w.shape[0], "experts"), c.static(w.shape[1], "router K")
        route = _routes_experts(c, a["top_k"])
        bias, choice_bias = "bias" in c.roles, "choice_bias" in c.roles
        for role in ("bias", "choice_bias"):
            if role in c.roles and (c.lay(role).strides[-1] != 1 or c.lay(role).rank != 1):
                raise c.fail(f"the router's {role.replace('_', ' ')} must be one contiguous "
                             "[E] vector")
        ctx = dict(kind="router", E=experts, K=k, BLOCK_E=max(16, next_pow2(experts)),
                   top_k=a["top_k"], normalize=a["normalize"], fn=a["fn"], bias=bias,
                   choice_bias=choice_bias, groups=a["groups"], top_groups=kept_groups(a),
                   group_score=a["group_score"], scale=a["scale"], x=rows(x),
                   w_row_stride=texpr(w.strides[0]), dot_kw=c.dot_kw,
                   M=pexpr(numel(n.shape[:-1])), route=route, gates_row_off=f"token * {experts}",
                   quant=quant_weight(c, "weight"))
        table = dict(table_ptr="*i32", block_expert_ptr="*i32", arrived_ptr="*i32") if route else {}
        kernels = [JitKernel("_kernel", "router", dict(N=experts, K=k, route=int(route)),
                             c.types(**table, M="i32", T="i32"))]
        if route:   # a prefill's tokens are routed in parallel after the router
            kernels += _parallel_routing(experts, triton_pointer(n.dtype))
        return ctx, kernels
    x, gates, w = c.lay("x"), c.lay("gates"), c.lay("weight")
    e, nw, k = (c.static(d, "the expert weights' size") for d in w.shape)
    contiguous(c, "weight", e, nw, k)
    if x.strides[-1] != 1 or gates.strides[-1] != 1:
        raise c.fail("x and the gates must have contiguous rows")
    up = a["stage"] == "up"
    steps = list(a["epilogue"])
    gated = bool(steps) and steps[0].fn == "glu"   # pairs gate and up rows: first, if at all
    interleaved = gated and bool(steps[0].kw("interleaved", False))
    width = nw // 2 if gated else nw
    if gated and interleaved:
        cols: tuple[str, ...] = ("w_rows",)          # one tile of alternating gate and up rows
    else:
        cols = ("cols", f"cols + {width}") if gated else ("cols",)
    # weight tiles by TMA when one accumulator takes them and a weight row (a descriptor's
    # stride) is a multiple of TMA_ALIGN bytes
    w_dtype = c.g.nodes[n.inputs[c.roles["weight"]]].dtype
    # (a quantized weight's tiles are dequantized from its parts: never TMA)
    tma = len(cols) == 1 and not is_quantized(w_dtype) and \
        (k * DTYPE_BYTES[w_dtype]) % TMA_ALIGN == 0
    if a["bias"]:
        contiguous(c, "bias", e, nw)
    acc_names = ("acc",) if len(cols) == 1 else ("acc1", "acc2")
    ctx = dict(kind="experts", stage=a["stage"], E=e, NW=nw, top_k=a["top_k"], gated=gated,
               interleaved=interleaved, tma=tma, BLOCK_E=max(16, next_pow2(e)), route=False,
               M=pexpr(numel(n.shape[:-2] if up else n.shape[:-1])), bias=a["bias"],
               gate_input=a["gate_input"],
               glu=glu_triton(steps[0], *(("gate", "up") if interleaved else acc_names))
               if gated else "",
               steps=[elementwise_step(c, st, idx, width) for idx, st in enumerate(steps)
                      if not (gated and idx == 0)],
               gates_row_off=row_offset(gates, "token"),
               x=dict(row_off=row_offset(x, "token" if up else "pair")),
               **_k_loop(c, w, width, k, cols))
    for wset in ctx["wsets"]:   # a quantized weight's rows: the expert's, flat over [E·NW]
        wset["rows"] = f"expert.to(tl.int64) * {nw} + ({wset['cols']})"
    table = dict(pairs_ptr="*i32", block_expert_ptr="*i32")
    own = dict(table, part_ptr="*fp32", arrived_ptr="*i32") if not up else table
    sizes = dict(N=nw, K=k, E=e, top_k=a["top_k"], gated=int(gated),
                 **({"bias": 1} if a["bias"] else {}), **({"tma": 1} if tma else {}))
    if ctx["quant"]:   # the code width: tiles sized for a dequantized weight
        sizes["quant"] = ctx["quant"]["bits"]
    kernels = [JitKernel("_kernel", "moe", sizes, c.types(**own, T="i32")),
               JitKernel("_routing", "moe_routing", dict(E=e),
                         {"gates_ptr": c.arg("gates").type, "table_ptr": "*i32",
                          "block_expert_ptr": "*i32", "M": "i32", "T": "i32"}),
               *_parallel_routing(e, c.arg("gates").type)]
    return ctx, kernels


def _parallel_routing(experts: int, gates: str) -> list[JitKernel]:
    """The two kernels that route a prefill's chunks of tokens in parallel: counts per chunk,
    then each chunk's pairs placed (templates/moe.py.j2)."""
    types = {"gates_ptr": gates, "chunk_counts_ptr": "*i32", "table_ptr": "*i32",
             "block_expert_ptr": "*i32", "M": "i32", "T": "i32"}
    return [JitKernel(suffix, "moe_routing", dict(E=experts), types)
            for suffix in ("_count", "_scatter")]


def _cache_arg(c: NodeCtx, param: str, kind: str, layer: int, kv_heads: int, hd: int,
               quant: str | None = None, block_size: int | None = None) -> Arg:
    """Layer `layer`'s `kind` (k|v) cache, [B, kv_heads, max_seq_len, hd], as an argument: in
    the node's dtype, or the codes of a quantized cache (`quant`). Paged (`block_size`): the
    layer's pool of blocks, [blocks, kv_heads, block_size, hd] (the store's "batch" is the
    block count the runtime allocates)."""
    dtype = c.node.dtype if quant is None else KV_CODES[quant].dtype
    rows = c.opts.max_seq_len if block_size is None else block_size
    c.stored.append(("cache", layer, kind, (kv_heads, rows, hd), dtype))
    codes = "" if quant is None else f" of {quant} codes"
    what = f"{'key' if kind == 'k' else 'value'} cache{codes}"
    return Arg(param, triton_pointer(dtype),
               f"{what} [B, {kv_heads}, {rows}, {hd}]" if block_size is None else
               f"{what} pool [blocks, {kv_heads}, {block_size}, {hd}]",
               f'd.cache.get({layer}, "{kind}")')


def _scale_arg(c: NodeCtx, param: str, kind: str, layer: int, kv_heads: int) -> Arg:
    """The f32 scales of a quantized `kind` cache, one per (sequence, KV head, position)."""
    c.stored.append(("cache", layer, f"{kind}_scale", (kv_heads, c.opts.max_seq_len), "f32"))
    what = "key" if kind == "k" else "value"
    return Arg(param, "*fp32", f"f32 scales of the {what} cache's rows [B, {kv_heads}, "
               f"{c.opts.max_seq_len}]", f'd.cache.get({layer}, "{kind}_scale")')


def _states(c: NodeCtx) -> None:
    """The recurrent state tensors the node's op declares, as arguments."""
    for decl in node_states(c.g, c.i):
        layer = c.attrs["layer"]
        if sympy.sympify(decl.shape[0]) != B:
            raise c.fail(f"the {decl.kind} state {list(decl.shape)} does not lead with B")
        tail = tuple(c.static(d, f"the {decl.kind} state's size") for d in decl.shape[1:])
        c.stored.append(("state", layer, decl.kind, tail, decl.dtype))
        c.args.append(Arg(f"{decl.kind.lower()}_state", triton_pointer(decl.dtype),
                          f"{decl.dtype} [{', '.join(map(str, ('B', *tail)))}] {decl.kind} "
                          "state, updated in place", f'd.states.get({layer}, "{decl.kind}")'))


def _causal_conv(c: NodeCtx) -> tuple[dict[str, Any], list[JitKernel]]:
    a = c.attrs
    channels = c.static(c.node.shape[-1], "the channel count")
    width = c.static(c.lay("weight").shape[1], "the filter width")
    contiguous(c, "weight", channels, width)
    if a["bias"]:
        contiguous(c, "bias", channels)
    ctx = dict(C=channels, K=width, bias=a["bias"], act_fn=a["act"], x=by_sequence(c, "x"))
    return ctx, [JitKernel("_kernel", "causal_conv", dict(C=channels, K=width),
                           c.types(T="i32"))]


def _ssm_scan(c: NodeCtx) -> tuple[dict[str, Any], list[JitKernel]]:
    a = c.attrs
    channels = c.static(c.node.shape[-1], "the channel count")
    states = c.static(c.lay("a").shape[1], "d_state")
    contiguous(c, "a", channels, states)
    for role, n in (("skip", channels), ("b_gain", states), ("c_gain", states)):
        if role in c.roles:
            contiguous(c, role, n)
    ctx = dict(C=channels, N=states, norm=a["norm_eps"] is not None, gate=a["gate"],
               eps=repr(a["norm_eps"]),
               **{r: by_sequence(c, r) for r in ("x", "dt", "b", "c", "z") if r in c.roles})
    return ctx, [JitKernel("_kernel", "ssm_scan", dict(C=channels, N=states),
                           c.types(T="i32"))]


def _linear_attention(c: NodeCtx) -> tuple[dict[str, Any], list[JitKernel]]:
    q, k, v = c.lay("q"), c.lay("k"), c.lay("v")
    heads, kv_heads = c.static(q.shape[1], "query heads"), c.static(k.shape[1], "KV heads")
    hd, dv = c.static(q.shape[3], "head_dim"), c.static(v.shape[3], "the value head dim")
    ctx = dict(H=heads, KVH=kv_heads, G=heads // kv_heads, D=hd, DV=dv,
               BLOCK_D=max(16, next_pow2(hd)), BLOCK_DV=max(16, next_pow2(dv)),
               feature=c.attrs["feature"], q=by_sequence(c, "q", HEAD),
               k=by_sequence(c, "k", KV_HEAD), v=by_sequence(c, "v", KV_HEAD), dot_kw=c.dot_kw)
    return ctx, [JitKernel("_kernel", "linear_attention", dict(D=hd, DV=dv),
                           c.types(T="i32"))]


def _delta_rule(c: NodeCtx) -> tuple[dict[str, Any], list[JitKernel]]:
    """The gated delta rule from and into the layer's state S (in place): the chunked kernel
    for a call of at least a chunk of tokens (prefill), the recurrent one for fewer (decode);
    q and k read per key head and L2-normalized in the kernels."""
    a = c.attrs
    heads, key_heads = a["heads"], a["key_heads"]
    dk = c.static(c.lay("q").shape[-1], "q's width") // key_heads
    dv = c.static(c.lay("v").shape[-1], "v's width") // heads
    forms = ["recurrent"] if a["algorithm"] == "recurrent" else ["recurrent", "chunked"]
    chunk = a["chunk"]
    if "chunked" in forms and (chunk & (chunk - 1) or (c.opts.target == "gpu" and
                                                         chunk < DOT_MIN)):
        raise c.fail(f"the chunked kernel takes a power-of-two chunk (at least "
                     f"{DOT_MIN} on a GPU, its products being tl.dot tiles), not "
                     f"{chunk}")
    ctx = dict(H=heads, DK=dk, DV=dv, G=heads // key_heads, BLOCK_DK=delta_rule_block_dk(dk),
               l2_eps=repr(a["eps"]), launcher=True, forms=forms, dot_kw=c.dot_kw,
               scale=a["scale"] if a["scale"] is not None else dk ** -0.5,
               docs={r: c.arg(r).comment for r in ("q", "k", "v", "g", "beta")},
               **{r: by_sequence(c, r) for r in ("q", "k", "v", "g", "beta")})
    types = {"o_ptr": triton_pointer(c.node.dtype),
             **{f"{r}_ptr": c.arg(r).type for r in ("q", "k", "v", "g", "beta")},
             "s0_ptr": "*fp32", "s_ptr": "*fp32", "T": "i32", "scale": "fp32"}
    sizes = dict(H=heads, DK=dk, DV=dv)
    return ctx, [JitKernel(f"_{form}", f"delta_rule_{form}", sizes, types,
                           static=dict(HAS_INITIAL=1, **({"CHUNK": chunk} if form == "chunked"
                                                         else {})))
                 for form in forms]


# ---- attention --------------------------------------------------------------------------------

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


def _multiple_of(e: sympy.Expr | int, n: int) -> bool:
    """Is `e` a multiple of `n` at every value of its dims — an integer polynomial in them whose
    coefficients all are?"""
    e = sympy.expand(sympy.sympify(e))
    try:
        poly = sympy.Poly(e, *sorted(e.free_symbols, key=str)) if e.free_symbols else None
    except sympy.PolynomialError:
        return False
    coeffs = poly.coeffs() if poly is not None else [e]
    return all(getattr(k, "is_Integer", False) and int(k) % n == 0 for k in coeffs)


def _tma_layout(lays: Sequence[Layout], cache_row: int | None, dtype: str) -> bool:
    """Can every operand tile be read through a tensor descriptor? Each [B, H, rows, D] operand
    must start and step from row to row, head to head and sequence to sequence at a multiple of
    16 bytes (buffers start 256-byte aligned): q, k and v are often column slices of one fused
    projection, whose offsets and row strides decide it. `cache_row`: the elements of a KV-cache
    row, when k and v are read from the cache ([B, H_kv, max_seq_len, D], laid out by the build;
    its other strides are multiples of a row)."""
    size = DTYPE_BYTES.get(dtype, 1)
    n = TMA_ALIGN // math.gcd(TMA_ALIGN, size)
    if cache_row is not None and (cache_row * size) % TMA_ALIGN:
        return False
    return all(lay.strides[-1] == 1 and all(_multiple_of(e, n) for e in
                                             (lay.offset, *lay.strides[:-1])) for lay in lays)


# Each leaf of a modifier expression as the attention kernels name its value in a tile: query
# positions a column, key positions a row; the head a scalar in the kernels whose rows are
# queries (prefill, ring) and a column in those whose rows are the heads of a KV group
# (decode, paged). A name the expressions read is loaded once as `<name>_at_h` (a per-head
# parameter at the head; `_at_kv` at the KV head), `<name>_val` (a per-sequence scalar),
# `<name>_at_q` (a per-token input at the queries), or per key tile as `<name>_at_k`.
ROW_KINDS = {"query": "h", "head": "head[:, None]"}
# The rows of each kernel, by which its tile classifier knows the heads of a tile: one head
# (prefill, ring), or the KV group's h_lo … h_hi (decode, paged)
TILE_KERNELS = {"prefill": "query", "decode": "head", "paged": "head", "ring": "query"}


def _leaf_code(e: Call, head: str) -> str:
    name = e.args[0]
    if e.fn == "index":
        at = e.args[1].args[0]
        return {"head": f"{name}_at_h" + ("[:, None]" if head != "h" else ""),
                "kv_head": f"{name}_at_kv", "q_pos": f"{name}_at_q[:, None]",
                "kv_pos": f"{name}_at_k[None, :]"}[at]
    return {"score": "score", "q_pos": "q_pos[:, None]", "kv_pos": "k_pos[None, :]",
            "head": head, "kv_head": "kv_h"}.get(name, f"{name}_val")


def _leaf_range(e: Call, kind: str) -> tuple[str, str] | None:
    """The (lo, hi) bounds a kernel knows of a leaf over its tile, as the template's
    tile_class names them (None: unknown)."""
    name = e.args[0]
    if e.fn == "index":
        at = e.args[1].args[0]
        if at in ("q_pos", "kv_pos"):
            var_name = f"{name}_at_{'q' if at == 'q_pos' else 'k'}"
            return f"{var_name}_lo", f"{var_name}_hi"
        return None       # a per-head parameter: a float, any value to the classifier
    return {"q_pos": ("q_lo", "q_hi"), "kv_pos": ("k_lo", "k_hi"),
            "head": ("h", "h") if kind == "query" else ("h_lo", "h_hi"),
            "kv_head": ("kv_h", "kv_h")}.get(name, (f"{name}_val", f"{name}_val"))


def _tile_code(code: TileCode) -> TileCode:
    """Known classes as int1 scalars: the template's loop state takes tl.where of them."""
    def scalar(x: str | bool) -> str:
        return x if isinstance(x, str) else f"tl.full((), {int(x)}, tl.int1)"
    return TileCode(code.lines, scalar(code.live), scalar(code.full))


def modifier_context(c: NodeCtx, mods: Modifiers, ring: bool = False) -> dict[str, Any]:
    """What the attention template reads of the node's modifiers: the score and the mask as
    Triton in each kind of kernel, the mask's tile classifier in each kernel, and the names
    they read — per-head parameters (the sinks among them), scalars, per-token inputs — with
    the strides of each per-token input [B, L]."""
    env, nz = mods.env, mods.normalizer
    used = list(dict.fromkeys([*leaves(mods.score), *leaves(mods.mask)]))
    sinks = nz.kw("sinks") if nz.fn == "softmax" else None
    heads = [(x.args[0], x.args[1].args[0]) for x in used
             if x.fn == "index" and x.args[0] in env.head_params]
    if sinks is not None and (sinks, "head") not in heads:
        heads.append((sinks, "head"))

    def token(x: Call) -> dict[str, str]:
        lay = c.lay(x.args[0])
        if lay.rank != 2:
            raise c.fail(f"the per-token input {x.args[0]} must be [B, L]")
        at = "q" if x.args[1] == var("q_pos") else "k"
        return dict(name=x.args[0], var=f"{x.args[0]}_at_{at}",
                    sb=f"({texpr(lay.strides[0], {'P': 'past'})})",
                    sl=f"({texpr(lay.strides[1])})")
    tokens = [x for x in used if x.fn == "index" and x.args[0] in env.token_inputs]
    q_inputs = [token(x) for x in tokens if x.args[1] == var("q_pos")]
    if ring and q_inputs:
        raise c.fail("ring attention reads per-token inputs at the keys only")
    tiled = {var("score"), var("q_pos"), var("kv_pos")} | set(tokens)
    ctx: dict[str, Any] = dict(
        heads=[dict(name=n, at=at, var=f"{n}_at_{'h' if at == 'head' else 'kv'}")
               for n, at in heads],
        scalars=[dict(name=x.args[0], var=f"{x.args[0]}_val") for x in used
                 if x.fn == "var" and x.args[0] in env.scalars],
        q_inputs=q_inputs, k_inputs=[token(x) for x in tokens if x.args[1] == var("kv_pos")])
    for kind, head in ROW_KINDS.items():
        code = {x: _leaf_code(x, head) for x in used}
        score = None
        if mods.score != var("score"):
            score = triton(mods.score, env, code, prefix="mod_s")
            if not tiled & set(leaves(mods.score)):   # a value for the tile, not one for all
                score = type(score)(score.lines, f"qk * 0.0 + {score.value}")
        mask = None if mods.mask is True else triton(mods.mask, env, code, prefix="mod_m")
        ctx[kind] = dict(score=score, mask=mask)
    tiles = {}
    for kernel, kind in TILE_KERNELS.items():
        ranges = {x: r for x in used if (r := _leaf_range(x, kind)) is not None}
        tiles[kernel] = _tile_code(triton_classify(
            mods.mask, env, ranges, live_if="k_hi >= 0" if kernel == "ring" else None,
            full_if="whole" if kernel == "ring" else "start_n + BLOCK_N <= key_end"))
    return dict(mods=ctx, tiles=tiles)


def _normalizer(mods: Modifiers, scale: float, t5: bool) -> dict[str, Any]:
    """The normalizer's kind and constants, the units of the scores it takes (log2 for the
    softmaxes' exp2, natural for σ), and whether an unmasked tile may scale its scores in the
    exponent's FMA (a plain score under a softmax, a positive scale)."""
    nz = mods.normalizer
    sigmoid = nz.fn == "sigmoid"
    sinks = None if sigmoid else nz.kw("sinks")
    unit = 1.0 if sigmoid else LOG2E
    return dict(nz=dict(kind="sigmoid" if sigmoid else "sinks" if sinks else "softmax",
                        sink=f"{sinks}_at_h" if sinks else None,
                        bias=repr(float(nz.kw("bias", 0.0))) if sigmoid else None),
                unit=repr(unit), scale=repr(scale), qk_scale=repr(scale * unit),
                fold_scale=not sigmoid and mods.score == var("score") and not t5 and scale > 0)


def _attention(c: NodeCtx) -> tuple[dict[str, Any], list[JitKernel]]:
    a = c.attrs
    q = c.lay("q")
    heads, hd = c.static(q.shape[1], "query heads"), c.static(q.shape[3], "head_dim")
    cached = a["cache_layer"] is not None
    max_len = c.opts.max_seq_len
    if a["paged"] is not None:
        return _paged_attention(c, heads, hd)
    second = _second_score(c, hd, max_len) if a["second_score"] else None
    if second is not None:   # one cache of key rows [k ‖ k2]; the values are their first D
        kv_heads = a["kv_heads"]
        kv = {kind: dict(base=f"b * {kv_heads * max_len * second['W']} + kv_h * "
                         f"{max_len * second['W']}", stride_t=str(second["W"])) for kind in "kv"}
        length, length_host = "tl.load(past_ptr) + T", ""
        c.args.append(PAST)
    elif cached:   # the layer's cache, read in place of k and v operands
        kv_heads, layer = a["kv_heads"], a["cache_layer"]
        quant = a["kv_quant"]
        c.args[1:1] = [_cache_arg(c, kind, kind, layer, kv_heads, hd, quant) for kind in "kv"]
        if quant is not None:   # and each row's scale, after the codes
            c.args[3:3] = [_scale_arg(c, f"{kind}_scale", kind, layer, kv_heads) for kind in "kv"]
        kv = {kind: dict(base=f"b * {kv_heads * max_len * hd} + kv_h * {max_len * hd}",
                         stride_t=str(hd)) for kind in "kv"}
        # keys: the cache's first P + T positions
        length, length_host = "tl.load(past_ptr) + T", ""
        c.args.append(PAST)
    else:
        kv_heads = c.static(c.lay("k").shape[1], "KV heads")
        kv = {kind: by_sequence(c, kind, KV_HEAD) for kind in "kv"}
        length, length_host = texpr(c.lay("k").shape[2]), pexpr(c.lay("k").shape[2])
    bias = a["bias"]
    # a quantized cache's codes are dequantized as they are loaded: through pointers
    tma = a["kv_quant"] is None and second is None and hd <= ROW_TILED_D and _tma_layout(
        [q] if cached else [q, c.lay("k"), c.lay("v")], hd if cached else None, c.node.dtype)
    mods = modifiers_of(a)     # the shorthand as library expressions; a T5 bias apart
    t5 = bias is not None and bias.fn == "t5"
    ctx: dict[str, Any] = dict(
        H=heads, KVH=kv_heads, G=heads // kv_heads, D=hd, BLOCK_D=max(16, next_pow2(hd)),
        deal=DECODE_DEAL, paged=None,
        q=by_sequence(c, "q", HEAD), k=kv["k"], v=kv["v"], cached=cached, L=length,
        L_host=length_host, dot_kw=c.dot_kw, t5=None, decode=cached or c.g.name == "decoder",
        tma=int(tma), elem_bytes=DTYPE_BYTES.get(c.node.dtype, 2),
        # bytes of a cached key's value: the codes of a quantized cache, else the model's dtype
        kv_bytes=1 if a["kv_quant"] is not None else DTYPE_BYTES.get(c.node.dtype, 2),
        kv_quant=None if a["kv_quant"] is None else dict(
            name=a["kv_quant"], scale_base=f"b * {kv_heads * max_len} + kv_h * {max_len}"),
        second=second, row_tiles=hd > ROW_TILED_D, value_tiles=hd > ROW_TILED_D,
        **_normalizer(mods, a["scale"], t5), **modifier_context(c, mods, a["ring"] is not None))
    if t5:
        table = c.lay("rel_table")
        thresholds = t5_thresholds(c.static(table.shape[0], "relative buckets"),
                                   bias.kw("bidirectional"), bias.kw("max_distance"))
        ctx["t5"] = dict(thresholds, stride_bucket=texpr(table.strides[0]),
                         stride_head=texpr(table.strides[1]))
    # arguments after q, k and v: the modifiers' operands, the past length
    ctx["more_params_"] = "".join(f"{a.param}, " for a in c.args[3:])
    ints = dict(B="i32", T="i32", S="i32")
    # what blocks.launch_config chooses the tiles and the load path by
    sizes = dict(D=hd, tma=int(tma), t5=int(ctx["t5"] is not None),
                 bytes=DTYPE_BYTES.get(c.node.dtype, 2))
    kernels = [JitKernel("_prefill", "attention", sizes, c.types(**ints))]
    if ctx["decode"]:
        kernels.append(JitKernel("_decode", "attention_decode", dict(
            D=hd, KVH=kv_heads, bytes=ctx["kv_bytes"]), dict(
            c.types(**ints), part_acc_ptr="*fp32", part_ml_ptr="*fp32", count_ptr="*i32",
            SPLITS="i32")))
    ctx.update(ring=None, ring_kv=None)
    if a["ring"] is not None:
        if hd > ROW_TILED_D:
            raise c.fail(f"ring attention over heads of {hd} (more than {ROW_TILED_D})")
        ctx.update(_ring(c, cached, kv_heads, hd))
        kernels.append(JitKernel("_ring", "attention_ring", {**sizes, "tma": 0}, {
            "out_ptr": triton_pointer(c.node.dtype), "acc_ptr": "*fp32",
            "ml_ptr": "*fp32", **{x.name: x.type for x in c.args}, "kpos_ptr": "*i64", **ints,
            "KEYS": "i32", "FIRST": "i32", "LAST": "i32"}))
    return ctx, kernels


def _second_score(c: NodeCtx, hd: int, max_len: int) -> dict[str, Any]:
    """What the attention template reads of a second score term q2·k2ᵀ over a cache of key
    rows [k ‖ k2] (W = D + D2 wide) whose first D columns are the values (latent attention,
    FlashMLA's layout): the cache as both the k and the v argument (the values load with the
    keys, once), q2's rows, and where k2 starts in a row."""
    a = c.attrs
    if a["cache_layer"] is None or a["ring"] is not None or a["paged"] is not None:
        raise c.fail("a second score term renders over the layer's cache of key rows only")
    d2 = c.static(c.lay("q2").shape[3], "the second term's head dim")
    width = hd + d2
    keys = _cache_arg(c, "k", "k", a["cache_layer"], a["kv_heads"], width)
    c.args[1:1] = [keys, replace(keys, param="v", comment="the values: the first "
                                 f"{hd} columns of the key rows")]
    return dict(D2=d2, BLOCK_D2=max(16, next_pow2(d2)), W=width,
                q2=by_sequence(c, "q2", HEAD))


def _host_view(c: NodeCtx, role: str) -> str:
    """The launcher's view of operand `role` at P = 0 (a ring step's): its root buffer (the
    launcher's parameter) through the operand's layout."""
    lay = c.lay(role)
    at = [pexpr(sympy.sympify(e).xreplace({P: 0})) for e in (*lay.shape, *lay.strides, lay.offset)]
    r = lay.rank
    return (f"{role}.as_strided(({', '.join(at[:r])},), ({', '.join(at[r:2 * r])},), "
            f"{role}.storage_offset() + {at[2 * r]})")


def _ring(c: NodeCtx, cached: bool, kv_heads: int, hd: int) -> dict[str, Any]:
    """What the ring kernel and its launcher read: the tensors of this rank's K/V block (host
    views of its own rows: k and v — codes and scales of a quantized cache — its positions and
    its keys' padding), each one's token dimension and filler, and the kernel's arguments with
    the block's tensors in place of the operands they stand for."""
    pos = c.lay("positions")
    if tuple(pos.strides) != (1,) or pos.offset != 0:
        raise c.fail("ring attention's positions must be a whole contiguous [T] tensor")
    names = {a.param for a in c.args}
    local, dims, fills, sub = [], [], [], {}
    for role in ("k", "v", "k_scale", "v_scale", "padding"):
        if role not in names:
            continue
        sub[role] = f"blk[{len(local)}]"
        if cached:      # the cache's first T rows: this rank's, written at P = 0
            local.append(f"{role}[:, :, :T]" if role != "padding" else _host_view(c, role))
        else:
            local.append(_host_view(c, role))
        dims.append("1" if role == "padding" else "2")
        fills.append("0")
    kpos = f"blk[{len(local)}]"
    local.append("positions")
    dims.append("0")
    fills.append("-1")
    what = ", ".join(r for r in ("k", "v", "k_scale", "v_scale", "padding") if r in sub)
    return dict(
        ring=dict(ranks=c.attrs["ring"], local=", ".join(local), dims=", ".join(dims),
                  fills=", ".join(fills), what=f"{what} and their positions", args=c.args,
                  call=", ".join([*(sub.get(a.param, a.param) for a in c.args), kpos])),
        ring_kv=dict(stride_t=str(hd)))


def _paged_attention(c: NodeCtx, heads: int, hd: int) -> tuple[dict[str, Any], list[JitKernel]]:
    """Attention over the layer's paged pool (``archc.passes.paged``): the `_paged` kernel, one
    program per (token, KV head), reading keys through the token's block table."""
    a = c.attrs
    kv_heads, layer, bs = a["kv_heads"], a["cache_layer"], a["paged"]
    c.args[1:1] = [_cache_arg(c, kind, kind, layer, kv_heads, hd, block_size=bs)
                   for kind in "kv"]
    table = c.lay("block_table")    # an input: a contiguous [T, blocks] buffer of its own
    mods = modifiers_of(a)
    ctx: dict[str, Any] = dict(
        H=heads, KVH=kv_heads, G=heads // kv_heads, D=hd, BLOCK_D=max(16, next_pow2(hd)),
        q=by_sequence(c, "q", HEAD), k={}, v={}, dot_kw=c.dot_kw, t5=None, tma=0,
        kv_quant=None, cached=True, decode=False, ring=None, ring_kv=None, second=None,
        row_tiles=False, value_tiles=False,
        paged=dict(block_size=bs, width=c.static(table.shape[1], "the block table's width"),
                   stride_block=kv_heads * bs * hd, stride_head=bs * hd),
        **_normalizer(mods, a["scale"], False), **modifier_context(c, mods))
    ctx["more_params_"] = "".join(f"{x.param}, " for x in c.args[3:])
    kernels = [JitKernel("_paged", "attention_paged", dict(D=hd),
                         c.types(B="i32", T="i32", S="i32"))]
    return ctx, kernels


# ---- the KV-cache write of a kernel's epilogue (fused_linear, norm) ----------------------------

def _kv_step(c: NodeCtx, st: Call, idx: int) -> dict[str, Any]:
    """What templates/steps.j2's kv_rows and kv_store read of a kv_write() or paged_kv_write()
    step (epilogue step `idx`)."""
    hd, kv_heads = st.kw("head_dim"), st.kw("kv_heads")
    # a paged cache's rows: a block of block_size rows per (block, KV head)
    paged = st.kw("block_size")
    max_len = c.opts.max_seq_len if paged is None else paged
    return dict(fn="kv_write", layer=st.kw("layer"), kv_heads=kv_heads, head_dim=hd,
                store_values=st.kw("values", True),
                k_start=st.kw("k_start"), v_start=st.kw("v_start"), width=kv_heads * hd,
                stride_b=kv_heads * max_len * hd, stride_h=max_len * hd, stride_l=hd,
                max_len=max_len, quant=st.kw("quant"), block_d=next_pow2(hd),
                qmax=repr(KV_CODES[st.kw("quant")].qmax) if st.kw("quant") else None,
                paged=None if paged is None else dict(
                    block_size=paged, pos_ptr=c.arg(f"pos{idx}").name,
                    table_ptr=c.arg(f"block_table{idx}").name,
                    width=c.static(c.lay(f"block_table{idx}").shape[1],
                                   "the block table's width")))


def _kv_args(c: NodeCtx, kv: dict[str, Any], cols_run: int) -> None:
    """The caches the step writes (and P, or the quantized cache's scales) as arguments, and how
    many columns land contiguously in the cache (`cols_run`: the lanes' own runs)."""
    run = math.gcd(cols_run, kv["head_dim"], kv["k_start"], kv["v_start"])
    kv["run"] = run & -run if run else 0
    if kv["quant"] is None:   # the store: templates/kv_write.py.j2
        c.helpers.append("kv_write")
    c.args += [_cache_arg(c, f"{kind}_cache", kind, kv["layer"], kv["kv_heads"],
                          kv["head_dim"], kv["quant"],
                          None if kv["paged"] is None else kv["paged"]["block_size"])
               for kind in ("kv" if kv["store_values"] else "k")]
    if kv["paged"] is None:   # a paged write finds each row's place from its position
        c.args.append(PAST)
    if kv["quant"] is not None:
        c.args += [_scale_arg(c, f"{kind}_scale", kind, kv["layer"], kv["kv_heads"])
                   for kind in "kv"]


def _kv_quant_kernel(c: NodeCtx, kv: dict[str, Any]) -> JitKernel:
    """The post-pass that makes a quantized cache's codes from the rows the kernel stored."""
    return JitKernel("_kvquant", "kv_quant", dict(D=kv["head_dim"]), c.types(
        [c.arg(n) for n in ("k_cache", "v_cache", "k_scale", "v_scale", "past")],
        M="i32", T="i32"))


# ---- fused_linear -----------------------------------------------------------------------------

def _rope_pair(st: Call, width: int, idx: int, c: NodeCtx) -> dict[str, Any]:
    """Rotary pairs over the first `heads` heads, then the remaining columns paired half their
    count apart; runs of pairs that map to contiguous, aligned columns (half-split only). Cos
    and sin come from the table [rows, 2, rotary_dim/2] (row-major, its rows and offset static);
    under dynamic NTK from the inverse frequencies, rescaled and turned into angles in the
    kernel."""
    heads, hd, rot = st.kw("heads"), st.kw("head_dim"), st.kw("rotary_dim")
    interleaved = st.kw("interleaved")
    tail = width - heads * hd
    tail_half = (tail + 1) // 2
    run = 0
    rot_start = st.kw("rotary_start", 0)   # the rotated dims of each head start here
    if not interleaved and tail % 2 == 0 and not rot_start:
        run = math.gcd(rot // 2, hd // 2 - rot // 2, heads * hd // 2, tail_half)
        run = run & -run  # the largest power of two dividing it
    dynamic, table = st.kw("dynamic"), None
    if dynamic is not None and dynamic.fn == "ntk":  # θ_j·s^(−2j/(d−2)), s from the length
        factor = dynamic.kw("factor")
        dynamic = dict(factor=repr(factor), factor_less_one=repr(factor - 1.0),
                       original=repr(float(dynamic.kw("original_max_seq_len"))),
                       step=repr(2.0 / (rot - 2)))
    else:
        lay = c.lay(f"rotation{idx}")
        if tuple(lay.strides) != (rot, rot // 2, 1) or not sympy.sympify(lay.offset).is_Integer:
            raise c.fail("the RoPE cos/sin table must be a row-major [rows, 2, "
                         f"{rot // 2}] buffer at a static offset")
        table = dict(rows=c.static(lay.shape[0], "the RoPE table's rows"),
                     base=f"{int(lay.offset)} + " if int(lay.offset) else "", long=None)
        if dynamic is not None:   # LongRoPE: the short table, then the long one
            table["long"] = dict(original=int(dynamic.kw("original_max_seq_len")),
                                 half=table["rows"] // 2)
            dynamic = None
    return dict(fn="rope", heads=heads, head_dim=hd, per_head=hd // 2, run=run,
                rot_start=rot_start, passthrough=False,
                rot_pairs=rot // 2, interleaved=interleaved, tail=tail, tail_half=tail_half,
                NP=heads * hd // 2 + tail_half, dynamic=dynamic, table=table,
                pos_ptr=c.arg(f"pos{idx}").name, rotation_ptr=c.arg(f"rotation{idx}").name)


def tma_rows(lay: Layout, elem: int, named: Named | None = None) -> dict[str, str] | None:
    """A 2-D tensor descriptor over the rows of `lay` — [rows, columns] with contiguous columns,
    the leading dims one row index of static stride, base and stride 16-byte aligned — as its
    static element offset and row stride (by its constexpr name where `named` holds it); None
    when the layout cannot be one (a column-strided view, a row stride or start that breaks the
    alignment: the pointer path reads it)."""
    if lay.rank < 2 or lay.strides[-1] != 1 or not lay.contiguous_rows:
        return None
    stride, offset = sympy.sympify(lay.strides[-2]), sympy.sympify(lay.offset)
    if not (stride.is_Integer and offset.is_Integer) or int(stride) <= 0:
        return None
    if (int(stride) * elem) % TMA_ALIGN or (int(offset) * elem) % TMA_ALIGN:
        return None
    return dict(offset=f" + {int(offset)}" if int(offset) else "",
                stride=texpr((named or {}).get(int(stride), stride)))


def _matmul(c: NodeCtx) -> tuple[dict[str, Any], list[JitKernel]]:
    a = c.attrs
    names = ["x1", "x2"] if a["concat_k"] else ["x"]
    w = c.lay("weight")
    if w.rank != 2 or w.strides[1] != 1 or not sympy.sympify(w.offset).is_Integer:
        raise c.fail("the weight must be a row-major [N, K] matrix at a static offset")
    n_rows, k_total = c.static(w.shape[0], "the weight's N"), c.static(w.shape[1], "the K")
    # N and K are constexpr parameters (JitKernel.static): the kernel's text names them wherever
    # a stride or extent is one of them, so projections that differ only there share a kernel
    c.dim_names["weight"] = {-2: "N", -1: "K"}
    # one operand: its K is the kernel's K (concatenated operands' own Ks stay numbers)
    named_k = {k_total: K_SIZE} if len(names) == 1 else {}
    operands, k0 = [], 0
    for name in names:
        lay = c.lay(name)
        kj = c.static(lay.shape[-1], f"{name}'s K")
        k_text = "K" if named_k else str(kj)
        if named_k:
            c.dim_names[name] = {-1: "K"}
        base = int(w.offset) + k0   # where this operand's K columns start in the weight's rows
        r = rows(lay, named_k)
        operands.append(dict(name=name, ptr=c.arg(name).name, K=kj, k0=k0, k_text=k_text,
                             row_off=r["row_off"], comment=f"{name} [M, {k_text}]",
                             w_base=f"{base} + " if base else "", k_mul=r["col_mul"],
                             tma=tma_rows(lay, DTYPE_BYTES[c.g.nodes[lay.root].dtype], named_k)))
        k0 += kj
    width, pair, kv = n_rows, None, None
    steps_pre: list[dict[str, Any]] = []
    steps_post: list[dict[str, Any]] = []
    head_norms = []
    for idx, st in enumerate(a["epilogue"]):
        target = steps_post if pair is not None else steps_pre
        if st.fn in ("rms_scale", "ln_scale"):
            target.append(dict(fn=st.fn, ptr=c.arg(f"colsum{idx}").name
                               if st.fn == "ln_scale" else ""))
        elif STEPS[st.fn].elementwise:
            # the step's inputs: rows or vectors of the width so far, N (or N // 2 after GLU)
            named = {width: N_SIZE if width == n_rows else sympy.floor(N_SIZE / 2)}
            target.append(elementwise_step(c, st, idx, width, named))
            for role in (f"{name}{idx}" for name in STEPS[st.fn].inputs):
                if c.lay(role).shape[-1] == width:
                    c.dim_names[role] = {-1: "N" if width == n_rows else "N // 2"}
        elif st.fn in ("kv_write", "paged_kv_write"):
            if kv is not None:
                raise c.fail("more than one kv_write() step")
            kv = _kv_step(c, st, idx)
            if kv["quant"] is not None and idx != len(a["epilogue"]) - 1:
                # the codes are made from the stored rows (see _kvquant in matmul.py.j2)
                raise c.fail("a quantized KV cache is written from the projection's stored "
                             "rows: kv_write() must be the epilogue's last step")
            target.append(kv)
        elif st.fn == "head_norm":
            hn = dict(fn="head_norm", kind=st.kw("kind"), heads=st.kw("heads"),
                      head_dim=st.kw("head_dim"), eps=repr(st.kw("eps")),
                      gain_ptr=c.arg(f"gain{idx}").name, shift_ptr=c.arg(f"shift{idx}").name)
            target.append(hn)
            head_norms.append(hn)
        elif pair is not None:
            raise c.fail(f"{st.fn}() after {pair['fn']}(): one pairing step per kernel")
        elif st.fn == "glu":
            pair = dict(fn="glu", act=st.kw("fn"), NP=width // 2)
            width //= 2
        else:
            pair = _rope_pair(st, width, idx, c)
    if a["paired"]:   # the weight rows are paired-adjacent: one accumulator, split in registers
        if pair is None:
            raise c.fail("paired weight rows need a glu() or rope() step")
        pair["adjacent"] = True
    elif pair is not None:
        pair["adjacent"] = False
    if kv is not None:   # how many columns land contiguously in the cache
        _kv_args(c, kv, pair["run"] if pair is not None and pair["fn"] == "rope" else 1 << 16)
    # Tiles hold whole heads. A power-of-two head is a reshape of the tile; any other size
    # (phi-2's 80) makes the tiles head-aligned: each covers ⌊TILE_N / group⌋ whole heads and
    # masks its last lanes, and the per-head sums are taken head by head.
    align, head_group = 16, None
    for hn in head_norms:
        hd = hn["head_dim"]
        align = max(align, next_pow2(hd))
        if pair is None:
            hn["group"] = hd
        elif pair["fn"] == "rope" and pair["head_dim"] == hd and hn["heads"] <= pair["heads"]:
            hn["group"] = hd // 2   # a head's pairs: half its columns in each accumulator
        else:
            raise c.fail("head_norm() needs its heads to be the rotated heads of rope() (same "
                         "head_dim), and no glu()")
        if hn["group"] & (hn["group"] - 1):
            if head_group not in (None, hn["group"]):
                raise c.fail(f"head_norm() steps over heads of {head_group} and {hn['group']} "
                             "columns: head-aligned tiles take one head size")
            head_group = hn["group"]
    for hn in head_norms:
        hn["pow2"] = head_group is None
    one = [dict(acc="acc", cols="cols", ok="col_ok")]
    # an odd RoPE tail's last pair has no partner: under paired-adjacent rows its second column
    # is past the weight (ok2 masks it)
    ok2 = "ok2" if pair is not None and pair["adjacent"] and pair.get("tail", 0) % 2 else "col_ok"
    accs_pre = one if pair is None else [dict(acc="acc1", cols="cols1", ok="col_ok"),
                                         dict(acc="acc2", cols="cols2", ok=ok2)]
    accs_post = one if pair is not None and pair["fn"] == "glu" else accs_pre
    layer_norm = int(a["prologue"] == "layer")
    # TMA (tensor descriptors) for the K loop's tiles where every operand's rows and the
    # weight's allow one and a tile's weight rows are contiguous (not two gathered partner sets)
    w_dtype = c.g.nodes[w.root].dtype
    # a quantized weight's tiles are dequantized from its parts: pointer loads, never TMA
    w_tma = None if is_quantized(w_dtype) else tma_rows(w, DTYPE_BYTES[w_dtype],
                                                        {k_total: K_SIZE})
    gain = None
    if a["gain"]:   # x · gain[k] as it is read: a contiguous [K] vector
        contiguous(c, "gain", k_total)
        gain = c.arg("gain").name
    tma = w_tma is not None and all(x["tma"] is not None for x in operands) and (
        pair is None or pair["adjacent"])
    # programmatic dependent launch: a weight that is a parameter (no kernel writes it) starts
    # loading its first tiles before the wait for the previous kernel (templates/kloop.j2)
    early = c.g.nodes[w.root].op == Op.PARAM
    loop = _k_loop(c, w, n_rows, k_total, ("cols",) if pair is None else ("wrows",)
                   if pair["adjacent"] else ("cols1", "cols2"))
    if loop["w_row_stride"] == str(k_total):
        loop["w_row_stride"] = "K"
    # the output's width and the columns (or pairs) the tiles cover, as the kernel names them
    out_n = "N" if width == n_rows else "(N // 2)"
    cols_n = "N" if pair is None else "N // 2" if pair["fn"] == "glu" else str(pair["NP"])
    ctx = dict(operands=operands, n_out=width, out_n=out_n, cols_n=cols_n,
               prologue=a["prologue"], eps=repr(a["eps"]), early=early,
               epilogue_doc=", ".join(f"{st.fn}()" for st in a["epilogue"]),
               pair=pair, steps_pre=steps_pre, steps_post=steps_post, accs_pre=accs_pre,
               accs_post=accs_post, kv=kv, needs_t=kv is not None or (
                   pair is not None and pair["fn"] == "rope"),
               M=pexpr(numel(c.node.shape[:-1])), align=align, has_head_norm=int(
                   bool(head_norms)), head_group=head_group, layer_norm=layer_norm, tma=tma,
               w_tma=w_tma, gain=gain, **loop)
    # (a tile's TILE_N lanes cover output columns, or ⌈N / 2⌉ pairs of a paired epilogue:
    # blocks.tile_columns); operands: K loops over more than one concatenated input do not split
    sizes = dict(N=n_rows, K=k_total,
                 paired=int(pair is not None), adjacent=int(bool(pair and pair["adjacent"])),
                 rope=int(pair is not None and pair["fn"] == "rope"),
                 align=align, head_norm=int(bool(head_norms)),
                 layer_norm=layer_norm, operands=len(operands))
    if is_quantized(w_dtype):   # the code width: no TMA, and a different kernel per scheme
        sizes["quant"] = scheme(w_dtype).bits
    ints = dict(M="i32", T="i32", **({"S": "i32"} if c.reads_encoder_len else {}))
    stats = {"stats_ptr": "*fp32"} if a["prologue"] else {}
    kernels = [JitKernel("_kernel", "matmul", sizes,
                         c.types(part_ptr="*fp32", count_ptr="*i32", **stats, **ints),
                         static=dict(N=n_rows, K=k_total))]
    if kv is not None and kv["quant"] is not None:   # the quantized cache rows' post-pass
        kernels.append(_kv_quant_kernel(c, kv))
    if a["prologue"]:   # the row statistics' pre-pass (prefill)
        x = c.arg(names[0])
        kernels.append(JitKernel("_rowstats", "matmul_rowstats", dict(K=k_total),
                                 {x.name: x.type, "stats_ptr": "*fp32", **ints},
                                 static=dict(K=k_total)))
    return ctx, kernels


# ---- head_linear ------------------------------------------------------------------------------

TOKEN = sympy.Symbol("t", integer=True, nonnegative=True)   # a token's index in its sequence


def _head_linear(c: NodeCtx) -> tuple[dict[str, Any], list[JitKernel]]:
    x = c.lay("x")
    if x.rank != 4:
        raise c.fail("x must be a [B, H, T, K] head view")
    heads, k = c.static(x.shape[1], "the heads"), c.static(x.shape[3], "the K")
    n = c.static(c.lay("weight").shape[1], "the N")
    contiguous(c, "weight", heads, n, k)
    sb, sh, st, sk = x.strides
    x_row = x.offset + BATCH * sb + HEAD * sh + TOKEN * st
    ctx = dict(H=heads, N=n, K=k, merged=c.attrs["merged"], dot_kw=c.dot_kw,
               x_row=texpr(x_row), x_col_mul="" if sk == 1 else f" * {texpr(sk)}")
    return ctx, [JitKernel("_kernel", "head_linear", dict(N=n, K=k),
                           c.types(B="i32", T="i32"))]


CONTEXTS: dict[str, Callable[[NodeCtx], tuple[dict[str, Any], list[JitKernel]]]] = {
    "matmul": _matmul, "attention": _attention, "norm": _norm, "pointwise": _pointwise,
    "embedding": _embedding, "moe": _moe, "causal_conv": _causal_conv, "ssm_scan": _ssm_scan,
    "linear_attention": _linear_attention, "delta_rule": _delta_rule, "head_linear": _head_linear,
}
