"""GGUF files → Model: metadata → spec by the mapping of the file's `general.architecture`
(``archc.sources.gguf_archs``: llama, qwen3, qwen3moe, gemma3, olmo2, deepseek2 — fields of its
namespace that archc does not know are refused by name, as config.json fields are), tensors, the
tokenizer and chat template.

Tensors of the block types archc has a scheme for (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K,
Q6_K: `archc.quant.schemes.BY_GGUF`) stay quantized: their bytes are repacked, exactly, into
archc's planar layout (`archc.quant.gguf_repack`). F32, F16 and BF16 tensors read as floats. Any
other quantized type is refused, unless the file is read with `dequantize=True` (`--dequantize`),
which dequantises every tensor with the `gguf` package (any type its `quants` implements).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from archc.errors import ArchcError, SpecError, WeightsError
from archc.ir.lower import lower
from archc.memory import release_freed
from archc.model import Model, Progress
from archc.quant.gguf_repack import UNPACK, repack, supported
from archc.quant.schemes import BY_GGUF
from archc.quant.tensor import QTensor
from archc.runtime.weights import checkpoint_shapes
from archc.sources.gguf_archs import (
    GGUF_ARCHES,
    LAYOUT,
    GGUFArch,
    unpermute_rope_rows,
)
from archc.sources.gguf_reader import read_gguf
from archc.sources.hf_config import HFConfig
from archc.sources.tensor_map import Checkpoint, Span, TensorMap, read_checkpoint
from archc.spec import from_dict
from archc.spec.schema import Spec
from archc.tokenizer import Tokenizer, from_gguf_vocab

# the llama layout and its Q/K row order, where tests and tools read them
__all__ = ["LAYOUT", "GGUFFile", "file_quant", "load_gguf", "spec_of_file",
           "unpermute_rope_rows"]

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


def arch_of(f: GGUFFile) -> GGUFArch:
    """The mapping of the file's `general.architecture`."""
    arch = f.fields.get("general.architecture")
    if arch not in GGUF_ARCHES:
        raise SpecError("general.architecture", f"{arch!r} is not supported", source=str(f.path),
                        allowed=", ".join(sorted(GGUF_ARCHES)))
    return GGUF_ARCHES[arch]


def spec_of_file(f: GGUFFile) -> Spec:
    arch = f.fields["general.architecture"]
    mapping = arch_of(f)
    meta = HFConfig({k.removeprefix(f"{arch}."): v for k, v in f.fields.items()
                     if k.startswith(f"{arch}.")}, str(f.path), model_type=arch,
                    prefix=f"{arch}.")
    data = mapping.spec(f, meta)
    meta.check_all_understood()
    return from_dict(data, source=str(f.path))


def file_quant(f: GGUFFile, spec: Spec) -> dict[str, str]:
    """archc tensor → scheme for the tensors of `f` that load kept quantized, read off the
    tensor types alone (no data is read)."""
    arch = arch_of(f)
    tmap = TensorMap(arch.layout, spec, Checkpoint(f), checkpoint_shapes(lower(spec)))
    out: dict[str, str] = {}
    for rule in tmap.rules:
        if any(re.fullmatch(p, n) for p in arch.dequantized for n in rule.sources):
            continue
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
    mapping = arch_of(f)
    weights, _ = read_checkpoint(spec, Checkpoint(f), mapping.layout, skip=mapping.skip,
                                 progress=progress, dtype=dtype,
                                 quant={} if dequantize else file_quant(f, spec), shard=shard)
    return Model(spec, weights, tokenizer=tokenizer, shard=shard,
                 chat_template=tokenizer.chat_template if tokenizer else None,
                 source=str(path), eos_token_ids=tokenizer.eos_token_ids if tokenizer else ())
