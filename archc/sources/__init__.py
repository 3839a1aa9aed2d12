"""Sources of real models: Hugging Face directories, GGUF files, archc's checkpoint directories
and quantized files, each read through a ``TensorSource`` (``tensor_map``).

``archc.load`` tries their loaders (``archc.api.SOURCES``) beside zoo names and spec files;
``describe`` reads just the spec of any source. A spec that names a checkpoint (``weights:``)
runs that checkpoint's tensors (``borrowed``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from archc.errors import SpecError, WeightsError
from archc.ir.lower import lower
from archc.runtime.weights import check_shapes, checkpoint_shapes
from archc.sources.gguf import GGUFFile, file_quant, load_gguf, spec_of_file
from archc.sources.hf import hf_spec, is_hf_dir, load_hf
from archc.sources.native import SPEC_FILE, is_native
from archc.sources.quantized import is_quantized_file, read_header
from archc.spec.load import load_spec, load_yaml
from archc.spec.schema import Spec

__all__ = ["Source", "borrowed", "describe", "is_gguf", "is_hf_dir", "load_gguf", "load_hf"]


def is_gguf(path: Path) -> bool:
    return path.suffix.lower() == ".gguf"


@dataclass(frozen=True)
class Source:
    """What a source is, read without loading its weights."""

    kind: str          # "spec" (a zoo name or YAML: random weights), "gguf", "hf" or "archc"
    spec: Spec
    tokenizer: bool    # does it carry a tokenizer?
    quant: dict[str, str] = field(default_factory=dict)  # tensor → scheme, for quantized ones

    @property
    def random_weights(self) -> bool:
        return self.kind == "spec"


def describe(source: str | Path) -> Source:
    """The kind, spec and tokenizer presence of any source: an HF directory's config, a GGUF
    file's metadata, an archc checkpoint directory's spec, an archc quantized file's metadata,
    a spec file or zoo name."""
    path = Path(source)
    if is_gguf(path):
        f = GGUFFile(path)
        spec = spec_of_file(f)
        return Source("gguf", spec, f.fields.size("tokenizer.ggml.tokens") > 0,
                      file_quant(f, spec))
    if is_native(path):
        return Source("archc", load_yaml(path / SPEC_FILE), False)
    if is_hf_dir(path):
        return Source("hf", hf_spec(path), (path / "tokenizer.json").is_file())
    if is_quantized_file(path):     # archc's quantized file: spec and schemes in its metadata
        spec, quant = read_header(path)
        return Source("archc", spec, False, {name: s for name, (s, _) in quant.items()})
    spec = load_spec(source)
    return Source("spec", spec, False) if spec.weights is None else borrowed(spec)


def borrowed(spec: Spec) -> Source:
    """The checkpoint a spec names (`weights:`) as a source of `spec`: its kind, tokenizer and
    quantized tensors, once each of its tensors (as its own spec maps them to archc's names) has
    the shape the program of `spec` wants. Nothing is read but the checkpoint's config or
    header."""
    assert spec.weights is not None
    path = Path(spec.weights)
    kinds = "a Hugging Face directory, GGUF file, archc checkpoint directory or quantized file"
    if not path.exists():
        raise SpecError("weights", f"{str(path)!r} does not exist", allowed=kinds)
    held = describe(path)
    if held.kind == "spec":
        raise SpecError("weights", f"{str(path)!r} is a spec, not a checkpoint", allowed=kinds)
    try:
        check_shapes(checkpoint_shapes(lower(spec, quant=held.quant)),
                     checkpoint_shapes(lower(held.spec, quant=held.quant)))
    except WeightsError as err:
        raise WeightsError(f"{spec.name} cannot run the weights of {path}: {err}") from None
    return Source(held.kind, spec, held.tokenizer, held.quant)
