"""hoist-cross-kv: the decoder's cross-attention K and V, which depend on the encoder's states
alone, move into a `cross_kv` graph that runs once per generation.

Checked: the rewrite itself (what moves, what the decoder reads instead, views and repeat_kv left
behind); that it keeps the function (the translation tests run it on tiny-t5 alone and inside the
pipeline; here also on GQA and QK-norm variants, which move more or less); that eager and triton
sessions run the graph once per generation and again only for other encoder states; and that
`archc passes` shows it and `archc roofline`'s decode step no longer pays for the projections.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

import archc
from archc.cli import main
from archc.gpus import GPUS
from archc.ir.graph import CROSS_KV
from archc.ir.lower import lower
from archc.ir.ops import Op
from archc.passes import optimize, run_pipeline
from archc.passes.manager import run_pass
from archc.perf.roofline import decode_floor, kernels, per_step
from archc.spec import load_spec
from tests.test_translation import LONG, T1, Shapes, padding

TOL = 1e-5


def variant(**attention: object) -> archc.Model:
    spec = load_spec("tiny-t5")
    spec = dataclasses.replace(spec, attention=dataclasses.replace(spec.attention, **attention))
    return archc.from_spec(spec, seed=5)


def test_the_projections_leave_the_decoder() -> None:
    program = lower(load_spec("tiny-t5"))
    step = run_pass(program, "hoist-cross-kv")
    cross, decoder = step.after.graph(CROSS_KV), step.after.graph("decoder")
    assert [g.name for g in step.after] == ["encoder", CROSS_KV, "decoder"]
    layers = load_spec("tiny-t5").decoder_layers
    # each layer's k and v projection, read by the decoder as inputs of their names
    assert len(cross.ids(Op.MATMUL)) == 2 * layers
    assert sorted(cross.outputs) == sorted(f"decoder.layers.{i}.cross.{kv}"
                                           for i in range(layers) for kv in "kv")
    assert set(cross.outputs) <= set(decoder.inputs)
    assert "encoder_hidden" not in decoder.inputs
    weights = {decoder.nodes[j].name for i in decoder.ids(Op.MATMUL)
               for j in decoder.nodes[i].inputs if decoder.nodes[j].op == Op.PARAM}
    assert not any(".cross.k." in w or ".cross.v." in w for w in weights)
    # the views stay with their readers: the decoder splits the heads of what it reads
    for name in cross.outputs:
        users = decoder.users()[decoder.inputs[name]]
        assert {decoder.nodes[u].op for u in users} == {Op.SPLIT_HEADS}
    assert len([d for d in step.decisions if d.applied]) == 2 * layers


def test_in_the_pipeline_one_merged_projection_per_layer_moves() -> None:
    run = run_pipeline(lower(load_spec("tiny-t5")))
    cross = run.program.graph(CROSS_KV)
    layers = load_spec("tiny-t5").decoder_layers
    assert [cross.nodes[i].op for i in cross.compute_ids()] == [Op.FUSED_LINEAR] * layers
    assert all(n.name.endswith(".cross.k+v") for n in cross if n.op == Op.OUTPUT)


def test_repeat_kv_stays_in_the_decoder() -> None:
    """GQA cross-attention: repeat_kv would store a copy per query head; it stays behind, where
    share-kv-heads reads the KV heads in place."""
    program = lower(variant(kv_heads=2).spec)
    after = run_pass(program, "hoist-cross-kv").after
    assert not after.graph(CROSS_KV).ids(Op.REPEAT_KV)
    assert not optimize(program).graph("decoder").ids(Op.REPEAT_KV)


def outputs(model: archc.Model, program: object, s: Shapes) -> list[torch.Tensor]:
    from archc.runtime.eager import EagerSession
    gen = torch.Generator().manual_seed(s.seed)
    session = EagerSession(program, model.weights, max_seq_len=model.spec.max_seq_len)
    src = torch.randint(0, 97, (s.batch, s.source), generator=gen)
    mask = padding(s.batch, s.source, gen)
    extra = {"encoder_hidden": session.encode(src, mask), "encoder_mask": mask}
    ids = torch.randint(0, 97, (s.batch, s.prefill + s.decode), generator=gen)
    out = [session.step(ids[:, :s.prefill], **extra)]
    out += [session.step(ids[:, t:t + 1], **extra) for t in range(s.prefill, ids.shape[1])]
    return out


@pytest.mark.parametrize("attention", [{"kv_heads": 2}, {"qk_norm": True}], ids=["gqa", "qk-norm"])
@pytest.mark.parametrize("s", [T1, LONG], ids=["T1", "long"])
def test_variants_keep_the_function(attention: dict[str, object], s: Shapes) -> None:
    model = variant(**attention)
    program = model.graph
    for after in (run_pass(program, "hoist-cross-kv").after, optimize(program)):
        assert CROSS_KV in [g.name for g in after]
        for want, got in zip(outputs(model, program, s), outputs(model, after, s)):
            assert (got - want).abs().max() <= TOL * want.abs().max()


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_computed_once_per_generation(backend: str, tmp_path: Path) -> None:
    model = archc.load("tiny-t5", seed=2)
    options = {"cache_dir": tmp_path, "passes": "default"} if backend == "triton" else \
        {"passes": "default"}
    compiled = model.compile(backend, **options)
    reference = model.compile("eager")
    session = compiled.session
    runs: list[torch.Tensor] = []
    run = session._run

    def counted(name: str, inputs: dict, **dims: Any) -> dict:
        if name == CROSS_KV:
            runs.append(inputs["encoder_hidden"])
        return run(name, inputs, **dims)
    session._run = counted  # type: ignore[method-assign]
    prompt = torch.randint(3, 97, (2, 7), generator=torch.Generator().manual_seed(1))
    got = compiled.generate(prompt, 6)
    assert len(runs) == 1
    assert torch.equal(got, reference.generate(prompt, 6))
    compiled.generate(prompt, 3)          # a new generation: computed again, once
    assert len(runs) == 2
    other = torch.randint(3, 97, (2, 5), generator=torch.Generator().manual_seed(2))
    assert torch.equal(compiled.generate(other, 4), reference.generate(other, 4))
    assert len(runs) == 3 and runs[-1].shape[1] == 5


def test_passes_table_shows_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["passes", "t5-small"]) == 0
    out = capsys.readouterr().out
    assert "hoist-cross-kv" in out and "hoist-cross-kv ×6" in out


def test_decode_step_no_longer_pays_for_the_projections() -> None:
    """t5-small's decode step, with the pass and without it: the difference is exactly the six
    layers' K/V projections of the S encoder states, which now run once, before decoding."""
    spec = load_spec("t5-small")
    dims = {"B": 1, "T": 1, "P": 600, "S": 512}
    program = lower(spec, "bf16")
    names = [p for p in run_pipeline(program).steps]
    without = optimize(program, [s.name for s in names if s.name != "hoist-cross-kv"])
    with_pass = optimize(program)
    step_with = kernels(per_step(with_pass), dims)
    step_without = kernels(per_step(without), dims)
    assert not any(".cross.k" in k.label for k in step_with)
    moved = [k for k in step_without if ".cross.k+v" in k.label]
    assert len(moved) == spec.decoder_layers
    saved = sum(k.flops for k in moved)
    s, d, kv = 512, spec.d_model, 2 * spec.attention.kv_heads * spec.attention.head_dim
    assert saved == spec.decoder_layers * (2 * s * kv * d + 4 * s * kv)  # matmul + epilogue
    assert sum(k.flops for k in step_without) - sum(k.flops for k in step_with) == saved
    floor_with = decode_floor(with_pass, GPUS["h200"], 1, 600)
    floor_without = decode_floor(without, GPUS["h200"], 1, 600)
    assert floor_without.weight_bytes - floor_with.weight_bytes == \
        spec.decoder_layers * kv * d * 2                                # bf16 weights


def test_roofline_prints_the_once_per_generation_graphs(capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    assert main(["roofline", "t5-small", "--prompt-len", "64", "--new-tokens", "8"]) == 0
    out = capsys.readouterr().out
    decode = out.split("one decode step")[1]
    assert "cross.k+v" not in decode and "encoder" not in decode
    assert "cross.k+v" in out.split("one decode step")[0]
