"""The matmul K loop through tensor descriptors (TMA on sm_90) agrees with eager, and the kernel
keeps the pointer path where a layout cannot be a descriptor.

On a GPU, prefill launches set TMA = 1 (``blocks.launch_config``); here every matmul launch is
forced to TMA = 1 and run under Triton's interpreter, which runs tensor descriptors too (reads
past the descriptor's shape give zeros, as TMA's do).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import sympy

from archc.codegen import blocks
from archc.codegen.build import CodegenOptions, tma_rows
from archc.codegen.layout import Layout
from archc.codegen.render import generate
from archc.ir.attrs import Call
from archc.ir.graph import GraphBuilder, Program
from archc.ir.ops import Op
from archc.ir.shapes import B, T, shape
from tests.test_splitk import SplitK
from tests.test_triton_kernels import (
    build,
    check,
    check_concat_k_operands,
    check_head_norm,
    check_rms_prologue_glu_bias_residual,
    rand,
)
from tests.test_triton_models import close, ids, pair


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kernels")


class ForcedTMA:
    """Sets TMA = 1 on every matmul launch and counts them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.launches = 0
        config = blocks.launch_config

        def forced(family: str, target: str, **sizes: int) -> dict[str, Any]:
            cfg = config(family, target, **sizes)
            if family == "matmul":
                cfg["TMA"] = 1
                self.launches += 1
            return cfg

        monkeypatch.setattr(blocks, "launch_config", forced)


def lay(shape_: tuple[int, ...], strides: tuple[int, ...], offset: int = 0) -> Layout:
    return Layout(0, sympy.Integer(offset), tuple(map(sympy.Integer, shape_)),
                  tuple(map(sympy.Integer, strides)))


@pytest.mark.parametrize("layout,elem,ok", [
    (lay((2, 5, 24), (120, 24, 1)), 4, True),           # contiguous rows of 96 bytes
    (lay((2, 5, 64), (640, 128, 1), 64), 2, True),      # a slice of a fused buffer, 128 B in
    (lay((2, 5, 25), (125, 25, 1)), 4, False),          # rows of 100 bytes
    (lay((2, 5, 24), (240, 48, 1), 3), 4, False),       # starts 12 bytes in
    (lay((2, 5, 24), (120, 24, 2)), 4, False),          # strided columns
    (lay((2, 5, 24), (256, 24, 1)), 4, False),          # batches apart: not one row stride
])
def test_descriptor_layouts(layout: Layout, elem: int, ok: bool) -> None:
    assert (tma_rows(layout, elem) is not None) == ok


def test_rms_prologue_glu_bias_residual(kernel_dir: Path, monkeypatch: pytest.MonkeyPatch
                                        ) -> None:
    forced = ForcedTMA(monkeypatch)
    check_rms_prologue_glu_bias_residual(kernel_dir, "f32")   # K = 40: zeros past K
    assert forced.launches


def test_concat_k_operands(kernel_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two operands, each with its own descriptor; the weight's ends at the operand's last
    column, so the second operand's columns never leak into the first's last step."""
    forced = ForcedTMA(monkeypatch)
    check_concat_k_operands(kernel_dir)
    assert forced.launches


@pytest.mark.parametrize("kind,hd", [("layer", 16), ("rms", 20)])
def test_head_norm_without_pairs(kernel_dir: Path, monkeypatch: pytest.MonkeyPatch, kind: str,
                                 hd: int) -> None:
    forced = ForcedTMA(monkeypatch)
    check_head_norm(kernel_dir, kind, hd, rope=False)
    assert forced.launches


def test_layer_norm_prologue_odd_width_takes_pointers(kernel_dir: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """K = 25 f32 rows (100 bytes) cannot be a descriptor: the kernel has no TMA branch and the
    forced launch still agrees with eager through its pointers."""
    k, n = 25, 37

    def fn(b: GraphBuilder, i: dict[str, int]) -> int:
        return b.emit(Op.FUSED_LINEAR, i["x"], i["w"], i["colsum"], prologue="layer", eps=1e-5,
                      epilogue=(Call("ln_scale"),))

    w = rand(n, k)
    g = build({"x": (shape(B, T, k), "f32"), "w": (shape(n, k), "f32"),
               "colsum": (shape(n), "f32")}, fn)
    text = generate(Program("m", (g,)), CodegenOptions(target="gpu")).unit_text("fused_linear_0")
    assert "make_tensor_descriptor" not in text
    ForcedTMA(monkeypatch)
    check(g, {"x": 2 + rand(2, 5, k), "w": w, "colsum": w.sum(1)}, {"B": 2, "T": 5, "P": 0},
          kernel_dir)


def test_split_k_with_descriptors(kernel_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each split's descriptor loads start at its first column."""
    forced = SplitK(monkeypatch, splits=3)
    ForcedTMA(monkeypatch)

    def fn(b: GraphBuilder, i: dict[str, int]) -> int:
        return b.emit(Op.FUSED_LINEAR, i["x"], i["w"], prologue="rms", eps=1e-5,
                      epilogue=(Call("rms_scale"),))

    k, n = 72, 40
    g = build({"x": (shape(B, T, k), "f32"), "w": (shape(n, k), "f32")}, fn)
    check(g, {"x": rand(2, 1, k), "w": rand(n, k)}, {"B": 2, "T": 1, "P": 0}, kernel_dir)
    assert forced.split_configs and all(int(c.abs().sum()) == 0 for c in forced.counters)


@pytest.mark.parametrize("name", ["tiny-llama3", "tiny-phi2"])
def test_tiny_model_prefill_with_descriptors(name: str, kernel_dir: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole model's prefill, every matmul through descriptors where its layout allows, at
    1e-4 of eager in f32."""
    forced = ForcedTMA(monkeypatch)
    eager, triton = pair(name, "f32", kernel_dir)
    x = ids(2, 13)
    close(triton(x), eager(x), "f32")
    assert forced.launches
