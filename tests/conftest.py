"""Shared fixtures: the zoo, split into real-size and tiny specs; Triton's process-wide state,
chosen once and checked after every test (``tests/triton_state.py``); autotuning off unless a
test asks for it."""

from __future__ import annotations

import pytest
import torch

from archc.runtime import triton_backend
from archc.spec import zoo_names
from tests import triton_state
from tests.triton_state import triton_state_unchanged  # noqa: F401 — autouse, after every test

# Test workers run side by side (pytest -n): one intra-op thread each. Tiny tensors pay
# milliseconds per op when two workers' thread pools contend for two cores.
torch.set_num_threads(1)

ALL_SPECS = zoo_names()
TINY_SPECS = [n for n in ALL_SPECS if n.startswith("tiny-")]
REAL_SPECS = [n for n in ALL_SPECS if not n.startswith("tiny-")]
KERNEL_SPECS = TINY_SPECS   # every tiny spec runs on the generated kernels


@pytest.fixture(params=TINY_SPECS)
def tiny_spec_name(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def nothing_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading a source or its weights fails the test: a refusal of bad arguments must come
    first."""
    import archc
    import archc.commands.common

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("a model was read before the arguments were checked")
    monkeypatch.setattr(archc, "load", forbidden)
    monkeypatch.setattr(archc.commands.common, "describe", forbidden)


def pytest_configure(config: pytest.Config) -> None:
    triton_state.pytest_configure(config)
    # Sessions do not tune unless a test asks (@pytest.mark.autotune): on a GPU every launch of
    # more than 16 rows would compile and time tens of candidates.
    triton_backend.AUTOTUNE_DEFAULT = False


@pytest.fixture(autouse=True)
def autotune_when_asked(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A test marked ``autotune`` gets the sessions users get: tuning on by default."""
    if request.node.get_closest_marker("autotune") is not None:
        monkeypatch.setattr(triton_backend, "AUTOTUNE_DEFAULT", True)
