"""Every generated kernel compiles for a real GPU, checked without one.

Triton compiles ahead of time for sm_90a here (PTX and a cubin; ptxas reports registers and
spills), in clean worker processes. At full size — the shapes the kernels are for — the matmul
and prefill-attention kernels must use the Hopper tensor cores (wgmma in the PTX), and no kernel
may spill registers. The tiny spec only has to compile.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from archc.codegen.aot import AotResult, compile_module
from archc.codegen.blocks import aot_config
from archc.codegen.build import CodegenOptions
from archc.codegen.render import generate, write_module
from archc.ir.lower import lower
from archc.passes import optimize
from archc.spec import load_spec

SPECS = ["tiny-llama3", "llama3-8b", "mixtral-8x7b", "gemma2-9b", "t5-small"]
FULL_SIZE = [s for s in SPECS if not s.startswith("tiny-")]
TENSOR_CORE_FAMILIES = ("matmul", "moe", "attention")   # attention: the prefill kernel


def aot(name: str, target: str, tmp: Path, kernels: list[str] | None = None) -> list[AotResult]:
    spec = load_spec(name)
    gen = generate(optimize(lower(spec, "bf16")),
                   CodegenOptions(target="gpu", max_seq_len=spec.max_seq_len))
    path = write_module(gen, tmp / name)
    # one compile process per test: pytest-xdist already runs tests side by side
    return compile_module(path, target, jobs=1, kernels=kernels)


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("aot")


@pytest.mark.slow
@pytest.mark.parametrize("name", SPECS)
def test_every_kernel_compiles_for_sm90a(name: str, tmp: Path) -> None:
    results = aot(name, "sm_90a", tmp)
    assert results
    failed = [f"{r.kernel}: {r.error}" for r in results if not r.ok]
    assert not failed, "\n".join(failed)
    assert all(r.registers > 0 for r in results)
    # every kernel waits for the previous one's writes before it reads (programmatic dependent
    # launch): a kernel launched with PDL that did not would race its producer
    assert all(r.pdl for r in results), [r.kernel for r in results if not r.pdl]
    if name not in FULL_SIZE:
        return
    # at full size: tensor cores in every matmul and prefill attention, no spills anywhere
    spilled = [f"{r.kernel} ({r.spill_bytes} bytes)" for r in results if r.spill_bytes]
    assert not spilled, f"kernels spill registers: {', '.join(spilled)}"
    tensor_core = [r for r in results if r.family in TENSOR_CORE_FAMILIES]
    assert tensor_core
    without = [r.kernel for r in tensor_core if r.tensor_core_ops == 0]
    assert not without, f"no wgmma in {', '.join(without)}"


@pytest.mark.slow
def test_sm80_matmul_and_attention_use_mma(tmp: Path) -> None:
    results = aot("llama3-8b", "sm_80", tmp,
                  kernels=["fused_linear_0_kernel", "attention_0_prefill"])
    for r in results:
        assert r.ok, r.error
        assert r.tensor_core_ops > 0, f"no mma.sync in {r.kernel}"
        assert r.spill_bytes == 0
        assert not r.pdl        # griddepcontrol is sm_90's: the PDL branch compiles away


def _linear_attention_8b():  # noqa: ANN202
    """llama3-8b's sizes (32 query heads over 8 KV heads of 128) with linear attention."""
    import dataclasses

    from archc.spec.schema import Mixer, Position
    return dataclasses.replace(load_spec("llama3-8b"), name="llama3-8b-linear",
                               mixer=Mixer(kind="linear_attention"), position=Position(kind="none"))


RECURRENT = {"mamba-130m": ["causal_conv_0_kernel", "ssm_scan_0_kernel"],
             "jamba-v0.1": ["causal_conv_0_kernel", "ssm_scan_0_kernel"],   # B, C norms
             "llama3-8b-linear": ["linear_attention_0_kernel"]}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(RECURRENT))
def test_recurrent_kernels_compile_for_sm90a_without_spills(name: str, tmp: Path) -> None:
    """At full size the scan keeps [32, d_state] of h per program in registers and linear
    attention a [128, 128] S per KV head: both must fit (no spills), as the conv must."""
    spec = _linear_attention_8b() if name == "llama3-8b-linear" else load_spec(name)
    gen = generate(optimize(lower(spec, "bf16")),
                   CodegenOptions(target="gpu", max_seq_len=spec.max_seq_len))
    results = compile_module(write_module(gen, tmp / name), "sm_90a", jobs=1,
                             kernels=RECURRENT[name])
    for r in results:
        assert r.ok, f"{r.kernel}: {r.error}"
        assert r.registers > 0 and r.spill_bytes == 0, f"{r.kernel}: {r.spill_bytes} bytes spill"


def expect_delta_rule_kernels(results: dict[str, AotResult]) -> None:
    """Both forms compiled, neither spills, both wait for the previous kernel (PDL), and the
    chunked one (chunks of 64) multiplies on the tensor cores (wgmma)."""
    assert sorted(results) == ["delta_rule_chunked", "delta_rule_recurrent"]
    for r in results.values():
        assert r.ok, f"{r.kernel}: {r.error}"
        assert r.registers > 0 and r.spill_bytes == 0, f"{r.kernel}: {r.spill_bytes} bytes spill"
        assert r.pdl, r.kernel
    assert "CHUNK=64" in results["delta_rule_chunked"].config
    assert results["delta_rule_chunked"].tensor_core_ops > 0 and results["delta_rule_chunked"].wgmma


@pytest.mark.slow
def test_delta_rule_kernels_compile_for_sm90a_without_spills(tmp: Path) -> None:
    """Qwen3-Next's linear-attention heads (Dk = Dv = 128, bf16) at chunks of 64: the recurrent
    kernel keeps [128, BLOCK_DV] of S per program, the chunked one also the chunk's [64, 64]
    triangular solve — neither may spill, the chunked one multiplies on the tensor cores (wgmma),
    and both wait for the previous kernel (PDL)."""
    from archc.codegen.delta_rule import DeltaRuleKernels, write
    path = write(DeltaRuleKernels(32, 128, 128, "bf16"), tmp / "delta-rule", chunk=64)
    results = {r.family: r for r in compile_module(path, "sm_90a", jobs=1)}
    expect_delta_rule_kernels(results)


@pytest.mark.slow
def test_the_models_delta_rule_kernels_compile_for_sm90a_without_spills(tmp: Path) -> None:
    """The same kernels as the model's module binds them at Qwen3-Next 80B-A3B's sizes: q and k
    read per key head through the conv's output and L2-normalized in the kernel — neither form
    may spill, and the chunked one multiplies on the tensor cores."""
    results = {r.family: r for r in aot("qwen3-next-80b-a3b", "sm_90a", tmp,
                                        kernels=["delta_rule_0_recurrent", "delta_rule_0_chunked"])}
    expect_delta_rule_kernels(results)


def test_decode_matmuls_load_their_weight_before_the_pdl_wait(tmp: Path) -> None:
    """Programmatic dependent launch: a decode projection may start before the kernel writing
    its activations has finished, so it reads them only after griddepcontrol.wait — but its
    weight, which no kernel writes, starts loading before it (the first K step's tiles). Read
    from the PTX of a real sm_90a compile at each launch's own decode tile (llama3-8b, split-K
    included): the only pointer argument read before the wait is the weight. A prefill tile
    loads by TMA, whose descriptors are written after the wait; attention reads nothing before
    it."""
    from archc.codegen.aot import compile_configs, kernel_table
    from archc.codegen.blocks import launch_config
    spec = load_spec("llama3-8b")
    gen = generate(optimize(lower(spec, "bf16")),
                   CodegenOptions(target="gpu", max_seq_len=spec.max_seq_len))
    path = write_module(gen, tmp / "llama3-8b-pdl")
    table = kernel_table(path)
    matmuls = sorted(k for k, e in table.items() if e["family"] == "matmul")
    assert len(matmuls) == 4         # q+k+v, o and down (one kernel: only K differs), gate+up, head
    # each at each of its sizes (N and K, its constexprs)
    decode = [(k, {**st, **launch_config("matmul", "gpu", M=1, **{**table[k]["sizes"], **st})})
              for k in matmuls for st in table[k]["static"]]
    assert len(decode) == 5
    assert any(cfg["SPLIT_K"] > 1 for _, cfg in decode)
    prefill = ("fused_linear_1_kernel", launch_config(
        "matmul", "gpu", M=4096, **table["fused_linear_1_kernel"]["sizes"]))
    attention = ("attention_0_decode", aot_config("attention_decode",
                                                   table["attention_0_decode"]["sizes"]))
    results = compile_configs(path, "sm_90a", [*decode, prefill, attention], jobs=1)
    for r in results:
        assert r.ok and r.pdl and r.spill_bytes == 0, (r.kernel, r.config, r.error)
    *mm, tiled, att = results
    for r in mm:
        assert r.early_reads == ["weight_ptr"], (r.kernel, r.early_reads)
    assert tiled.tma and tiled.early_reads == []
    assert att.early_reads == []


def test_the_last_token_head_compiles_for_sm90a(tmp: Path) -> None:
    """The LM head of the last-token-logits variant reads each sequence's last row through a
    strided view (no TMA: rows T apart): at a batch of one (a GEMV tile) and of 64 prompts (a
    prefill tile: wgmma), it compiles for sm_90a without spills, loading its weight before the
    PDL wait."""
    from archc.codegen.aot import compile_configs, kernel_table
    from archc.codegen.blocks import launch_config
    from archc.ir.graph import LAST_TOKEN
    from archc.passes.logits import last_token_graph
    spec = load_spec("llama3-8b")
    program = optimize(lower(spec, "bf16"))
    gen = generate(program, CodegenOptions(target="gpu", max_seq_len=spec.max_seq_len),
                   {LAST_TOKEN: last_token_graph(program)})
    head = gen.steps[LAST_TOKEN][-1].unit
    assert head not in {step.unit for step in gen.steps["decoder"]}
    path = write_module(gen, tmp / "llama3-8b-last")
    kernel = f"{head}_kernel"
    sizes = kernel_table(path)[kernel]["sizes"]
    configs = [(kernel, launch_config("matmul", "gpu", M=m, **sizes)) for m in (1, 64)]
    one, many = compile_configs(path, "sm_90a", configs, jobs=1)
    for r in (one, many):
        assert r.ok and r.spill_bytes == 0 and not r.tma, (r.config, r.error)
        assert r.early_reads == ["weight_ptr"]
    assert many.wgmma


def test_reads_before_wait_follow_the_parameters_into_addresses() -> None:
    """A load's address computed from a parameter reads that parameter; registers loaded from
    memory carry nothing; the reads after the wait do not count."""
    from archc.codegen.aot_worker import reads_before_wait
    ptx = ("\tld.param.b64 \t%rd1, [k_param_0];\n"
           "\tld.param.b64 \t%rd2, [k_param_1];\n"
           "\tld.param.b32 \t%r1, [k_param_2];\n"
           "\tmad.wide.s32 \t%rd3, %r1, 2, %rd2;\n"
           "\t@%p1 ld.global.v4.b32 { %r2, %r3, %r4, %r5 }, [ %rd3 + 0 ];\n"
           "\tmul.wide.s32 \t%rd4, %r2, 4;\n"
           "\tadd.s64 \t%rd5, %rd4, 64;\n"
           "\tcp.async.cg.shared.global [ %r9 + 0 ], [ %rd5 + 0 ], 0x10, %r10;\n"
           "\tgriddepcontrol.wait ;\n"
           "\tld.global.b32 \t%r6, [ %rd1 + 0 ];\n")
    assert reads_before_wait(ptx, ["x_ptr", "weight_ptr", "M"]) == ["weight_ptr", "M"]
    assert reads_before_wait(ptx.replace("%rd2;", "%rd1;"), ["x_ptr", "weight_ptr", "M"]) == \
        ["x_ptr", "M"]


def test_wgmma_shapes_and_tma_from_ptx_text() -> None:
    from archc.codegen.aot_worker import TMA_OP, wgmma_shapes
    ptx = ("\twgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%f1}, %rd1, %rd2;\n"
           "\twgmma.fence.sync.aligned;\n"
           "\twgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%f2}, %rd3, %rd4;\n"
           "\twgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%f3}, %rd5, %rd6;\n")
    assert wgmma_shapes(ptx) == ["m64n64k16", "m64n128k16"]
    assert wgmma_shapes("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == []
    assert TMA_OP in "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"


def test_explicit_configs_compile_once_and_are_cached(tmp: Path) -> None:
    """One kernel at a prefill tile (wgmma, 128 rows) and a decode tile (16 rows: too few for
    wgmma's 64), compiled for sm_90a — at its first use's constexpr sizes, which the configs do
    not set; asked again, both come from the on-disk cache."""
    from archc.codegen.aot import compile_configs
    spec = load_spec("tiny-llama3")
    gen = generate(optimize(lower(spec, "bf16")),
                   CodegenOptions(target="gpu", max_seq_len=spec.max_seq_len))
    path = write_module(gen, tmp / "explicit")
    prefill = dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, SPLIT_K=1, TMA=1,
                   ROW_STATS=1, num_warps=4, num_stages=3)
    decode = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, GROUP_M=8, SPLIT_K=2, TMA=0, ROW_STATS=0,
                  num_warps=4, num_stages=2)
    configs = [("fused_linear_1_kernel", prefill), ("fused_linear_1_kernel", decode)]
    seen: list[AotResult] = []
    first = compile_configs(path, "sm_90a", configs, jobs=1, cache_dir=tmp / "aot-cache",
                            progress=seen.append)
    assert len(seen) == 2 and all(r.ok and not r.cached for r in first), first
    big, small = first
    assert big.config == "N=64, K=64, BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, " \
                         "SPLIT_K=1, TMA=1, ROW_STATS=1, num_warps=4, num_stages=3"
    assert big.tensor_core_ops > 0 and big.wgmma and all(
        s.startswith("m64n") and s.endswith("k16") for s in big.wgmma)
    assert small.wgmma == [] and small.registers > 0
    assert big.tma is True and small.tma is False       # prefill's tiles by TMA, decode's not
    assert big.pdl and small.pdl                        # sm_90a: programmatic dependent launch
    again = compile_configs(path, "sm_90a", configs, jobs=1, cache_dir=tmp / "aot-cache")
    assert all(r.cached for r in again)
    for a, b in zip(first, again):
        assert (a.registers, a.spill_bytes, a.shared_bytes, a.wgmma, a.tma) == \
               (b.registers, b.spill_bytes, b.shared_bytes, b.wgmma, b.tma)


# ---- Blackwell (sm_100a) ----------------------------------------------------------------------

# One bf16 matmul tile per program, its operands moved by tensor descriptors (TMA), its K loop
# warp-specialized when WS is set: the shape of the generated matmul, small enough to compile in
# a second. BLOCK_M × BLOCK_N = 128 × 64 and 16-bit operands make one tcgen05.mma m128n64k16.
TCGEN05_MODULE = '''
import triton
import triton.language as tl


@triton.jit
def tile_kernel(out_ptr, x_ptr, w_ptr, M, K: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WS: tl.constexpr,
                PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    x = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[K, 1],
                                  block_shape=[BLOCK_M, BLOCK_K])
    w = tl.make_tensor_descriptor(w_ptr, shape=[BLOCK_N, K], strides=[K, 1],
                                  block_shape=[BLOCK_N, BLOCK_K])
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k in tl.range(0, K, BLOCK_K, warp_specialize=WS):
        acc = tl.dot(x.load([tl.program_id(0) * BLOCK_M, k]), w.load([0, k]).T, acc)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    tl.store(out_ptr + rows[:, None] * BLOCK_N + cols[None, :], acc.to(tl.bfloat16),
             mask=rows[:, None] < M)


KERNELS = {"tile_kernel": {"family": "matmul", "unit": "tile", "sizes": {},
                           "types": {"out_ptr": "*bf16", "x_ptr": "*bf16", "w_ptr": "*bf16",
                                     "M": "i32"}}}
'''


def test_bf16_dot_compiles_to_tcgen05_for_sm100a(tmp: Path) -> None:
    """A real compile for Blackwell: tensor-core MMAs are tcgen05.mma of the tile's shape, tiles
    come by TMA, every program waits for the previous kernel (PDL), and warp_specialize=True
    splits the loop into partitions that add warps to the program."""
    from archc.codegen.aot import compile_configs
    path = tmp / "tcgen05.py"
    path.write_text(TCGEN05_MODULE)
    tile = dict(K=256, BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)
    plain, specialized = compile_configs(
        path, "sm_100a", [("tile_kernel", tile | {"WS": False}),
                          ("tile_kernel", tile | {"WS": True})], jobs=1)
    for r in (plain, specialized):
        assert r.ok, r.error
        assert r.tensor_core_ops > 0 and r.mma == ["m128n64k16"] and r.wgmma == []
        assert r.tma and r.pdl and r.registers > 0 and r.spill_bytes == 0
    assert not plain.warp_specialized and plain.warps == 4
    assert specialized.warp_specialized and specialized.warps > 4


def test_tcgen05_shapes_from_ptx_text() -> None:
    """M and N come from the instruction descriptor's bit fields, K from the kind; an MMA whose
    descriptor is not a constant in the PTX has no readable shape."""
    from archc.codegen.aot_worker import mma_shapes, tcgen05_shapes

    def descriptor(m: int, n: int) -> int:
        # bf16 A and B (1 at bits 7 and 10), f32 D (1 at bit 4), N >> 3 at 17, M >> 4 at 24
        return (m >> 4) << 24 | (n >> 3) << 17 | 1 << 10 | 1 << 7 | 1 << 4

    ptx = (f"\tmov.b32 \t%r82, {descriptor(128, 256)};\n"
           "\t@%p9 tcgen05.mma.cta_group::1.kind::f16 [ %r353 + 0 ], %rd44, %rd45, %r82, %p8;\n"
           f"\tmov.b32 \t%r90, {descriptor(64, 32)};\n"
           "\ttcgen05.mma.cta_group::1.kind::tf32 [ %r354 + 0 ], %rd46, %rd47, %r90, %p8;\n"
           "\ttcgen05.mma.cta_group::1.kind::f16 [ %r355 + 0 ], %rd48, %rd49, %r91, %p8;\n")
    assert tcgen05_shapes(ptx) == ["m64n32k8", "m128n256k16"]
    assert mma_shapes(ptx, 100) == tcgen05_shapes(ptx)
    assert mma_shapes(ptx, 90) == [] and mma_shapes(ptx, 80) == []
    assert tcgen05_shapes("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16") == []


@pytest.mark.slow
def test_every_tiny_llama3_kernel_compiles_for_sm100a(tmp: Path) -> None:
    results = aot("tiny-llama3", "sm_100a", tmp)
    assert results
    failed = [f"{r.kernel}: {r.error}" for r in results if not r.ok]
    assert not failed, "\n".join(failed)
    assert all(r.registers > 0 and r.warps > 0 for r in results)
    assert all(r.pdl for r in results), [r.kernel for r in results if not r.pdl]


QUANTIZED = {"llama3-8b": ["fused_linear_0_kernel", "fused_linear_2_kernel"],
             "mixtral-8x7b": ["moe_linear_0_kernel", "moe_linear_1_kernel"]}


@pytest.mark.parametrize("scheme", ["int4_g32", "q4_k"])
@pytest.mark.parametrize("name", sorted(QUANTIZED))
def test_quantized_matmuls_use_tensor_cores_without_spills(name: str, scheme: str,
                                                           tmp: Path) -> None:
    """Every linear weight quantized: llama3-8b's QKV (RoPE, KV write) and gate/up (GLU)
    matmuls and mixtral-8x7b's gated up and down experts dequantize their weight tiles in the K
    loop, at the launch heuristic's prefill tile (wgmma, pointer loads: no TMA for a quantized
    weight) and decode tile, without spills."""
    from archc.codegen.aot import compile_configs, kernel_table
    from archc.codegen.blocks import launch_config
    from archc.runtime.weights import quantizable
    spec = load_spec(name)
    quant = {tensor: scheme for tensor in quantizable(lower(spec, "bf16"))}
    gen = generate(optimize(lower(spec, "bf16", quant)),
                   CodegenOptions(target="gpu", max_seq_len=spec.max_seq_len))
    path = write_module(gen, tmp / f"{name}-{scheme}")
    table = kernel_table(path)
    kernels = QUANTIZED[name]
    assert all(table[k]["sizes"].get("quant") == 4 for k in kernels)
    configs = [(k, launch_config(table[k]["family"], "gpu", M=m, **table[k]["sizes"]))
               for k in kernels for m in (4096, 1)]
    results = compile_configs(path, "sm_90a", configs, jobs=1)
    for r, (_, cfg) in zip(results, configs, strict=True):
        assert r.ok, f"{r.kernel}: {r.error}"
        assert r.spill_bytes == 0, f"{r.kernel} [{r.config}]: {r.spill_bytes} bytes spill"
        assert not r.tma
        if cfg["BLOCK_M"] >= 64:   # prefill tiles: the Hopper tensor cores
            assert r.wgmma, f"no wgmma in {r.kernel} [{r.config}]"


@pytest.mark.slow
def test_latent_attention_compiles_for_sm90a_without_spills(tmp: Path) -> None:
    """DeepSeek-V3's absorbed attention at its size (bf16): 128 query heads over one cached row
    of the 512-dim latent and the 64-dim RoPE key, the latent its values. Decode (16 of the
    heads a program) and prefill (128 of the value columns a program, both products on the
    tensor cores) must not spill, nor the per-head up-projections."""
    from archc.spec import from_dict
    spec = from_dict({"name": "deepseek-v3-attention", "vocab_size": 1024, "d_model": 7168,
                      "layers": 1, "max_seq_len": 4096, "dtype": "bf16",
                      "norm": {"kind": "rmsnorm"}, "attention": {
                          "heads": 128, "head_dim": 192, "latent": {
                              "kv_rank": 512, "rope_dims": 64, "q_rank": 1536, "v_dim": 128}},
                      "ffn": {"kind": "swiglu", "d_ff": 256}})
    gen = generate(optimize(lower(spec, "bf16")), CodegenOptions(target="gpu", max_seq_len=4096))
    kernels = ["attention_0_decode", "attention_0_prefill", "head_linear_0_kernel",
               "head_linear_1_kernel"]
    results = {r.kernel: r for r in compile_module(write_module(gen, tmp / spec.name),
                                                   "sm_90a", jobs=1, kernels=kernels)}
    assert sorted(results) == sorted(kernels)
    for r in results.values():
        assert r.ok, f"{r.kernel}: {r.error}"
        assert r.registers > 0 and r.spill_bytes == 0, f"{r.kernel}: {r.spill_bytes} bytes spill"
        assert r.pdl, r.kernel
    assert results["attention_0_prefill"].tensor_core_ops > 0
