"""The errors archc raises on bad input. Each names the thing that is wrong.

The CLI turns any ``ArchcError`` into one message on stderr and a non-zero exit (status 2 for
bad input), never a traceback. Internal bugs are not ``ArchcError``s and do show a traceback.
"""

from __future__ import annotations

from collections.abc import Callable


class ArchcError(Exception):
    """Base of every error caused by what the user gave archc (spec, checkpoint, arguments)."""

    exit_code = 2


class SpecError(ArchcError):
    """A spec that cannot describe a model: names the file, the field path, the value and what
    is allowed."""

    def __init__(self, path: str, problem: str, *, source: str | None = None,
                 allowed: str | None = None) -> None:
        self.source = source
        self.path = path
        self.problem = problem
        self.allowed = allowed
        where = f"{source}: " if source else ""
        field = f"{path}: " if path else ""
        tail = f" (allowed: {allowed})" if allowed else ""
        super().__init__(f"{where}{field}{problem}{tail}")

    def with_source(self, source: str) -> SpecError:
        return SpecError(self.path, self.problem, source=source, allowed=self.allowed)


class IRError(ArchcError):
    """A graph that is malformed: a verifier or parser failure, naming the node."""


class WeightsError(ArchcError):
    """A checkpoint that does not fit the model: names the tensor, expected and found shape."""


class RunError(ArchcError):
    """A failure while executing a graph, naming the node being run."""

    exit_code = 1


# How an error names an option the caller can change: a keyword argument to Python callers
# (`dtype='bf16'`), a flag on the command line (`--dtype bf16`). Checks shared by both take one.
Spell = Callable[[str, object], str]


def python_option(name: str, value: object) -> str:
    return f"{name}={value!r}"


def cli_option(name: str, value: object) -> str:
    return f"--{name.replace('_', '-')} {value}"
