"""The errors archc raises on bad input, each naming the thing that is wrong. The CLI prints an
``ArchcError`` as one line and exits non-zero, never with a traceback; a bug is not an
``ArchcError`` and shows its traceback."""

from __future__ import annotations

from collections.abc import Callable


class ArchcError(Exception):
    """Caused by what the user gave archc: a spec, a checkpoint, an argument."""

    exit_code = 2


class SpecError(ArchcError):
    """A spec that cannot describe a model: the file, the field path, the value and what is
    allowed."""

    def __init__(self, path: str, problem: str, *, source: str | None = None,
                 allowed: str | None = None) -> None:
        self.path, self.problem, self.allowed = path, problem, allowed
        super().__init__((f"{source}: " if source else "") + (f"{path}: " if path else "") +
                         problem + (f" (allowed: {allowed})" if allowed else ""))

    def with_source(self, source: str) -> SpecError:
        return SpecError(self.path, self.problem, source=source, allowed=self.allowed)


class IRError(ArchcError):
    """A malformed graph: a verifier or parser failure, naming the node."""


class WeightsError(ArchcError):
    """A checkpoint that does not fit the model: the tensor, expected and found shape."""


class RunError(ArchcError):
    """A failure while executing a graph, naming the node being run."""

    exit_code = 1


# How an error names an option the caller can change: a keyword argument to Python callers
# (`dtype='bf16'`), a flag on the command line (`--dtype bf16`).
Spell = Callable[[str, object], str]


def python_option(name: str, value: object) -> str:
    return f"{name}={value!r}"


def cli_option(name: str, value: object) -> str:
    return f"--{name.replace('_', '-')} {value}"
