"""The kernel cache: where modules go ($XDG_CACHE_HOME/archc/kernels), `archc cache` listing and
clearing it, and the size cap that keeps it, deleting what was used longest ago and never the
module in use."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import archc
from archc import kernel_cache
from archc.cli import main


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path / "archc" / "kernels"


def listing(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    capsys.readouterr()
    assert main(["cache", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def age(entry: Path, seconds: float) -> None:
    for f in entry.rglob("*"):
        t = f.stat().st_mtime - seconds
        os.utime(f, (t, t))


def test_compiled_modules_are_listed_and_cleared(cache: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert listing(capsys)["entries"] == []
    assert main(["compile", "tiny-llama3"]) == 0
    archc.load("tiny-gpt2").compile("triton")
    data = listing(capsys)
    assert data["directory"] == str(cache)
    assert sorted(m for e in data["entries"] for m in e["models"]) == ["tiny-gpt2", "tiny-llama3"]
    on_disk = sum(f.stat().st_size for f in cache.rglob("*") if f.is_file())
    assert data["bytes"] == on_disk > 0
    capsys.readouterr()
    assert main(["cache"]) == 0
    out = capsys.readouterr().out
    assert "tiny-gpt2" in out and "2 entries" in out
    data = listing(capsys, "--clear")
    assert data["entries"] == [] and len(data["removed"]) == 2 and not any(cache.iterdir())


def test_the_cap_deletes_what_was_used_longest_ago(cache: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("tiny-llama3", "tiny-gpt2", "tiny-mistral"):
        assert main(["compile", name]) == 0
    entries = {e.models[0]: e for e in kernel_cache.entries(cache)}
    age(entries["tiny-llama3"].path, 300)
    age(entries["tiny-gpt2"].path, 200)       # tiny-mistral: the newest
    keep = entries["tiny-mistral"].bytes + entries["tiny-gpt2"].bytes
    data = listing(capsys, "--max-size", str(keep))
    assert [Path(p).name for p in data["removed"]] == [entries["tiny-llama3"].path.name]
    assert data["max_bytes"] == keep and data["bytes"] == keep
    # remembered: a later compile keeps the cache within it, and keeps what it compiled
    assert main(["compile", "tiny-llama3"]) == 0
    sizes = {name: e.bytes for name, e in entries.items()}
    expected = set(sizes)
    for victim in ("tiny-gpt2", "tiny-mistral"):    # oldest first; tiny-llama3 is in use
        if sum(sizes[m] for m in expected) <= keep:
            break
        expected.remove(victim)
    assert {e.models[0] for e in kernel_cache.entries(cache)} == expected != set(sizes)


def test_the_module_in_use_is_never_deleted(cache: Path) -> None:
    kernel_cache.set_max_bytes(0)
    compiled = archc.load("tiny-llama3").compile("triton")
    assert [e.models for e in kernel_cache.entries(cache)] == [("tiny-llama3",)]
    assert compiled.session.module_path.is_file()  # type: ignore[attr-defined]


@pytest.mark.parametrize("text,size", [("500M", 500 << 20), ("2GiB", 2 << 30), ("0", 0),
                                       ("1.5g", 3 << 29), ("64k", 64 << 10)])
def test_sizes(text: str, size: int) -> None:
    assert kernel_cache.parse_size(text) == size
