"""Shared fixtures: the zoo, split into real-size and tiny specs."""

from __future__ import annotations

import pytest

from archc.spec import zoo_names

ALL_SPECS = zoo_names()
TINY_SPECS = [n for n in ALL_SPECS if n.startswith("tiny-")]
REAL_SPECS = [n for n in ALL_SPECS if not n.startswith("tiny-")]


@pytest.fixture(params=TINY_SPECS)
def tiny_spec_name(request: pytest.FixtureRequest) -> str:
    return request.param
