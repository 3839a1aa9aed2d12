"""Spec features added for Hugging Face architectures, checked without transformers:
`embedding.project_dim` (OPT-350m's narrow embeddings) and `position.alibi_scaled` (Falcon-RW's
ALiBi added before the score scale)."""

from __future__ import annotations

import dataclasses
import math

import torch

import archc
from archc.ir.paramexpr import alibi_slopes
from archc.runtime.weights import checkpoint_shapes
from archc.spec import Spec, from_dict

BASE = {"name": "feature", "vocab_size": 61, "d_model": 32, "layers": 2, "max_seq_len": 32,
        "attention": {"heads": 4}, "ffn": {"kind": "mlp", "d_ff": 48},
        "norm": {"kind": "layernorm"}, "position": {"kind": "learned"},
        "embedding": {"tied": True}}


def spec(**sections: dict) -> Spec:
    data = {**BASE, **{k: {**BASE.get(k, {}), **v} for k, v in sections.items()}}
    return from_dict(data)


def test_project_dim_declares_narrow_embeddings_and_both_projections() -> None:
    model = archc.from_spec(spec(embedding={"project_dim": 24}))
    shapes = checkpoint_shapes(model.graph)
    assert shapes["embed.weight"] == (61, 24)
    assert shapes["embed.project_in.weight"] == (32, 24)
    assert shapes["head.project_out.weight"] == (24, 32)


def test_identity_projections_change_nothing() -> None:
    """With project_dim = d_model and identity projections, the model is the plain one."""
    plain = archc.from_spec(spec(), seed=3)
    projected = spec(embedding={"project_dim": 32})
    assert plain.weights is not None
    weights = dict(plain.weights)
    weights["embed.project_in.weight"] = torch.eye(32)
    weights["head.project_out.weight"] = torch.eye(32)
    ids = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(0))
    want = plain.compile()(ids)
    got = archc.Model(projected, weights).compile()(ids)
    assert torch.allclose(got, want, rtol=0, atol=1e-6 * float(want.abs().max()))
    weights["head.project_out.weight"] = 2 * torch.eye(32)   # and the projection is used
    assert not torch.allclose(archc.Model(projected, weights).compile()(ids), want)


def test_alibi_scaled_scales_the_slopes_with_the_scores() -> None:
    base = spec(position={"kind": "alibi"})
    scaled = dataclasses.replace(base, position=dataclasses.replace(base.position,
                                                                    alibi_scaled=True))
    slopes = {}
    for s in (base, scaled):
        session = archc.from_spec(s).compile().session
        slopes[s.position.alibi_scaled] = session.params["decoder"]["alibi.slopes"]
    assert torch.equal(slopes[False], alibi_slopes(4))
    assert torch.allclose(slopes[True], alibi_slopes(4) / math.sqrt(8))
