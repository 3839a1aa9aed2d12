"""Sources of real models: Hugging Face directories and GGUF files.

Importing this package registers both loaders with ``archc.api.register_source``, so
``archc.load`` accepts a directory or a ``.gguf`` path beside zoo names and spec files.
"""

from __future__ import annotations

from pathlib import Path

from archc.api import register_source
from archc.sources.hf import is_hf_dir, load_hf


def _is_gguf(path: Path) -> bool:
    return path.suffix.lower() == ".gguf"


def _load_gguf(path: Path, *, progress=None):  # type: ignore[no-untyped-def]
    from archc.sources.gguf import load_gguf
    return load_gguf(path, progress=progress)


register_source(_is_gguf, _load_gguf)
register_source(is_hf_dir, load_hf)
