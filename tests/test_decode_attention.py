"""Split-KV decode attention over a grid fixed by the launch plan.

On a GPU one plan (and one captured CUDA graph) serves every decode step: the attention grid is
sized for the keys the plan covers (the whole cache), and each program deals itself its share of
the live length's key blocks on the device. The last program of a (batch, KV head) to finish
merges the partial results in the same launch. Checked here, under the interpreter, by replaying
ONE plan built for more keys than any step has, at several past lengths:
- the output against eager at 1e-4 of its scale (f32; both sides sum in f32 in different orders,
  a few ulps of the scale), with more splits than blocks (empty splits), uneven deals, GQA, MQA,
  a sliding window (splits that see no key) and global tokens;
- the keys each split read, from its partial sums, against ``blocks.split_keys``;
- the arrival counters are zero again after every launch;
- cache positions past the live length are NaN: a split that read one would spread it; and no
  NaN is computed anywhere, not even from a merge step of only empty splits (numpy's
  RuntimeWarning is an error).
Also the GPU sizing: llama3-8b's and mixtral-8x7b's decode grids keep two waves of programs
with work from a context of 1024 tokens (4 MiB of KV per layer) to the whole cache.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from archc.codegen import blocks
from archc.ir.graph import Graph, GraphBuilder, Program
from archc.ir.ops import Op
from archc.ir.shapes import B, T, shape
from archc.ir.verify import verify_graph
from archc.runtime.eager import EagerContext, KVCache, run_graph
from archc.runtime.triton_backend import TritonOptions, TritonSession
from archc.spec import load_spec
from tests.test_triton_kernels import DEVICE, rand

TOL = 1e-4
MAX_SEQ_LEN = 128     # the cache
KV_LEN_MAX = 120      # the keys the replayed plan's grid covers
LAYER = 0


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kernels")


@pytest.fixture
def deal(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Force the decode grid's key block and split count (the interpreter's defaults give four
    splits of one block each at most: no uneven deal), the keys per busy split (SPLIT_KEYS: the
    interpreter's keep every split busy) and the rows and columns the merge takes a step (the
    interpreter's: all rows, whole heads). The merge always takes every split in one tile."""
    launch_config, split_count = blocks.launch_config, blocks.decode_split_count

    def force(block_n: int, splits: int, block_mr: int | None = None,
              block_dm: int | None = None, split_keys: int | None = None) -> None:
        def config(family: str, target: str, **sizes: int) -> dict[str, Any]:
            cfg = launch_config(family, target, **sizes)
            if family != "attention_decode":
                return cfg
            assert cfg["BLOCK_S"] >= splits           # the merge's tile holds every split
            return {**cfg, "BLOCK_N": block_n, "BLOCK_MR": block_mr or cfg["BLOCK_MR"],
                    "BLOCK_DM": block_dm or cfg["BLOCK_DM"],
                    "SPLIT_KEYS": split_keys or cfg["SPLIT_KEYS"]}

        def count(target: str, programs: int, max_keys: int, sms: int = 0) -> int:
            assert max_keys == KV_LEN_MAX
            return splits
        monkeypatch.setattr(blocks, "launch_config", config)
        monkeypatch.setattr(blocks, "decode_split_count", count)
    yield force
    monkeypatch.setattr(blocks, "launch_config", launch_config)
    monkeypatch.setattr(blocks, "decode_split_count", split_count)


def cached_attention(heads: int, kv_heads: int, hd: int, *, window: int | None = None,
                     global_tokens: int | None = None) -> Graph:
    """Causal attention of T new queries over the first P + T positions of layer 0's cache."""
    b = GraphBuilder("decoder")
    q = b.emit(Op.SPLIT_HEADS, b.input("q", shape(B, T, heads * hd), "f32"), heads=heads)
    b.output("y", b.emit(Op.ATTENTION, q, cache_layer=LAYER, kv_heads=kv_heads, scale=0.3,
                         causal=True, padding=False, prefix=False, window=window,
                         global_tokens=global_tokens))
    g = b.build()
    verify_graph(g)
    return g


class Replay:
    """One session and one decode plan at (batch, T), built for KV_LEN_MAX keys, replayed at any
    past length over a cache of random keys and values."""

    def __init__(self, g: Graph, batch: int, t: int, kv_heads: int, hd: int,
                 kernel_dir: Path) -> None:
        self.g, self.batch, self.t = g, batch, t
        self.s = TritonSession(Program("decoder", (g,)), {}, max_seq_len=MAX_SEQ_LEN,
                               device=DEVICE,
                               options=TritonOptions(passes=None, cache_dir=kernel_dir))
        self.s.cache.ensure(batch)
        self.kv = {kind: rand(batch, kv_heads, MAX_SEQ_LEN, hd, seed=seed)
                   for seed, kind in enumerate("kv", 1)}
        self.runner = self.s.runners["decoder"]
        self.plan = self.plan_at(0)

    def plan_at(self, past: int) -> Any:
        return self.runner.plan(self.s.ctx, self.batch, self.t, past, 0, KV_LEN_MAX)

    def step(self, past: int, q: torch.Tensor) -> torch.Tensor:
        """The plan's output at past length `past`; cache positions past P + T are NaN."""
        assert self.plan_at(past) is self.plan          # one plan for every past length
        length = past + self.t
        for kind, clean in self.kv.items():
            held = self.s.cache.get(LAYER, kind)
            held.copy_(clean)
            held[:, :, length:] = float("nan")
        self.runner.feed(self.plan, {"q": q})
        self.runner.execute(self.plan, self.s.ctx, past)
        return self.plan.outputs["y"].cpu().clone()

    def eager(self, past: int, q: torch.Tensor) -> torch.Tensor:
        length = past + self.t
        cache = KVCache(MAX_SEQ_LEN)
        for kind, clean in self.kv.items():
            EagerContext({"B": self.batch, "T": length, "P": 0, "S": 0}, cache).cache_append(
                LAYER, kind, clean[:, :, :length])
        dims = {"B": self.batch, "T": self.t, "P": past, "S": 0}
        return run_graph(self.g, {}, {"q": q}, EagerContext(dims, cache))["y"]

    def counters(self, kv_heads: int) -> torch.Tensor:
        return self.s.ctx.counters("attention_decode", self.batch * kv_heads).cpu()


CASES = [
    # heads, kv_heads, head_dim, T, window, global tokens, BLOCK_N, splits, merge step
    # (BLOCK_MR, BLOCK_DM), keys per busy split (SPLIT_KEYS), past lengths
    (4, 2, 16, 1, None, None, 16, 4, (None, None), None, (0, 19, 40, 86, 119)),  # GQA: 1 to 8
    #                                                                             blocks
    (3, 1, 16, 2, None, None, 16, 3, (2, None), None, (5, 50, 118)),   # MQA, T = 2: 6 rows, 2
    #                                                                    a merge step; uneven
    (4, 4, 24, 1, None, None, 16, 5, (None, 16), None, (0, 7, 33, 100)),   # MHA; head_dim 24 in
    #                                                             16 + 8 (of 16) columns a step
    (4, 2, 16, 1, 5, None, 16, 4, (None, None), None, (3, 45, 110)),  # window: splits that see
    #                                                                   no key
    (4, 2, 16, 3, 6, 3, 16, 4, (4, None), None, (2, 61, 117)),        # window + global: 12 rows
    (4, 1, 16, 1, 4, 20, 16, 3, (None, None), None, (10, 70, 119)),   # global keys in two
    #                                                                   blocks
    (4, 2, 16, 1, None, None, 32, 2, (None, None), None, (0, 64, 119)),   # interpreter's BLOCK_N
    # few busy splits: one per 40 keys of 5 (a lone split writes its output itself at 1 to 40
    # keys; 2 splits at 41 to 80, 3 across block and split edges, all 5 only past 160)
    (4, 2, 16, 1, None, None, 16, 5, (None, None), 40, (0, 39, 40, 57, 80, 97, 119)),
    (3, 1, 16, 2, 6, None, 16, 4, (2, 8), 48, (1, 46, 47, 95, 118)),   # T = 2 over an edge
]


@pytest.mark.filterwarnings("error::RuntimeWarning")   # numpy's: a NaN computed anywhere
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:10])))
def test_one_plan_replayed_at_every_past_length_agrees_with_eager(kernel_dir: Path, deal: Any,
                                                                  case: tuple) -> None:
    heads, kv_heads, hd, t, window, g, block_n, splits, step, per_split, pasts = case
    deal(block_n, splits, *step, per_split)
    replay = Replay(cached_attention(heads, kv_heads, hd, window=window, global_tokens=g),
                    2, t, kv_heads, hd, kernel_dir)
    for past in pasts:
        q = rand(2, t, heads * hd, seed=past)
        want, got = replay.eager(past, q), replay.step(past, q)
        assert torch.isfinite(got).all(), f"past {past}: read a key past the live length"
        err = (got - want).abs().max()
        assert err <= TOL * want.abs().max(), f"past {past}: max error {err:.3g}"
        assert not replay.counters(kv_heads).any(), f"past {past}: counters left non-zero"


@pytest.mark.parametrize("block_n, splits, per_split", [(16, 3, None), (16, 5, None),
                                                        (32, 4, None), (16, 5, 40)])
def test_each_split_reads_the_keys_split_keys_deals_it(kernel_dir: Path, deal: Any,
                                                        block_n: int, splits: int,
                                                        per_split: int | None) -> None:
    """With q = 0 every visible key scores alike, so a split's partial Σp is the number of keys
    it read and Σp·v / Σp their mean value; values that are the key positions make these the
    count and the mean position of the split's keys: the range itself. Only busy splits leave a
    partial, and only when there are two or more (a lone one writes the output)."""
    deal(block_n, splits, split_keys=per_split)
    per_split = per_split or blocks.DECODE_DEAL
    heads, kv_heads, hd, batch = 2, 1, 16, 1
    replay = Replay(cached_attention(heads, kv_heads, hd), batch, 1, kv_heads, hd, kernel_dir)
    replay.kv["v"][:] = torch.arange(MAX_SEQ_LEN, dtype=torch.float32)[:, None]
    rows = 16                                           # BLOCK_R: G·T = 2 rows, padded
    part = batch * kv_heads * splits * rows
    checked = 0
    for past in (0, 17, 40, 95, 119):
        ml = replay.s.ctx.scratch("attention_ml", part * 2, "f32")
        ml.fill_(-1.0)                                  # what no split wrote stays −1
        replay.step(past, torch.zeros(batch, 1, heads * hd))
        length = past + 1
        busy = blocks.decode_work(length, splits, per_split)
        ml = ml.cpu().view(splits, rows, 2)
        acc = replay.s.ctx.scratch("attention_acc", part * hd, "f32").cpu().view(
            splits, rows, hd)
        for s in range(splits):
            first, end = blocks.split_keys(length, splits, s, per_split)
            if busy == 1 or s >= busy:
                assert (ml[s] == -1.0).all(), f"past {past}: split {s} of {busy} busy wrote"
                continue
            keys = torch.arange(first, end, dtype=torch.float32)
            assert len(keys) > 0
            for r in range(heads):
                assert ml[s, r, 1] == len(keys), f"past {past}, split {s}: {ml[s, r, 1]} keys"
                assert torch.equal(acc[s, r], keys.sum().expand(hd)), f"past {past}, split {s}"
            checked += 1
    assert checked


@pytest.mark.parametrize("name", ["llama3-8b", "mixtral-8x7b"])
def test_gpu_decode_grid_keeps_two_waves_busy_from_a_1k_context(name: str) -> None:
    """At batch 1 (the KV heads' G·T = 4 rows a program), every context from 1024 past tokens
    (4 MiB of KV a layer) to the whole cache leaves at least two programs with work per SM of an
    H100/H200; a shorter one keeps fewer splits busy, one per SPLIT_KEYS keys."""
    spec = load_spec(name)
    kv_heads, hd = spec.attention.kv_heads, spec.attention.head_dim
    group = spec.attention.heads // kv_heads
    cfg = blocks.launch_config("attention_decode", "gpu", L=spec.max_seq_len, D=hd, R=group,
                               KVH=kv_heads, bytes=2)
    assert cfg["BLOCK_N"] >= 16                          # tl.dot's smallest tile
    splits = blocks.decode_split_count("gpu", kv_heads, spec.max_seq_len)
    assert cfg["BLOCK_S"] >= splits                      # the merge's one tile
    kv_bytes = 2 * kv_heads * hd * 2                     # K and V of one key, bf16
    first = (4 << 20) // kv_bytes                        # the first context of ≥ 4 MiB of KV
    assert first == 1024
    per_split = cfg["SPLIT_KEYS"]
    busy = [kv_heads * blocks.decode_work(keys, splits, per_split)
            for keys in range(first, spec.max_seq_len + 1)]
    assert min(busy) >= blocks.DECODE_TARGET_PROGRAMS
    for keys in (1, 100, 512):
        work = blocks.decode_work(keys, splits, per_split)
        assert work == -(-keys // per_split) < splits, (keys, work)


@pytest.mark.parametrize("per_split", [blocks.DECODE_DEAL, 31, 40])
def test_split_keys_deal_every_key_once(per_split: int) -> None:
    """The deal the kernel computes: consecutive ranges covering [0, keys), starting on units of
    DECODE_DEAL keys, the busy splits' sizes differing by at most one unit, one busy split per
    `per_split` keys while there are splits, the others empty."""
    unit = blocks.DECODE_DEAL
    for keys in (1, 15, 16, 17, 100, 1024, 1025):
        for splits in (1, 3, 4, 33):
            deal = [blocks.split_keys(keys, splits, s, per_split) for s in range(splits)]
            busy = blocks.decode_work(keys, splits, per_split)
            assert busy == min(splits, -(-keys // per_split))
            assert deal[0][0] == 0 and deal[busy - 1][1] == keys
            assert all(a[1] == b[0] for a, b in zip(deal[:busy], deal[1:busy]))
            assert all(first % unit == 0 for first, _ in deal[:busy])
            sizes = [end - first for first, end in deal]
            assert max(sizes[:busy]) - min(sizes[:busy]) <= unit
            assert min(sizes[:busy]) > 0 and not any(sizes[busy:])
