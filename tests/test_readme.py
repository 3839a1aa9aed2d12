"""The README stays true: every command it shows runs, and what it shows a command printing is
what the command prints now.

Blocks fenced as ``console`` hold commands (``$ archc …``) each followed by its output, compared
line by line; a line ``…`` stands for any lines the README leaves out. Within a line, text must
match (runs of spaces and table rules aside: a column may widen) and numbers must agree within
``RTOL``/``ATOL``: the digits of a floating-point result depend on the CPU and BLAS build.
Blocks fenced as ``sh`` hold commands whose output varies (timings, sampled text): each must run
and exit 0. The commands of one block run in order, in-process, in one scratch directory, as
piped output (120 columns). Blocks fenced as ``python`` run as written.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from archc.cli import main

README = Path(__file__).resolve().parent.parent / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
ELIDED = "…"
# Whole numbers (counts, sizes) must be equal. Decimals printed with three significant digits
# agree to 1% wherever they are computed; rounding
# errors (validation's max error of f32 kernels against eager, ~1e-6 of outputs of scale ~4) vary
# with summation order across CPUs, so anything below 1e-5 is the same. A wrong kernel is off by
# far more than either.
RTOL = 1e-2
ATOL = 1e-5
NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")
# The versions a report names (`software: triton 3.9.0, torch 2.13.0+cpu, python 3.11.7`) are
# this machine's: any version stands for any other.
VERSION = re.compile(r"\b(triton|torch|python) \d[\w.+-]*")
SPACE = re.compile(r"[\s─━═]+")


@dataclass(frozen=True)
class Example:
    command: str
    output: tuple[str, ...] | None      # None: only the exit status is checked
    line: int

    def __str__(self) -> str:
        return f"README.md:{self.line}: {self.command}"


@dataclass(frozen=True)
class Block:
    """The commands of one fenced block, run in order in one directory (a later command may
    read what an earlier one wrote)."""

    examples: tuple[Example, ...]

    def __str__(self) -> str:
        return str(self.examples[0])


def examples(text: str) -> list[Block]:
    found: list[Block] = []
    for block in FENCE.finditer(text):
        kind, body = block.group(1), block.group(2)
        first = text.count("\n", 0, block.start(2)) + 1
        runs: list[Example] = []
        if kind == "console":
            command: str | None = None
            out: list[str] = []
            start = first
            for k, line in enumerate(body.splitlines()):
                if line.startswith("$ "):
                    if command is not None:
                        runs.append(Example(command, tuple(out), start))
                    command, out, start = line[2:], [], first + k
                elif command is not None:
                    out.append(line.rstrip())
            if command is not None:
                runs.append(Example(command, tuple(out), start))
        elif kind == "sh":
            for k, line in enumerate(body.splitlines()):
                line = line.split("  #")[0].strip()
                if line.startswith("archc "):
                    runs.append(Example(line, None, first + k))
        if runs:
            found.append(Block(tuple(runs)))
    return found


def same_line(want: str, got: str) -> bool:
    """The same text, and numbers within RTOL/ATOL of each other."""
    want, got = (VERSION.sub(r"\1 <version>", line) for line in (want, got))
    wants, gots = NUMBER.findall(want), NUMBER.findall(got)
    texts = [SPACE.sub(" ", t).strip() for t in NUMBER.split(want)]
    if texts != [SPACE.sub(" ", t).strip() for t in NUMBER.split(got)] or len(wants) != len(gots):
        return False
    for a, b in zip(wants, gots):
        if a == b:
            continue
        if not any(ch in a + b for ch in ".eE"):
            return False
        if not abs(float(a) - float(b)) <= ATOL + RTOL * abs(float(a)):
            return False
    return True


def matches(want: tuple[str, ...], got: list[str]) -> bool:
    """Do the lines match, each `…` in `want` standing for any run of lines?"""
    if not want:
        return not got
    if want[0] == ELIDED:
        return any(matches(want[1:], got[k:]) for k in range(len(got) + 1))
    return bool(got) and same_line(want[0], got[0]) and matches(want[1:], got[1:])


BLOCKS = examples(README.read_text(encoding="utf-8"))


def test_the_readme_shows_commands() -> None:
    shown = sum(e.output is not None for b in BLOCKS for e in b.examples)
    assert shown >= 8, "the README lost its examples"


@pytest.mark.parametrize("block", BLOCKS, ids=str)
def test_readme_commands(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    for example in block.examples:
        argv = shlex.split(example.command)
        assert argv[0] == "archc" and all(ch not in example.command for ch in "|;&$`"), \
            f"{example}: README examples are plain archc commands"
        status = main(argv[1:])
        out = capsys.readouterr().out
        assert status == 0, f"{example}: exit status {status}"
        if example.output is not None:
            got = [line.rstrip() for line in out.splitlines()]
            assert matches(example.output, got), f"{example}: prints now:\n" + "\n".join(got)


@pytest.mark.parametrize("want,got,same", [
    (("a", "b"), ["a", "b"], True),
    (("a", "b"), ["a", "c"], False),
    (("a", ELIDED, "d"), ["a", "b", "c", "d"], True),
    (("a", ELIDED), ["a"], True),
    (("a", ELIDED, "d"), ["a", "b", "c"], False),
    (("a",), ["a", "b"], False),
    (("max error 4.29e-06 ok",), ["max error 2.62e-06 ok"], True),      # rounding noise
    (("max error 4.29e-06 ok",), ["max error 3.1e-03 ok"], False),      # a real error
    (("│ 3.60 │ 12 │",), ["│  3.61 │ 12 │"], True),                      # a wider column
    (("│ 3.60 │ 12 │",), ["│ 3.60 │ 13 │"], False),
    (("1000 params",), ["1001 params"], False),                          # counts are exact
    (("12 kernels",), ["12 launches"], False),
    (("layers 0-3",), ["layers 0-4"], False),
    (("software: triton 3.9.0, torch 2.13.0+cpu",), ["software: triton 3.6.0, torch 2.11.0"],
     True),                                                             # another machine's
    (("software: triton 3.9.0, torch 2.13.0",), ["software: torch 3.9.0, triton 2.13.0"],
     False),
    (("triton 3.9.0: 12 kernels",), ["triton 3.6.0: 13 kernels"], False),
])
def test_elision_matches_only_what_it_should(want: tuple[str, ...], got: list[str],
                                             same: bool) -> None:
    assert matches(want, got) is same


def python_blocks(text: str) -> list[tuple[str, int]]:
    """The ```python blocks of the README, each with the line it starts on."""
    return [(b.group(2), text.count("\n", 0, b.start(2)) + 1) for b in FENCE.finditer(text)
            if b.group(1) == "python"]


PYTHON = python_blocks(README.read_text(encoding="utf-8"))


@pytest.mark.parametrize("code,line", PYTHON, ids=[f"README.md:{line}" for _, line in PYTHON])
def test_readme_python_runs(code: str, line: int, tmp_path: Path,
                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's Python examples run as written (the README is this repository's own text)."""
    monkeypatch.chdir(tmp_path)
    exec(compile(code, f"README.md:{line}", "exec"), {"__name__": "readme"})  # noqa: S102


def test_the_model_types_listed_are_the_ones_archc_reads() -> None:
    """The "Real checkpoints" list of Hugging Face model types and GGUF architectures is the
    sources' own tables, no more and no less."""
    from archc.sources.gguf_archs import GGUF_ARCHES
    from archc.sources.hf import ARCHITECTURES

    text = " ".join(README.read_text(encoding="utf-8").split())
    found = re.search(r"of model type (.*?); or a GGUF file of llama\.cpp's architecture (.*?), "
                      r"with", text)
    assert found, "the README's list of model types is missing"

    def names(listed: str) -> set[str]:   # a remark in parentheses names no model type
        listed = re.sub(r"\s*\([^)]*\)", "", listed)
        return {n.strip() for n in re.split(r",| or ", listed) if n.strip()}
    assert names(found[1]) == {t for a in ARCHITECTURES for t in a.model_types}
    assert names(found[2]) == set(GGUF_ARCHES)
