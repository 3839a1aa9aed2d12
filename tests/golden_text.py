"""Golden-text comparison: a generated text against the file that holds what it was, with a diff
and the command that regenerates the file when a change is intended."""

from __future__ import annotations

import difflib
from pathlib import Path

import pytest


def assert_matches_golden(path: Path, text: str, what: str, regenerate: str) -> None:
    assert path.is_file(), f"no golden text yet; create it with: {regenerate}"
    want = path.read_text(encoding="utf-8")
    if text != want:
        diff = "".join(list(difflib.unified_diff(want.splitlines(keepends=True),
                                                 text.splitlines(keepends=True),
                                                 "golden", "now"))[:80])
        pytest.fail(f"{what} changed:\n{diff}\nif intended, regenerate with: {regenerate}")
