"""Shared fixtures: the zoo, split into real-size and tiny specs."""

from __future__ import annotations

import pytest
import torch

from archc.spec import zoo_names

# Test workers run side by side (pytest -n): one intra-op thread each. Tiny tensors pay
# milliseconds per op when two workers' thread pools contend for two cores.
torch.set_num_threads(1)

ALL_SPECS = zoo_names()
TINY_SPECS = [n for n in ALL_SPECS if n.startswith("tiny-")]
REAL_SPECS = [n for n in ALL_SPECS if not n.startswith("tiny-")]


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
