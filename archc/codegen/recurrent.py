"""Builders of the recurrent kernels: causal_conv, ssm_scan and linear_attention.

Each reads its node's inputs through their layouts (the conv input and the gate z are column
slices of Mamba's in_proj, B and C of its x_proj, q, k and v head views of a QKV projection),
checks every size and literal it prints, and names the layer state the kernel updates in place:
``d.state(layer, kind)`` at launch, allocated by the runtime from the op table's ``StateDecl``s
(``c.extras["state"]``) and zeroed when a sequence starts. Registered in ``kernels.BUILDERS``.
"""

from __future__ import annotations

from typing import Any

import sympy

from archc.codegen.blocks import next_pow2
from archc.codegen.kernels import JitKernel, NodeCtx, Unit, lit_act, lit_float, lit_int, static
from archc.codegen.layout import Layout
from archc.codegen.printer import texpr
from archc.ir.cost import node_states
from archc.ir.ops.linear_attention import FEATURE_MAPS
from archc.ir.shapes import B

# Index symbols the kernels define: the sequence, the query head, the KV head; and the dynamic
# dim they take as an argument.
BATCH, HEAD, KV_HEAD = (sympy.Symbol(s, integer=True, nonnegative=True) for s in ("b", "h", "kv_h"))
KERNEL_DIMS = frozenset({"b", "h", "kv_h", "T"})


def _device(c: NodeCtx, e: sympy.Expr, what: str) -> str:
    """An index expression as device code, over only the names the recurrent kernels have."""
    e = sympy.sympify(e)
    extra = sorted(str(s) for s in e.free_symbols if str(s) not in KERNEL_DIMS)
    if extra:
        raise c.fail(f"{what} is {e}, which needs {', '.join(extra)}: the kernel knows only the "
                     "sequence, the head and T")
    return texpr(e)


def _rows(c: NodeCtx, k: int, what: str) -> dict[str, str]:
    """A [B, T, W] input read as rows of contiguous columns: the start of sequence b's rows and
    the stride from one token to the next."""
    lay: Layout = c.lay(k)
    if lay.rank != 3 or lay.strides[2] != 1:
        raise c.fail(f"{what} must be [B, T, W] with contiguous columns")
    return dict(batch=_device(c, lay.offset + BATCH * lay.strides[0], f"{what}'s offset"),
                stride_t=_device(c, lay.strides[1], f"{what}'s token stride"))


def _heads(c: NodeCtx, k: int, head: sympy.Symbol, what: str) -> dict[str, str]:
    """A [B, H, T, D] head view: the start of head `head` of sequence b, and the token stride."""
    lay: Layout = c.lay(k)
    if lay.rank != 4 or lay.strides[3] != 1:
        raise c.fail(f"{what} must be [B, H, T, D] with contiguous head dims")
    base = lay.offset + BATCH * lay.strides[0] + head * lay.strides[1]
    return dict(base=_device(c, base, f"{what}'s offset"),
                stride_t=_device(c, lay.strides[2], f"{what}'s token stride"))


def _vector(c: NodeCtx, k: int, n: int, what: str) -> None:
    lay = c.lay(k)
    if lay.rank != 1 or lay.strides[0] != 1 or lay.offset != 0 or \
            static(c, lay.shape[0], what) != n:
        raise c.fail(f"{what} must be a contiguous [{n}] vector")


def _matrix(c: NodeCtx, k: int, rows: int, cols: int, what: str) -> None:
    lay = c.lay(k)
    if lay.rank != 2 or lay.offset != 0 or [static(c, d, what) for d in lay.shape] != [rows, cols] \
            or lay.strides != (sympy.Integer(cols), sympy.Integer(1)):
        raise c.fail(f"{what} must be a contiguous [{rows}, {cols}] matrix")


def _layer(c: NodeCtx) -> int:
    layer = lit_int(c, c.node.attr("layer"), "layer")
    if layer < 0:
        raise c.fail(f"layer must be ≥ 0, got {layer}")
    return layer


def _states(c: NodeCtx, layer: int) -> dict[str, str]:
    """The state tensors the op declares, recorded for the runtime to allocate: kind → the
    launch expression of that tensor."""
    decls = node_states(c.g, c.i)
    calls = {}
    for decl in decls:
        if decl.kind not in ("conv", "ssm", "S", "z"):
            raise c.fail(f"unknown state {decl.kind!r}")
        if sympy.sympify(decl.shape[0]) != B:
            raise c.fail(f"the {decl.kind} state {list(decl.shape)} does not lead with B")
        tail = tuple(static(c, d, f"the {decl.kind} state's size") for d in decl.shape[1:])
        c.extras.setdefault("state", []).append((layer, decl.kind, tail, decl.dtype))
        calls[decl.kind] = f'd.state({layer}, "{decl.kind}")'
    return calls


def _types(c: NodeCtx, names: list[str], *, state: dict[str, str]) -> dict[str, str]:
    """Argument types for AOT compiles: the output, each input's root buffer, the states, T."""
    types = {"out_ptr": c.out_type()}
    for k, name in enumerate(names):
        types[f"{name}_ptr"] = c.ptr_type(k)
    for kind in state:
        dtype = "*fp32" if kind != "conv" else c.out_type()
        types[{"conv": "state_ptr", "ssm": "state_ptr", "S": "s_ptr", "z": "z_ptr"}[kind]] = dtype
    types["T"] = "i32"
    return types


def _unit(c: NodeCtx, family: str, names: list[str], ctx: dict[str, Any],
          sizes: dict[str, int]) -> Unit:
    """A recurrent kernel's unit, rendered from `<family>.py.j2`: launched with the output, each
    input's buffer (`names`, in input order), then the layer's states in the op's order."""
    state = _states(c, _layer(c))
    call = ", ".join([f"v[{c.i}]"] + [c.ref(k) for k in range(len(names))] + list(state.values()))
    kernel = JitKernel("_kernel", family, sizes, _types(c, names, state=state))
    return Unit(family, f"{family}.py.j2", ctx, [kernel], call)


# ---- causal_conv -----------------------------------------------------------------------------

def build_causal_conv(c: NodeCtx) -> Unit:
    n, a = c.node, c.attrs
    bias = a.get("bias")
    if not isinstance(bias, bool):
        raise c.fail(f"bias must be true or false, got {bias!r}")
    if len(n.inputs) != 2 + bias:
        raise c.fail(f"causal_conv with bias={bias} takes {2 + bias} inputs")
    channels = static(c, n.shape[-1], "the channel count")
    width = static(c, c.lay(1).shape[1], "the filter width")
    if width < 2:
        raise c.fail(f"the filter width must be ≥ 2, got {width}")
    _matrix(c, 1, channels, width, "the filter")
    if bias:
        _vector(c, 2, channels, "the bias")
    names = ["x", "w"] + (["bias"] if bias else [])
    ctx: dict[str, Any] = dict(C=channels, K=width, bias=bias, act_fn=lit_act(c, a.get("act")),
                               x=_rows(c, 0, "the input"))
    return _unit(c, "causal_conv", names, ctx, dict(C=channels, K=width))


# ---- ssm_scan --------------------------------------------------------------------------------

def build_ssm_scan(c: NodeCtx) -> Unit:
    n, a = c.node, c.attrs
    eps = a["norm_eps"]
    norm, gate = eps is not None, a["gate"]
    slot = c.roles
    names = [{"A": "a", "B": "bm", "C": "cm", "D": "d", "B_gain": "b_gain",
              "C_gain": "c_gain"}.get(r, r) for r in slot]
    channels = static(c, n.shape[-1], "the channel count")
    states = static(c, c.lay(2).shape[1], "d_state")
    _matrix(c, 2, channels, states, "A")
    if gate:
        _vector(c, slot["D"], channels, "D")
    if norm:
        _vector(c, slot["B_gain"], states, "the B norm's gain")
        _vector(c, slot["C_gain"], states, "the C norm's gain")
    ctx: dict[str, Any] = dict(C=channels, N=states, norm=norm, gate=gate,
                               eps=lit_float(c, eps, "norm_eps") if norm else "")
    for role, name in (("x", "x"), ("dt", "dt"), ("B", "bm"), ("C", "cm"), ("z", "z")):
        if role in slot:
            ctx[name] = _rows(c, slot[role], name)
    return _unit(c, "ssm_scan", names, ctx, dict(C=channels, N=states))


# ---- linear_attention ------------------------------------------------------------------------

def build_linear_attention(c: NodeCtx) -> Unit:
    a = c.attrs
    feature = a.get("feature")
    if feature not in FEATURE_MAPS:
        raise c.fail(f"unknown feature map {feature!r} (known: {', '.join(FEATURE_MAPS)})")
    q_lay, k_lay, v_lay = c.lay(0), c.lay(1), c.lay(2)
    heads = static(c, q_lay.shape[1], "query heads")
    kv_heads = static(c, k_lay.shape[1], "KV heads")
    hd = static(c, q_lay.shape[3], "head_dim")
    dv = static(c, v_lay.shape[3], "the value head dim")
    if heads % kv_heads or static(c, v_lay.shape[1], "value heads") != kv_heads or \
            static(c, k_lay.shape[3], "the key head dim") != hd:
        raise c.fail(f"{heads} query heads of {hd} over {kv_heads} KV heads: q, k and v do not "
                     "line up")
    ctx: dict[str, Any] = dict(
        H=heads, KVH=kv_heads, G=heads // kv_heads, D=hd, DV=dv,
        BLOCK_D=max(16, next_pow2(hd)), BLOCK_DV=max(16, next_pow2(dv)), feature=feature,
        q=_heads(c, 0, HEAD, "q"), k=_heads(c, 1, KV_HEAD, "k"), v=_heads(c, 2, KV_HEAD, "v"),
        dot_kw=c.dot_kw)
    return _unit(c, "linear_attention", ["q", "k", "v"], ctx, dict(D=hd, DV=dv))
