"""`archc validate`: per-kernel errors against eager, and the first diverging kernel named.

On a machine with a GPU the kernels run compiled there: switching this worker to Triton's
interpreter would leave every later GPU test in it running interpreted kernels.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import archc
import archc.ir.expr as E
from archc.cli import main
from archc.errors import ArchcError
from archc.runtime.validation import validate

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("name", ["tiny-llama3", "tiny-t5", "tiny-bert"])
def test_validate_agrees_kernel_by_kernel(name: str, tmp_path: Path) -> None:
    report = validate(archc.load(name), device=DEVICE, cache_dir=tmp_path)
    assert report.ok, report.first_divergence
    phases = {"tiny-bert": {"encode"},
              "tiny-t5": {"encode", "cross-kv", "prefill", "decode"}}.get(
        name, {"prefill", "decode"})
    assert {p.phase for p in report.phases} == phases
    assert {k.phase for k in report.kernels} == phases
    # every kernel of every phase was compared, and the cache writes with them
    assert any(k.what == "k cache" for k in report.kernels) == (name != "tiny-bert")
    assert all(k.relative <= report.tolerance for k in report.kernels)


def test_validate_names_the_first_diverging_kernel(monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path) -> None:
    """A wrong activation in the generated code (silu rendered as sigmoid) is caught at the
    first kernel that uses it — the gated FFN's projection — not later."""
    silu = dataclasses.replace(E.ACTIVATIONS["silu"], triton="tl.sigmoid({x})")
    monkeypatch.setitem(E.ACTIVATIONS, "silu", silu)
    report = validate(archc.load("tiny-llama3"), device=DEVICE, cache_dir=tmp_path)
    first = report.first_divergence
    assert first is not None and not report.ok
    assert first.phase == "prefill"
    assert 'glu(fn="silu")' in first.text and first.kernel.startswith("fused_linear")
    earlier = [k for k in report.kernels if k.phase == "prefill" and k.node < first.node]
    assert earlier and all(k.relative <= report.tolerance for k in earlier)


def test_validate_command_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", "tiny-llama3", "--prompt-len", "5", "--device", DEVICE]) == 0
    out = capsys.readouterr().out
    assert "all kernels agree with eager" in out
    assert "prefill: logits vs eager on the unfused graph" in out
    assert "decode: logits" in out


def test_bf16_on_the_cpu_is_refused_with_the_reason() -> None:
    if torch.cuda.is_available():
        pytest.skip("bf16 runs on the GPU")
    with pytest.raises(ArchcError, match="interpreter computes bfloat16 wrongly"):
        archc.load("tiny-llama3").compile("triton", dtype="bf16")


def test_validate_compares_the_recurrent_state(tmp_path: Path) -> None:
    """Mamba keeps no KV cache: after each phase the conv and SSM state of every layer is
    compared with eager's, beside each kernel's output."""
    report = validate(archc.load("tiny-mamba"), device=DEVICE, cache_dir=tmp_path)
    assert report.ok, report.first_divergence
    whats = {(k.phase, k.what) for k in report.kernels}
    assert {(p, w) for p in ("prefill", "decode") for w in ("conv state", "ssm state")} <= whats
    assert not any(w.endswith("cache") for _, w in whats)
