"""GGUF files of the llama architecture → Model: metadata → spec (fields in the `llama.`
namespace that archc does not know are refused by name, as config.json fields are), tensors, the
tokenizer and chat template.

Tensors of the block types archc has a scheme for (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K,
Q6_K: `archc.quant.schemes.BY_GGUF`) stay quantized: their bytes are repacked, exactly, into
archc's planar layout (`archc.quant.gguf_repack`). F32, F16 and BF16 tensors read as floats. Any
other quantized type is refused, unless the file is read with `dequantize=True` (`--dequantize`),
which dequantises every tensor with the `gguf` package (any type its `quants` implements).

llama.cpp's converter reorders the rows of each head of the Q and K projections so that its RoPE
can rotate interleaved pairs; archc's Llama rotates halves (as the original checkpoint does), so
the loader puts the rows back.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from archc.errors import ArchcError, SpecError, WeightsError
from archc.ir.lower import lower
from archc.ir.paramexpr import rope_inv_freq
from archc.memory import release_freed
from archc.model import Model, Progress
from archc.quant.gguf_repack import UNPACK, repack, supported
from archc.quant.schemes import BY_GGUF
from archc.quant.tensor import QTensor
from archc.runtime.weights import checkpoint_shapes
from archc.sources.gguf_reader import read_gguf
from archc.sources.hf_config import HFConfig, spec_name
from archc.sources.tensor_map import (
    Checkpoint,
    Layout,
    Part,
    Span,
    TensorMap,
    each,
    read_checkpoint,
)
from archc.spec import from_dict
from archc.spec.schema import Spec
from archc.tokenizer import Tokenizer, from_gguf_vocab

ARCH = "llama"


class GGUFFile:
    """Metadata fields and tensors of one GGUF file. `keep_quantized`: `load` returns the
    tensors of a block type archc has a scheme for as QTensors (else as f32 values)."""

    def __init__(self, path: Path, *, keep_quantized: bool = False) -> None:
        try:
            import gguf
        except ImportError:  # pragma: no cover - an optional dependency
            raise ArchcError("reading GGUF files needs the `gguf` package "
                             "(pip install 'archc[gguf]')") from None
        self.path, self.dequantize = path, gguf.quants.dequantize
        self.keep_quantized, self.block_sizes = keep_quantized, gguf.GGML_QUANT_SIZES
        if not path.is_file():
            raise WeightsError(f"{path}: no such file")
        # plain reads of the metadata; each tensor's bytes mapped only while it is read
        self.fields, self.tensors = read_gguf(path, gguf.GGML_QUANT_SIZES,
                                              gguf.GGMLQuantizationType)

    def shape(self, name: str) -> tuple[int, ...]:
        """[out, in] as torch orders it (GGUF lists dims innermost first)."""
        return tuple(int(d) for d in reversed(self.tensors[name].shape))

    def kind(self, name: str) -> str:
        """The GGML type a tensor is stored as ("F32", "Q4_K")."""
        return self.tensors[name].tensor_type.name

    def quantized(self, name: str) -> bool:
        """Is the tensor stored in blocks of quantized values (not F32/F16/BF16 or integers)?"""
        return self.block_sizes[self.tensors[name].tensor_type][0] > 1

    def load(self, name: str) -> torch.Tensor | QTensor:
        return self._values(name, self.tensors[name].data, self.shape(name))

    def load_slice(self, name: str, span: Span) -> torch.Tensor | QTensor:
        """Elements [start, stop) of dim `dim` of a tensor, read through the file's memory map
        alone: rows of a leading dim, or columns of the last where both ends fall on whole
        blocks of its type (each row is a run of blocks); else read whole and narrowed."""
        dim, start, stop = span
        t, shape = self.tensors[name], self.shape(name)
        dim %= len(shape)
        index: list[slice] = [slice(None)] * len(shape)
        if dim < len(shape) - 1:
            index[dim] = slice(start, stop)
        else:
            block, size = self.block_sizes[t.tensor_type]
            if start % block or stop % block:   # not whole blocks: whole rows, narrowed after
                whole = self.load(name)
                out = whole.narrow(dim, start, stop - start)
                return out if isinstance(out, QTensor) else out.contiguous()
            # a quantized (or BF16) row is stored as bytes, `size` of them per `block` elements
            per = (1, 1) if t.data.dtype != np.uint8 else (block, size)
            index[dim] = slice(start // per[0] * per[1], stop // per[0] * per[1])
        cut = tuple(stop - start if d == dim else n for d, n in enumerate(shape))
        return self._values(name, t.data[tuple(index)], cut)

    def _values(self, name: str, data: np.ndarray, shape: tuple[int, ...]
                ) -> torch.Tensor | QTensor:
        """The tensor `shape` of tensor `name`'s stored `data` (all of it, or a view of some
        rows or blocks): repacked, kept quantized, or as f32 values."""
        t = self.tensors[name]
        kind = t.tensor_type.name
        if self.keep_quantized and self.quantized(name):
            if not supported(kind):
                raise unsupported(name, kind)
            return repack(data, kind, shape)
        try:
            values = self.dequantize(data, t.tensor_type)
        except NotImplementedError:
            raise WeightsError(f"tensor {name!r} is stored as {kind}, which the gguf package "
                               f"cannot dequantise") from None
        except Exception as err:
            raise WeightsError(f"{self.path}: tensor {name!r} ({kind}) cannot be read "
                               f"({err}); is the file truncated?") from None
        # a copy only where the values are not already a writeable f32 array
        return torch.from_numpy(np.require(values, np.float32, ("C", "W")).reshape(shape))


def unsupported(name: str, kind: str) -> WeightsError:
    """The error for a tensor of a quantized type archc has no scheme for."""
    return WeightsError(f"tensor {name!r} is stored as {kind}, a quantized type archc does not "
                        f"keep quantized (it keeps {', '.join(UNPACK)}); --dequantize "
                        "(dequantize=True) reads the file as floats")


def _f32(value: float) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not 9.99999975e-06)."""
    return float(f"{value:.7g}")


def llama3_scaling(f: GGUFFile, theta: float, rotary_dim: int) -> dict[str, Any]:
    """Llama 3.1's RoPE scaling from the per-frequency divisors llama.cpp stores instead of its
    parameters (`rope_freqs.weight`, θ_j / f_j).

    The llama3 rule keeps short wavelengths (f = 1), divides long ones by `factor` (f = factor)
    and between them blends: 1/f = (1 − s)/factor + s with s = (L/λ − low)/(high − low), which
    is linear in 1/λ. The middle band's points give that line; its slope L/(high − low) and
    intercept −low/(high − low) fix the rule up to one common scale of L, low and high, so
    low = 1 is taken. The parameters are accepted only if archc's llama3 frequencies computed
    from them reproduce θ_j / f_j (to f32 rounding); anything else is refused."""
    where = "rope_freqs.weight"
    factors = f.load(where).double().flatten()
    if factors.numel() != rotary_dim // 2 or not bool((factors >= 1.0 - 1e-6).all()):
        raise SpecError(where, f"{factors.numel()} factors, expected {rotary_dim // 2} of ≥ 1 "
                        "(one divisor per rotary pair)", source=str(f.path))
    base = rope_inv_freq(rotary_dim, theta).double()
    factor = float(factors.max())
    medium = (factors > 1.0 + 1e-6) & (factors < factor * (1 - 1e-6))
    if factor > 1.0 + 1e-6 and int(medium.sum()) >= 2:
        inv_wavelen = base[medium] / (2 * math.pi)
        blend = (1 / factors[medium] - 1 / factor) / (1 - 1 / factor)
        design = torch.stack([inv_wavelen, torch.ones_like(inv_wavelen)], dim=1)
        slope, intercept = (float(v) for v in torch.linalg.lstsq(design, blend[:, None]).solution)
        if intercept < 0 and slope > 0:
            params = {"factor": _f32(factor), "original_max_seq_len": round(-slope / intercept),
                      "low_freq_factor": 1.0, "high_freq_factor": _f32(1.0 - 1.0 / intercept)}
            got = rope_inv_freq(rotary_dim, theta, **params, kind="llama3").double()
            if torch.allclose(got, (base / factors).float().double(), rtol=1e-5, atol=0.0):
                return {"kind": "llama3", **params}
    raise SpecError(where, "per-frequency RoPE factors that do not follow Llama 3's scaling rule "
                    "(factors > 1, at least two of them blended)", source=str(f.path))


def spec_of_file(f: GGUFFile) -> Spec:
    arch = f.fields.get("general.architecture")
    if arch != ARCH:
        raise SpecError("general.architecture", f"{arch!r} is not supported: archc reads "
                        "llama-architecture GGUF files", source=str(f.path), allowed=ARCH)
    meta = HFConfig({k.removeprefix("llama."): v for k, v in f.fields.items()
                     if k.startswith("llama.")}, str(f.path), model_type=ARCH, prefix="llama.")
    d = meta.number("embedding_length")
    heads = meta.number("attention.head_count")
    kv = meta.get("attention.head_count_kv", heads)
    if isinstance(kv, list):  # per-layer counts: only a uniform list is a spec
        if len(set(kv)) != 1:
            raise meta.refuse("attention.head_count_kv", kv, "every layer must have the same "
                              "number of KV heads")
        kv = kv[0]
    head_dim = meta.number("attention.key_length", d // heads)
    meta.expect("attention.value_length", (head_dim,), f"keys and values of different widths "
                f"({head_dim})")
    meta.expect("rope.dimension_count", (head_dim,), f"llama rotates the whole head ({head_dim} "
                "dims)")
    max_seq = meta.number("context_length", 2048)
    position: dict[str, Any] = {"kind": "rope",
                                "theta": _f32(meta.number("rope.freq_base", 10000.0, kind=float))}
    scaling = meta.expect("rope.scaling.type", ("none", "linear", "yarn"))
    factor = meta.number("rope.scaling.factor", 1.0, kind=float)
    if scaling == "linear" and factor != 1.0:
        position["scaling"] = {"kind": "linear", "factor": factor}
    elif scaling == "yarn":
        position["scaling"] = {"kind": "yarn", "factor": factor, "original_max_seq_len":
                               meta.number("rope.scaling.original_context_length", max_seq)}
    if "rope_freqs.weight" in f.tensors:
        if "scaling" in position:
            raise meta.refuse("rope.scaling.type", scaling, "the file also holds per-frequency "
                              "factors (rope_freqs.weight): one scaling at a time")
        position["scaling"] = llama3_scaling(f, position["theta"], head_dim)
    ffn: dict[str, Any] = {"kind": "swiglu", "d_ff": meta.number("feed_forward_length")}
    if experts := meta.number("expert_count", 0):
        ffn |= {"kind": "moe", "moe": {"experts": experts,
                                       "top_k": meta.number("expert_used_count", 2)}}
    embed_rows = f.shape("token_embd.weight")[0] if "token_embd.weight" in f.tensors else None
    data = {
        "name": spec_name(f.path.stem, str(f.fields.get("general.name") or "")),
        "description": f"{f.fields.get('general.name') or f.path.stem} from {f.path.name}",
        "vocab_size": meta.number("vocab_size", embed_rows or
                                  f.fields.size("tokenizer.ggml.tokens")),
        "d_model": d, "layers": meta.number("block_count"), "max_seq_len": max_seq, "dtype": "f32",
        "attention": {"heads": heads, "kv_heads": kv, "head_dim": head_dim, "bias": {
            p[0]: f"blk.0.attn_{p}.bias" in f.tensors for p in ("q", "k", "v", "output")}},
        "ffn": ffn, "position": position, "norm": {"kind": "rmsnorm", "eps": _f32(
            meta.number("attention.layer_norm_rms_epsilon", 1e-5, kind=float))},
        "embedding": {"tied": "output.weight" not in f.tensors}}
    meta.check_all_understood()
    return from_dict(data, source=str(f.path))


def unpermute_rope_rows(w: torch.Tensor | QTensor, heads: int) -> torch.Tensor | QTensor:
    """Undo llama.cpp's reordering of Q/K rows: within each head it stores rows as interleaved
    pairs (0, d/2, 1, d/2+1, ...) of the original half-split order. Whole rows move, so a
    quantized weight stays quantized."""
    # row order (heads, D/2, 2) → (heads, 2, D/2)
    rows = torch.arange(w.shape[0]).reshape(heads, -1, 2).transpose(1, 2).reshape(-1)
    return w.index_select(0, rows).contiguous() if isinstance(w, torch.Tensor) else \
        w.index_select(0, rows)


def _rope_rows(t: TensorMap) -> None:
    """Q and K, weights and biases, with their rows put back in half-split order."""
    for target in t.want:
        if m := re.fullmatch(r"layers\.\d+\.attn\.([qk])\.(weight|bias)", target):
            heads = t.spec.attention.heads if m[1] == "q" else t.spec.attention.kv_heads
            name, rows = t.name(target), t.want[target][0]
            t.add([name], [t.want[target]], [target],
                  lambda xs, h=heads: [unpermute_rope_rows(xs[0], h)],
                  lambda spans, n=name, x=target, h=heads, r=rows:
                  _narrow_rope_rows(n, spans[x], h, r))


def _narrow_rope_rows(name: str, span: Span, heads: int, rows: int) -> Part | None:
    """A rank's slice of Q or K (`rows` rows over `heads` heads) read from the file: the
    un-permutation moves rows within each head, so a span of whole heads is the same rows of
    the file, put back head by head, and a span of columns commutes with it. A span that
    splits a head (which the shard pass, cutting whole heads, never makes) is read whole."""
    dim, start, stop = span
    if dim != 0:
        return Part(((name, span),), lambda xs: [unpermute_rope_rows(xs[0], heads)])
    per_head = rows // heads
    if start % per_head or stop % per_head:
        return None
    return Part(((name, span),),
                lambda xs: [unpermute_rope_rows(xs[0], (stop - start) // per_head)])


LAYOUT = Layout({
    "embed": "token_embd", "final_norm": "output_norm", "attn_norm": "attn_norm",
    "ffn_norm": "ffn_norm", **each("attn.*", "attn_*", "q k v"), "attn.o": "attn_output",
    **each("ffn.*", "ffn_*", "gate up down"), "ffn.router": "ffn_gate_inp",
    **each("ffn.experts.*", "ffn_*_exps", "gate up down")},
    layer="blk.{i}.", head=("output",), special=_rope_rows)


def file_quant(f: GGUFFile, spec: Spec) -> dict[str, str]:
    """archc tensor → scheme for the tensors of `f` that load kept quantized, read off the
    tensor types alone (no data is read)."""
    tmap = TensorMap(LAYOUT, spec, Checkpoint(f), checkpoint_shapes(lower(spec)))
    out: dict[str, str] = {}
    for rule in tmap.rules:
        kinds = {f.kind(n) if n in f.tensors else None for n in rule.sources}
        if len(kinds) == 1 and (kind := kinds.pop()) is not None and supported(kind):
            out |= dict.fromkeys(rule.targets, BY_GGUF[kind].name)
    return out


def _tokenizer(f: GGUFFile) -> Tokenizer | None:
    """The tokenizer the file's `tokenizer.ggml.*` metadata stores, if any."""
    if not f.fields.size("tokenizer.ggml.tokens"):
        return None
    tok = {k.removeprefix("tokenizer.ggml."): f.fields[k] for k in f.fields
           if k.startswith("tokenizer.")}
    eos = [tok[k] for k in ("eos_token_id", "eot_token_id", "eom_token_id")
           if isinstance(tok.get(k), int)]
    return from_gguf_vocab(
        model=str(tok.get("model", "gpt2")), tokens=tok["tokens"],
        token_types=tok.get("token_type"), merges=tok.get("merges"), scores=tok.get("scores"),
        pre=tok.get("pre"), bos_id=tok.get("bos_token_id"), eos_ids=list(dict.fromkeys(eos)),
        add_bos=tok.get("add_bos_token"), add_space_prefix=tok.get("add_space_prefix"),
        chat_template=tok.get("tokenizer.chat_template"), source=str(f.path))


def load_gguf(path: Path, *, progress: Progress | None = None, dtype: str | None = None,
              dequantize: bool = False, shard: tuple[int, int] | None = None) -> Model:
    """The model of a GGUF file, with the tokenizer its `tokenizer.ggml.*` metadata stores, if
    any. Tensors of the quantized types archc has a scheme for stay quantized (any other
    quantized type is refused); the rest are read in f32 (or `dtype`, one at a time). With
    `dequantize`, every tensor is dequantised to f32 (or `dtype`) instead."""
    f = GGUFFile(path, keep_quantized=not dequantize)
    spec = spec_of_file(f)
    if not dequantize:   # refused before anything is read
        for name in f.tensors:
            if f.quantized(name) and not supported(f.kind(name)):
                raise unsupported(name, f.kind(name))
    tokenizer = _tokenizer(f)   # first: its vocabulary's strings are gone before the weights
    release_freed()
    # rope_freqs.weight, when there, was read into the spec's RoPE scaling
    weights, _ = read_checkpoint(spec, Checkpoint(f), LAYOUT, skip=(r"rope_freqs\.weight",),
                                 progress=progress, dtype=dtype,
                                 quant={} if dequantize else file_quant(f, spec), shard=shard)
    return Model(spec, weights, tokenizer=tokenizer, shard=shard,
                 chat_template=tokenizer.chat_template if tokenizer else None,
                 source=str(path), eos_token_ids=tokenizer.eos_token_ids if tokenizer else ())
