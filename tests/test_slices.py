"""A tensor-parallel rank reads only its slices of a checkpoint: `archc.load(SRC, tp=N, rank=r)`
reads from the file just the rows (or whole quantization blocks) of each tensor the sharded
program cuts, and gives bit for bit the tensors that reading each whole and cutting it gives
(`Model.sliced`) — for every kind of source (GGUF floats and quantized types, kept or
dequantised; Hugging Face directories, one file or sharded, plain and fused Q/K/V; archc's
checkpoint directories and quantized files), every rank, tp = 2 and 3. The bytes each rank reads
of each tensor are counted: 1/N of a sharded one (its share), all of a replicated one."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import archc
import archc.sources.native as native
import archc.sources.quantized as quant_file
from archc.passes.shard import ShardError
from archc.passes.slices import rank_slices, rank_span
from archc.quant.tensor import QTensor, tensor_bytes
from archc.sources.gguf import LAYOUT, GGUFFile
from archc.sources.hf import SafetensorsFiles
from archc.sources.tensor_map import Checkpoint, TensorMap

gguf = pytest.importorskip("gguf", reason="needs gguf (pip install 'archc[gguf]')")
transformers = pytest.importorskip("transformers", reason="needs transformers")

from tests.test_gguf import write_gguf  # noqa: E402  (after the skips)
from tests.test_gguf_quant import raw_tensor  # noqa: E402
from tests.test_hf_crosscheck import build, randomize  # noqa: E402

Q = gguf.GGMLQuantizationType


# ---- tiny checkpoints that split 2 and 3 ways --------------------------------------------------

def llama_12_heads() -> Any:
    """A random Llama of 12 heads over 6 KV heads, d = 192 and FFN 192 (every cut along K is
    whole 32-element blocks at tp = 2 and 3), vocabulary 96 (split too)."""
    kw: dict[str, Any] = dict(vocab_size=96, hidden_size=192, intermediate_size=192,
                              num_hidden_layers=2, num_attention_heads=12, num_key_value_heads=6,
                              max_position_embeddings=64, rms_norm_eps=1e-5, bos_token_id=1,
                              eos_token_id=2, pad_token_id=0,
                              rope_parameters={"rope_type": "default", "rope_theta": 5000.0})
    config = transformers.LlamaConfig(**kw)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    randomize(model, 0)
    return model


def write_raw_gguf(path: Path, kind: str, d: int, ff: int, heads: int, kv: int, vocab: int,
                   experts: int = 0) -> None:
    """A one-layer llama GGUF of random blocks of `kind` (K-quants too, which the gguf package
    cannot write from floats); F32 norms (and router)."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(64)
    w.add_embedding_length(d)
    w.add_block_count(1)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(d // heads)
    for name in ("output_norm.weight", "blk.0.attn_norm.weight", "blk.0.ffn_norm.weight"):
        w.add_tensor(name, (1 + 0.1 * rng.standard_normal(d)).astype(np.float32))
    kv_rows = d // heads * kv
    ffn = {"gate": (ff, d), "up": (ff, d), "down": (d, ff)}
    matrices = {"token_embd.weight": (vocab, d), "output.weight": (vocab, d),
                "blk.0.attn_q.weight": (d, d), "blk.0.attn_k.weight": (kv_rows, d),
                "blk.0.attn_v.weight": (kv_rows, d), "blk.0.attn_output.weight": (d, d)}
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(2)
        w.add_tensor("blk.0.ffn_gate_inp.weight",
                     rng.standard_normal((experts, d)).astype(np.float32))
        matrices |= {f"blk.0.ffn_{p}_exps.weight": (experts, *s) for p, s in ffn.items()}
    else:
        matrices |= {f"blk.0.ffn_{p}.weight": s for p, s in ffn.items()}
    for name, (*rows, cols) in matrices.items():
        raw = raw_tensor(kind, int(np.prod(rows)), cols, rng).reshape(*rows, -1)
        w.add_tensor(name, raw, raw_dtype=Q[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every checkpoint the tests read, by a short name."""
    root = tmp_path_factory.mktemp("slices")
    out: dict[str, Path] = {}
    model = llama_12_heads()
    for qtype in ("F32", "F16", "BF16", "Q8_0", "Q4_1"):
        out[f"gguf-{qtype}"] = root / f"llama-{qtype}.gguf"
        write_gguf(model, out[f"gguf-{qtype}"], Q[qtype])
    # K-quants: rows of 256-element blocks, so K = 768 splits 3 ways (and not 2: read whole)
    for kind in ("Q4_K", "Q6_K"):
        out[f"gguf-{kind}"] = root / f"raw-{kind}.gguf"
        write_raw_gguf(out[f"gguf-{kind}"], kind, 768, 768, 6, 6, 96)
    out["gguf-moe-Q8_0"] = root / "moe-Q8_0.gguf"
    write_raw_gguf(out["gguf-moe-Q8_0"], "Q8_0", 192, 192, 12, 6, 96, experts=3)
    out["hf"] = root / "hf"
    model.save_pretrained(out["hf"])
    out["hf-sharded"] = root / "hf-sharded"
    model.save_pretrained(out["hf-sharded"], max_shard_size="200KB")
    assert len(list(out["hf-sharded"].glob("*.safetensors"))) > 2
    whole = archc.load(out["hf"])
    out["native"] = root / "native"
    native.save(out["native"], whole.spec, whole.weights)
    # int4 in groups of 32; int8 with one scale per row, cut along K anywhere
    for kind in ("int4", "int8"):
        out[f"quant-{kind}"] = root / f"llama-{kind}.safetensors"
        q = whole.quantized(kind, 32)
        quant_file.save(out[f"quant-{kind}"], q.spec, q.weights)
    # fused Q/K/V: concatenated (GPT-2, stored transposed; Falcon MQA, its one KV head
    # replicated), per head (GPT-NeoX, BLOOM), per KV group (Falcon's new architecture: at
    # tp = 4 two ranks share a group's K and V and split its queries); experts one tensor each
    for case in ("gpt2", "gpt_neox", "bloom", "falcon-mqa", "falcon-new-arch", "mixtral"):
        out[f"hf-{case}"] = root / case
        build(case, out[f"hf-{case}"])
    return out


# (file, tp): every kind of source at tp = 2 and 3 where its shapes split
CASES = [(name, tp) for name in ("gguf-F32", "gguf-F16", "gguf-BF16", "gguf-Q8_0", "gguf-Q4_1",
                                 "gguf-moe-Q8_0", "hf", "hf-sharded", "native", "quant-int4",
                                 "quant-int8")
              for tp in (2, 3)] + [
    ("gguf-Q4_K", 3), ("gguf-Q6_K", 3), ("hf-gpt2", 2), ("hf-gpt_neox", 2), ("hf-bloom", 2),
    ("hf-falcon-mqa", 2), ("hf-falcon-mqa", 4), ("hf-falcon-new-arch", 2),
    ("hf-falcon-new-arch", 4), ("hf-mixtral", 2)]


def same(a: Any, b: Any) -> bool:
    """Bit for bit the same weight: dtype, shape and every stored value (a quantized one's
    scheme and parts)."""
    if isinstance(a, QTensor) or isinstance(b, QTensor):
        return (isinstance(a, QTensor) and isinstance(b, QTensor) and a.scheme == b.scheme
                and a.shape == b.shape and a.parts.keys() == b.parts.keys()
                and all(same(a.parts[k], b.parts[k]) for k in a.parts))
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize(("name", "tp"), CASES)
def test_a_rank_reads_what_reading_whole_and_cutting_gives(files: dict[str, Path], name: str,
                                                            tp: int) -> None:
    whole = archc.load(files[name])
    cuts = rank_slices(whole.graph, tp)
    assert cuts, "nothing is cut: the case tests nothing"
    for rank in range(tp):
        got, want = archc.load(files[name], tp=tp, rank=rank), whole.sliced(tp, rank)
        assert got.shard == want.shard == (tp, rank)
        assert got.weights.keys() == want.weights.keys()
        for key, w in want.weights.items():
            assert same(got.weights[key], w), f"{name}, tp={tp}, rank {rank}: {key}"
            if isinstance(w, QTensor) and key in cuts:   # its values: the whole's, cut
                dim, start, stop = rank_span(cuts[key], w.shape[cuts[key][0]] * cuts[key][1],
                                             rank)
                assert torch.equal(got.weights[key].dequantize(), whole.weights[key]
                                   .dequantize().narrow(dim, start, stop - start)), key


def test_a_quantized_k_that_does_not_split_is_refused_before_any_read(
        files: dict[str, Path]) -> None:
    """Q4_K's 256-element super-blocks: K = 768 does not split over 2 ranks. Refused by the
    shard pass with the field and the tp that work — on load and before any rank starts — not
    by a failed cut after the ranks are running."""
    from archc.cli import main
    message = (r"attention.heads × attention.head_dim = 768 \(K of the q4_k weights\) does not "
               r"split into tp parts of whole 256-element groups; tp values that work: 1, 3")
    with pytest.raises(ShardError, match=message):
        archc.load(files["gguf-Q4_K"], tp=2, rank=0)
    started = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("archc.commands.launch.launch", lambda *a, **kw: started.append(a) or 0)
        assert main(["run", str(files["gguf-Q4_K"]), "--tp", "2", "--quiet"]) == 2
    assert not started


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_a_rank_quantizing_at_load_holds_the_whole_models_quantized_slices(
        files: dict[str, Path], kind: str) -> None:
    """--quantize with --tp: each rank holds what quantizing the whole checkpoint and cutting
    gives — an int8 row's scale is its whole row's, also where the rank holds part of the row."""
    whole = archc.load(files["hf"], quantize=kind, group=32)
    for rank in range(2):
        got, want = archc.load(files["hf"], quantize=kind, group=32, tp=2, rank=rank), \
            whole.sliced(2, rank)
        assert got.weights.keys() == want.weights.keys()
        for key, w in want.weights.items():
            assert same(got.weights[key], w), f"{kind}, rank {rank}: {key}"


@pytest.mark.parametrize(("name", "tp"), [("gguf-Q4_K", 3), ("gguf-Q4_K", 2), ("gguf-Q8_0", 3)])
def test_a_gguf_file_read_as_floats_slices_alike(files: dict[str, Path], name: str,
                                                 tp: int) -> None:
    """Dequantised: the program is a float one, so its cuts along K need not fall on the
    file's blocks (Q4_K's 256 at tp = 2: those rows are read whole, then cut)."""
    whole = archc.load(files[name], dequantize=True)
    for rank in range(tp):
        got = archc.load(files[name], dequantize=True, tp=tp, rank=rank)
        for key, w in whole.sliced(tp, rank).weights.items():
            assert same(got.weights[key], w), f"{name}, tp={tp}, rank {rank}: {key}"


# ---- the bytes a rank reads ---------------------------------------------------------------------

class Reads:
    """Bytes of tensor data each checkpoint tensor gave, counted at the sources every reader
    reads through: GGUF files and safetensors files (Hugging Face directories, archc's
    checkpoint directories, the parts and float tensors of its quantized files), their `load`
    and `load_slice`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.bytes: dict[str, int] = defaultdict(int)
        for cls in (GGUFFile, SafetensorsFiles):
            for method in ("load", "load_slice"):
                monkeypatch.setattr(cls, method, self._counted(getattr(cls, method)))

    def _counted(self, method: Any) -> Any:
        def read(source: Any, name: str, *args: Any) -> Any:
            out = method(source, name, *args)
            self.bytes[name] += tensor_bytes(out)
            return out
        return read


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[Reads]:
    yield Reads(monkeypatch)


def share(model: archc.Model, tp: int) -> dict[str, Fraction]:
    """archc tensor → the share of it a rank keeps: 1/parts of one the sharded program cuts
    (every > 1 ranks sharing a part keep the same one), 1 of a replicated one."""
    cuts = rank_slices(model.graph, tp)
    return {k: Fraction(1, cuts[k][1]) if k in cuts else Fraction(1) for k in model.weights}


def file_shares(name: str, path: Path, model: archc.Model, tp: int) -> dict[str, Fraction]:
    """Checkpoint tensor → the share of it a rank reads: its targets' shares, weighted by their
    elements (a fused Q/K/V is its targets' rows), through the source's own rules."""
    keep = share(model, tp)
    if name == "native":
        return keep
    if name.startswith("quant"):
        return {f"{k}.{p}": s for k, s in keep.items() if isinstance(model.weights[k], QTensor)
                for p in model.weights[k].parts} | {
            k: s for k, s in keep.items() if not isinstance(model.weights[k], QTensor)}
    if name.startswith("gguf"):
        ckpt, layout = Checkpoint(GGUFFile(path)), LAYOUT
    else:
        from archc.sources.hf import _read
        _, arch, ckpt, _ = _read(path, True)
        layout = arch.layout
    from archc.ir.lower import lower
    from archc.runtime.weights import checkpoint_shapes
    tmap = TensorMap(layout, model.spec, ckpt, checkpoint_shapes(lower(model.spec)))
    out: dict[str, Fraction] = {}
    for rule in tmap.rules:
        if rule.targets:
            size = {t: model.weights[t].numel() for t in rule.targets}
            fraction = sum(size[t] * keep[t] for t in size) / sum(size.values())
            out |= dict.fromkeys(rule.sources, fraction)
    return out


@pytest.mark.parametrize(("name", "tp"), [
    ("gguf-F32", 3), ("gguf-Q4_1", 2), ("gguf-Q4_K", 3), ("gguf-moe-Q8_0", 3), ("hf-sharded", 3),
    ("hf-gpt2", 2), ("hf-bloom", 2), ("hf-falcon-mqa", 4), ("hf-falcon-new-arch", 4),
    ("hf-mixtral", 2), ("native", 2), ("quant-int4", 3)])
def test_a_rank_reads_its_share_of_each_tensor(files: dict[str, Path], reads: Reads, name: str,
                                               tp: int) -> None:
    """Each checkpoint tensor's bytes read by one rank are its share of the bytes one process
    reads of it: 1/tp of a tensor cut over the ranks, all of a replicated one; the rank's total
    is its slices of the sharded weights plus the replicated ones, and what it holds."""
    whole_model = archc.load(files[name])
    reads.bytes.clear()
    archc.load(files[name])
    whole = dict(reads.bytes)
    shares = file_shares(name, files[name], whole_model, tp)
    assert whole.keys() == shares.keys()
    assert any(s < 1 for s in shares.values()) and any(s == 1 for s in shares.values())
    for rank in range(tp):
        reads.bytes.clear()
        model = archc.load(files[name], tp=tp, rank=rank)
        for key, n in whole.items():
            expect = n * shares[key]
            assert reads.bytes[key] == expect, f"{name}, rank {rank}: {key} read " \
                f"{reads.bytes[key]} of {n} bytes, expected {expect}"
        assert sum(reads.bytes.values()) == sum(tensor_bytes(w) for w in model.weights.values())
