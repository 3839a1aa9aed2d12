"""The occupancy report, `archc compile SPEC --target sm_90a --occupancy`.

The launches are the runtime's own (a launch plan built for the GPU target, nothing launched);
the ahead-of-time compiles are faked here (one real compile is in test_aot.py), so these tests
check what the report computes from the plans: programs with work, bytes, launches per layer and
the verdicts. Expected values come from the spec and plain arithmetic, not from the code under
test.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

import archc.codegen.aot as aot
import archc.codegen.build as build
import archc.perf.occupancy as occupancy
from archc.cli import main
from archc.codegen import blocks
from archc.codegen.aot import AotResult, config_text
from archc.gpus import GPU_TARGETS, GPUS
from archc.ir.lower import lower
from archc.ir.shapes import DTYPE_BYTES
from archc.passes import optimize
from archc.perf.occupancy import balanced_blocks, programs_with_work
from archc.perf.roofline import kernels
from archc.spec import load_spec
from tests.test_moe_kernels import reference_routing

FIELDS = ("kernel", "family", "phase", "programs", "programs_with_work", "bytes", "registers",
          "spill_bytes", "shared_bytes", "wgmma", "tma", "pdl")


def fake_compile(spill: dict[str, int] | None = None, **measured: Any):  # noqa: ANN201
    """A stand-in for ``compile_configs``: 32 registers, 1 KiB of shared memory, `spill`
    bytes for the kernels named there, and any other `measured` fields of ``AotResult``."""
    def compile_configs(module_path: Path, target: str, configs: list[tuple[str, Any]], *,
                        progress: Any = None, **_: Any) -> list[AotResult]:
        table = aot.kernel_table(module_path)
        out = []
        for name, cfg in configs:
            r = AotResult(name, table[name]["unit"], table[name]["family"], target,
                          registers=32, shared_bytes=1024, config=config_text(cfg),
                          spill_bytes=(spill or {}).get(name, 0),
                          **({"wgmma": ["m64n32k16"]} | measured))
            out.append(r)
            if progress is not None:
                progress(r)
        return out
    return compile_configs


def report(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
           *argv: str, spill: dict[str, int] | None = None) -> dict[str, Any]:
    monkeypatch.setattr(aot, "compile_configs", fake_compile(spill))
    assert main(["compile", *argv, "--target", "sm_90a", "--occupancy", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("occupancy")


def phase(data: dict[str, Any], name: str, context: int) -> dict[str, Any]:
    return next(p for p in data["phases"] if p["phase"] == name and p["context"] == context)


def test_tiny_llama3_json(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                          cache_dir: Path) -> None:
    spec = load_spec("tiny-llama3")
    data = report(capsys, monkeypatch, "tiny-llama3", "--context", "24", "40",
                  "--cache-dir", str(cache_dir))
    assert data["target"] == "sm_90a" and data["gpu"]["sms"] == 132 and data["batch"] == 1
    assert not any("balanced" in a or "host step" in a for a in data["assumptions"])  # no MoE
    assert [(p["phase"], p["context"]) for p in data["phases"]] == [
        ("prefill", 24), ("decode", 24), ("prefill", 40), ("decode", 40)]
    program = optimize(lower(spec, spec.dtype))
    graph = program.graph("decoder")
    for p in data["phases"]:
        for x in p["launches"]:
            assert all(k in x for k in FIELDS), x
            assert x["programs"] == math.prod(x["grid"]) >= x["programs_with_work"] >= 1
        # every node of the decoder is launched, its bytes charged once: they add up to the
        # roofline's bytes at the phase's dims
        assert {x["node"] for x in p["launches"]} == set(graph.compute_ids())
        c = p["context"]
        dims = ({"B": 1, "T": c, "P": 0, "S": 0} if p["phase"] == "prefill" else
                {"B": 1, "T": 1, "P": c - 1, "S": 0})
        want = sum(k.bytes for k in kernels(program, dims) if k.graph == "decoder")
        assert sum(x["bytes"] or 0 for x in p["launches"]) == want
        # a layer: q+k+v, attention, o, gate+up, down
        assert set(p["layer_limits"].values()) == {5}
        assert set(p["launches_per_layer"]) == {str(i) for i in range(spec.layers)}
    # decode attention covers the whole cache (CUDA graphs): a fixed grid (B · KV heads,
    # splits); one split is busy per SPLIT_KEYS live keys — a split's share of 4 MiB of keys
    # and values over two programs per SM — and the others return at once
    key_bytes = 2 * spec.attention.head_dim * DTYPE_BYTES[spec.dtype]
    per_split = max(16, (4 << 20) // (2 * 132) // key_bytes)
    for c in (24, 40):
        atts = [x for x in phase(data, "decode", c)["launches"]
                if x["family"] == "attention_decode"]
        assert len(atts) == spec.layers
        for att in atts:
            rows = spec.attention.kv_heads   # B = 1
            splits = blocks.decode_split_count("gpu", rows, spec.max_seq_len)
            assert att["grid"] == [rows, splits]
            assert att["programs_with_work"] == rows * min(splits, -(-c // per_split))
    # the fake compile's numbers reach every launch; nothing spills, the verdict says so
    assert all(x["registers"] == 32 and x["wgmma"] == ["m64n32k16"] and x["tma"] is False
               for p in data["phases"] for x in p["launches"])
    no_spill = [v for v in data["verdicts"]["24"] if "spill" in v["what"]]
    assert no_spill and no_spill[0]["pass"]


def test_tiny_mixtral_experts_with_work(capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch, cache_dir: Path) -> None:
    spec = load_spec("tiny-mixtral")
    experts, top_k = spec.ffn.moe.experts, spec.ffn.moe.top_k
    data = report(capsys, monkeypatch, "tiny-mixtral", "--context", "48", "--cache-dir",
                  str(cache_dir))
    assert any("balanced" in a for a in data["assumptions"])
    for name, tokens in (("decode", 1), ("prefill", 48)):
        p = phase(data, name, 48)
        moe = [x for x in p["launches"] if x["family"] == "moe"]
        assert len(moe) == 2 * spec.layers         # up and down in every layer
        for x in moe:
            block_m = x["config"]["BLOCK_M"]
            # the grid: an upper bound of row blocks, cdiv(pairs, BLOCK_M) + E
            assert x["grid"][0] == -(-tokens * top_k // block_m) + experts
            # with work: one token routes to top_k distinct experts, one block each; a
            # prefill's pairs dealt evenly over the experts
            per_expert = [tokens * top_k // experts + (e < tokens * top_k % experts)
                          for e in range(experts)]
            routed = sum(-(-n // block_m) for n in per_expert)
            if tokens == 1:
                assert routed == top_k
            assert x["programs_with_work"] == routed * math.prod(x["grid"][1:])
        # the router's last program routes: no host step, no routing launch; a layer's
        # launches are its kernel-level nodes
        assert not p["host_steps"] and not [x for x in p["launches"]
                                            if x["family"] == "moe_routing"]
        # a prefill's q+k+v (a folded norm) adds its row statistics' pre-pass
        pre = sum(x["family"] == "matmul_rowstats" and x["layer"] == 0 for x in p["launches"])
        assert pre == (name == "prefill")
        for layer, count in p["launches_per_layer"].items():
            assert count == sum(1 for x in p["launches"] if x["layer"] == int(layer)) == 7 + pre
        # a layer: q+k+v, attention, o, norm, router, up, down, and its routing
        assert set(p["layer_limits"].values()) == {8}
    (launch_verdict,) = [v for v in data["verdicts"]["48"] if "per layer" in v["what"]]
    over = any(int(n) > 8 for n in phase(data, "decode", 48)["launches_per_layer"].values())
    assert launch_verdict["pass"] is not over


def test_balanced_blocks_match_a_routing() -> None:
    """Row blocks of routing where every expert gets its even share, counted from the tables of
    the torch routing the routing kernel is tested against."""
    for tokens, experts, top_k, block_m in ((1, 8, 2, 16), (5, 4, 2, 4), (37, 8, 2, 16),
                                            (64, 8, 2, 16)):
        gates = torch.zeros(tokens, experts)
        for t in range(tokens):
            for j in range(top_k):      # token t's j-th choice: pair t·k + j, dealt round-robin
                gates[t, (t * top_k + j) % experts] = 1.0 + j * 1e-3
        n_blocks = -(-tokens * top_k // block_m) + experts
        _, block_expert = reference_routing(gates, top_k, block_m, n_blocks)
        used = int((block_expert >= 0).sum())
        assert balanced_blocks(tokens * top_k, experts, block_m) == used


def test_programs_with_work_by_family() -> None:
    # decode attention: a fixed grid whose splits deal the live keys out in units of 16; every
    # split works once there are as many units as splits
    args = {"BLOCK_N": 64}
    assert programs_with_work("attention_decode", (8, 33), args, keys=128, tokens=1) == 8 * 8
    assert programs_with_work("attention_decode", (8, 33), args, keys=129, tokens=1) == 8 * 9
    assert programs_with_work("attention_decode", (8, 33), args, keys=512, tokens=1) == 8 * 32
    assert programs_with_work("attention_decode", (8, 33), args, keys=528, tokens=1) == 8 * 33
    # expert GEMMs: one token's 2 pairs go to 2 experts, a block each, of 9 row blocks
    moe = {"BLOCK_M": 16}
    assert programs_with_work("moe", (9, 256), moe, keys=0, tokens=1, experts=8,
                              top_k=2) == 2 * 256
    # others: every program, split-K splits and the routing's one program included
    assert programs_with_work("matmul", (128, 3), {"SPLIT_K": 3}, keys=0, tokens=1) == 384
    assert programs_with_work("moe_routing", (1,), {}, keys=0, tokens=1) == 1


def test_llama3_8b_decode_split_k(capsys: pytest.CaptureFixture[str],
                                  monkeypatch: pytest.MonkeyPatch, cache_dir: Path) -> None:
    """llama3-8b's decode GEMVs: the grid (tiles, SPLIT_K), tiles from the projection's shape;
    every split has K steps, so every program has work; a layer makes 5 launches."""
    spec = load_spec("llama3-8b")
    a, d = spec.attention, spec.d_model
    shapes = {"attn.q+k+v": ((a.heads + 2 * a.kv_heads) * a.head_dim, d),   # (N, K)
              "attn.o": (d, a.heads * a.head_dim), "ffn.gate+up": (2 * spec.ffn.d_ff, d),
              "ffn.down": (d, spec.ffn.d_ff), "head": (spec.vocab_size, d)}
    data = report(capsys, monkeypatch, "llama3-8b", "--context", "2048", "--cache-dir",
                  str(cache_dir))
    p = phase(data, "decode", 2048)
    matmuls = [x for x in p["launches"] if x["family"] == "matmul"]
    assert len(matmuls) == 4 * spec.layers + 1
    split = set()
    for x in matmuls:
        (n, k), cfg = shapes[x["label"].split(".", 2)[-1].split(".weight")[0]
                             if x["layer"] is not None else "head"], x["config"]
        assert n % cfg["BLOCK_N"] == 0 and cfg["BLOCK_M"] >= 1       # one row block, whole tiles
        tiles, splits = n // cfg["BLOCK_N"], cfg["SPLIT_K"]
        assert x["grid"] == [tiles, splits]
        # split s sums K steps [s·span, (s + 1)·span): the last split starts inside K
        steps = -(-k // cfg["BLOCK_K"])
        assert (splits - 1) * -(-steps // splits) < steps
        assert x["programs_with_work"] == x["programs"] == tiles * splits >= 264
        if splits > 1:
            split.add(x["label"].split(".", 2)[-1])
    assert split      # split-K is exercised (the o and down projections: 128 tiles each)
    assert set(p["launches_per_layer"].values()) == set(p["layer_limits"].values()) == {5}


def test_resident_programs_per_sm() -> None:
    sm = GPU_TARGETS["sm_90a"].sm
    # 4 warps of 128 threads at 64 registers: 8192 registers each, 8 fit in 65536
    assert sm.resident(64, 4, 0) == 8
    # shared memory bounds: 100 KiB + 1 KiB reserved each, 2 in 228 KiB
    assert sm.resident(32, 4, 100 * 1024) == 2
    # 255 registers round up to 256 a thread: 8 warps take 65536, one program
    assert sm.resident(255, 8, 0) == 1
    assert GPUS["h200"].sms == 132 and GPUS["a100"].sms == 108


def test_verdict_catches_too_few_programs(capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch,
                                          cache_dir: Path) -> None:
    """llama3-8b decode at context 512, without split-K: matmul tiles 8 columns wide give every
    projection ≥ 512 programs (pass; the KV cache is 2 MiB a layer, under the bar); 256 columns
    for the down projection (K = 14336) give it 4096 / 256 = 16 programs (FAIL, naming it)."""
    real = blocks.launch_config

    def narrow(down: int):  # noqa: ANN202
        def config(family: str, target: str, **sizes: int) -> dict[str, Any]:
            cfg = real(family, target, **sizes)
            if family == "matmul" and sizes["M"] <= 16:
                cfg["BLOCK_N"] = down if sizes["K"] == 14336 else 8
                cfg["SPLIT_K"] = 1
            return cfg
        return config

    verdicts = {}
    for width in (8, 256):
        monkeypatch.setattr(blocks, "launch_config", narrow(width))
        data = report(capsys, monkeypatch, "llama3-8b", "--context", "512", "--cache-dir",
                      str(cache_dir))
        (v,) = [v for v in data["verdicts"]["512"] if "programs with work" in v["what"]]
        verdicts[width] = v
    assert verdicts[8]["pass"] and not verdicts[8]["offending"]
    assert not verdicts[256]["pass"]
    assert verdicts[256]["offending"] == ["fused_linear_1 (ffn.down ×32): 16 programs"]


def test_spills_fail_their_verdict(capsys: pytest.CaptureFixture[str],
                                   monkeypatch: pytest.MonkeyPatch, cache_dir: Path) -> None:
    data = report(capsys, monkeypatch, "tiny-llama3", "--context", "16", "--cache-dir",
                  str(cache_dir), spill={"fused_linear_1_kernel": 96})
    (v,) = [v for v in data["verdicts"]["16"] if "spill" in v["what"]]
    assert not v["pass"] and all(o.startswith("fused_linear_1 in") and o.endswith(": 96 bytes")
                                 for o in v["offending"])


def test_the_table_report(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                          cache_dir: Path) -> None:
    monkeypatch.setattr(aot, "compile_configs", fake_compile())
    assert main(["compile", "tiny-mixtral", "--target", "sm_90a", "--occupancy", "--context",
                 "32", "--cache-dir", str(cache_dir)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "decode step at context 32 (1 token after 31)" in out
    assert "prefill of 32 tokens" in out
    assert "router_0" in out and "moe_linear_1" in out and "H200 SXM" in out
    assert "(host)" not in out and "host step" not in out      # the plans make launches only
    assert out.count("context 32: ") == 3


def test_a_routing_launch(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                          cache_dir: Path) -> None:
    """A router that does not route: the up projection launches the routing kernel first, one
    program, charged nothing (the expert GEMM, the node's widest launch, carries its bytes);
    the layer makes its 8 launches, the bound."""
    monkeypatch.setattr(build, "_routes_experts", lambda c, top_k: False)
    spec = load_spec("tiny-mixtral")
    data = report(capsys, monkeypatch, "tiny-mixtral", "--context", "32", "--cache-dir",
                  str(cache_dir))
    p = phase(data, "decode", 32)
    routing = [x for x in p["launches"] if x["family"] == "moe_routing"]
    assert len(routing) == spec.layers
    for x in routing:
        assert x["grid"] == [1] and x["programs_with_work"] == 1 and x["bytes"] is None
        (gemm,) = [y for y in p["launches"] if y["node"] == x["node"] and y is not x]
        assert gemm["family"] == "moe" and gemm["bytes"] > 0
    assert set(p["launches_per_layer"].values()) == set(p["layer_limits"].values()) == {8}
    (v,) = [v for v in data["verdicts"]["32"] if "per layer" in v["what"]]
    assert v["pass"]


def test_host_steps_are_shown_and_counted(capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch,
                                          cache_dir: Path) -> None:
    """A plan entry that is not a kernel launch (a function called before each decode
    attention): listed, counted as a launch of its layer, so a layer of tiny-llama3 makes 6,
    one over its bound, and the verdict says what they are."""
    def lengths() -> None:
        """A stand-in for host work."""

    record = occupancy.PlanRecorder._call

    def call(self: Any, fn: Any, *args: Any, **kw: Any) -> None:
        if isinstance(fn, occupancy._Bound) and fn.kernel.fn.__name__.endswith("_decode"):
            record(self, lengths)
        record(self, fn, *args, **kw)

    monkeypatch.setattr(occupancy.PlanRecorder, "_call", call)
    spec = load_spec("tiny-llama3")
    data = report(capsys, monkeypatch, "tiny-llama3", "--context", "16", "--cache-dir",
                  str(cache_dir))
    p = phase(data, "decode", 16)
    assert [(h["name"], h["layer"]) for h in p["host_steps"]] == [
        ("lengths", i) for i in range(spec.layers)]
    assert set(p["launches_per_layer"].values()) == {6} and set(p["layer_limits"].values()) == {5}
    (v,) = [v for v in data["verdicts"]["16"] if "per layer" in v["what"]]
    assert not v["pass"]
    assert v["offending"] == [f"6 in layers 0–{spec.layers - 1} (5 kernel launches + 1 host step)"]
    monkeypatch.setattr(aot, "compile_configs", fake_compile())
    assert main(["compile", "tiny-llama3", "--target", "sm_90a", "--occupancy", "--context",
                 "16", "--cache-dir", str(cache_dir)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "lengths (host)" in out and f"+ {spec.layers} host steps" in out
    assert "assumed: a host step counts as one launch" in out


@pytest.mark.parametrize(("argv", "message"), [
    (["--occupancy"], "--occupancy needs a GPU to report on: add --target sm_90a"),
    (["--context", "16"], "--context goes with --occupancy"),
    (["--target", "sm_90a", "--occupancy", "--context", "65"],
     "--context 65 exceeds tiny-llama3's max_seq_len = 64"),
    (["--target", "sm_90a", "--occupancy", "--gpu", "a100"], "--gpu a100 is not an sm_90a GPU"),
    (["--target", "sm_90a", "--occupancy", "--passes", "none"], "leave out --passes"),
])
def test_cli_errors(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    assert main(["compile", "tiny-llama3", *argv]) == 2
    assert message in capsys.readouterr().err


def test_bad_context_is_refused_by_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    for bad, why in (("0", "0 must be ≥ 1"), ("2k", "'2k' is not a whole number")):
        assert main(["compile", "tiny-llama3", "--target", "sm_90a", "--occupancy",
                     "--context", bad]) == 2
        assert f"argument --context: {why}" in capsys.readouterr().err


# ---- Blackwell (sm_100a) ----------------------------------------------------------------------

def test_sm100a_json_models_a_b200(capsys: pytest.CaptureFixture[str],
                                   monkeypatch: pytest.MonkeyPatch, cache_dir: Path) -> None:
    """sm_100a reports on a B200 by default: its 148 SMs, tcgen05 shapes where wgmma's were,
    and residency from the compiled program's warps — a warp-specialized kernel runs more warps
    than its configuration asks for."""
    monkeypatch.setattr(aot, "compile_configs", fake_compile(
        wgmma=[], mma=["m128n64k16"], warp_specialized=True, warps=8, tma=True, pdl=True))
    assert main(["compile", "tiny-llama3", "--target", "sm_100a", "--occupancy", "--json",
                 "--context", "24", "--cache-dir", str(cache_dir)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["target"] == "sm_100a" and data["mma_op"] == "tcgen05"
    assert data["gpu"]["name"] == "B200 SXM" and data["gpu"]["sms"] == 148
    launches = [x for p in data["phases"] for x in p["launches"]]
    assert launches
    for x in launches:
        assert x["mma"] == ["m128n64k16"] and x["wgmma"] == []
        assert x["warp_specialized"] is True and x["warps"] == 8 and x["tma"] and x["pdl"]
        # 32 registers × 32 threads = 1024 a warp: 8 warps take 8192 of 65536, and 64 warps
        # fit on an SM, so 8 programs (shared memory: 228 KiB / 2 KiB allows 114)
        assert x["resident_per_sm"] == 8
        assert x["waves"] == -(-x["programs_with_work"] // (148 * 8))


def test_sm100a_table_names_tcgen05_and_warp_specialization(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        cache_dir: Path) -> None:
    monkeypatch.setattr(aot, "compile_configs", fake_compile(
        wgmma=[], mma=["m128n64k16"], warp_specialized=False))
    assert main(["compile", "tiny-llama3", "--target", "sm_100a", "--occupancy",
                 "--context", "24", "--cache-dir", str(cache_dir)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "on sm_100a: B200 SXM, 148 SMs" in out
    assert "tcgen05" in out and "wgmma" not in out and "m128n64k16" in out
    assert "warp-specialized (loop split into producer and consumer warps): none" in out


@pytest.mark.parametrize(("argv", "message"), [
    (["--target", "sm_100a", "--occupancy", "--gpu", "h200"],
     "--gpu h200 is not an sm_100a GPU (those: b200)"),
    (["--target", "sm_90a", "--occupancy", "--gpu", "b200"], "--gpu b200 is not an sm_90a GPU"),
    (["--target", "sm_70"], "argument --target: invalid choice: 'sm_70'"),
])
def test_sm100a_cli_errors(capsys: pytest.CaptureFixture[str], argv: list[str],
                           message: str) -> None:
    assert main(["compile", "tiny-llama3", *argv]) == 2
    assert message in capsys.readouterr().err


def test_target_choices_include_blackwell(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["compile", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "{sm_80,sm_90a,sm_100a}" in out
    assert "b200 for sm_100a" in out
