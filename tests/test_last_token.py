"""The LM head over the rows whose logits are used (``archc.passes.logits``).

A prefill for `generate` or the serving engine reads each sequence's last logits only; the
`last-token-logits` variant computes the head over that row alone. Checked here:
- the variant is in the IR: a `last_token` view of the stream the head starts from, the head
  over [B, 1, ·] — at the unfused level and after the default pipeline;
- its logits equal the full run's last rows (f32: the same products over fewer rows, to 1e-5
  of the logits' scale), on the eager and the triton backend, from the same program;
- generate's greedy tokens are those of the full-logits loop it replaced, on several tiny specs
  (an encoder-decoder and an MoE among them), on both backends;
- the triton module holds the variant as one more run function: its layers run the program's
  kernels, the one-row head is its only kernel of its own, and its launch plans are its own;
- the serving engine's prefills run the variant (a prompt's logits, decode steps' plans apart).
"""

from __future__ import annotations

import pytest
import torch

import archc
from archc.ir.graph import LAST_TOKEN
from archc.ir.lower import lower
from archc.ir.ops import Op
from archc.ir.shapes import T
from archc.ir.text import format_program
from archc.passes import PASSES, optimize, run_pipeline
from archc.passes.logits import PASS, last_token_graph
from archc.spec import load_spec

TOL = 1e-5                                      # f32, relative to the logits' scale
SPECS = ["tiny-llama3", "tiny-gemma2", "tiny-gpt2", "tiny-mixtral", "tiny-t5"]


def test_the_variant_is_a_node_of_the_ir_before_the_head() -> None:
    assert PASSES[PASS].kind == "variant"
    for program in (lower(load_spec("tiny-llama3")), optimize(lower(load_spec("tiny-llama3")))):
        run = run_pipeline(program, [PASS])
        [decision] = run.decisions()
        assert decision.applied and "last_token(%" in decision.reason
        g = run.program.graph("decoder")
        [view] = g.ids(Op.LAST_TOKEN)
        before = g.nodes[g.nodes[view].inputs[0]]
        assert before.shape[1] == T and g.nodes[view].shape[1] == 1
        # everything after the view is the head, over one row a sequence
        assert all(n.shape[1] == 1 for n in g.nodes[view + 1:] if n.op != Op.PARAM)
        assert g.nodes[g.outputs["logits"]].shape[1] == 1
        assert "= last_token(%" in format_program(run.program)
        # the blocks are the program's: every node before the view is unchanged
        old = program.graph("decoder")
        assert g.nodes[:view] == tuple(n for n in old.nodes[:view])


def test_an_encoder_has_no_variant() -> None:
    assert last_token_graph(lower(load_spec("tiny-bert"))) is None


def _greedy_full_logits(compiled: archc.CompiledModel, ids: torch.Tensor, new: int,
                        extra: dict[str, torch.Tensor]) -> torch.Tensor:
    """generate's greedy loop as it was: every step's full logits, their last row's argmax."""
    session, tokens = compiled.session, ids
    if compiled.spec.family == "encoder-decoder":
        tokens = torch.zeros(ids.shape[0], 1, dtype=torch.long)
    session.reset()
    out = [tokens]
    for _ in range(new):
        out.append(session.step(out[-1], **extra)[:, -1].argmax(-1)[:, None])
    return torch.cat(out, dim=1)


# the interpreter's runs cost seconds each: triton on the specs whose heads differ (a separate
# sandwich norm and a soft-cap; an encoder-decoder)
CASES = [(name, "eager") for name in SPECS] + [
    (name, "triton") for name in ("tiny-gemma2", "tiny-t5")]


@pytest.mark.parametrize("name, backend", CASES)
def test_the_last_rows_and_the_greedy_tokens_are_the_full_runs(name: str, backend: str) -> None:
    compiled = archc.load(name, seed=3).compile(backend, dtype="f32")
    session = compiled.session
    assert session.has_last_token() and LAST_TOKEN in session.runs
    ids = torch.randint(0, compiled.spec.vocab_size, (2, 7),
                        generator=torch.Generator().manual_seed(0))
    extra: dict[str, torch.Tensor] = {}
    if compiled.spec.family == "encoder-decoder":
        extra = {"encoder_hidden": session.encode(ids), "encoder_mask": None}
    session.reset()
    full = session.step(ids, **extra)
    session.reset()
    last = session.step(ids, **extra, last=True)
    assert full.shape[1] == ids.shape[1] and last.shape == (2, 1, full.shape[2])
    err = (last - full[:, -1:]).abs().max()
    assert err <= TOL * full.abs().max(), f"max error {err:.3g}"
    # generate (the variant's prefill, then decode steps) picks the tokens the full logits do
    want = _greedy_full_logits(compiled, ids, 3, extra)
    got = compiled.generate(ids, 3, eos_token_id=())
    assert torch.equal(got, want)


def test_the_triton_module_runs_the_variant_on_the_programs_kernels() -> None:
    compiled = archc.load("tiny-llama3", seed=1).compile("triton", dtype="f32")
    s = compiled.session
    gen = s.generated
    full, last = gen.steps["decoder"], gen.steps[LAST_TOKEN]
    assert len(full) == len(last)
    # every launch but the head's runs the program's own kernel; the head over one row is the
    # module's one kernel of its own
    assert [a.unit for a in full[:-1]] == [b.unit for b in last[:-1]]
    assert last[-1].unit not in {a.unit for a in full}
    assert {u.name for u in gen.units} == {a.unit for a in full} | {last[-1].unit}
    assert "def run_decoder_last(v, d):" in gen.source
    # the plans of each are their own: a prefill's, the decode steps'
    compiled.generate(torch.tensor([[3, 4, 5, 6, 7]]), 3, eos_token_id=())
    assert [k[:2] for k in s.runners[LAST_TOKEN].plans] == [(1, 5)]
    assert {k[:2] for k in s.runners["decoder"].plans} == {(1, 1)}
    # the variant's parameters are the program's tensors, not copies
    held = {id(t) for t in s.runners["decoder"].params if t is not None}
    assert {id(t) for t in s.runners[LAST_TOKEN].params if t is not None} <= held


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_the_engine_prefills_the_last_token_only(backend: str) -> None:
    compiled = archc.load("tiny-llama3", seed=2).compile(backend, dtype="f32")
    engine = compiled.engine(block_size=4, blocks=16, max_batch=2)
    prompt = [5, 9, 2, 7, 7, 1, 3]
    logits = engine.prefill(1, prompt, total_tokens=10)
    want = compiled(torch.tensor([prompt]))[0, -1]
    assert logits.shape == want.shape
    assert (logits - want).abs().max() <= TOL * want.abs().max()
    if backend == "triton":
        runners = engine.steps.session.runners
        assert [k[:2] for k in runners[LAST_TOKEN].plans] == [(1, len(prompt))]
        assert not runners["decoder"].plans
        engine.decode([1], [int(logits.argmax())])
        assert [k[:2] for k in runners["decoder"].plans] == [(1, 1)]
