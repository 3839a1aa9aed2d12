"""Triton's process-wide state in the test suite: chosen once, and never left changed by a test.

Triton decides whether ``@triton.jit`` builds compiler or interpreter functions from
``TRITON_INTERPRET`` when it is imported, and archc switches a process that has already imported
it by rebinding the functions of ``triton.language`` (``runtime.triton_backend.prepare_triton``):
a test that chose the interpreter would choose it for every later test in its process — on a GPU
machine, every CUDA test after it would fail. So (a pytest plugin; ``tests/conftest.py`` loads it):

- without a CUDA GPU, the interpreter is chosen here, once, before any test is collected: every
  test finds the same state, whatever ran before it;
- with one, ``TRITON_INTERPRET`` must be unset, and a test that would choose the interpreter (a
  triton session on the CPU) is skipped at that point, before anything has changed: it runs
  where there is no GPU;
- after every test, the state is compared with the one at the start — ``TRITON_INTERPRET``,
  Triton's interpret knob and every function bound in ``triton.language`` — and a test that
  changed it fails, the state put back so that the tests after it run as they should.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

UNSET = object()
TENSOR = "triton.language.tensor (the class)"


@dataclass(frozen=True)
class TritonState:
    env: str | None                     # TRITON_INTERPRET
    knob: bool                          # knobs.runtime.interpret: set in Python, else the env's
    knob_set: Any                       # … what was set in Python, or UNSET
    functions: dict[tuple[str, str], Any]   # (module or class, name) → the function there

    @classmethod
    def now(cls) -> TritonState:
        import triton.language as tl
        from triton import knobs
        from triton.runtime.jit import KernelInterface  # compiled and interpreted alike
        spaces = [(name, m) for name, m in list(sys.modules.items())
                  if m is not None and name.startswith("triton.language")]
        functions = {(space, name): value
                     for space, holder in [*spaces, (TENSOR, tl.tensor)]
                     for name, value in list(vars(holder).items())
                     if isinstance(value, KernelInterface)}
        return cls(os.environ.get("TRITON_INTERPRET"), bool(knobs.runtime.interpret),
                   vars(knobs.runtime).get("interpret", UNSET), functions)

    def changes(self, now: TritonState) -> list[str]:
        """What differs in `now` from this state, as text; a module first imported since then
        must hold functions of the kind this state's are."""
        found = []
        if now.env != self.env:
            found.append(f"TRITON_INTERPRET is {now.env!r}, was {self.env!r}")
        if now.knob != self.knob:
            found.append(f"triton.knobs.runtime.interpret is {now.knob!r}, was {self.knob!r}")
        def kind(f: Any) -> str:
            return "nothing" if f is None else type(f).__name__
        kinds = {kind(f) for f in self.functions.values()}
        rebound = [f"{s}.{n} ({kind(f)} → {kind(now.functions.get((s, n)))})"
                   for (s, n), f in self.functions.items() if now.functions.get((s, n)) is not f]
        rebound += [f"{s}.{n} (a {kind(f)} where the others are {', '.join(sorted(kinds))})"
                    for (s, n), f in now.functions.items()
                    if (s, n) not in self.functions and kind(f) not in kinds]
        if rebound:
            found.append(f"{len(rebound)} functions of triton.language rebound: "
                         + ", ".join(rebound[:3]) + (", …" if len(rebound) > 3 else ""))
        return found

    def restore(self) -> None:
        from triton import knobs
        if self.knob_set is UNSET:
            vars(knobs.runtime).pop("interpret", None)
        else:
            knobs.runtime.interpret = self.knob_set
        if self.env is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = self.env
        import triton.language as tl
        for (space, name), f in self.functions.items():
            holder = tl.tensor if space == TENSOR else sys.modules.get(space)
            if holder is not None:
                setattr(holder, name, f)


START: TritonState | None = None
INTERPRETER_SKIP = ("needs Triton's interpreter, which one test cannot choose in a process that "
                    "runs CUDA tests (it would hold for every later test there): it runs on a "
                    "machine without a GPU")


def pytest_configure(config: pytest.Config) -> None:
    global START
    from archc.runtime import triton_backend
    if torch.cuda.is_available():
        if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
            raise pytest.UsageError("TRITON_INTERPRET is set on a machine with a CUDA GPU: unset "
                                    "it (archc chooses the interpreter only for a CPU device)")
        prepare = triton_backend.prepare_triton

        def compiled_only(device: torch.device) -> str:
            if device.type == "cpu":
                pytest.skip(INTERPRETER_SKIP)
            return prepare(device)
        triton_backend.prepare_triton = compiled_only
    else:
        triton_backend.prepare_triton(torch.device("cpu"))
    START = TritonState.now()


@pytest.fixture(autouse=True)
def triton_state_unchanged() -> Iterator[None]:
    """Fails a test that leaves Triton's state other than the session found it (and puts it
    back)."""
    yield
    assert START is not None
    changes = START.changes(TritonState.now())
    if changes:
        START.restore()
        pytest.fail("this test changed Triton's process-wide state (tests/triton_state.py): "
                    + "; ".join(changes), pytrace=False)
