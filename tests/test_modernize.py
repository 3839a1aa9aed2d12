"""Architecture steps: spec transforms, what they buy, and checkpoint conversion."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import archc
from archc.errors import ArchcError
from archc.ir.cost import kv_cache_bytes_per_token, parameter_count
from archc.ir.lower import lower
from archc.modernize import convert, decode_intensity
from archc.spec import load_spec
from archc.spec.steps import STEPS, StepCall, StepError, parse_steps
from tests.conftest import KERNEL_SPECS, TINY_SPECS


@pytest.mark.parametrize("name", ["gpt1", "gpt2", "bert-base", "gpt-j-6b", "falcon-7b"])
@pytest.mark.parametrize("kind", ["swiglu", "geglu", "reglu"])
def test_gated_step_keeps_parameters_within_one_percent(name: str, kind: str) -> None:
    before = load_spec(name)
    (call,) = parse_steps(kind)
    after = call.apply(before)
    assert after.ffn.kind == kind and after.ffn.d_ff == -(-2 * before.ffn.d_ff // 3)
    p0, p1 = parameter_count(lower(before)), parameter_count(lower(after))
    assert abs(p1 - p0) / p0 < 0.01


def _mha(name: str):  # noqa: ANN202
    spec = load_spec(name)
    return dataclasses.replace(spec, attention=dataclasses.replace(
        spec.attention, kv_heads=spec.attention.heads))


def test_gqa_8_on_llama2_70b_cuts_kv_bytes_8x_and_mqa_64x() -> None:
    mha = _mha("llama2-70b")
    kv = kv_cache_bytes_per_token(lower(mha, "bf16"))
    (gqa,) = parse_steps("gqa:8")
    (mqa,) = parse_steps("mqa")
    assert kv_cache_bytes_per_token(lower(gqa.apply(mha), "bf16")) * 8 == kv
    assert kv_cache_bytes_per_token(lower(mqa.apply(mha), "bf16")) * 64 == kv


def test_decode_intensity_model() -> None:
    """AI = (1/d + n·H_kv/(d·H_q) + 1/b)⁻¹: MQA moves the context term from n/d to n/(d·H)."""
    d, n, h, b = 4096, 8192, 32, 16
    assert decode_intensity(d, n, h, h, b) == pytest.approx(1 / (1 / d + n / d + 1 / b))
    assert decode_intensity(d, n, 1, h, b) == pytest.approx(1 / (1 / d + n / (d * h) + 1 / b))
    assert decode_intensity(d, n, 8, h, b) > decode_intensity(d, n, h, h, b)


def _applies(call: StepCall, name: str) -> bool:
    try:
        call.apply(load_spec(name))
    except StepError:
        return False
    return True


STEP_CALLS = [f"{s}:8" if s == "sliding-window" else s for s in STEPS]


@pytest.mark.parametrize("step", STEP_CALLS)
def test_every_step_applies_to_some_tiny_spec(step: str) -> None:
    (call,) = parse_steps(step)
    assert any(_applies(call, n) for n in TINY_SPECS)


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    return tmp_path_factory.mktemp("kernels")


@pytest.mark.parametrize("name", KERNEL_SPECS)
@pytest.mark.parametrize("step", STEP_CALLS)
def test_each_step_yields_a_spec_that_compiles_and_runs(name: str, step: str,
                                                         kernel_dir) -> None:  # noqa: ANN001
    """The spec a step makes validates, lowers, goes through the exact pipeline to kernel-level
    ops only, and runs: eager on the unfused graph and the triton backend (interpreter, f32)
    agree to 1e-4 of the output scale, as every tiny spec must."""
    from archc.ir.ops import KERNEL_LEVEL, META, VIEW, Op
    from archc.passes import optimize
    (call,) = parse_steps(step)
    try:
        after = call.apply(load_spec(name))
    except StepError as err:
        assert str(err)  # a refusal says why
        return
    kernel_ops = {op for g in optimize(lower(after)) for op in (n.op for n in g)}
    assert kernel_ops <= KERNEL_LEVEL | META | VIEW | {Op.EMBEDDING}
    model = archc.from_spec(after, seed=1)
    ids = torch.randint(0, after.vocab_size, (1, 4), generator=torch.Generator().manual_seed(0))
    extra = {"decoder_input_ids": ids[:, :3]} if after.family == "encoder-decoder" else {}
    want = model.compile("eager")(ids, **extra)
    got = model.compile("triton", cache_dir=kernel_dir)(ids, **extra)
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()


def test_mean_pooled_gqa_equals_original_with_group_means() -> None:
    """Ainslie et al. 2023: the converted GQA model is, by construction, the MHA model whose
    K/V heads in each group are replaced by their mean."""
    mha = _mha("tiny-llama2-70b")                       # 8 heads, now 8 KV heads
    model = archc.from_spec(mha, seed=4)
    (call,) = parse_steps("gqa:2")
    gqa = call.apply(mha)
    converted, report = convert(call, mha, gqa, dict(model.weights))
    assert len(report.pooled) == 2 * mha.layers
    # the original with each group's K/V rows replaced by the group mean
    averaged = dict(model.weights)
    for name, t in model.weights.items():
        if name.endswith(("attn.k.weight", "attn.v.weight")):
            heads = list(t.reshape(8, t.shape[0] // 8, -1))      # per head [D, d]
            # query head h reads KV head h // 4 after conversion: groups are heads 0-3 and 4-7
            means = [sum(heads[g * 4:(g + 1) * 4]) / 4 for g in range(2)]
            averaged[name] = torch.cat([means[h // 4] for h in range(8)])
    ids = torch.randint(0, mha.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    want = archc.Model(mha, averaged).compile("eager")(ids)
    got = archc.Model(gqa, converted).compile("eager")(ids)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    original = archc.Model(mha, model.weights).compile("eager")(ids)
    assert (original - want).abs().max() > 1e-3 * want.abs().max()  # pooling did change K/V


def test_no_bias_removes_key_biases_exactly_and_reports_the_rest() -> None:
    spec = load_spec("tiny-gpt2")                      # learned positions: the key bias folds
    model = archc.from_spec(spec, seed=2)
    (call,) = parse_steps("no-bias")
    after = call.apply(spec)
    weights, report = convert(call, spec, after, dict(model.weights))
    assert sorted(report.exact) == [f"layers.{i}.attn.k.bias" for i in range(spec.layers)]
    assert report.dropped and all(rms > 0 for _, rms in report.dropped)
    ids = torch.randint(0, spec.vocab_size, (1, 7), generator=torch.Generator().manual_seed(3))
    # removing only the key biases leaves the function unchanged
    only_k = dict(model.weights)
    for name in report.exact:
        only_k[name] = torch.zeros_like(only_k[name])
    base = model.compile("eager")(ids)
    same = archc.Model(spec, only_k).compile("eager")(ids)
    assert (same - base).abs().max() <= 1e-5 * base.abs().max()
    converted = archc.Model(after, weights).compile("eager")(ids)
    assert (converted - base).abs().max() > 1e-3 * base.abs().max()


def test_key_bias_under_rope_is_dropped_not_exact() -> None:
    spec = load_spec("tiny-qwen2")                     # RoPE after the key bias: it must stay
    model = archc.from_spec(spec, seed=2)
    (call,) = parse_steps("no-bias")
    _, report = convert(call, spec, call.apply(spec), dict(model.weights))
    assert not report.exact
    assert any(name.endswith("attn.k.bias") for name, _ in report.dropped)


@pytest.mark.parametrize("step", ["prenorm", "rmsnorm", "swiglu", "rope", "alibi", "qk-norm"])
def test_steps_that_need_training_refuse_loaded_weights(step: str) -> None:
    spec = load_spec("tiny-gpt1")
    (call,) = parse_steps(step)
    after = call.apply(spec)
    with pytest.raises(StepError, match="needs training"):
        convert(call, spec, after, dict(archc.from_spec(spec).weights))


@pytest.mark.parametrize("text, message", [
    ("prenorm,frobnicate", "unknown step 'frobnicate'"),
    ("gqa:x", "whole number"),
    ("rmsnorm:3", "takes no argument"),
    ("sliding-window", "needs an argument"),
    ("prenorm,,rope", "empty step"),
])
def test_bad_steps_are_refused(text: str, message: str) -> None:
    with pytest.raises(ArchcError, match=message):
        parse_steps(text)


def test_inapplicable_steps_say_why() -> None:
    llama = load_spec("tiny-llama3")
    for step, why in [("prenorm", "already pre-norm"), ("rmsnorm", "already uses RMSNorm"),
                      ("swiglu", "FFN is swiglu"), ("rope", "already uses RoPE"),
                      ("gqa:4", "only reduces"), ("no-bias", "has no biases")]:
        (call,) = parse_steps(step)
        with pytest.raises(StepError, match=why):
            call.apply(llama)


def test_report_walks_gpt1_to_a_llama_style_block() -> None:
    from archc.modernize import walk
    from archc.spec.steps import DEFAULT_STEPS
    rows = walk(load_spec("gpt1"), parse_steps(",".join(DEFAULT_STEPS)), batch=1, context=512)
    assert [r.step for r in rows] == ["(start)", *DEFAULT_STEPS]
    final = rows[-1].spec
    assert (final.norm.kind, final.norm.placement, final.ffn.kind, final.position.kind) == (
        "rmsnorm", "pre", "swiglu", "rope")
    assert final.attention.kv_heads == 3 and not final.attention.bias.any
    by = {r.step: r for r in rows}
    assert by["gqa"].kv_bytes_per_token * 4 == by["rope"].kv_bytes_per_token
    assert by["gqa"].intensity > by["rope"].intensity
    # post-norm cannot fold its norms into the next matmul; pre-norm can
    assert by["(start)"].kernels_per_layer > by["prenorm"].kernels_per_layer


def test_cli_writes_a_spec_that_loads(tmp_path, capsys) -> None:  # noqa: ANN001
    from archc.cli import main
    out = tmp_path / "modern.yaml"
    assert main(["modernize", "tiny-gpt1", "--context", "32", "-o", str(out)]) == 0
    spec = load_spec(str(out))
    assert spec.norm.placement == "pre" and spec.ffn.kind == "swiglu"
    assert "kernels/layer" in capsys.readouterr().out


def test_cli_converts_a_loaded_checkpoint(tmp_path) -> None:  # noqa: ANN001
    from archc.commands.modernize import run
    from archc.sources import native
    src = tmp_path / "mha"
    mha = _mha("tiny-llama2-70b")
    native.save(src, mha, archc.from_spec(mha, seed=5).weights)
    import argparse
    args = argparse.Namespace(source=str(src), steps="gqa:2", batch=1, context=16,
                              output=tmp_path / "gqa", plot=None)
    assert run(args) == 0
    model = archc.load(tmp_path / "gqa")
    assert model.spec.attention.kv_heads == 2
    with pytest.raises(StepError, match="needs training"):
        run(argparse.Namespace(source=str(src), steps="gqa:4,qk-norm", batch=1, context=16,
                               output=None, plot=None))


def test_plot(tmp_path) -> None:  # noqa: ANN001
    pytest.importorskip("matplotlib", reason="--plot needs the optional plot extra")
    from archc.commands.modernize import _plot
    from archc.modernize import walk
    rows = walk(load_spec("tiny-gpt2"), parse_steps("rmsnorm,gqa:2"), batch=1, context=16)
    _plot(rows, tmp_path / "steps.png")
    assert (tmp_path / "steps.png").stat().st_size > 10_000


@pytest.mark.parametrize("name, step, why", [
    ("tiny-mamba", "rope", r"tiny-mamba has no softmax-attention layer \(its layers are mamba\)"),
    ("tiny-linear-attention", "alibi", r"no softmax-attention layer \(its layers are linear "
                                       r"attention\), and ALiBi acts on attention scores"),
    ("tiny-linear-attention", "sliding-window:8", "no softmax-attention layer"),
    ("tiny-linear-attention", "qk-norm", "no softmax-attention layer"),
    ("tiny-mamba", "gqa:1", "tiny-mamba has no attention layer"),
    ("tiny-mamba", "parallel", "no FFN to run beside its mixer"),
    ("tiny-mamba", "no-bias", "conv and Δ biases are part of its recurrence"),
])
def test_steps_that_need_a_kind_of_layer_say_which(name: str, step: str, why: str) -> None:
    (call,) = parse_steps(step)
    with pytest.raises(StepError, match=why):
        call.apply(load_spec(name))


@pytest.mark.parametrize("name, step, section, field, value", [
    ("tiny-linear-attention", "mqa", "attention", "kv_heads", 1),
    ("tiny-jamba", "sliding-window:8", "attention", "window", 8),
    ("tiny-jamba", "rope", "position", "kind", "rope"),
])
def test_attention_steps_apply_where_some_layer_has_that_attention(
        name: str, step: str, section: str, field: str, value: object) -> None:
    """Linear attention has KV heads to share; a hybrid's attention layers take windows and
    RoPE."""
    (call,) = parse_steps(step)
    before, after = load_spec(name), call.apply(load_spec(name))
    assert getattr(getattr(after, section), field) == value != \
        getattr(getattr(before, section), field)
