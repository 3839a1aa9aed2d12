"""Codegen: the sympy printer, the rendered module, errors that name the node, golden kernels.

Golden text: one generated kernel per template family, checked in, so a change to a template
is a visible diff. When a change is intended, regenerate the file the failure names, e.g.

    archc compile tiny-llama3 --kernel fused_linear_0 > tests/golden/kernels/matmul.txt
"""

from __future__ import annotations

import ast
import importlib
import re
import sys
from pathlib import Path

import pytest
import sympy
import torch

from archc.codegen.build import CodegenOptions
from archc.codegen.layout import CodegenError, layouts
from archc.codegen.printer import PrintError, pexpr, texpr
from archc.codegen.render import generate, load_module, write_module
from archc.errors import ArchcError
from archc.ir.attrs import Call
from archc.ir.graph import Graph, GraphBuilder, Program
from archc.ir.lower import lower
from archc.ir.ops import Op
from archc.ir.shapes import B, P, T, shape
from archc.passes import optimize
from archc.runtime.buffers import plan_buffers
from archc.runtime.triton_backend import prepare_triton
from archc.spec import load_spec
from tests.conftest import ALL_SPECS
from tests.golden_text import assert_matches_golden

GOLDEN = Path(__file__).parent / "golden" / "kernels"
# kernels run compiled on a GPU when there is one: the interpreter, once chosen, stays for the
# whole worker process
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# one kernel per template family, from the tiny spec that exercises the most of it
GOLDEN_KERNELS = {
    "matmul": ("tiny-llama3", "fused_linear_0"),     # rms prologue, RoPE pairs, KV-cache write
    "attention": ("tiny-gemma2", "attention_0"),     # window, soft-cap, GQA, prefill + decode
    "norm": ("tiny-gemma2", "norm_0"),               # sandwich norm: residual after, 1 + w
    "pointwise": ("tiny-gemma2", "pointwise_0"),     # the embedding scale
    "embedding": ("tiny-llama3", "embedding_0"),
    "moe": ("tiny-mixtral", "moe_linear_0"),         # grouped experts, gated up projection
    "causal_conv": ("tiny-mamba", "causal_conv_0"),  # bias + silu, the conv state in place
    "ssm_scan": ("tiny-jamba", "ssm_scan_0"),        # Jamba's B and C norms inside the scan
    "linear_attention": ("tiny-linear-attention", "linear_attention_0"),   # GQA 4/2 heads
    # q and k of 2 key heads read through the conv's output, L2-normalized, for 4 value heads;
    # the chunked kernel for prefill, the recurrent one for decode, the state in place
    "delta_rule": ("tiny-qwen3-next", "delta_rule_0"),
}


# ---- the printer ----------------------------------------------------------------------------

X = sympy.Symbol("x", integer=True)


@pytest.mark.parametrize("expr", [sympy.Mod(X - 7, 3), sympy.floor((X - 7) / 4),
                                  sympy.Mod(2 * X + 1, 5) + sympy.floor(X / 3)])
def test_triton_printer_keeps_floor_semantics_for_negative_operands(expr: sympy.Expr,
                                                                    tmp_path: Path) -> None:
    """Triton's // and % truncate toward zero; the printed code must still mean sympy's floor
    and Mod. Evaluated in a Triton kernel over negative and positive x."""
    prepare_triton(DEVICE)
    code = texpr(expr, {"x": "x"})
    src = tmp_path / "printed.py"
    src.write_text("import triton\nimport triton.language as tl\n\n\n@triton.jit\n"
                   "def k(x_ptr, out_ptr, N: tl.constexpr):\n"
                   "    offs = tl.arange(0, N)\n"
                   "    x = tl.load(x_ptr + offs)\n"
                   f"    tl.store(out_ptr + offs, {code})\n")
    sys.path.insert(0, str(tmp_path))
    try:
        mod = importlib.import_module("printed")
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("printed", None)
    xs = torch.arange(-16, 16, dtype=torch.int32, device=DEVICE)
    out = torch.empty_like(xs)
    mod.k[(1,)](xs, out, 32)
    xs = xs.cpu()
    want = [int(expr.subs(X, int(v))) for v in xs]
    assert out.tolist() == want
    naive = torch.fmod(xs - 7, 3)  # what a plain C-like `%` gives: differs for negatives
    assert naive.tolist() != [int(sympy.Mod(int(v) - 7, 3)) for v in xs]


def test_printer_uses_plain_operators_when_operands_are_nonnegative() -> None:
    assert texpr(sympy.floor((P + T) / 16)) == "((P + T) // 16)"
    assert texpr(sympy.Mod(P + T, 16)) == "((P + T) % 16)"
    assert texpr(sympy.Min(P + T, 8)) == "tl.minimum(8, P + T)"
    assert pexpr(sympy.Min(P + T, 8)) == "min(8, P + T)"
    assert texpr(B * T * 64) == "64 * B * T"


@pytest.mark.parametrize("bad", [sympy.Rational(1, 2) * T, sympy.Float(1.5), sympy.sqrt(T)])
def test_printer_refuses_non_integer_arithmetic(bad: sympy.Expr) -> None:
    with pytest.raises(PrintError):
        texpr(bad)


# ---- the module -----------------------------------------------------------------------------

def kernel_program(name: str, dtype: str = "bf16") -> Program:
    return optimize(lower(load_spec(name), dtype))


def test_module_is_deterministic_and_keyed_by_graph_and_options(tmp_path: Path) -> None:
    program = kernel_program("tiny-llama3")
    a = generate(program, CodegenOptions(target="gpu", max_seq_len=64))
    b = generate(program, CodegenOptions(target="gpu", max_seq_len=64))
    c = generate(program, CodegenOptions(target="gpu", max_seq_len=128))
    assert a.source == b.source and a.digest == b.digest
    assert c.digest != a.digest                       # max_seq_len is baked into cache strides
    assert "8192" not in a.source and "64, 16]" in a.source
    path = write_module(a, tmp_path / a.digest[:24])
    assert path.read_text() == a.source
    compile(a.source, str(path), "exec")              # valid Python


def test_each_kernel_is_headed_by_the_ir_nodes_it_implements() -> None:
    program = kernel_program("tiny-llama3")
    gen = generate(program, CodegenOptions(target="gpu", max_seq_len=64))
    g = program.graph("decoder")
    for u in gen.units:
        text = gen.unit_text(u.name)
        graph, node, line = u.uses[0]
        assert f"# implements {graph} {line}" in text
        assert all(f"%{i}" in text for _, i, _ in u.uses)
        assert all(g.nodes[i].op.value == u.family for _, i, _ in u.uses)
    # every compute node is launched once, in order
    steps = gen.steps["decoder"]
    assert [s.node.split(" ")[0] for s in steps] == [f"%{i}" for i in g.compute_ids()]


def test_unique_kernels_versus_launches_at_full_size() -> None:
    program = kernel_program("llama3-8b")
    gen = generate(program, CodegenOptions(target="gpu", max_seq_len=8192))
    layers = load_spec("llama3-8b").layers
    assert gen.launches == 2 + 5 * layers
    # embedding, head, and one kernel per layer op, shared — but the output and down
    # projections (residual epilogue, N = 4096) differ only in K, a constexpr: one kernel
    assert len(gen.units) == 6
    [shared] = [u for u in gen.units if len(u.uses) == 2 * layers]
    assert shared.static["_kernel"] == [{"N": 4096, "K": 4096}, {"N": 4096, "K": 14336}]


def graph_with(op: Op, *args: object, **attrs: object) -> Program:
    b = GraphBuilder("decoder")
    x = b.input("x", shape(B, T, 16), "f32")
    w = b.input("w", shape(24, 16), "f32")
    inputs = {"x": x, "w": w}
    y = b.emit(op, *[inputs[a] for a in args], **attrs)  # type: ignore[index]
    b.output("y", y)
    return Program("t", (b.build(),))


def test_an_op_without_a_template_is_refused_naming_the_node() -> None:
    program = graph_with(Op.MATMUL, "x", "w")
    with pytest.raises(CodegenError, match=r"%2 : f32\[B,T,24\] = matmul\(%0, %1\).*no Triton "
                                           r"template for matmul"):
        generate(program, CodegenOptions())


def test_an_unsupported_epilogue_is_refused_naming_the_node() -> None:
    glu = Call("glu", (), (("fn", "silu"),))
    head_norm = Call("head_norm", (), (("eps", 1e-6), ("head_dim", 4), ("heads", 2),
                                       ("kind", "rms")))
    b = GraphBuilder("decoder")
    x = b.input("x", shape(B, T, 16), "f32")
    w = b.input("w", shape(24, 16), "f32")
    g, s = b.input("g", shape(8), "f32"), b.input("s", shape(8), "f32")
    b.output("y", b.emit(Op.FUSED_LINEAR, x, w, g, s, epilogue=(glu, head_norm)))
    with pytest.raises(CodegenError, match=r"%4 : f32\[B,T,12\] = fused_linear.*head_norm\(\) "
                                           r"needs its heads"):
        generate(Program("t", (b.build(),)), CodegenOptions())


def _with_attrs(g: Graph, i: int, **attrs: object) -> Program:
    """`g` with node i's attributes replaced, bypassing the builder's checks."""
    bad = g.nodes[i].replace(attrs=g.nodes[i].attrs.replace(**attrs))
    return Program("t", (Graph(g.name, g.nodes[:i] + (bad,) + g.nodes[i + 1:]),))


def test_numbers_reach_generated_code_only_as_checked_literals() -> None:
    """Attributes that reach generated code are checked before anything renders: a string where
    a number belongs, an activation name that is code, are refused naming the node."""
    b = GraphBuilder("decoder")
    x = b.input("x", shape(B, T, 16), "f32")
    b.output("y", b.emit(Op.POINTWISE, x, expr=Call("scale", (Call("x", (0,)),),
                                                     (("by", 2.0),))))
    g = b.build()
    evil = Call("scale", (Call("x", (0,)),), (("by", "2) or __import__('os'"),))
    with pytest.raises(ArchcError, match=r"pointwise.*by must be a finite number"):
        generate(_with_attrs(g, 1, expr=evil), CodegenOptions())
    b = GraphBuilder("decoder")
    x = b.input("x", shape(B, T, 16), "f32")
    w = b.input("w", shape(24, 16), "f32")
    b.output("y", b.emit(Op.FUSED_LINEAR, x, w, epilogue=(Call("scale", (), (("by", 2.0),)),)))
    act = Call("act", (), (("fn", "silu(x) + __import__('os')"),))
    with pytest.raises(ArchcError, match="fused_linear.*act.. fn is .*not one of"):
        generate(_with_attrs(b.build(), 2, epilogue=(act,)), CodegenOptions())


def test_views_are_read_through_strides_not_copied() -> None:
    """q, k and v of a fused QKV are slices + head splits of one buffer: the attention kernel
    is passed that buffer and reads it with the views' offsets and strides."""
    program = kernel_program("tiny-gpt2")
    g = program.graph("decoder")
    lays = layouts(g)
    gen = generate(program, CodegenOptions(target="gpu", max_seq_len=64))
    for i in g.ids(Op.ATTENTION):
        q = g.nodes[i].inputs[0]
        assert g.nodes[q].op == Op.SPLIT_HEADS
        root = lays[q].root
        assert g.nodes[root].op == Op.FUSED_LINEAR
        step = next(s for s in gen.steps["decoder"] if s.node.startswith(f"%{i} "))
        assert f"v[{root}]" in step.call and f"v[{q}]" not in step.call


def test_buffers_are_reused_by_liveness() -> None:
    program = kernel_program("tiny-llama3", "f32")
    g = program.graph("decoder")
    plan = plan_buffers(g, layouts(g))
    dims = (2, 16, 0, 0)  # B, T, P, S
    assert len(plan.members) < len(g.compute_ids()) / 2
    assert sum(plan.slot_bytes(dims)) < sum(plan.root_bytes(dims).values()) / 2
    # no node's buffer is shared with a buffer that is still live when it is written
    users = g.users()
    lays = layouts(g)
    last = {r: max([r] + [u for u in range(len(g.nodes)) for j in g.nodes[u].inputs
                          if lays[j].root == r]) for r in plan.slot_of}
    for r, slot in plan.slot_of.items():
        for other in plan.members[slot]:
            if other < r:
                assert last[other] < r or (last[other] == r and r not in users[other]), \
                    f"%{r} overwrites %{other} while it is live"


def test_generated_module_imports_and_lists_its_kernels(tmp_path: Path) -> None:
    prepare_triton(DEVICE)
    gen = generate(kernel_program("tiny-mixtral", "f32"), CodegenOptions(max_seq_len=64))
    mod = load_module(write_module(gen, tmp_path), gen.digest)
    assert set(mod.KERNELS) == {u.name + k.suffix for u in gen.units for k in u.kernels}
    assert callable(mod.run_decoder)
    for name, entry in mod.KERNELS.items():
        fn = getattr(mod, name)
        for arg in fn.arg_names:  # every runtime argument has a type for AOT compiles
            assert arg in entry["types"] or arg in entry.get("static", [{}])[0] or \
                arg.startswith("BLOCK_") or arg in (
                "GROUP_M", "SPLIT_K", "TMA", "ROW_STATS", "PDL", "SPLIT_KEYS", "ROUTE_LAST"), arg


# ---- golden kernels -------------------------------------------------------------------------

@pytest.mark.parametrize("family", sorted(GOLDEN_KERNELS))
def test_generated_kernel_matches_golden_text(family: str) -> None:
    spec, kernel = GOLDEN_KERNELS[family]
    path = GOLDEN / f"{family}.txt"
    regenerate = (f"archc compile {spec} --dtype bf16 --kernel {kernel} > "
                  f"tests/golden/kernels/{family}.txt")
    gen = generate(kernel_program(spec), CodegenOptions(target="gpu",
                                                        max_seq_len=load_spec(spec).max_seq_len))
    assert gen.unit(kernel).family == {"matmul": "fused_linear", "moe": "moe_linear"}.get(
        family, family)
    text = gen.unit_text(kernel)
    assert_matches_golden(path, text, f"the generated {family} kernel", regenerate)


def test_compile_table_prints_ir_text_with_its_brackets(capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        tmp_path: Path) -> None:
    """IR text holds [...] (epilogue lists, shapes); rich would read `[rms_scale(), …]` as
    markup and print `epilogue=` with nothing after it."""
    from archc.cli import main
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert main(["compile", "tiny-llama3", "--dtype", "f32"]) == 0
    out = capsys.readouterr().out
    assert "{epilogue=[residual()]}" in out


# ---- programmatic dependent launch ------------------------------------------------------------

WEIGHT_POINTER = re.compile(r"^(w\d*_ptrs|weight(_\w+)?_ptr)$")   # a weight tile's pointers


def _memory_accesses(node: ast.AST) -> list[ast.Call]:
    """The tl.load / tl.store / tl.atomic_* calls in `node`."""
    return [n for n in ast.walk(node) if isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name)
            and n.func.value.id == "tl"
            and (n.func.attr in ("load", "store") or n.func.attr.startswith("atomic_"))]


def _is_wait(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.If) and ast.unparse(stmt.test) == "PDL" and \
        ast.unparse(stmt.body[0]) == "tl.extra.cuda.gdc_wait()"


def _before_wait(stmts: list[ast.stmt]) -> tuple[list[str], bool]:
    """Walking `stmts` in order, branch by branch: the memory accesses made before the PDL wait
    on some path, other than loads of weight tiles (a parameter no kernel writes), and whether
    every path has waited at the end."""
    bad: list[str] = []
    for stmt in stmts:
        if _is_wait(stmt):
            return bad, True
        if isinstance(stmt, ast.If) and not _memory_accesses(stmt.test):
            body, waited_body = _before_wait(stmt.body)
            other, waited_other = _before_wait(stmt.orelse)
            bad += body + other
            if waited_body and waited_other:
                return bad, True
            continue
        bad += [ast.unparse(c) for c in _memory_accesses(stmt)
                if not (c.func.attr == "load" and any(  # type: ignore[attr-defined]
                    isinstance(n, ast.Name) and WEIGHT_POINTER.match(n.id)
                    for n in ast.walk(c.args[0])))]
    return bad, False


@pytest.mark.parametrize("name", ALL_SPECS)
def test_every_launched_kernel_waits_for_its_producer_first(name: str) -> None:
    """Kernels launch with programmatic dependent launch on sm_90: one may start before the
    kernel writing its inputs has finished, so every launched kernel takes the PDL constexpr and
    waits (gdc_wait) before any memory access — on every path, of every branch — but the loads of
    a matmul's first weight tiles (a parameter: no kernel writes it), which overlap the previous
    kernel's tail. A kernel that did not would race its producer on a GPU and pass every test on
    the CPU. (tests/test_aot.py checks the same order in the PTX of a real compile.)"""
    spec = load_spec(name)
    gen = generate(optimize(lower(spec, "bf16")),
                   CodegenOptions(target="gpu", max_seq_len=spec.max_seq_len))
    tree = ast.parse(gen.source)
    launched = {u.name + k.suffix for u in gen.units for k in u.kernels}
    funcs = {f.name: f for f in tree.body if isinstance(f, ast.FunctionDef)}
    assert launched <= set(funcs)
    early = 0
    for kernel in sorted(launched):
        fn = funcs[kernel]
        assert fn.args.args[-1].arg == "PDL", f"{kernel}: PDL is not its last parameter"
        bad, waited = _before_wait(fn.body)
        assert waited, f"{kernel}: a path that never waits"
        assert not bad, f"{kernel} touches memory before it waits: {bad}"
        early += not _is_wait(fn.body[0])
    # the matmuls of every spec with a weight start loading it before they wait
    assert early >= sum(u.family == "fused_linear" for u in gen.units)
