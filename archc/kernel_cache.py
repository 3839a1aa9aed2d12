"""The kernel cache: generated Triton modules on disk, one directory per program and options,

    $XDG_CACHE_HOME/archc/kernels/<digest>/<model>.py      (~/.cache when XDG_CACHE_HOME is unset)

named by a hash of what codegen renders, so that a model compiled again reuses its module. The
cache is kept under a size cap — `max_bytes` in ``settings.json`` beside the kernels, 1 GiB
unless `archc cache --max-size` sets another — by deleting the entries used longest ago (an
entry's time is its newest file's modification time: a module is touched whenever it is loaded)."""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from archc.errors import ArchcError

DEFAULT_MAX_BYTES = 1 << 30
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "archc" / "kernels"


def _settings() -> Path:
    return default_cache_dir().parent / "settings.json"


@dataclass(frozen=True)
class Entry:
    path: Path
    models: tuple[str, ...]     # the modules it holds, by model name
    bytes: int
    used: float                 # newest modification time, seconds since the epoch


def entries(directory: Path | None = None) -> list[Entry]:
    """The cache's entries, most recently used first."""
    directory = directory or default_cache_dir()
    out = []
    for d in directory.iterdir() if directory.is_dir() else ():
        if d.is_dir():
            files = [(f, f.stat()) for f in d.rglob("*") if f.is_file()]
            out.append(Entry(d, tuple(sorted(f.stem for f, _ in files if f.suffix == ".py")),
                             sum(s.st_size for _, s in files),
                             max((s.st_mtime for _, s in files), default=d.stat().st_mtime)))
    return sorted(out, key=lambda e: e.used, reverse=True)


def parse_size(text: str) -> int:
    """'500M', '2GiB', '1.5G', '0' → bytes."""
    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text.lower())
    if not found:
        raise ArchcError(f"{text!r} is not a size (e.g. 500M, 2G, 1.5GiB)")
    return int(float(found.group(1)) * _UNITS[found.group(2)])


def max_bytes() -> int:
    try:
        value = json.loads(_settings().read_text()).get("max_bytes")
    except (OSError, ValueError, AttributeError):
        return DEFAULT_MAX_BYTES
    return value if isinstance(value, int) and value >= 0 else DEFAULT_MAX_BYTES


def set_max_bytes(value: int) -> None:
    path = _settings()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"max_bytes": value}) + "\n")
    except OSError as err:
        raise ArchcError(f"cannot write {path}: {err.strerror}") from None


def trim(directory: Path | None = None, cap: int | None = None,
         keep: Path | None = None) -> list[Entry]:
    """Delete the least recently used entries until the cache is within `cap` (default: the
    configured cap), never `keep`, the entry in use. Returns what was deleted."""
    found = entries(directory)
    cap = max_bytes() if cap is None else cap
    total = sum(e.bytes for e in found)
    removed = []
    for e in reversed(found):            # oldest first
        if total > cap and e.path != keep:
            try:
                shutil.rmtree(e.path)
            except OSError as err:
                raise ArchcError(f"cannot remove {e.path}: {err.strerror}") from None
            total -= e.bytes
            removed.append(e)
    return removed


def used(module: Path) -> None:
    """A module was just loaded: mark it used now (loading it again does not rewrite it) and,
    when it lives in the default cache, trim the cache to its cap, never deleting this one."""
    try:
        os.utime(module)       # now
    except OSError:
        return
    if module.parent.parent == default_cache_dir():
        trim(keep=module.parent)
