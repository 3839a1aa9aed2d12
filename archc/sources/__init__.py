"""Sources of real models: Hugging Face directories and GGUF files.

``archc.load`` tries both loaders (``archc.api.SOURCES``), so it accepts a directory or a ``.gguf``
path beside zoo names and spec files; ``describe`` reads just the spec of any source.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from archc.model import Model, Progress
from archc.sources.hf import hf_spec, is_hf_dir, load_hf
from archc.spec import load_spec
from archc.spec.schema import Spec

__all__ = ["Source", "describe", "is_gguf", "is_hf_dir", "load_gguf", "load_hf"]


def is_gguf(path: Path) -> bool:
    return path.suffix.lower() == ".gguf"


def load_gguf(path: Path, *, progress: Progress | None = None, dtype: str | None = None) -> Model:
    from archc.sources import gguf  # reads the gguf package only when a file is loaded
    return gguf.load_gguf(path, progress=progress, dtype=dtype)


@dataclass(frozen=True)
class Source:
    """What a source is, read without loading its weights."""

    kind: str          # "spec" (a zoo name or YAML: random weights), "gguf", "hf" or "archc"
    spec: Spec
    tokenizer: bool    # does it carry a tokenizer?

    @property
    def random_weights(self) -> bool:
        return self.kind == "spec"


def describe(source: str | Path) -> Source:
    """The kind, spec and tokenizer presence of any source: an HF directory's config, a GGUF
    file's metadata, an archc checkpoint directory's spec, a spec file or zoo name."""
    import archc.native as native
    path = Path(source)
    if is_gguf(path):
        from archc.sources.gguf import GGUFFile, spec_of_file
        f = GGUFFile(path)
        return Source("gguf", spec_of_file(f), bool(f.fields.get("tokenizer.ggml.tokens")))
    if native.is_native(path):
        from archc.spec.load import load_yaml
        return Source("archc", load_yaml(path / native.SPEC_FILE), False)
    if is_hf_dir(path):
        return Source("hf", hf_spec(path), (path / "tokenizer.json").is_file())
    return Source("spec", load_spec(source), False)


def source_spec(source: str | Path) -> Spec:
    """The spec of any source, without loading weights."""
    return describe(source).spec
