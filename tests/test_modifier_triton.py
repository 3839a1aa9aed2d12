"""The Triton rendering of modifier expressions agrees with the torch rendering: random
expressions (and the library's, and negative operands of // and %) rendered into tiny
@triton.jit kernels over one tile — q positions a column, kv positions a row, the head a
program id, per-head parameters loaded as scalars, per-token inputs as vectors — run under
Triton's interpreter in a subprocess (TRITON_INTERPRET must be set before triton is imported,
and must not leak into this process).

Integers and bools must be equal; floats within 1e-4 (relative and absolute): the interpreter's
exp/log/sqrt and the rendering's tanh = 2σ(2y) − 1 differ from torch's by a few ulps, which
sums and products of up to a few terms keep far below that."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from archc.codegen.aot import compile_configs
from archc.ir.modifiers import (
    EagerValues,
    builtin,
    evaluate,
    format_expr,
    index,
    parse,
    triton,
    var,
)
from archc.ir.modifiers.language import FUNCTIONS, type_of
from archc.ir.modifiers.library import library_env
from archc.ir.paramexpr import calls
from tests.modifier_exprs import ENV, bools, exact, floats, ints

H, KV_HEADS, BM, BN, Q0, K0 = 4, 2, 8, 16, 21, 3
ROOT = Path(__file__).resolve().parents[1]

CODE = {var("score"): "score", var("q_pos"): "q_pos[:, None]", var("kv_pos"): "k_pos[None, :]",
        var("head"): "head", var("kv_head"): "kv_head", var("prefix_len"): "prefix_len",
        index("slope", "head"): "slope_h", index("slope", "kv_head"): "slope_kv",
        index("doc", "q_pos"): "doc_q[:, None]", index("doc", "kv_pos"): "doc_k[None, :]",
        index("slopes", "head"): "slope_h", index("padding", "kv_pos"): "doc_k[None, :]"}

KERNEL = '''
@triton.jit
def expr_{i}(out_ptr, score_ptr, slope_ptr, doc_ptr, prefix_ptr, Q0, K0,
             GROUP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    # {text}
    head = tl.program_id(0)
    kv_head = head // GROUP
    rows = tl.arange(0, BM)
    cols = tl.arange(0, BN)
    q_pos = Q0 + rows
    k_pos = K0 + cols
    tile = head * BM * BN + rows[:, None] * BN + cols[None, :]
    score = tl.load(score_ptr + tile)
    slope_h = tl.load(slope_ptr + head)
    slope_kv = tl.load(slope_ptr + kv_head)
    doc_q = tl.load(doc_ptr + q_pos)
    doc_k = tl.load(doc_ptr + k_pos)
    prefix_len = tl.load(prefix_ptr)
{lines}
    value = {value}
    tl.store(out_ptr + tile, {store})
'''

DRIVER = '''
import importlib.util, sys, torch
spec = importlib.util.spec_from_file_location("modifier_kernels", sys.argv[1])
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
inp = torch.load(sys.argv[2])
outs = []
for i, dtype in enumerate(inp["dtypes"]):
    out = torch.zeros(inp["H"], inp["BM"], inp["BN"], dtype=dtype)
    getattr(mod, f"expr_{i}")[(inp["H"],)](out, inp["score"], inp["slope"], inp["doc"],
        inp["prefix"], inp["Q0"], inp["K0"], GROUP=inp["GROUP"], BM=inp["BM"], BN=inp["BN"])
    outs.append(out)
torch.save(outs, sys.argv[3])
'''

STORE = {bool: "value.to(tl.int8) + tl.zeros([BM, BN], tl.int8)",
         int: "value + tl.zeros([BM, BN], tl.int64)",
         float: "value + tl.zeros([BM, BN], tl.float32)"}
DTYPE = {bool: torch.int8, int: torch.int64, float: torch.float32}


def _negative_operands() -> list[object]:
    texts = ["(kv_pos - q_pos) // 3", "(kv_pos - q_pos) % 5", "-q_pos // 4 + -kv_pos % 4",
             "(q_pos - 40) % 7 - (kv_pos - 40) // 7", "(-7 - head) // 2 * 10 + (-7 - head) % 2",
             "kv_pos - q_pos - (kv_pos - q_pos) // 6 * 6 == (kv_pos - q_pos) % 6"]
    return [parse(t, "test").tree for t in texts]


# every function of the table, on tile values (and kv_head, which GQA maps from head)
EVERY_FUNCTION = [
    "score + slope[kv_head] * kv_head - q_pos * 0.5", "score * 2.0 - -score / 3.0",
    "(q_pos - 7 * kv_pos) // 4 - (kv_pos - q_pos) % 3", "-score", "abs(score - 1.0)",
    "where(score > 0.0, min(score, 1.5), max(score, -0.5))", "exp(score / 4.0)",
    "log(abs(score) + 0.5)", "tanh(score)", "sigmoid(score)", "sqrt(abs(score))",
    "1.0 * floor(score * 3.0)", "where(not q_pos < kv_pos or kv_pos == 5 and q_pos != 22, "
    "1.0, 0.0) + where(q_pos >= kv_pos, 2.0, 0.0) + where(q_pos <= 2 * kv_pos, 4.0, 0.0)",
    "where(head == 1 and kv_pos < 10 or kv_head > 0, score, 0.0)"]


def _library() -> list[object]:
    constants = dict(window=5, global_tokens=2, chunk=8, dilation=3, softcap=2.5)
    return [builtin(name, **constants) for name in (
        "causal", "sliding_window", "sliding_window_bidirectional", "prefix_lm", "longformer",
        "longformer_bidirectional", "chunked", "dilated_window", "alibi", "alibi_bloom",
        "softcap")]


def _run(exprs: list[object], tmp: Path) -> None:
    env = ENV
    lib_env = library_env({})
    envs = [env] * len(exprs)
    fixed = [*_negative_operands(), *(parse(t, "test").tree for t in EVERY_FUNCTION)]
    exprs = [*exprs, *fixed, *_library()]
    envs += [env] * len(fixed) + [lib_env] * 11
    kernels, types = [], []
    for i, (e, en) in enumerate(zip(exprs, envs)):
        code = triton(e, en, CODE)
        t = type_of(e, en)
        types.append(t)
        lines = "\n".join("    " + ln for ln in code.lines)
        kernels.append(KERNEL.format(i=i, text=format_expr(e)[:200], lines=lines,
                                     value=code.value, store=STORE[t]))
    (tmp / "kernels.py").write_text("import triton\nimport triton.language as tl\n" +
                                    "".join(kernels))
    g = torch.Generator().manual_seed(5)
    score = torch.randn(H, BM, BN, generator=g) * 2
    slope = torch.rand(H, generator=g) + 0.25
    doc = torch.randint(0, 3, (48,), generator=g)
    prefix = torch.tensor(6)
    torch.save(dict(dtypes=[DTYPE[t] for t in types], H=H, BM=BM, BN=BN, GROUP=H // KV_HEADS,
                    Q0=Q0, K0=K0, score=score, slope=slope, doc=doc, prefix=prefix),
               tmp / "inputs.pt")
    run = subprocess.run([sys.executable, "-c", DRIVER, str(tmp / "kernels.py"),
                          str(tmp / "inputs.pt"), str(tmp / "outputs.pt")],
                         capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr[-3000:]
    outs = torch.load(tmp / "outputs.pt")
    for e, en, t, out in zip(exprs, envs, types, outs):
        values = EagerValues(
            torch.arange(Q0, Q0 + BM), torch.arange(K0, K0 + BN), H, KV_HEADS, score[None],
            head_params={"slope": slope, "slopes": slope},
            token_inputs={"doc": doc[None], "padding": doc[None]},
            scalars={"prefix_len": prefix})
        want = evaluate(e, en, values).expand(1, H, BM, BN)[0]
        if t is float:
            torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4, equal_nan=True,
                                       msg=lambda m, e=e: f"{format_expr(e)}: {m}")
        else:
            assert torch.equal(out.to(want.dtype), want), format_expr(e)


def test_every_function_is_rendered_here() -> None:
    used = {c.fn for t in EVERY_FUNCTION for c in calls(parse(t, "test").tree)}
    assert set(FUNCTIONS) <= used, set(FUNCTIONS) - used


# one batch, one subprocess; a failure names its expression, so no shrinking (a run each)
@settings(max_examples=1, deadline=None, derandomize=True, phases=[Phase.generate])
@given(st.tuples(st.lists(ints(3), min_size=14, max_size=14),
                 st.lists(bools(3), min_size=14, max_size=14),
                 st.lists(exact(2), min_size=6, max_size=6),
                 st.lists(floats(2), min_size=14, max_size=14)))
def test_triton_rendering_matches_torch(tmp_path_factory: object, batches: tuple) -> None:
    _run([e for batch in batches for e in batch], tmp_path_factory.mktemp("modifiers"))


def test_rendered_expressions_compile_for_hopper(tmp_path: Path) -> None:
    """The fixed expressions and the library's, stored from one kernel, compile for sm_90a with
    Triton's own compiler (no GPU needed), without spills on 32 × 32 tiles."""
    body = []
    exprs = [(e, ENV) for e in [*_negative_operands(),
                                *(parse(t, "test").tree for t in EVERY_FUNCTION)]]
    exprs += [(e, library_env({})) for e in _library()]
    for i, (e, en) in enumerate(exprs):
        code = triton(e, en, CODE, prefix=f"e{i}_")
        body += [*code.lines, f"value = {code.value}",
                 f"tl.store(out_ptr + {i} * N + tile, ({STORE[type_of(e, en)]}).to(tl.float32))"]
    kernel = KERNEL.format(i="all", text="every fixed expression", lines="\n".join(
        "    " + ln for ln in body), value="0.0", store="value")
    kernel = kernel.replace("BN: tl.constexpr):", "BN: tl.constexpr, N: tl.constexpr, "
                            "PDL: tl.constexpr):")
    types = {"out_ptr": "*fp32", "score_ptr": "*fp32", "slope_ptr": "*fp32", "doc_ptr": "*i64",
             "prefix_ptr": "*i64", "Q0": "i32", "K0": "i32"}
    table = {"expr_all": {"unit": "modifiers", "family": "modifiers", "types": types,
                          "sizes": {}}}
    path = tmp_path / "kernels.py"
    path.write_text(f"import triton\nimport triton.language as tl\nKERNELS = {table!r}\n{kernel}")
    [result] = compile_configs(path, "sm_90a", [("expr_all", dict(
        GROUP=2, BM=32, BN=32, N=H * 32 * 32, num_warps=4, num_stages=1))], timeout=300)
    assert result.ok, result.error
    assert result.spill_bytes == 0 and result.registers > 0
