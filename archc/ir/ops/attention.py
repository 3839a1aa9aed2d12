"""Attention as lowering emits it — rotary positions, the KV cache, GQA head repetition, scores,
ALiBi, T5 relative bias, masks, the value sum — and the flash `attention` kernel passes make.

Positions come from shapes: scores are [B, H, T, L] for T new queries over L keys, and query row
i sits at position L − T + i (P over the cache; an encoder has L = T).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import sympy
import torch
import torch.nn.functional as F

from archc.dtypes import KV_CODES
from archc.errors import ArchcError
from archc.ir.attrs import Attr, Attrs, Call, Expression
from archc.ir.modifiers import SOFTMAX, Expr, attend, builtin, evaluate, leaves, var
from archc.ir.modifiers.normalizers import MASKED, ONLINE, State
from archc.ir.ops.base import (
    LAYER,
    Args,
    EagerCtx,
    Op,
    OpDef,
    Sig,
    float_dtype,
    operands,
    per_element,
    register,
    require,
    same_dim,
)
from archc.ir.ops.modifiers import (
    MASK_ATTRS,
    NORMALIZER,
    T5,
    check_mask,
    check_modifiers,
    eager_values,
    modifier_roles,
    modifiers_of,
    query_key_positions,
    t5_bias,
    t5_buckets,  # noqa: F401  (read here by codegen's T5 thresholds)
)
from archc.ir.shapes import DTYPE_BYTES, P, Shape, numel

# ---- rotary positions ----------------------------------------------------------------------

def rope_table_rows(pos: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (T, R/2) of the table rows at `pos`. Sessions refuse sequences longer than
    the table before they run (``SessionBase``); a bounds check here would read the positions
    back to the host at every call, and stop torch.compile's graph in the PyTorch baseline
    that runs these semantics. Torch's own indexing still refuses a row past the table."""
    rows = table[pos.to(table.device)]              # (T, 2, R/2)
    return rows[:, 0], rows[:, 1]


def rope(x: torch.Tensor, pos: torch.Tensor, rotation: torch.Tensor, rotary_dim: int,
         interleaved: bool, dynamic: Call | None = None) -> torch.Tensor:
    """Rotate the first `rotary_dim` dims of each head by pos·θ_j (Su et al. 2021), pairing dim j
    with j + rotary_dim/2 (GPT-NeoX, Llama) or, interleaved, 2j with 2j + 1 (GPT-J); the rest
    pass through (partial rotary).

    `rotation` is the cos/sin table [max_seq_len, 2, R/2] computed at load (``rope_cos_sin``,
    any attention scale already in it): the rows at `pos` are gathered. With `dynamic` the
    frequencies depend on the sequence length, so `rotation` is the inverse frequencies [R/2]
    and the angles are computed here. `dynamic`, ntk(factor, original_max_seq_len), is
    transformers' rope_type "dynamic": with L the sequence length after this call, past the
    trained context the base grows to base·s^(d/(d−2)), s = factor·L/original − (factor − 1),
    so θ_j = base^(−2j/d) becomes θ_j·s^(−2j/(d−2)); up to it s = 1. `dynamic`
    longrope(original_max_seq_len) is transformers' rope_type "longrope": `rotation` holds two
    tables one after the other (short factors, then long), and a call whose sequence length
    passes original_max_seq_len reads the long one. Keys cached earlier keep the rotation they
    had."""
    if dynamic is None:
        cos, sin = rope_table_rows(pos, rotation)
    elif dynamic.fn == "longrope":
        cos, sin = rope_table_rows(longrope_rows(pos, rotation, dynamic), rotation)
    else:
        inv_freq = rotation
        if pos.numel():
            factor, original = dynamic.kw("factor"), dynamic.kw("original_max_seq_len")
            length = pos[-1].to(inv_freq.device, torch.float64) + 1
            s = torch.clamp(factor * length / original - (factor - 1), min=1.0)
            j = torch.arange(inv_freq.shape[0], dtype=torch.float64, device=inv_freq.device)
            inv_freq = (inv_freq.double() * s ** (-2 * j / (rotary_dim - 2))).float()
        angles = pos.to(torch.float32)[:, None] * inv_freq.float()[None, :]  # (T, R/2)
        cos, sin = angles.cos(), angles.sin()
    rot, rest = x[..., :rotary_dim].float(), x[..., rotary_dim:]
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)
    else:
        x1, x2 = rot[..., :rotary_dim // 2], rot[..., rotary_dim // 2:]
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return torch.cat([out.to(x.dtype), rest], dim=-1)


def longrope_rows(pos: torch.Tensor, table: torch.Tensor, dynamic: Call) -> torch.Tensor:
    """The rows of LongRoPE's two tables that positions `pos` of one call read: their own in the
    short table, or, once the call's sequence length (last position + 1) passes
    original_max_seq_len, in the long table after it."""
    if not pos.numel():
        return pos
    long = pos[-1] + 1 > dynamic.kw("original_max_seq_len")
    return pos + long.to(pos.dtype) * (table.shape[0] // 2)


NTK = (Attr("factor", float, at_least=1.0), Attr("original_max_seq_len", int, at_least=1))
LONGROPE = (Attr("original_max_seq_len", int, at_least=1),)
ROPE_ATTRS = (Attr("rotary_dim", int, at_least=2), Attr("interleaved", bool),
              Attr("dynamic", Call, None, {"ntk": NTK, "longrope": LONGROPE}))
ROTATION_DOC = ("cos/sin table (row p: cos, then sin, of p·θ_j), or with `dynamic` inverse "
                "frequencies")


def check_rope(rot: int, head_dim: sympy.Expr, tokens: sympy.Expr, pos: Shape, rotation: Shape,
               rotation_dtype: str, dynamic: Call | None) -> None:
    """What the rope op and the rope epilogue step both require of their operands: the table
    [rows, 2, rotary_dim/2] (rows = max_seq_len, static), or under dynamic NTK the frequencies
    [rotary_dim/2], in f32."""
    require(len(pos) == 1 and same_dim(pos[0], tokens), f"positions {list(pos)} must be [{tokens}]")
    require(rot % 2 == 0 and rot <= int(head_dim), f"rotary_dim={rot} for head dim {head_dim}")
    require(rotation_dtype == "f32", f"the RoPE rotation operand must be f32, got "
            f"{rotation_dtype}")
    if dynamic is None or dynamic.fn == "longrope":
        require(len(rotation) == 3 and rotation[0].is_Integer and int(rotation[0]) >= 1 and
                int(rotation[1]) == 2 and int(rotation[2]) == rot // 2,
                f"cos/sin table {list(rotation)} must be [max_seq_len, 2, {rot // 2}] for "
                f"rotary_dim={rot}")
    else:
        require(len(rotation) == 1 and int(rotation[0]) == rot // 2,
                f"frequencies {list(rotation)} do not match rotary_dim={rot}")
        require(rot >= 4, f"dynamic NTK needs ≥ 4 rotary dims, got {rot}")


def _rope_infer(sig: Sig) -> tuple[Shape, str]:
    x, pos, rotation = sig.shapes
    require(len(x) == 4, f"rope takes [B, H, T, D], got {list(x)}")
    require(sig.dtypes[1] == "i64", f"positions must be i64, got {sig.dtypes[1]}")
    check_rope(sig.attr("rotary_dim"), x[3], x[2], pos, rotation, sig.dtypes[2],
               sig.attr("dynamic"))
    return x, float_dtype(sig)


def rotation_bytes(pos: Shape, rotation: Shape, dynamic: Call | None) -> sympy.Expr:
    """Bytes a rope reads of its rotation operand (f32): of the cos/sin table only the rows at
    its positions, not the max_seq_len rows (LongRoPE: of one of its two tables); under
    dynamic NTK all the frequencies."""
    return (numel(rotation) if dynamic is not None and dynamic.fn == "ntk" else
            numel(pos) * numel(rotation[1:])) * DTYPE_BYTES["f32"]


def _rope_bytes(sig: Sig) -> sympy.Expr:
    # x in, the result out, the positions, and what it reads of the rotation operand
    x, pos, rotation = sig.shapes
    return (2 * numel(x) * DTYPE_BYTES[sig.dtypes[0]] + numel(pos) * DTYPE_BYTES[sig.dtypes[1]]
            + rotation_bytes(pos, rotation, sig.attr("dynamic")))


register(OpDef(
    Op.ROPE, "Rotary position embedding of q or k at the given positions, cos and sin read "
    "from the table computed at load; with `dynamic`, frequencies rescaled from the sequence "
    "length (dynamic NTK) and the angles computed.",
    "%12 : f32[B,4,T,16] = rope(%11, %1, %2) {interleaved=false, rotary_dim=16}",
    operands("x", "positions", "rotation"), _rope_infer,
    lambda ctx, a, at: rope(a["x"], a["positions"], a["rotation"], at["rotary_dim"],
                            at["interleaved"], at["dynamic"]),
    attrs=ROPE_ATTRS, flops=per_element(3), bytes=_rope_bytes, arity=(3, 3),
    docs={"x": "q or k, [B, H, T, D]", "positions": "positions, [T]",
          "rotation": ROTATION_DOC}))


# ---- KV cache and GQA ----------------------------------------------------------------------

# How a quantized KV cache stores a row (one token of one KV head, head_dim values): codes of
# this torch dtype and one f32 scale = max|x|/QMAX over the row, so a value reads back as
# code·scale. f32, not f16, for the scale: it costs 2 more bytes per row (≈3% of a 64-wide int8
# row) and the kernels and the interpreter then compute the same scale bit for bit, with no
# second rounding and no f16 overflow or underflow for rows near 0. fp8 e4m3 gets a scale too:
# its largest value is 448, and a key row above that would saturate without one. The code
# dtypes and QMAX: ``archc.dtypes.KV_CODES``.
KV_SCALE_BYTES = 4
# what a KV cache holds per layer: keys and values, or latent attention's latent and RoPE key
KV_KINDS = ("k", "v", "latent", "k_rope")
KV_QUANT_ATTR = Attr("quant", str, None, choices=tuple(KV_CODES))


def kv_row_bytes(head_dim: int | sympy.Expr, dtype: str, quant: str | None) -> sympy.Expr:
    """Bytes one cached row (one token, one KV head) takes: head_dim values in `dtype`, or
    head_dim one-byte codes and an f32 scale."""
    if quant is None:
        return head_dim * DTYPE_BYTES[dtype]
    return head_dim * 1 + KV_SCALE_BYTES


def kv_quantize(x: torch.Tensor, quant: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes [..., D] and f32 scales [...] of rows x [..., D]: scale = max|x|/QMAX over the row;
    int8 codes round half up, floor(x/scale + 0.5) (what the kernels compute); fp8 codes are
    x/scale cast to e4m3 (round to nearest even). A row of zeros has scale 0 and codes 0."""
    dtype, qmax = KV_CODES[quant].torch, KV_CODES[quant].qmax
    if dtype is None:
        raise ArchcError(f"this torch ({torch.__version__}) has no float8_e4m3fn for an fp8 "
                         "KV cache; use int8")
    xf = x.float()
    scale = xf.abs().amax(-1) / qmax
    q = xf / torch.where(scale > 0, scale, 1.0)[..., None]
    if quant == "int8":
        return torch.floor(q + 0.5).clamp(-qmax, qmax).to(dtype), scale
    return q.clamp(-qmax, qmax).to(dtype), scale


def kv_dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows code·scale in `dtype`, as an attention kernel reads them from a quantized cache."""
    return (codes.float() * scale[..., None]).to(dtype)


def _kv_infer(sig: Sig) -> tuple[Shape, str]:
    x = sig.shape("x")
    require(len(x) == 4, f"kv_cache takes [B, H, T, D], got {list(x)}")
    if sig.attr("paged") is not None:
        require(sig.attr("quant") is None, "a paged KV cache holds the model dtype (no quant)")
        check_paged(sig, x[2])
        return x, float_dtype(sig)       # the rows it wrote: attention reads the pool itself
    return (x[0], x[1], P + x[2], x[3]), float_dtype(sig)


# ---- the paged KV cache ------------------------------------------------------------------------
#
# A paged cache (``archc.passes.paged``) keeps each layer's k and v in one pool of fixed-size
# blocks, [blocks, H_kv, block_size, D]; a sequence owns a list of blocks, its block table. The
# T rows of a paged step are tokens, each of its own sequence and at its own position: a
# prefill's T are one sequence's prompt, a decode step's T are one token of each of T sequences.
# Token t at position p lives in block block_table[t, p // block_size], at offset
# p % block_size, and attends to the keys of its sequence at positions 0 … p.

PAGED_ATTR = Attr("paged", int, None, at_least=1)


def check_paged(sig: Sig, tokens: sympy.Expr) -> None:
    """A paged node's operands: positions i64[T] and the block table i32[T, blocks]."""
    pos, table = sig.shape("positions"), sig.shape("block_table")
    require(len(pos) == 1 and same_dim(pos[0], tokens) and sig.dtype("positions") == "i64",
            f"paged positions must be i64[{tokens}], got {sig.dtype('positions')}{list(pos)}")
    require(len(table) == 2 and same_dim(table[0], tokens) and table[1].is_Integer and
            sig.dtype("block_table") == "i32",
            f"the block table must be i32[{tokens}, blocks] (blocks static), got "
            f"{sig.dtype('block_table')}{list(table)}")


def paged_slots(positions: torch.Tensor, table: torch.Tensor, block_size: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The (block, offset) in the pool of each token t at positions[t] — [T] each."""
    pos = positions.to(table.device).long()
    block = table.long().gather(1, (pos // block_size)[:, None])[:, 0]
    return block, pos % block_size


def paged_keys(pool: torch.Tensor, positions: torch.Tensor, table: torch.Tensor
               ) -> torch.Tensor:
    """[R, H_kv, L, D]: for each of the R block table rows (sequences), its rows at positions
    0 … L − 1, L the largest of `positions` + 1 (rows past a token's own position are whatever
    its blocks hold there, and a mask hides them)."""
    block_size = pool.shape[2]
    length = int(positions.max()) + 1
    j = torch.arange(length, device=pool.device)
    blocks = table.long().to(pool.device)[:, j // block_size]            # (R, L)
    return pool[blocks, :, j % block_size].permute(0, 2, 1, 3)           # (R, H_kv, L, D)


def _kv_cache(ctx: EagerCtx, a: Args, at: Attrs) -> torch.Tensor:
    if at["paged"] is None:
        return ctx.cache_append(at["layer"], at["kind"], a["x"], at["quant"])
    ctx.paged_write(at["layer"], at["kind"], a["x"], a["positions"], a["block_table"])
    return a["x"]


register(OpDef(
    Op.KV_CACHE, "Write the new keys or values at offset P; return the cache's first P+T. With "
    "`quant` the cache holds int8 or fp8 e4m3 codes and an f32 scale per (token, head), and "
    "returns what it holds, code·scale. With `paged` (the block size) each token's row goes "
    "to its block of the layer's pool (block_table at its position), and it returns the rows.",
    '%14 : f32[B,2,P+T,16] = kv_cache(%13) {kind="k", layer=0, quant="int8"}',
    operands("x", ("positions", "paged"), ("block_table", "paged")),
    _kv_infer,
    _kv_cache,
    # read the new rows, write them into the cache; readers of the cache pay for reading it
    bytes=lambda sig: numel(sig.shapes[0]) * DTYPE_BYTES[sig.dtypes[0]] + numel(
        sig.shapes[0][:3]) * kv_row_bytes(sig.shapes[0][3], sig.dtypes[0], sig.attr("quant")),
    attrs=(LAYER, Attr("kind", str, choices=KV_KINDS), KV_QUANT_ATTR, PAGED_ATTR),
    arity=(1, 3), docs={"positions": "with `paged`: each token's position",
                        "block_table": "with `paged`: each token's sequence's blocks"}))


def _repeat_infer(sig: Sig) -> tuple[Shape, str]:
    x = sig.shapes[0]
    require(len(x) == 4, "repeat_kv takes [B, H, L, D]")
    return (x[0], x[1] * sig.attr("groups"), x[2], x[3]), sig.dtypes[0]


register(OpDef(
    Op.REPEAT_KV, "Repeat each KV head `groups` times so GQA heads line up with queries.",
    "%16 : f32[B,4,P+T,16] = repeat_kv(%14) {groups=2}", operands("x"), _repeat_infer,
    lambda ctx, a, at: a["x"].repeat_interleave(at["groups"], dim=1),
    attrs=(Attr("groups", int, at_least=1),), arity=(1, 1)))


# ---- scores and the value sum --------------------------------------------------------------

def groups(q_heads: sympy.Expr, kv_heads: sympy.Expr) -> int:
    """Query heads per KV head (1 after repeat_kv): query head h uses KV head h // groups."""
    q, kv = int(q_heads), int(kv_heads)
    require(q % kv == 0, f"{q} query heads are not a multiple of {kv} key/value heads")
    return q // kv


def expand_kv(x: torch.Tensor, q_heads: int) -> torch.Tensor:
    """[B, H_kv, L, D] → [B, H, L, D]: KV head h // g serves query head h."""
    g = q_heads // x.shape[1]
    return x if g == 1 else x.repeat_interleave(g, dim=1)


def _head_matmul(op: Op, summary: str, example: str, a: str, b: str, transpose: bool) -> None:
    """scores (q·kᵀ, transpose) and weighted_sum (p·v): per head, b with H_kv ≤ H heads."""
    def infer(sig: Sig) -> tuple[Shape, str]:
        x, y = sig.shapes
        require(len(x) == 4 and len(y) == 4, f"{op.value} takes {a} [B, H, T, ·] and {b} "
                f"[B, H_kv, ·, ·], got {list(x)} and {list(y)}")
        groups(x[1], y[1])
        inner, out = (y[3], y[2]) if transpose else (y[2], y[3])
        require(same_dim(x[3], inner), f"{a} {list(x)} and {b} {list(y)} do not match")
        return (x[0], x[1], x[2], out), float_dtype(sig)

    def eager(ctx: EagerCtx, args: Args, at: Attrs) -> torch.Tensor:
        y = expand_kv(args[b], args[a].shape[1])
        return args[a] @ (y.transpose(-1, -2) if transpose else y)

    register(OpDef(op, summary, example, operands(a, b), infer, eager, arity=(2, 2),
                   flops=lambda sig: 2 * numel(sig.shapes[0]) * sig.out_shape[-1]))


_head_matmul(Op.SCORES, "Attention scores q·kᵀ per head; k may have fewer (KV) heads than q.",
             "%17 : f32[B,4,T,P+T] = scores(%12, %16)", "q", "k", transpose=True)
_head_matmul(Op.WEIGHTED_SUM, "The value sum p·v per head; v may have fewer (KV) heads than p.",
             "%22 : f32[B,4,T,16] = weighted_sum(%21, %20)", "p", "v", transpose=False)


def _head_linear_infer(sig: Sig) -> tuple[Shape, str]:
    x, w = sig.shape("x"), sig.shape("weight")
    require(len(x) == 4 and len(w) == 3 and same_dim(x[1], w[0]) and same_dim(x[3], w[2]),
            f"head_linear takes x [B, H, T, K] and weight [H, N, K], got {list(x)} and {list(w)}")
    if sig.attr("merged"):
        return (x[0], x[2], x[1] * w[1]), float_dtype(sig)
    return (x[0], x[1], x[2], w[1]), float_dtype(sig)


def _head_linear_eager(ctx: EagerCtx, a: Args, at: Attrs) -> torch.Tensor:
    y = torch.einsum("bhtk,hnk->bhtn", a["x"].float(), a["weight"].float())   # (B, H, T, N)
    if at["merged"]:
        y = y.transpose(1, 2).flatten(2)                                      # (B, T, H·N)
    return y.to(a["x"].dtype)


register(OpDef(
    Op.HEAD_LINEAR, "Each head's rows times that head's own weight: x [B, H, T, K] · W[h]ᵀ "
    "[H, N, K] → [B, H, T, N], or with `merged` heads merged, [B, T, H·N] (latent attention's "
    "key up-projection on the query side, its value up-projection on the output).",
    "%20 : f32[B,4,T,32] = head_linear(%18, %19)", operands("x", "weight"), _head_linear_infer,
    _head_linear_eager, attrs=(Attr("merged", bool, False),), template="head_linear",
    flops=lambda sig: 2 * numel(sig.out_shape) * sig.shape("x")[3], arity=(2, 2),
    docs={"x": "per-head rows", "weight": "one [N, K] weight per head"}))


# ---- the attention kernel --------------------------------------------------------------------

CAUSAL = builtin("causal")


def _addend(score: Expr) -> Expr | None:
    """X where the score expression is score + X (0.0 for score itself), so that a softmax
    can take it as an additive mask; None where it is not."""
    if score == var("score"):
        return 0.0
    if isinstance(score, Call) and score.fn in ("add", "sub") and var("score") in score.args:
        x = score.args[1] if score.args[0] == var("score") else score.args[0]
        if var("score") not in leaves(x) and (score.fn == "add" or x is score.args[1]):
            return x if score.fn == "add" else Call("neg", (x,))
    return None


def _t5(at: Attrs, a: Mapping[str, torch.Tensor], q_pos: torch.Tensor, kv_pos: torch.Tensor
        ) -> torch.Tensor | None:
    bias = at["bias"]
    return None if bias is None or bias.fn != "t5" else \
        t5_bias(a["rel_table"], q_pos, kv_pos, dict(bias.kwargs))


def modified_scores(q: torch.Tensor, k: torch.Tensor, kv_heads: int, q_pos: torch.Tensor,
                    kv_pos: torch.Tensor, at: Attrs, a: Mapping[str, torch.Tensor]
                    ) -> torch.Tensor:
    """The scores [B, H, T, L] the normalizer sees — the score expression of scale·q·kᵀ (and a
    T5 bias) where the mask shows a key, f32's most negative finite value where it hides one —
    for q [B, H, T, D] and k [B, H, L, D] (f32, heads expanded from `kv_heads`) at absolute
    positions `q_pos` [T] and `kv_pos` [L]; `a`: the operands the modifiers read."""
    mods = modifiers_of(at)
    values = eager_values(mods, a, q_pos, kv_pos, q.shape[1], kv_heads,
                          (q @ k.transpose(-1, -2)) * at["scale"])
    s, t5 = evaluate(mods.score, mods.env, values), _t5(at, a, q_pos, kv_pos)
    return torch.where(evaluate(mods.mask, mods.env, values), s if t5 is None else s + t5[None],
                       MASKED).expand(*q.shape[:3], k.shape[2])


def modified_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_heads: int,
                       positions: tuple[torch.Tensor, torch.Tensor] | None, at: Attrs,
                       a: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """normalizer(modified_scores)·v: [B, H, T, D] f32 for q [B, H, T, D] and k, v [B, H, L, D]
    (f32, heads expanded) at absolute `positions` (q [T], kv [L]; None: the queries are the
    last T of keys 0 … L − 1).

    A softmax row whose keys are all hidden (padding) averages the values, not NaN. Under a
    softmax whose score is the scaled score plus a bias (ALiBi, none), bias and mask go to
    F.scaled_dot_product_attention as one additive mask, without storing the [B, H, T, L]
    scores (at 8192 tokens one layer of SmolLM2's are 2.4 GB in f32); a causal prefill (T = L)
    or decode step (T = 1) at positions 0 … L − 1 needs no mask at all."""
    mods, (t, length) = modifiers_of(at), (q.shape[2], k.shape[2])
    q_pos, kv_pos = positions or query_key_positions(t, length, q.device)
    addend, t5 = _addend(mods.score), _t5(at, a, q_pos, kv_pos)
    if mods.normalizer == SOFTMAX and addend is not None:
        ordered = positions is None and t in (1, length)
        if addend == 0.0 and t5 is None and (mods.mask is True or mods.mask == CAUSAL and
                                             ordered):
            return F.scaled_dot_product_attention(q, k, v, is_causal=mods.mask is not True
                                                  and t > 1, scale=at["scale"])
        values = eager_values(mods, a, q_pos, kv_pos, q.shape[1], kv_heads)
        add = evaluate(addend, mods.env, values).float() + (0.0 if t5 is None else t5[None])
        m = torch.where(evaluate(mods.mask, mods.env, values), add, MASKED)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=at["scale"])
    sinks = mods.normalizer.kw("sinks")
    return attend(mods.normalizer, modified_scores(q, k, kv_heads, q_pos, kv_pos, at, a),
                  torch.tensor(True), v, None if sinks is None else a[sinks])


def _attention_roles(attrs: Mapping[str, Any], n: int) -> list[str]:
    bias = attrs.get("bias")
    return ["q", *(["k", "v"] if attrs.get("cache_layer") is None else []),
            *(["q2", *(["k2"] if attrs.get("cache_layer") is None else [])]
              if attrs.get("second_score") else []), *modifier_roles(attrs),
            *(["rel_table"] if bias is not None and bias.fn == "t5" else []),
            *(["positions"] if attrs.get("ring") is not None or attrs.get("paged") is not None
              else []),
            *(["block_table"] if attrs.get("paged") is not None else [])]


def _attention_infer(sig: Sig) -> tuple[Shape, str]:
    q = sig.shape("q")
    require(len(q) == 4, f"q must be [B, H, T, D], got {list(q)}")
    if sig.has("k"):
        k, v = sig.shape("k"), sig.shape("v")
        require(len(k) == 4 and k == v, f"k {list(k)} and v {list(v)} must match [B, H_kv, L, D]")
        groups(q[1], k[1])
        require(same_dim(k[3], q[3]), f"k head dim {k[3]} ≠ q head dim {q[3]}")
    else:
        require(sig.attr("kv_heads") is not None, "a cached attention needs kv_heads")
        groups(q[1], sympy.Integer(sig.attr("kv_heads")))
    if sig.attr("second_score"):
        require(sig.attr("ring") is None and sig.attr("paged") is None and
                sig.attr("kv_quant") is None, "a second score term reads no ring, pool or "
                "quantized cache")
        q2 = sig.shape("q2")
        require(len(q2) == 4 and q2[:3] == q[:3], f"q2 {list(q2)} must be [B, H, T, D2] "
                "beside q")
        if sig.has("k"):
            k2 = sig.shape("k2")
            require(len(k2) == 4 and k2[:3] == sig.shape("k")[:3] and same_dim(q2[3], k2[3]),
                    f"k2 {list(k2)} must be [B, H_kv, L, {q2[3]}] beside k")
    require(sig.attr("kv_quant") is None or not sig.has("k"),
            "kv_quant describes the layer's cache: an attention given k and v reads no cache")
    check_mask(sig, _keys(sig))
    kv_heads = sig.shape("k")[1] if sig.has("k") else sympy.Integer(sig.attr("kv_heads"))
    check_modifiers(sig, q[1], kv_heads, _keys(sig))
    own_inputs = set(modifiers_of(sig.attrs).env.token_inputs) - {"padding"}
    if sig.attr("paged") is not None:
        require(not sig.has("k") and sig.attr("kv_quant") is None,
                "a paged attention reads its layer's pool (cache_layer), unquantized")
        require((sig.attr("causal") or sig.attr("mask") is not None) and not sig.attr("prefix")
                and not sig.attr("padding") and not own_inputs and
                (sig.attr("bias") is None or sig.attr("bias").fn == "alibi"),
                "a paged attention is causal or masked by positions alone, with no prefix, "
                "padding, per-token input or T5 bias")
        check_paged(sig, q[2])
    if sig.attr("ring") is not None:
        pos = sig.shape("positions")
        require(len(pos) == 1 and same_dim(pos[0], q[2]) and sig.dtype("positions") == "i64",
                f"ring attention's positions must be i64[{q[2]}], got "
                f"{sig.dtype('positions')}{list(pos)}")
        require(not own_inputs, "ring attention reads no per-token input but padding")
    return (q[0], q[2], q[1] * q[3]), float_dtype(sig)


def attention(ctx: EagerCtx, a: Args, at: Attrs) -> torch.Tensor:
    """The attention of q over the k and v given (or the layer's cache) with its modifiers
    (``modified_attention``), in f32, heads merged: [B, T, H·D]."""
    q, layer = a["q"], at["cache_layer"]
    (b, h, t, d) = q.shape
    if at["second_score"] and layer is not None:   # the cached rows are [k ‖ k2], v = k
        k = ctx.cache_read(layer, "k")
        q, v = torch.cat([q, a["q2"].to(q.dtype)], -1), k[..., :d]
    else:
        k, v = (a[r] if layer is None else ctx.cache_read(layer, r) for r in ("k", "v"))
    if at["second_score"] and layer is None:   # q·kᵀ + q2·k2ᵀ = [q ‖ q2]·[k ‖ k2]ᵀ
        q, k = torch.cat([q, a["q2"].to(q.dtype)], -1), torch.cat([k, a["k2"].to(k.dtype)], -1)
    out = modified_attention(q.float(), expand_kv(k, h).float(), expand_kv(v, h).float(),
                             k.shape[1], None, at, a)
    return out.transpose(1, 2).reshape(b, t, h * d).to(q.dtype)                # (B, T, H·D)


# ---- ring attention (context parallel) -------------------------------------------------------
#
# With cp ranks the sequence is cut into 2·cp chunks and rank r holds chunks r and 2·cp − 1 − r
# ("zig-zag": under a causal mask the early chunk sees few keys and the late one many, so every
# rank has the same work; ``archc.passes.context``). An attention with ring=cp computes its
# rank's queries against its own K/V block, then cp − 1 times passes the block in hand to rank
# r + 1 and takes rank r − 1's, each block carrying its tokens' global positions (masks and
# position biases are functions of global positions). Each block is one step of the
# normalizer's online form (``archc.ir.modifiers.normalizers``: for softmax, the running max
# and sum's rescale), which is exact.

def _padded(x: torch.Tensor, length: int, fill: int) -> torch.Tensor:
    """x with its dim 2 (keys; dim 0 for positions, dim 1 for a padding mask) filled to
    `length` rows: blocks of one ring all have the longest rank's length, so a process-group
    send and receive agree on the shape."""
    dim = {1: 0, 2: 1}.get(x.dim(), 2)
    missing = length - x.shape[dim]
    if missing == 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x, torch.full(shape, fill, dtype=x.dtype, device=x.device)], dim=dim)


def ring_step(state: State | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              kv_heads: int, q_pos: torch.Tensor, kv_pos: torch.Tensor, at: Attrs,
              a: Mapping[str, torch.Tensor]) -> State:
    """The online normalizer's state after one block of keys and values [B, H, L, D] (f32,
    heads expanded) at global positions `kv_pos` [L] (the block's real rows), for queries q
    [B, H, T, D] at `q_pos`; `a`: the modifiers' operands, a padding mask over these keys."""
    if "padding" in a:   # a per-token input is read by absolute position
        full = a["padding"].new_zeros(a["padding"].shape[0], int(kv_pos.max()) + 1)
        a = {**a, "padding": full.index_copy(1, kv_pos, a["padding"])}
    s = modified_scores(q, k, kv_heads, q_pos, kv_pos, at, a)
    nz = modifiers_of(at).normalizer
    form, sinks = ONLINE[nz.fn], nz.kw("sinks")
    if state is None:
        state = form.init(nz, s, v.shape[-1], None if sinks is None else a[sinks])
    return form.step(nz, state, s, v)


def ring_attention(ctx: EagerCtx, a: Args, at: Attrs) -> torch.Tensor:
    """Attention over the "cp" group: this rank's queries against every rank's K/V block, the
    blocks passed round the ring (``Comm.ring_pass``) while the one in hand is computed, each
    an exact online step. In a group of one it is plain attention over the k and v given:
    what a step after a ring prefill runs, every rank then holding the whole sequence."""
    comm = ctx.comm("cp")
    if comm.size == 1:
        return attention(ctx, a, at)
    if comm.size != at["ring"]:
        raise ValueError(f"the program's attention is a ring over {at['ring']} cp ranks; this "
                         f"run has {comm.size}")
    q, pos, layer = a["q"], a["positions"], at["cache_layer"]
    # k and v given, or this rank's rows of the layer's cache (written at P = 0 just before)
    k, v = (a[r] if layer is None else ctx.cache_read(layer, r) for r in ("k", "v"))
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"a ring step attends over its own {q.shape[2]} tokens; it was given "
                         f"{k.shape[2]} keys (a ring runs at P = 0, after a reset)")
    (b, h, t, d) = q.shape
    # every rank's block is filled to the longest (T need not split evenly); filler keys have
    # position −1 and are left out of each step
    longest = int(comm.all_gather(torch.tensor([t], device=q.device), 0).max())
    padding = a.get("padding")
    block = [_padded(k, longest, 0), _padded(v, longest, 0), _padded(pos.to(q.device),
                                                                     longest, -1)]
    if padding is not None:
        block.append(_padded(padding.to(q.device), longest, 0))
    qf, q_pos = q.float(), pos.to(q.device)
    state: State | None = None
    for step in range(comm.size):
        # the next block is asked for before this one is computed: a process group moves it
        # while the local block is in hand
        coming = comm.ring_pass_start(block) if step < comm.size - 1 else None
        n = int((block[2] >= 0).sum())              # its real rows come first
        kb, vb, kpos = (x[:, :, :n] if x.dim() == 4 else x[:n] for x in block[:3])
        mine = {**a, **({"padding": block[3][:, :n]} if padding is not None else {})}
        state = ring_step(state, qf, expand_kv(kb, h).float(), expand_kv(vb, h).float(),
                          k.shape[1], q_pos, kpos, at, mine)
        if coming is not None:
            block = coming()
    assert state is not None
    o = ONLINE[modifiers_of(at).normalizer.fn].finish(state)
    return o.transpose(1, 2).reshape(b, t, h * d).to(q.dtype)                  # (B, T, H·D)


def paged_attention(ctx: EagerCtx, a: Args, at: Attrs) -> torch.Tensor:
    """Each token t (of B = 1 rows) attends to its own sequence's keys at positions
    0 … positions[t], read from the layer's pool through its block table: [1, T, H·D].

    Tokens with the same block table row are one sequence's (a prefill's prompt): its keys are
    gathered once, up to its last token's position, for all of them, so a long prompt costs
    [T, L] of mask rather than T copies of its keys."""
    q, pos, table = a["q"], a["positions"].to(a["q"].device), a["block_table"]
    (b, h, t, d) = q.shape
    if b != 1:
        raise ValueError(f"a paged step runs its tokens as one row (B = 1), got B = {b}")
    pools = [ctx.paged_pool(at["cache_layer"], kind) for kind in ("k", "v")]
    out = torch.empty(t, h, d, dtype=torch.float32, device=q.device)
    rows, seq_of = torch.unique(table.to(q.device), dim=0, return_inverse=True)
    for r in range(rows.shape[0]):
        mine = (seq_of == r).nonzero()[:, 0]                                    # its tokens
        k, v = (paged_keys(pool, pos[mine], rows[r:r + 1]) for pool in pools)  # (1, H_kv, L, D)
        keys = torch.arange(k.shape[2], device=q.device)
        o = modified_attention(q[:, :, mine].float(), expand_kv(k, h).float(),
                               expand_kv(v, h).float(), k.shape[1], (pos[mine], keys), at, a)
        out[mine] = o[0].transpose(0, 1)                                        # (n, H, D)
    return out.reshape(1, t, h * d).to(q.dtype)                                 # (1, T, H·D)


def _attention_eager(ctx: EagerCtx, a: Args, at: Attrs) -> torch.Tensor:
    if at["paged"] is not None:
        return paged_attention(ctx, a, at)
    return attention(ctx, a, at) if at["ring"] is None else ring_attention(ctx, a, at)


def visible_pairs(t: sympy.Expr, length: sympy.Expr, causal: bool,
                  window: int | None, global_tokens: int | None = None) -> sympy.Expr:
    """Query-key pairs a mask lets through, for T queries at the end of L keys. Causal row i
    sees min(L − T + i + 1, W) keys; with k = clamp(W − (L − T) − 1, 0, T) rows below the cap,
    Σ = k(L − T + 1) + k(k − 1)/2 + (T − k)·W. Bidirectional windows are approximated by
    T·min(L, 2W − 1). G global tokens add, causally, the global keys behind the window,
    min(G, L − W) per row (an upper bound: the last row's count); bidirectionally, G keys per
    row and G rows that see all L keys."""
    past = length - t
    if not causal:
        if window is None:
            return t * length
        pairs = t * sympy.Min(length, 2 * window - 1)
        if global_tokens is not None:
            g = global_tokens
            pairs = sympy.Min(t * length, pairs + t * g + sympy.Min(g, t) * length)
        return pairs
    if window is None:
        return t * past + t * (t + 1) / 2
    k = sympy.Min(t, sympy.Max(0, window - past - 1))
    pairs = k * (past + 1) + k * (k - 1) / 2 + (t - k) * window
    if global_tokens is not None:
        pairs += t * sympy.Min(global_tokens, sympy.Max(0, length - window))
    return pairs


def _keys(sig: Sig) -> sympy.Expr:
    """L: the keys given, or the cache's P + T."""
    return sig.shape("k")[2] if sig.has("k") else P + sig.shape("q")[2]


def _attention_flops(sig: Sig) -> sympy.Expr:
    q, ring = sig.shape("q"), sig.attr("ring")
    if ring is None:
        pairs = visible_pairs(q[2], _keys(sig), sig.attr("causal"), sig.attr("window"),
                              sig.attr("global_tokens"))
    else:   # a ring rank's share of the whole sequence's pairs (zig-zag: the same on each)
        whole = ring * q[2]
        pairs = visible_pairs(whole, whole, sig.attr("causal"), sig.attr("window"),
                              sig.attr("global_tokens")) / ring
    # per visible pair: q·k (and q2·k2), p·v, the normalizer's few
    qk = q[3] + (sig.shape("q2")[3] if sig.attr("second_score") else 0)
    return q[0] * q[1] * pairs * (2 * qk + 2 * q[3] + 5)


def _attention_bytes(sig: Sig) -> sympy.Expr:
    q, length = sig.shape("q"), _keys(sig)
    kv_heads = sig.shape("k")[1] if sig.has("k") else sig.attr("kv_heads")
    window, g = sig.attr("window"), sig.attr("global_tokens")
    # bidirectional global rows read every key
    keys = length if window is None or (g is not None and not sig.attr("causal")) else \
        sympy.Min(length, window + q[2] + (g or 0))
    if sig.attr("ring") is not None:    # a ring rank reads every rank's block in full
        keys = sig.attr("ring") * length
    # q in and out, and each visible key's k and v rows (codes and scales from a quantized cache)
    if sig.attr("second_score"):   # q2 in; each visible key's k2 row
        q2 = sig.shape("q2")
        extra = numel(q2) * DTYPE_BYTES[sig.dtype("q")]
        if not sig.has("k"):   # one cached row [k ‖ k2] a key, its first columns the values
            return 2 * numel(q) * DTYPE_BYTES[sig.dtype("q")] + extra + q[0] * kv_heads * \
                keys * kv_row_bytes(q[3] + q2[3], sig.dtype("q"), None)
        extra += q[0] * kv_heads * keys * kv_row_bytes(q2[3], sig.dtype("q"), None)
    else:
        extra = 0
    return 2 * numel(q) * DTYPE_BYTES[sig.dtype("q")] + 2 * q[0] * kv_heads * keys * \
        kv_row_bytes(q[3], sig.dtype("q"), sig.attr("kv_quant")) + extra


register(OpDef(
    Op.ATTENTION, "Flash attention: scale, soft-cap, ALiBi or T5 bias, causal/window (with "
    "global tokens)/prefix/padding mask, explicit `score` and `mask` expressions over them and "
    "a `normalizer`, GQA by index, over given k/v or the layer's KV cache; heads merged. "
    "With `ring`, ring attention over that many cp ranks (context parallel), "
    "masks at the global positions given. With `paged` (the block size), each token attends to "
    "its own sequence's keys up to its position, read through its block table. With "
    "`second_score`, the score is q·kᵀ + q2·k2ᵀ before its modifiers; cached, the layer's "
    "key rows hold [k ‖ k2] and the values are their first D columns (latent attention).",
    "%12 : f32[B,T,64] = attention(%11) {cache_layer=0, causal=true, kv_heads=2, scale=0.25, "
    "window=8}", _attention_roles, _attention_infer, _attention_eager,
    attrs=(Attr("scale", float), *MASK_ATTRS, Attr("score", Expression, None), NORMALIZER,
           Attr("softcap", float, None),
           Attr("bias", Call, None, {"alibi": (), "t5": T5}),
           Attr("cache_layer", int, None, at_least=0), Attr("kv_heads", int, None, at_least=1),
           Attr("kv_quant", str, None, choices=tuple(KV_CODES)),
           Attr("ring", int, None, at_least=2), PAGED_ATTR,
           Attr("second_score", bool, False)),
    flops=_attention_flops, bytes=_attention_bytes, template="attention", arity=(1, -1),
    docs={"q2": "with `second_score`: the queries of the score's second term q2·k2ᵀ",
          "k2": "with `second_score`: its keys (latent attention's shared RoPE key)",
          "padding": "1 = key present", "prefix_len": "prefix length",
          "positions": "with `ring`: the global positions of this rank's tokens; with "
          "`paged`: each token's position",
          "block_table": "with `paged`: each token's sequence's blocks in the layer's pool",
          "slopes": "ALiBi slopes", "rel_table": "relative-position bias per bucket and head",
          "NAME": "each name the modifiers read: a per-head parameter f32[H] (or [H_kv]), a "
          "per-token input [B, L] by key position, a per-sequence scalar i64[]"}))
