"""GGML block bytes → a `QTensor` in archc's planar layout (`archc.quant.schemes`), exactly.

A GGUF quantized tensor stores each row as a run of blocks, each block its scales followed by its
codes in llama.cpp's order. The repack reads every block of a tensor at once (numpy views of the
raw bytes, no loop over blocks), takes out the integer codes and the scales, and lays them out as
archc does: codes packed two to a byte in element order, high bits in `qh`, scales per group.
Nothing is computed on a value, so `QTensor.dequantize()` is bitwise what the gguf package's
`dequantize` gives.

Block layouts (bytes, in order) of the types read here:

- Q8_0 [34 per 32]: d f16, 32 int8 codes.
- Q4_0 [18 per 32], Q4_1 [20 per 32]: d f16, (Q4_1: m f16), 16 bytes; byte j holds element j in
  its low nibble and element j + 16 in its high one.
- Q5_0 [22 per 32], Q5_1 [24 per 32]: d f16, (Q5_1: m f16), qh 4 bytes (bit i of the little-endian
  uint32: element i's fifth bit, which is archc's `qh` order already), then low nibbles as Q4_0.
- Q4_K [144 per 256]: d f16, dmin f16, 12 bytes of 6-bit scales and mins for the 8 groups of 32,
  128 bytes of codes: 4 chunks of 32 bytes, byte l of chunk i holding element 64i + l (low
  nibble) and 64i + 32 + l (high nibble).
- Q5_K [176 per 256]: as Q4_K with qh 32 bytes before the codes: bit j of qh byte l is the fifth
  bit of element 32j + l.
- Q6_K [210 per 256]: ql 128 bytes, qh 64 bytes, 16 int8 scales (one per 16), d f16. Each half h
  of 128 elements has 64 ql bytes (byte l: element 128h + l low nibble, 128h + 64 + l high) and
  32 qh bytes (bits 2j..2j+1 of byte l: the high two bits of element 128h + 32j + l).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from archc.errors import WeightsError
from archc.memory import mapped
from archc.quant.schemes import BY_GGUF, SUPER, Scheme
from archc.quant.tensor import QTensor

# bytes per block of each type read here (the gguf package's GGML_QUANT_SIZES agrees)
BLOCK_BYTES: dict[str, int] = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24,
                               "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
Parts = dict[str, np.ndarray]
TORCH_OF = {np.dtype(np.uint8): torch.uint8, np.dtype(np.int8): torch.int8,
            np.dtype(np.float16): torch.float16}


def _f16(raw: np.ndarray) -> np.ndarray:
    """Two bytes per entry of the last axis → float16 [...] (GGUF is little-endian)."""
    return np.ascontiguousarray(raw).view("<f2")[..., 0]


def _pack_low(codes: np.ndarray) -> np.ndarray:
    """Codes [..., K] (any width) → their low nibbles two to a byte, element k in byte k // 2,
    low nibble for even k."""
    low = codes & 0x0F
    return low[..., 0::2] | (low[..., 1::2] << 4)


def _pack_high(codes: np.ndarray, bits: int) -> np.ndarray:
    """The `bits` high bits (above the low four) of codes [..., K], packed 8 // bits to a byte:
    element k's at bit (k · bits) mod 8 of byte k · bits // 8."""
    per = 8 // bits
    high = (codes >> 4).reshape(*codes.shape[:-1], -1, per)
    shifts = (np.arange(per, dtype=np.uint8) * bits)
    return np.bitwise_or.reduce(high << shifts, axis=-1).astype(np.uint8)


def _nibbles_split(qs: np.ndarray, span: int) -> np.ndarray:
    """llama.cpp's nibble order → codes: chunks of `span` bytes, each holding `span` elements in
    its low nibbles and the next `span` in its high ones. qs [..., chunks·span] → [..., 2·that]."""
    q = qs.reshape(*qs.shape[:-1], -1, 1, span)
    both = np.concatenate([q & 0x0F, q >> 4], axis=-2)    # [..., chunks, 2, span]
    return both.reshape(*qs.shape[:-1], -1)


def _q8_0(b: np.ndarray) -> Parts:
    return {"q": b[..., 2:].view(np.int8), "scale": _f16(b[..., 0:2])}


def _q4(b: np.ndarray, offset: bool) -> Parts:
    at = 4 if offset else 2
    parts = {"q": _pack_low(_nibbles_split(b[..., at:], 16)), "scale": _f16(b[..., 0:2])}
    if offset:
        parts["min"] = _f16(b[..., 2:4])
    return parts


def _q5(b: np.ndarray, offset: bool) -> Parts:
    at = 4 if offset else 2
    parts = {"q": _pack_low(_nibbles_split(b[..., at + 4:], 16)), "qh": b[..., at:at + 4],
             "scale": _f16(b[..., 0:2])}
    if offset:
        parts["min"] = _f16(b[..., 2:4])
    return parts


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes → 8 six-bit scales and 8 six-bit mins. Bytes 0-3 hold scales 0-3
    (low 6 bits) and the top 2 bits of scales 4-7; bytes 4-7 the same for mins; bytes 8-11 the
    low 4 bits of scales 4-7 (low nibble) and mins 4-7 (high nibble)."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _qk(b: np.ndarray, fifth_bit: bool) -> Parts:
    sc, mn = _k_scales(b[..., 4:16])
    codes = _nibbles_split(b[..., -128:], 32)
    parts = {"d": _f16(b[..., 0:2]), "dmin": _f16(b[..., 2:4]), "sc": sc, "mn": mn}
    if fifth_bit:
        qh = b[..., 16:48]                                     # [..., 32]: bit j → group j
        high = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1
        codes = codes | (high.reshape(codes.shape) << 4)
        parts["qh"] = _pack_high(codes, 1)
    parts["q"] = _pack_low(codes)
    return parts


def _q6_k(b: np.ndarray) -> Parts:
    lead = b.shape[:-1]
    low = _nibbles_split(b[..., 0:128], 64)                    # [..., 256]
    qh = b[..., 128:192].reshape(*lead, 2, 1, 32)              # per half: 32 bytes
    high = (qh >> (np.arange(4, dtype=np.uint8) * 2)[:, None]) & 3   # [..., 2, 4, 32]
    codes = low | (high.reshape(*lead, SUPER) << 4)
    return {"q": _pack_low(codes), "qh": _pack_high(codes, 2),
            "d": _f16(b[..., 208:210]), "sc": b[..., 192:208].view(np.int8)}


UNPACK: dict[str, Callable[[np.ndarray], Parts]] = {
    "Q8_0": _q8_0, "Q4_0": lambda b: _q4(b, False), "Q4_1": lambda b: _q4(b, True),
    "Q5_0": lambda b: _q5(b, False), "Q5_1": lambda b: _q5(b, True),
    "Q4_K": lambda b: _qk(b, False), "Q5_K": lambda b: _qk(b, True), "Q6_K": _q6_k}


def supported(kind: str) -> bool:
    """Is GGML type `kind` (a name: "Q4_K") one that loads kept quantized?"""
    return kind in BY_GGUF and kind in UNPACK


def repack(raw: np.ndarray, kind: str, shape: tuple[int, ...]) -> QTensor:
    """The tensor of logical `shape` [..., N, K] whose GGML blocks of type `kind` are the bytes
    `raw` (row-major, as a GGUF file stores them), as a QTensor of the matching scheme."""
    if not supported(kind):
        raise WeightsError(f"GGML type {kind} has no archc scheme (kept quantized: "
                           f"{', '.join(UNPACK)})")
    scheme: Scheme = BY_GGUF[kind]
    block = SUPER if scheme.two_level else scheme.group
    if len(shape) < 2 or shape[-1] % block:
        raise WeightsError(f"a {kind} tensor's rows are whole blocks of {block}; its shape "
                           f"{list(shape)} is not")
    rows, k = int(np.prod(shape[:-1])), shape[-1]
    data = np.asarray(raw).reshape(-1).view(np.uint8)
    if data.size != rows * (k // block) * BLOCK_BYTES[kind]:
        raise WeightsError(f"a {kind}{list(shape)} tensor holds "
                           f"{rows * (k // block) * BLOCK_BYTES[kind]} bytes, got {data.size}")
    blocks = data.reshape(rows, k // block, BLOCK_BYTES[kind])
    parts = UNPACK[kind](blocks)
    # each part: [rows, blocks, per block] → [..., N, per row], as its own contiguous tensor in
    # pages of its own (`archc.memory.mapped`): when a backend merges it into another weight
    # and lets it go, its memory goes back to the system (freed heap memory would stay)
    out = {}
    for name, p in parts.items():
        p = p.reshape(*shape[:-1], -1)
        held = mapped(p.shape, TORCH_OF[p.dtype])
        np.copyto(held.numpy(), p)
        out[name] = held
    return QTensor(scheme, shape, out)
