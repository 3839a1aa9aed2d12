"""Quantization schemes: how a quantized weight's values are stored and what they mean — one
declaration per scheme, read by the IR (its dtype name and bytes per element), the loaders, the
eager reference and the kernels.

Every scheme stores a weight [..., N, K] row by row in groups of `group` elements along K, in
the same planar layout (the GGUF block formats are repacked into it at load, exactly: a repack
moves bits, never changes a value):

- ``q``: the low codes. 8-bit codes are int8 [..., N, K]; narrower ones keep their low four bits
  in uint8 [..., N, ⌈K/2⌉], element k in byte k // 2, low nibble for even k.
- ``qh``: the high bits of 5- and 6-bit codes, uint8 [..., N, ⌈K·(bits−4)/8⌉]: element k's
  (bits − 4) bits at bit (k · (bits − 4)) mod 8 of byte k · (bits − 4) // 8.
- the scale of each group: ``scale`` [..., N, ⌈K/group⌉] (f16 or f32), or for the k-quants two
  levels, ``d`` f16 per 256-element super-block times ``sc`` (uint8, or int8 for q6_k) per group;
- the offset of each group, if the scheme has one: ``min`` f16 per group (added), or ``dmin`` f16
  per super-block times ``mn`` uint8 per group (subtracted).

A value is, in float32 and in this order (the order llama.cpp's reference dequantizes in, so the
values are bitwise those of the gguf package):

    s = scale                    or  d · sc
    v = s · (c − zero)           then  + min   or  − dmin · mn

where c is the unsigned code (signed for 8-bit codes) and `zero` the scheme's fixed offset.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

SUPER = 256       # elements per super-block of the k-quants


@dataclass(frozen=True)
class Scheme:
    name: str
    bits: int                   # code width: 4, 5, 6 or 8
    group: int                  # elements sharing one scale (and offset)
    zero: int = 0               # subtracted from every code
    scale: str = "f16"          # "f16" | "f32": one per group; "super": d (f16) · sc per group
    signed_sc: bool = False     # the per-group sc of a "super" scale is int8 (else uint8)
    offset: str | None = None   # None | "f16": min per group, added | "super": dmin·mn, subtracted
    gguf: str | None = None     # the GGML type it stores, for schemes read from GGUF files
    summary: str = ""

    @property
    def two_level(self) -> bool:
        return self.scale == "super"

    @property
    def high_bits(self) -> int:
        """Bits of each code held in `qh` (0 for 4- and 8-bit codes)."""
        return self.bits - 4 if self.bits in (5, 6) else 0

    @property
    def align(self) -> int:
        """K must be a multiple of this to join two weights along K (their groups and packed
        bytes end together)."""
        return SUPER if self.two_level or self.offset == "super" else max(self.group, 8)

    def k_step(self, k: int) -> int:
        """A weight of K = k columns may be cut along K at multiples of this: 1 where one scale
        covers the whole row and every code is a byte of its own (int8 per channel), else
        `align` (whole groups, super-blocks and bytes)."""
        return 1 if self.group >= k and self.bits == 8 else self.align

    @property
    def bytes_per_element(self) -> Fraction:
        """Bytes per weight element when K is a multiple of `align`: codes, scales, offsets."""
        size = Fraction(self.bits, 8)
        scale_bytes = {"f16": 2, "f32": 4}.get(self.scale, 0)
        size += Fraction(scale_bytes, self.group)
        if self.two_level:
            size += Fraction(1, self.group) + Fraction(2, SUPER)
        if self.offset == "f16":
            size += Fraction(2, self.group)
        elif self.offset == "super":
            size += Fraction(1, self.group) + Fraction(2, SUPER)
        return size

    def part_shapes(self, n: int, k: int) -> dict[str, tuple[tuple[int, int], str]]:
        """Each stored part of an [n, k] weight: name → ((rows, columns), dtype)."""
        groups, supers = -(-k // self.group), -(-k // SUPER)
        parts: dict[str, tuple[tuple[int, int], str]] = {
            "q": ((n, k), "i8") if self.bits == 8 else ((n, -(-k // 2)), "u8")}
        if self.high_bits:
            parts["qh"] = ((n, -(-k * self.high_bits // 8)), "u8")
        if self.two_level:
            parts["d"] = ((n, supers), "f16")
            parts["sc"] = ((n, groups), "i8" if self.signed_sc else "u8")
        else:
            parts["scale"] = ((n, groups), self.scale)
        if self.offset == "f16":
            parts["min"] = ((n, groups), "f16")
        elif self.offset == "super":
            parts["dmin"] = ((n, supers), "f16")
            parts["mn"] = ((n, groups), "u8")
        return parts


def _schemes(*schemes: Scheme) -> dict[str, Scheme]:
    return {s.name: s for s in schemes}


SCHEMES: dict[str, Scheme] = _schemes(
    # llama.cpp's block formats, as GGUF files store them
    Scheme("q8_0", 8, 32, gguf="Q8_0", summary="8-bit codes, an f16 scale per 32"),
    Scheme("q4_0", 4, 32, zero=8, gguf="Q4_0", summary="4-bit codes − 8, an f16 scale per 32"),
    Scheme("q4_1", 4, 32, offset="f16", gguf="Q4_1",
           summary="4-bit codes, an f16 scale and minimum per 32"),
    Scheme("q5_0", 5, 32, zero=16, gguf="Q5_0", summary="5-bit codes − 16, an f16 scale per 32"),
    Scheme("q5_1", 5, 32, offset="f16", gguf="Q5_1",
           summary="5-bit codes, an f16 scale and minimum per 32"),
    Scheme("q4_k", 4, 32, scale="super", offset="super", gguf="Q4_K",
           summary="4-bit codes; 6-bit scales and minimums per 32 times f16 ones per 256"),
    Scheme("q5_k", 5, 32, scale="super", offset="super", gguf="Q5_K",
           summary="5-bit codes; 6-bit scales and minimums per 32 times f16 ones per 256"),
    Scheme("q6_k", 6, 16, zero=32, scale="super", signed_sc=True, gguf="Q6_K",
           summary="6-bit codes − 32; 8-bit scales per 16 times an f16 one per 256"),
    # archc's own round-to-nearest weight-only quantization (archc.quant.rtn)
    Scheme("int8_ch", 8, 1 << 30, scale="f32",
           summary="8-bit codes, one f32 scale per output channel (row)"),
    Scheme("int4_g32", 4, 32, zero=8, summary="4-bit codes − 8, an f16 scale per 32"),
    Scheme("int4_g64", 4, 64, zero=8, summary="4-bit codes − 8, an f16 scale per 64"),
    Scheme("int4_g128", 4, 128, zero=8, summary="4-bit codes − 8, an f16 scale per 128"),
)

BY_GGUF: dict[str, Scheme] = {s.gguf: s for s in SCHEMES.values() if s.gguf}


def is_quantized(dtype: str) -> bool:
    return dtype in SCHEMES


def scheme(dtype: str) -> Scheme:
    return SCHEMES[dtype]
