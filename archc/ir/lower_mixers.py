"""Lowering the recurrent sequence mixers: Mamba and causal linear attention, faithful and unfused.

Called by ``lower._Stack.mix`` for the layers whose mixer is not softmax attention; each returns
the mixer's output [B, T, d] for its normalized input. The recurrences carry their state between
calls themselves (``causal_conv``, ``ssm_scan``, ``linear_attention``), so one graph serves prefill
and decode, as the KV cache does for attention.

Mamba (Gu & Dao 2023), as the reference implementation lays it out::

    x, z   = split(in_proj(h))                      # [B, T, 2·d_inner]
    x      = silu(conv1d(x) + conv_bias)            # causal depthwise, width d_conv
    Δ, B, C = split(x_proj(x))                      # [dt_rank | d_state | d_state]
    Δ      = softplus(dt_proj(Δ) + dt_bias)         # (Jamba: RMSNorm on Δ, B and C first)
    y      = selective_scan(x, Δ, A = −exp(A_log), B, C) + D·x
    out    = out_proj(y · silu(z))

Linear attention (Katharopoulos et al. 2020): q, k, v projections as attention's, split into
heads, φ = elu + 1 on q and k, the running sums (heads merged on the way out), the output
projection.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from archc.ir.attrs import Call
from archc.ir.ops import Op
from archc.ir.paramexpr import leaf

if TYPE_CHECKING:
    from archc.ir.lower import _Stack


def lower_mamba(st: _Stack, h: int, layer: int) -> int:
    s = st.s
    m = s.mixer.mamba
    assert m is not None and m.dt_rank is not None
    inner, n, rank = s.mamba_inner, m.d_state, m.dt_rank
    base = f"layers.{layer}.ssm"
    with st.at("mixer.mamba.expand"):
        xz = st.linear(h, f"{base}.in", 2 * inner, m.bias, "mixer.mamba.bias")
        x = st.emit(Op.SLICE, xz, start=0, stop=inner)
        z = st.emit(Op.SLICE, xz, start=inner, stop=2 * inner)
    with st.at("mixer.mamba.d_conv"):
        x = st.emit(Op.CAUSAL_CONV, x, st.param(f"{base}.conv.weight", inner, m.d_conv),
                    layer=layer)
    if m.conv_bias:
        with st.at("mixer.mamba.conv_bias"):
            x = st.emit(Op.ADD, x, st.param(f"{base}.conv.bias", inner))
    with st.at("mixer.mamba.d_conv"):
        x = st.emit(Op.ACT, x, fn="silu")
    with st.at("mixer.mamba.dt_rank"):
        proj = st.emit(Op.MATMUL, x, st.param(f"{base}.x.weight", rank + 2 * n, inner))
        dt = st.emit(Op.SLICE, proj, start=0, stop=rank)
    with st.at("mixer.mamba.d_state"):
        bm = st.emit(Op.SLICE, proj, start=rank, stop=rank + n)
        cm = st.emit(Op.SLICE, proj, start=rank + n, stop=rank + 2 * n)
    if m.inner_norms:
        with st.at("mixer.mamba.inner_norms"):
            dt, bm, cm = (st.emit(Op.NORM, v, st.param(f"{base}.{name}_norm.weight", width),
                                  kind="rms", eps=s.norm.eps)
                          for v, name, width in ((dt, "dt", rank), (bm, "b", n), (cm, "c", n)))
    with st.at("mixer.mamba.dt_rank"):
        dt = st.linear(dt, f"{base}.dt", inner, True, "mixer.mamba.dt_rank")
        dt = st.emit(Op.ACT, dt, fn="softplus")
    with st.at("mixer.mamba.d_state"):
        st.param(f"{base}.A_log", inner, n)   # the checkpoint's; A = −exp(A_log) at load time
        a = st.param(f"{base}.A", inner, n, dtype="f32",
                     expr=Call("neg_exp", (leaf(st.prefix + f"{base}.A_log"),)))
        y = st.emit(Op.SSM_SCAN, x, dt, a, bm, cm, layer=layer)
        y = st.emit(Op.ADD, y, st.emit(Op.MUL, x, st.param(f"{base}.D", inner)))
    with st.at("mixer.mamba.expand"):
        y = st.emit(Op.MUL, y, st.emit(Op.ACT, z, fn="silu"))
        return st.linear(y, f"{base}.out", st.d, m.bias, "mixer.mamba.bias")


def lower_linear_attention(st: _Stack, h: int, layer: int) -> int:
    base = f"layers.{layer}.attn"
    mixer = "mixer.pattern" if st.s.mixer.pattern is not None else "mixer.kind"
    q, k, v = st.qkv_heads(h, h, base)     # (B, H, T, D), (B, Hkv, T, D) twice
    with st.at(mixer):
        q = st.emit(Op.ACT, q, fn="elu_plus_one")
        k = st.emit(Op.ACT, k, fn="elu_plus_one")
        out = st.emit(Op.LINEAR_ATTENTION, q, k, v, layer=layer)   # (B, T, H·D)
    with st.at("attention.heads"):
        return st.linear(out, f"{base}.o", st.d, st.s.attention.bias.o, "attention.bias.o")
