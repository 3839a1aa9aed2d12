"""The kernel cache: generated Triton modules on disk, one directory per program and options.

    $XDG_CACHE_HOME/archc/kernels/<digest>/<model>.py      (~/.cache when XDG_CACHE_HOME is unset)

Codegen names each directory by a hash of what it renders, so a model compiled again reuses its
module. The cache is kept under a size cap — `max_bytes` in ``settings.json`` beside the
kernels, 1 GiB unless `archc cache --max-size` sets another — by deleting the entries used
longest ago (an entry's time is its newest file's modification time: a module is rewritten,
or touched, whenever it is loaded again). `archc cache` lists the entries and clears them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from archc.errors import ArchcError

DEFAULT_MAX_BYTES = 1 << 30
SETTINGS = "settings.json"
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def cache_root() -> Path:
    """$XDG_CACHE_HOME/archc (~/.cache/archc): kernels and the cache's settings."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "archc"


def default_cache_dir() -> Path:
    return cache_root() / "kernels"


@dataclass(frozen=True)
class Entry:
    path: Path
    models: tuple[str, ...]     # the modules it holds, by model name
    bytes: int
    used: float                 # newest modification time, seconds since the epoch


def entries(directory: Path | None = None) -> list[Entry]:
    """The cache's entries, most recently used first."""
    directory = directory or default_cache_dir()
    if not directory.is_dir():
        return []
    out = []
    for d in directory.iterdir():
        if not d.is_dir():
            continue
        files = [f for f in d.rglob("*") if f.is_file()]
        stats = [f.stat() for f in files]
        out.append(Entry(d, tuple(sorted(f.stem for f in files if f.suffix == ".py")),
                         sum(s.st_size for s in stats),
                         max((s.st_mtime for s in stats), default=d.stat().st_mtime)))
    return sorted(out, key=lambda e: e.used, reverse=True)


def parse_size(text: str) -> int:
    """'500M', '2GiB', '1.5G', '0' → bytes."""
    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text.lower())
    if not found:
        raise ArchcError(f"{text!r} is not a size (e.g. 500M, 2G, 1.5GiB)")
    return int(float(found.group(1)) * _UNITS[found.group(2)])


def max_bytes(root: Path | None = None) -> int:
    path = (root or cache_root()) / SETTINGS
    try:
        value = json.loads(path.read_text(encoding="utf-8")).get("max_bytes")
    except (OSError, ValueError, AttributeError):
        return DEFAULT_MAX_BYTES
    return value if isinstance(value, int) and value >= 0 else DEFAULT_MAX_BYTES


def set_max_bytes(value: int, root: Path | None = None) -> None:
    root = root or cache_root()
    try:
        root.mkdir(parents=True, exist_ok=True)
        (root / SETTINGS).write_text(json.dumps({"max_bytes": value}) + "\n", encoding="utf-8")
    except OSError as err:
        raise ArchcError(f"cannot write {root / SETTINGS}: {err.strerror}") from None


def remove(entry: Entry) -> None:
    try:
        shutil.rmtree(entry.path)
    except OSError as err:
        raise ArchcError(f"cannot remove {entry.path}: {err.strerror}") from None


def trim(directory: Path | None = None, cap: int | None = None,
         keep: Path | None = None) -> list[Entry]:
    """Delete the least recently used entries until the cache is within `cap` (default: the
    configured cap); never `keep`, the entry in use. Returns what was deleted."""
    directory = directory or default_cache_dir()
    cap = max_bytes() if cap is None else cap
    found = entries(directory)
    total = sum(e.bytes for e in found)
    removed = []
    for e in reversed(found):            # oldest first
        if total <= cap:
            break
        if keep is not None and e.path == keep:
            continue
        remove(e)
        total -= e.bytes
        removed.append(e)
    return removed


def used(module: Path) -> None:
    """A module was just loaded: mark it used now (loading it again does not rewrite it) and,
    when it lives in the default cache, trim the cache to its cap, never deleting this one."""
    try:
        now = time.time()
        os.utime(module, (now, now))
    except OSError:
        return
    if module.parent.parent == default_cache_dir():
        trim(keep=module.parent)
