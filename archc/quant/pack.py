"""Codes into the planar layout of `archc.quant.schemes` (the inverse of `QTensor.codes`), and
archc's own round-to-nearest weight-only quantizers."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from archc.errors import WeightsError
from archc.quant.schemes import SCHEMES, Scheme
from archc.quant.tensor import QTensor


def pack_codes(scheme: Scheme, codes: torch.Tensor) -> dict[str, torch.Tensor]:
    """`q` (and `qh`) of integer codes [..., N, K]: unsigned codes below 2^bits, or int8 codes
    for 8-bit schemes."""
    if scheme.bits == 8:
        return {"q": codes.to(torch.int8).contiguous()}
    k = codes.shape[-1]
    c = codes.to(torch.int32)
    low = F.pad(c & 0x0F, (0, k % 2))
    parts = {"q": (low[..., 0::2] | (low[..., 1::2] << 4)).to(torch.uint8).contiguous()}
    if hb := scheme.high_bits:
        per_byte = 8 // hb
        high = F.pad(c >> 4, (0, -k % per_byte)).unflatten(-1, (-1, per_byte))
        shifts = torch.arange(per_byte, dtype=torch.int32, device=c.device) * hb
        parts["qh"] = (high << shifts).sum(-1).to(torch.uint8).contiguous()
    return parts


def scheme_name(kind: str, group: int = 128) -> str:
    """The scheme `quantize(w, kind, group)` makes: int8_ch, or int4_g32/64/128."""
    if kind == "int8":
        return "int8_ch"
    if kind == "int4":
        if group not in (32, 64, 128):
            raise WeightsError(f"int4 groups of {group}: use 32, 64 or 128")
        return f"int4_g{group}"
    raise WeightsError(f"quantize={kind!r}: use 'int8' or 'int4'")


def quantize(w: torch.Tensor, kind: str, group: int = 128) -> QTensor:
    """Round-to-nearest, weight-only, symmetric: "int8" per output channel (row), "int4" per
    `group` elements of a row (32, 64 or 128; a last, shorter group where K is not a multiple).
    The scale is max|w| / 127 (int8) or max|w| / 7 (int4, codes −8…7 stored as 0…15)."""
    s = SCHEMES[scheme_name(kind, group)]
    top = 127 if s.bits == 8 else 7
    x = w.float()
    k = x.shape[-1]
    g = k if s.bits == 8 else group
    groups = F.pad(x, (0, -k % g)).unflatten(-1, (-1, g))            # [..., N, G, g]
    amax = groups.abs().amax(-1)
    scale = (amax / top).to(torch.float32 if s.scale == "f32" else torch.float16)
    safe = torch.where(scale.float() == 0, torch.ones_like(scale.float()), scale.float())
    codes = torch.round(groups / safe[..., None]).clamp(-top - (s.bits == 4), top)
    codes = codes.flatten(-2)[..., :k] + s.zero
    return QTensor(s, x.shape, {**pack_codes(s, codes), "scale": scale.contiguous()})
