"""DeepSeek's MoE routing as spec features of every router: a per-expert choice bias (added to
the weights for the choice only), groups of experts of which the best few are kept for the
choice (scored by their two best, or their best, choice values), and a scale on the weights.

- Eager `route` against plain torch versions of Hugging Face's DeepseekV3TopkRouter and
  DeepseekV2TopkRouter (written out below, not calling archc): the same experts chosen, the
  weights within 1e-6 — V3 (σ, a random choice bias, 4 groups of 16 experts, 2 kept, top-3,
  renormalized, ×2.5), V2 (softmax, groups scored by their best, no renormalizing, ×16) and one
  group (V2's greedy, V3 with n_group 1).
- The Triton router kernel (under the interpreter without a GPU) on the same cases and a few
  more (12 experts in 3 groups: padded expert lanes; a router bias beside the choice bias):
  equal to eager — the same experts, weights within 1e-6.
- A whole tiny model with these fields: prefill and decode on eager and on Triton agree at 1e-4
  (f32, as tests/test_moe_kernels.py: the two backends sum the matmuls in different orders); the
  printed IR round-trips; the choice bias is replicated over tensor-parallel ranks and the
  sharded model computes the unsharded one.
- Malformed fields: one line naming the field, the value and what is allowed.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml

import archc
from archc.errors import SpecError
from archc.ir.lower import lower
from archc.ir.ops import Op
from archc.ir.ops.core import route
from archc.ir.shapes import B, T, shape
from archc.ir.text import format_node, format_program, parse_program
from archc.passes import optimize
from archc.passes.shard import shard_program
from archc.runtime.eager import EagerContext, KVCache, run_graph
from archc.runtime.weights import random_weights
from archc.spec import from_dict, to_dict
from tests.test_shard import assert_same, on_ranks, outputs
from tests.test_triton_kernels import build
from tests.triton_graph import run_graph_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
WEIGHT_TOL = 1e-6     # f32 weights: the renormalizing sums add the same k values in any order
MODEL_TOL = 1e-4      # f32 logits of a whole model, relative to their largest magnitude


# ---- plain torch versions of transformers' DeepSeek routers (5.25), over [M, E] logits ---------

def deepseek_v3(logits: torch.Tensor, bias: torch.Tensor, n_group: int, topk_group: int,
                top_k: int, norm_topk_prob: bool, scaling: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepseekV3TopkRouter.forward after its matmul: (indices, weights), [M, top_k] each."""
    n = logits.shape[-1]
    scores = logits.sigmoid()
    scores_for_choice = scores + bias
    group_scores = scores_for_choice.view(-1, n_group, n // n_group).topk(2, dim=-1)[0].sum(-1)
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, n_group, n // n_group).reshape(-1, n)
    scores_for_choice = scores_for_choice.masked_fill(~score_mask.bool(), float("-inf"))
    indices = torch.topk(scores_for_choice, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, indices)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return indices, weights * scaling


def deepseek_v2(logits: torch.Tensor, method: str, n_group: int, topk_group: int, top_k: int,
                scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepseekV2TopkRouter.forward after its matmul: greedy or group_limited_greedy."""
    n = logits.shape[-1]
    scores = logits.softmax(dim=-1, dtype=torch.float32)
    if method == "group_limited_greedy":
        group_scores = scores.view(-1, n_group, n // n_group).max(dim=-1).values
        group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores)
        group_mask.scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(-1, n_group, n // n_group).reshape(-1, n)
        scores = scores.masked_fill(~score_mask.bool(), 0.0)
    weights, indices = torch.topk(scores, k=top_k, dim=-1, sorted=False)
    return indices, weights * scaling


def chosen(gates: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense gates [M, E] → (experts ascending, their gates): exactly k nonzero per row."""
    nonzero = gates != 0
    assert bool((nonzero.sum(-1) == top_k).all())
    experts = nonzero.nonzero()[:, 1].reshape(-1, top_k)
    return experts, gates.gather(-1, experts)


def ascending(indices: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = indices.argsort(dim=-1)
    return indices.gather(-1, order), weights.gather(-1, order)


# (id, experts, top_k, the router's attrs, the oracle of [M, E] logits and a [E] choice bias)
CASES: list[tuple[str, int, int, dict[str, Any], Any]] = [
    ("v3", 16, 3, dict(fn="sigmoid", normalize=True, choice_bias=True, groups=4, top_groups=2,
                       group_score="top2", scale=2.5),
     lambda lg, cb: deepseek_v3(lg, cb, 4, 2, 3, True, 2.5)),
    ("v3-one-group", 16, 4, dict(fn="sigmoid", normalize=True, choice_bias=True, scale=1.5),
     lambda lg, cb: deepseek_v3(lg, cb, 1, 1, 4, True, 1.5)),
    ("v2-group-limited", 16, 3, dict(fn="softmax", normalize=False, groups=4, top_groups=2,
                                     group_score="max", scale=16.0),
     lambda lg, cb: deepseek_v2(lg, "group_limited_greedy", 4, 2, 3, 16.0)),
    ("v2-greedy", 16, 6, dict(fn="softmax", normalize=False, scale=16.0),
     lambda lg, cb: deepseek_v2(lg, "greedy", 1, 1, 6, 16.0)),
    ("v3-12-experts-3-groups", 12, 2, dict(fn="sigmoid", normalize=True, choice_bias=True,
                                           groups=3, top_groups=1, group_score="top2", scale=2.0),
     lambda lg, cb: deepseek_v3(lg, cb, 3, 1, 2, True, 2.0)),
]
IDS = [c[0] for c in CASES]


def rand(*dims: int, seed: int) -> torch.Tensor:
    return torch.randn(*dims, generator=torch.Generator().manual_seed(seed))


def route_attrs(attrs: dict[str, Any]) -> dict[str, Any]:
    """The router's attrs as `route`'s keywords (the choice bias is a tensor there)."""
    return {k: v for k, v in attrs.items() if k not in ("fn", "normalize", "choice_bias")}


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_eager_route_matches_the_deepseek_routers(case: Any) -> None:
    """Random logits (40 tokens, seed 0) and a choice bias about as large as the spread of the
    σ scores, so that it changes choices: the experts equal, the weights within 1e-6."""
    _, experts, top_k, attrs, oracle = case
    logits, bias = 2 * rand(40, experts, seed=0), 0.3 * rand(experts, seed=1)
    gates = route(logits, attrs["fn"], top_k, attrs["normalize"],
                  choice_bias=bias if attrs.get("choice_bias") else None, **route_attrs(attrs))
    got_e, got_w = chosen(gates, top_k)
    want_e, want_w = ascending(*oracle(logits, bias))
    assert torch.equal(got_e, want_e)
    assert float((got_w - want_w).abs().max()) <= WEIGHT_TOL * attrs["scale"]
    if attrs.get("choice_bias"):   # the bias changed some choice: the test can see it
        plain = route(logits, attrs["fn"], top_k, attrs["normalize"], **route_attrs(attrs))
        assert not torch.equal(chosen(plain, top_k)[0], got_e)


def test_route_ties_pick_the_lowest_group_and_expert() -> None:
    """Equal group scores keep the lowest groups; equal choice values the lowest experts."""
    logits = torch.zeros(1, 8)                                 # every σ is 0.5
    gates = route(logits, "sigmoid", 3, False, groups=4, top_groups=2, group_score="top2")
    assert chosen(gates, 3)[0].tolist() == [[0, 1, 2]]          # groups 0 and 1, experts 0..2
    bias = torch.tensor([0., 0., 0., 0., 0., 0., 1., 0.])     # group 3 first, then group 0
    gates = route(logits, "sigmoid", 3, False, choice_bias=bias, groups=4, top_groups=2)
    assert chosen(gates, 3)[0].tolist() == [[0, 1, 6]]
    assert torch.allclose(gates[0, [0, 1, 6]], torch.full((3,), 0.5))  # unbiased weights


def router_graph(experts: int, top_k: int, d: int, attrs: dict[str, Any], router_bias: bool
                 ) -> Any:
    """x → router(x, W_r [, b], [choice bias]) → the dense gates, one fused router kernel."""
    def fn(b: Any, i: dict[str, int]) -> int:
        operands = [i["x"], i["wr"], *([i["rb"]] if router_bias else []),
                    *([i["cb"]] if attrs.get("choice_bias") else [])]
        return b.emit(Op.ROUTER, *operands, top_k=top_k, **attrs)

    inputs = {"x": (shape(B, T, d), "f32"), "wr": (shape(experts, d), "f32")}
    if router_bias:
        inputs["rb"] = (shape(experts), "f32")
    if attrs.get("choice_bias"):
        inputs["cb"] = (shape(experts), "f32")
    return build(inputs, fn)


KERNEL_CASES = [(c, False) for c in CASES] + [(CASES[0], True)]


@pytest.mark.parametrize("case,router_bias", KERNEL_CASES,
                         ids=[c[0] + ("+router-bias" if rb else "") for c, rb in KERNEL_CASES])
def test_router_kernel_equals_eager(case: Any, router_bias: bool, tmp_path: Path) -> None:
    """The Triton router over 21 tokens (two programs of 16 on the interpreter's blocks where
    they apply) against eager's router on the same graph: the same experts, weights within
    1e-6; and eager's experts are the DeepSeek oracle's."""
    _, experts, top_k, attrs, oracle = case
    d = 8
    g = router_graph(experts, top_k, d, attrs, router_bias)
    inputs = {"x": rand(1, 21, d, seed=2), "wr": rand(experts, d, seed=3),
              "rb": 0.5 * rand(experts, seed=4), "cb": 0.3 * rand(experts, seed=5)}
    inputs = {k: v for k, v in inputs.items() if k in {n.name for n in g if n.op == Op.INPUT}}
    dims = {"B": 1, "T": 21, "P": 0}
    want = run_graph(g, {}, inputs, EagerContext(dims, KVCache(8)))["y"].reshape(21, experts)
    run = run_graph_triton(g, {}, inputs, dims, max_seq_len=32, device=DEVICE, cache_dir=tmp_path)
    got = run.outputs["y"].cpu().reshape(21, experts)
    got_e, got_w = chosen(got, top_k)
    want_e, want_w = chosen(want, top_k)
    assert torch.equal(got_e, want_e)
    assert float((got_w - want_w).abs().max()) <= WEIGHT_TOL * attrs["scale"]
    logits = inputs["x"].reshape(21, d) @ inputs["wr"].T + inputs.get("rb", 0.0)
    oracle_e, _ = ascending(*oracle(logits, inputs.get("cb", torch.zeros(experts))))
    assert torch.equal(want_e, oracle_e)


# ---- a whole model ------------------------------------------------------------------------------

SPEC: dict[str, Any] = {
    "name": "tiny-deepseek-routing", "family": "decoder", "vocab_size": 97, "d_model": 32,
    "layers": 2, "max_seq_len": 32, "dtype": "f32",
    "attention": {"heads": 4, "kv_heads": 2},
    "ffn": {"kind": "moe", "d_ff": 16,
            "moe": {"experts": 16, "top_k": 3, "expert": "swiglu", "router": "sigmoid",
                    "choice_bias": True, "groups": 4, "top_groups": 2, "group_score": "top2",
                    "scale": 2.5, "shared_expert_d_ff": 16}},
    "norm": {"kind": "rmsnorm", "eps": 1e-5},
    "position": {"kind": "rope", "theta": 10000.0},
    "embedding": {"tied": False},
}


def test_spec_fields_load_print_and_lower() -> None:
    """The fields load (top_groups derived as all groups when left out), write back only what
    differs from the defaults, and lower to one router with its choice bias operand."""
    spec = from_dict(SPEC)
    moe = spec.ffn.moe
    assert (moe.choice_bias, moe.groups, moe.top_groups, moe.group_score, moe.scale) == \
        (True, 4, 2, "top2", 2.5)
    assert from_dict(to_dict(spec)) == spec
    loose = copy.deepcopy(SPEC)
    del loose["ffn"]["moe"]["top_groups"]
    assert from_dict(loose).ffn.moe.top_groups == 4
    assert "top_groups" not in to_dict(from_dict(loose))["ffn"]["moe"]
    program = lower(spec)
    assert parse_program(format_program(program, provenance=True)) == program
    g = program.graphs[0]
    routers = [(i, n) for i, n in enumerate(g.nodes) if n.op == Op.ROUTER]
    assert len(routers) == spec.layers
    i, n = routers[0]
    assert g.nodes[n.inputs[-1]].name == "layers.0.ffn.router.choice_bias"
    assert g.nodes[n.inputs[-1]].dtype == "f32"
    assert format_node(i, n).endswith('{choice_bias=true, fn="sigmoid", groups=4, '
                                      'normalize=true, scale=2.5, top_groups=2, top_k=3}')
    fused = optimize(program).graphs[0]
    [(_, r), *_] = [(i, n) for i, n in enumerate(fused.nodes) if n.op == Op.ROUTER]
    assert [fused.nodes[j].name for j in r.inputs[1:]] == ["layers.0.ffn.router.weight",
                                                           "layers.0.ffn.router.choice_bias"]
    # a router without these fields prints as before
    plain = lower(from_dict({**SPEC, "ffn": {"kind": "moe", "d_ff": 16,
                                             "moe": {"experts": 4, "top_k": 2}}}))
    line = next(format_node(i, n) for i, n in enumerate(plain.graphs[0].nodes)
                if n.op == Op.ROUTER)
    assert line.endswith("{normalize=true, top_k=2}")


def test_model_runs_alike_on_eager_and_triton(tmp_path: Path) -> None:
    """A 5-token prefill of two sequences, then three decode steps: logits within 1e-4 of
    eager's largest (f32), the greedy tokens equal."""
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(SPEC))
    model = archc.load(str(path), seed=3)
    eager = model.compile("eager", dtype="f32", device=DEVICE)
    triton = model.compile("triton", dtype="f32", device=DEVICE, cache_dir=tmp_path / "kernels")
    sessions = (eager.session, triton.session)
    x = torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(5))
    for s in sessions:
        s.reset()
    with np.errstate(over="ignore", under="ignore"):
        for _ in range(4):
            want, got = (s.step(x)[:, -1] for s in sessions)
            assert float((got - want).abs().max()) <= MODEL_TOL * float(want.abs().max())
            assert torch.equal(got.argmax(-1), want.argmax(-1))
            x = want.argmax(-1)[:, None]


def test_choice_bias_is_replicated_over_ranks() -> None:
    """Tensor parallelism over 2 ranks: every rank reads the whole choice bias (as the router's
    weight and bias), and the sharded program computes the unsharded one."""
    spec = from_dict(SPEC)
    program = lower(spec)
    checkpoint = random_weights(program, seed=5)
    sharded = shard_program(program, 2)
    for g in sharded:
        params = [n for n in g if n.op == Op.PARAM and n.name.endswith("router.choice_bias")]
        assert len(params) == spec.layers
        assert all(n.attr("expr") is None and tuple(n.shape) == (16,) for n in params)
    assert_same(spec, outputs(spec, program, checkpoint), on_ranks(spec, sharded, checkpoint, 2))


# ---- malformed fields ---------------------------------------------------------------------------

BAD = [
    ("groups-not-dividing", {"groups": 5}, "ffn.moe.groups",
     "5 does not divide ffn.moe.experts (16)", "a divisor of 16: 1, 2, 4, 8, 16"),
    ("top-groups-above-groups", {"top_groups": 5}, "ffn.moe.top_groups",
     "5 is more than ffn.moe.groups (4)", "1 to 4"),
    ("top-k-beyond-kept-groups", {"top_k": 9, "top_groups": 2}, "ffn.moe.top_k",
     "9 is more than the 8 experts of the 2 kept groups of 4", "1 to 8"),
    ("top2-of-one-expert", {"groups": 16, "top_groups": 4}, "ffn.moe.group_score",
     "'top2' sums a group's two best", "max"),
    ("group-score-without-groups", {"groups": 1, "top_groups": 1, "group_score": "max"},
     "ffn.moe.group_score", "'max' is set, but ffn.moe.groups is 1", "set ffn.moe.groups"),
    ("scale-zero", {"scale": 0.0}, "ffn.moe.scale", "0.0", "a number > 0"),
    ("group-score-unknown", {"group_score": "sum"}, "ffn.moe.group_score", "'sum'", "top2"),
    ("choice-bias-text", {"choice_bias": "yes"}, "ffn.moe.choice_bias", "not true/false",
     "true, false"),
]


@pytest.mark.parametrize("edit,path,says,allowed", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_malformed_routing_fields_are_refused(edit: dict[str, Any], path: str, says: str,
                                              allowed: str) -> None:
    data = copy.deepcopy(SPEC)
    data["ffn"]["moe"].update(edit)
    with pytest.raises(SpecError) as info:
        from_dict(data, source="x.yaml")
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith(f"x.yaml: {path}: "), msg
    assert says in info.value.problem, msg
    assert info.value.allowed is not None and allowed in info.value.allowed, msg
