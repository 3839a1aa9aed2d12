"""Sources of real models: Hugging Face directories and GGUF files.

Importing this package registers both loaders with ``archc.api.register_source``, so
``archc.load`` accepts a directory or a ``.gguf`` path beside zoo names and spec files;
``source_spec`` reads just the spec of any source.
"""

from __future__ import annotations

from pathlib import Path

from archc.api import Model, Progress, register_source
from archc.sources.hf import hf_spec, is_hf_dir, load_hf
from archc.spec.schema import Spec
from archc.spec.zoo import load_spec


def _is_gguf(path: Path) -> bool:
    return path.suffix.lower() == ".gguf"


def _load_gguf(path: Path, *, progress: Progress | None = None,
               dtype: str | None = None) -> Model:
    from archc.sources.gguf import load_gguf
    return load_gguf(path, progress=progress, dtype=dtype)


register_source(_is_gguf, _load_gguf)
register_source(is_hf_dir, load_hf)


def source_spec(source: str | Path) -> Spec:
    """The spec of any source, without loading weights: an HF directory's config, a GGUF file's
    metadata, a spec file or zoo name."""
    path = Path(source)
    if path.suffix.lower() == ".gguf":
        from archc.sources.gguf import gguf_spec
        return gguf_spec(path)
    if is_hf_dir(path):
        return hf_spec(path)
    return load_spec(source)
