"""GGUF tensors kept quantized: each supported GGML block type repacked into archc's planar
layout bit for bit (its values bitwise those of the gguf package's dequantize), a model read kept
quantized computing what the same file read as floats computes, unsupported types refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import archc
from archc.errors import ArchcError, WeightsError
from archc.quant.gguf_repack import repack
from archc.quant.schemes import BY_GGUF
from archc.quant.tensor import QTensor
from archc.sources import describe
from archc.sources.gguf import unpermute_rope_rows

gguf = pytest.importorskip("gguf", reason="needs gguf (pip install 'archc[gguf]')")
Q = gguf.GGMLQuantizationType
TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")     # the gguf package reads these but cannot write them

# a tiny llama whose every matrix has K = 256·odd or 256 columns and whose vocabulary is odd
D, FF, HEADS, KV, VOCAB = 768, 256, 4, 2, 97


# ---- a plain packer of K-quant blocks, from their fields (llama.cpp's block layouts) ------------
def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype("<f2").view(np.uint8).reshape(*x.shape, 2)


def _k_scale_bytes(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins [nb, 8] → Q4_K/Q5_K's 12 bytes."""
    out = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    for j in range(4):
        out[:, j] = sc[:, j] | ((sc[:, j + 4] >> 4) << 6)
        out[:, j + 4] = mn[:, j] | ((mn[:, j + 4] >> 4) << 6)
        out[:, j + 8] = (sc[:, j + 4] & 0x0F) | ((mn[:, j + 4] & 0x0F) << 4)
    return out


def _interleave_nibbles(codes: np.ndarray, span: int) -> np.ndarray:
    """Codes [nb, 2·chunks·span] → bytes: chunk i's byte l holds element 2·span·i + l (low
    nibble) and 2·span·i + span + l (high)."""
    c = (codes & 0x0F).reshape(codes.shape[0], -1, 2, span)
    return (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(codes.shape[0], -1)


def pack_k_quant(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random valid blocks of a K-quant: random f16 super-block scales, random sub-block scales
    (and mins), random codes. Returns the raw bytes [rows, bytes per row]."""
    nb = rows * cols // 256
    d = rng.uniform(1e-4, 6e-4, nb)
    if kind == "Q6_K":
        codes = rng.integers(0, 64, (nb, 256), dtype=np.uint8)
        ql = np.concatenate([_interleave_nibbles(codes[:, h * 128:(h + 1) * 128], 64)
                             for h in range(2)], axis=1)
        high = (codes >> 4).reshape(nb, 2, 4, 32)              # [half, j, l]
        qh = sum(high[:, :, j] << (2 * j) for j in range(4)).astype(np.uint8).reshape(nb, 64)
        sc = rng.integers(-128, 128, (nb, 16)).astype(np.int8).view(np.uint8)
        blocks = np.concatenate([ql, qh, sc, _f16_bytes(d)], axis=1)
    else:
        bits = 5 if kind == "Q5_K" else 4
        codes = rng.integers(0, 1 << bits, (nb, 256), dtype=np.uint8)
        sc, mn = (rng.integers(0, 64, (nb, 8), dtype=np.uint8) for _ in range(2))
        head = [_f16_bytes(d), _f16_bytes(rng.uniform(1e-4, 6e-4, nb)), _k_scale_bytes(sc, mn)]
        if bits == 5:
            fifth = ((codes >> 4) & 1).reshape(nb, 8, 32)      # [group j, byte l]
            head.append(sum(fifth[:, j] << j for j in range(8)).astype(np.uint8))
        blocks = np.concatenate([*head, _interleave_nibbles(codes, 32)], axis=1)
    return blocks.reshape(rows, -1)


def raw_tensor(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    if kind in K_QUANTS:
        return pack_k_quant(kind, rows, cols, rng)
    x = rng.standard_normal((rows, cols)).astype(np.float32) / cols ** 0.5
    return gguf.quants.quantize(x, Q[kind])


def gguf_values(raw: np.ndarray, kind: str) -> torch.Tensor:
    return torch.from_numpy(np.array(gguf.quants.dequantize(raw, Q[kind]), dtype=np.float32))


def repacked_bytes(raw: np.ndarray, kind: str, elements: int) -> int:
    """A repack moves bits and adds none, but for Q4_K/Q5_K's 12 bytes of 6-bit scales and
    mins, which become 16 (one byte each) per super-block."""
    return raw.nbytes + (4 * elements // 256 if kind in ("Q4_K", "Q5_K") else 0)


# ---- the repack, tensor by tensor ---------------------------------------------------------------
@pytest.mark.parametrize("kind", TYPES)
def test_repack_is_bitwise_the_gguf_dequantization(kind: str) -> None:
    rng = np.random.default_rng(1)
    for rows, cols in ((7, 256 * 3), (1, 256)):
        raw = raw_tensor(kind, rows, cols, rng)
        t = repack(raw, kind, (rows, cols))
        assert isinstance(t, QTensor) and t.scheme is BY_GGUF[kind]
        assert t.nbytes == repacked_bytes(raw, kind, rows * cols)
        want = gguf_values(raw, kind)
        assert want.abs().max() > 0
        assert torch.equal(t.dequantize(), want)


def test_q_and_k_rows_of_a_quantized_weight_are_put_back_as_rows() -> None:
    raw = raw_tensor("Q4_K", 16, 256, np.random.default_rng(2))
    t = repack(raw, "Q4_K", (16, 256))
    back = unpermute_rope_rows(t, 2)
    assert isinstance(back, QTensor)
    assert torch.equal(back.dequantize(), unpermute_rope_rows(gguf_values(raw, "Q4_K"), 2))


# ---- whole files ------------------------------------------------------------------------------
def _metadata(w: Any) -> None:
    w.add_context_length(64)
    w.add_embedding_length(D)
    w.add_block_count(1)
    w.add_feed_forward_length(FF)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(D // HEADS)


MATRICES = {"token_embd.weight": (VOCAB, D), "output.weight": (VOCAB, D),
            "blk.0.attn_q.weight": (D, D), "blk.0.attn_k.weight": (D // HEADS * KV, D),
            "blk.0.attn_v.weight": (D // HEADS * KV, D), "blk.0.attn_output.weight": (D, D),
            "blk.0.ffn_gate.weight": (FF, D), "blk.0.ffn_up.weight": (FF, D),
            "blk.0.ffn_down.weight": (D, FF)}
NORMS = ("output_norm.weight", "blk.0.attn_norm.weight", "blk.0.ffn_norm.weight")


def write_tiny(path: Path, kinds: dict[str, str], experts: int = 0) -> dict[str, np.ndarray]:
    """A one-layer llama GGUF: each matrix in `kinds[name]` (default the "*" entry), random;
    norms F32. With `experts`, a mixture of experts (llama.cpp's [experts, rows, cols] tensors,
    an F32 router) instead of the FFN. Returns the raw bytes of the quantized matrices."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    _metadata(w)
    raws: dict[str, np.ndarray] = {}
    for name in NORMS:
        w.add_tensor(name, (1 + 0.1 * rng.standard_normal(D)).astype(np.float32))
    matrices = dict(MATRICES)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(2)
        w.add_tensor("blk.0.ffn_gate_inp.weight",
                     rng.standard_normal((experts, D)).astype(np.float32))
        for part in ("gate", "up", "down"):
            rows, cols = matrices.pop(f"blk.0.ffn_{part}.weight")
            matrices[f"blk.0.ffn_{part}_exps.weight"] = (experts, rows, cols)
    for name, (*rows, cols) in matrices.items():
        kind = kinds.get(name, kinds["*"])
        if kind == "Q2_K":   # d, dmin f16 at the end of each 84-byte block: small, finite
            raw = rng.integers(0, 256, (*rows, cols // 256, 84), dtype=np.uint8)
            raw[..., 80:84] = np.array([1e-3, 1e-3], dtype="<f2").view(np.uint8)
            raw = raw.reshape(*rows, -1)
        else:
            raw = raw_tensor(kind, int(np.prod(rows)), cols, rng).reshape(*rows, -1)
        raws[name] = raw
        w.add_tensor(name, raw, raw_dtype=Q[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return raws


@pytest.mark.parametrize("kind", TYPES)
def test_a_gguf_model_stays_quantized_and_computes_what_its_floats_do(kind: str,
                                                                       tmp_path: Path) -> None:
    path = tmp_path / f"tiny-{kind}.gguf"
    raws = write_tiny(path, {"*": kind})
    kept, floats = archc.load(path), archc.load(path, dequantize=True)
    scheme = BY_GGUF[kind].name
    matrices = {n for n, w in kept.weights.items() if w.dim() == 2}
    assert len(matrices) == len(MATRICES)
    assert kept.quant == dict.fromkeys(matrices, scheme)
    assert describe(path).quant == kept.quant           # told from the tensor types alone
    assert floats.quant == {}
    for name, w in kept.weights.items():
        if isinstance(w, QTensor):   # gguf's values (Q/K rows put back), bitwise
            assert torch.equal(w.dequantize(), floats.weights[name]), name
        else:
            assert w.dim() == 1 and torch.equal(w, floats.weights[name]), name
    on_disk = sum(repacked_bytes(r, kind, int(np.prod(MATRICES[n]))) for n, r in raws.items())
    assert sum(w.nbytes for w in kept.weights.values() if isinstance(w, QTensor)) == on_disk
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    got, want = kept.compile()(ids), floats.compile()(ids)
    assert want.abs().max() > 0
    assert torch.equal(got, want)


def test_an_unsupported_quantized_type_is_refused_unless_dequantized(tmp_path: Path) -> None:
    path = tmp_path / "q2k.gguf"
    raws = write_tiny(path, {"*": "Q8_0", "blk.0.ffn_down.weight": "Q2_K"})
    with pytest.raises(WeightsError, match=r"tensor 'blk.0.ffn_down.weight' is stored as Q2_K"
                       r".*--dequantize"):
        archc.load(path)
    model = archc.load(path, dequantize=True)
    assert model.quant == {}
    assert torch.equal(model.weights["layers.0.ffn.down.weight"],
                       gguf_values(raws["blk.0.ffn_down.weight"], "Q2_K"))
    # what inspection sees: the supported tensors' schemes, not the Q2_K one
    assert set(describe(path).quant.values()) == {"q8_0"}
    assert "layers.0.ffn.down.weight" not in describe(path).quant


def test_memory_is_priced_at_the_bytes_a_quantized_file_holds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A host with room for the quantized weights but not for their floats: the file loads
    kept quantized and is refused, with what it would need, when read as floats."""
    path = tmp_path / "q4.gguf"
    write_tiny(path, {"*": "Q4_0"})
    floats = sum(w.numel() * 4 for w in archc.load(path, dequantize=True).weights.values())
    kept = sum(w.nbytes if isinstance(w, QTensor) else w.numel() * 4
               for w in archc.load(path).weights.values())
    assert 2 * kept < floats
    monkeypatch.setattr("archc.memory.host_available", lambda: (kept + floats) // 2)
    assert archc.load(path).quant
    with pytest.raises(ArchcError, match=r"its weights need .* in f32\) and"):
        archc.load(path, dequantize=True)


def test_experts_stored_as_one_quantized_tensor_each_stay_quantized(tmp_path: Path) -> None:
    path = tmp_path / "moe.gguf"
    raws = write_tiny(path, {"*": "Q4_K", "blk.0.ffn_down_exps.weight": "Q6_K"}, experts=4)
    kept, floats = archc.load(path), archc.load(path, dequantize=True)
    experts = {n: w for n, w in kept.weights.items() if ".experts." in n}
    assert {n: (w.dtype, w.shape) for n, w in experts.items()} == {
        "layers.0.ffn.experts.gate.weight": ("q4_k", (4, FF, D)),
        "layers.0.ffn.experts.up.weight": ("q4_k", (4, FF, D)),
        "layers.0.ffn.experts.down.weight": ("q6_k", (4, D, FF))}
    down = raws["blk.0.ffn_down_exps.weight"]
    assert torch.equal(experts["layers.0.ffn.experts.down.weight"].dequantize(),
                       gguf_values(down.reshape(4 * D, -1), "Q6_K").reshape(4, D, FF))
    assert isinstance(kept.weights["layers.0.ffn.router.weight"], torch.Tensor)
    ids = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(1))
    assert torch.equal(kept.compile()(ids), floats.compile()(ids))
