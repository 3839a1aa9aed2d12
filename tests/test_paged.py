"""The paged KV cache against the contiguous one: the program after `paged_kv`, its KV-cache
writes and attention reading blocks scattered in a pool through each token's block table, gives
the logits the compiled model's own (contiguous-cache) session gives, on eager and on Triton
(interpreted, f32)."""

from __future__ import annotations

import pytest
import torch

import archc
from archc.errors import ArchcError
from archc.ir.ops import Op
from archc.ir.text import format_program, parse_program
from archc.passes.paged import PagedError, paged_kv
from archc.runtime.paged import PagedEngine

BLOCK = 4
POOL = 13       # an odd number of blocks
# (prompt length, its blocks in the pool): blocks scattered and out of order; prompts ending
# exactly at a block edge (8) and inside a block (6, 3)
SEQUENCES = [(8, [11, 2, 7, 4]), (6, [5, 0, 12]), (3, [9, 3])]
DECODE_STEPS = 4    # rows of lengths 8…11, 6…9 and 3…6 in each decode batch


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got − want| over max |want|: f32 logits agree to 1e-5 of their scale."""
    return float((got - want).abs().max() / want.abs().max())


def paged_run(engine: PagedEngine, rows: list[tuple[list[int], int, int]]) -> torch.Tensor:
    """Logits [T, vocab] of one paged step: row t is (blocks, position, token)."""
    table = torch.zeros(len(rows), engine.table_width, dtype=torch.int32)
    for t, (blocks, _, _) in enumerate(rows):
        table[t, :len(blocks)] = torch.tensor(blocks)
    inputs = {"tokens": torch.tensor([[tok for _, _, tok in rows]]),
              "positions": torch.tensor([pos for _, pos, _ in rows]), "block_table": table}
    return engine.steps.run(inputs, len(rows))[0]


def check_against_contiguous(name: str, backend: str) -> None:
    model = archc.load(name)
    engine = model.compile(backend, dtype="f32").engine(block_size=BLOCK, blocks=POOL,
                                                        max_batch=4)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.spec.vocab_size, (n,), generator=gen).tolist()
               for n, _ in SEQUENCES]
    # one contiguous-cache session per sequence: the reference, step by step
    refs = [model.compile(backend, dtype="f32").session for _ in SEQUENCES]
    last = []
    for (n, blocks), prompt, ref in zip(SEQUENCES, prompts, refs):
        got = paged_run(engine, [(blocks, p, tok) for p, tok in enumerate(prompt)])
        ref.reset()
        want = ref.step(torch.tensor([prompt]))[0]                       # (T, vocab)
        assert relative_error(got, want) < 1e-5, (name, "prefill", n)
        last.append(got[-1])
    lengths = [n for n, _ in SEQUENCES]
    for step in range(DECODE_STEPS):
        tokens = [int(x.argmax()) for x in last]
        got = paged_run(engine, [(blocks, length, tok) for (_, blocks), length, tok
                                 in zip(SEQUENCES, lengths, tokens)])
        for r, (ref, tok) in enumerate(zip(refs, tokens)):
            want = ref.step(torch.tensor([[tok]]))[0, -1]
            assert relative_error(got[r], want) < 1e-5, (name, "decode", step, r)
        last = list(got)
        lengths = [n + 1 for n in lengths]


# GQA and RoPE; learned positions; ALiBi; a sliding window shorter than the sequences; soft-caps
# with local and global layers
@pytest.mark.parametrize("name", ["tiny-llama3", "tiny-gpt2", "tiny-bloom", "tiny-mistral",
                                  "tiny-gemma2"])
def test_paged_eager_matches_the_contiguous_cache(name: str) -> None:
    check_against_contiguous(name, "eager")


# GQA and RoPE; soft-caps and a window shorter than the sequences in local and global layers;
# OLMo 2's QK-norm over the whole projections, whose norm kernel writes the pool
@pytest.mark.parametrize("name", ["tiny-llama3", "tiny-gemma2", "tiny-olmo2"])
def test_paged_triton_matches_the_contiguous_cache(name: str) -> None:
    check_against_contiguous(name, "triton")


def test_paged_program_shows_the_block_table_and_round_trips() -> None:
    program = archc.load("tiny-llama3").compile("triton", dtype="f32").session.program
    paged = paged_kv(program, BLOCK, 64)
    g = paged.graph("decoder")
    table = g.nodes[g.inputs["block_table"]]
    assert (table.dtype, [str(d) for d in table.shape]) == ("i32", ["T", "16"])
    attentions = [n for n in g if n.op == Op.ATTENTION]
    assert attentions and all(n.attr("paged") == BLOCK for n in attentions)
    writes = [st for n in g if n.op == Op.FUSED_LINEAR for st in n.attr("epilogue", ())
              if st.fn in ("kv_write", "paged_kv_write")]
    assert writes and {st.fn for st in writes} == {"paged_kv_write"}
    assert parse_program(format_program(paged, provenance=True)) == paged
    eager = paged_kv(archc.load("tiny-llama3").compile("eager").session.program, BLOCK, 64)
    caches = [n for n in eager.graph("decoder") if n.op == Op.KV_CACHE]
    assert caches and all(n.attr("paged") == BLOCK for n in caches)
    assert parse_program(format_program(eager, provenance=True)) == eager


def test_paged_kv_refuses_a_bad_block_size_and_a_paged_program() -> None:
    program = archc.load("tiny-llama3").graph
    with pytest.raises(ArchcError, match="given block_size=0, not a whole number ≥ 1"):
        paged_kv(program, 0, 64)
    with pytest.raises(PagedError, match="tiny-llama3's KV cache is paged already"):
        paged_kv(paged_kv(program, 4, 64), 4, 64)
