"""Recurrent layers against transformers step by step: prefill, then decode through both sides'
state — transformers' conv and SSM cache, archc's conv and SSM state — comparing the logits of
every step, not only their argmax (a state carried wrongly can leave a greedy token unchanged).

The models are test_hf_crosscheck's random Mamba and Jamba cases. fp32; tolerance as there.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import archc
from tests.test_hf_crosscheck import RTOL, VOCAB, build, rel_error

transformers = pytest.importorskip("transformers")

CASES = ["mamba", "mamba-bias-narrow-conv", "jamba"]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("split", [1, 5])
def test_decode_steps_match_transformers_cache(case: str, split: int, tmp_path: Path) -> None:
    hf = build(case, tmp_path)
    session = archc.load(tmp_path).compile().session
    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(split))
    session.reset()
    with torch.no_grad():
        out = hf(ids[:, :split], use_cache=True)
        want, got = [out.logits], [session.step(ids[:, :split])]
        for t in range(split, ids.shape[1]):
            out = hf(ids[:, t:t + 1], cache=out.cache, use_cache=True)
            want.append(out.logits)
            got.append(session.step(ids[:, t:t + 1]))
    for k, (g, w) in enumerate(zip(got, want)):
        assert rel_error(g, w) <= RTOL, f"{case}: call {k} after a prefill of {split}"
