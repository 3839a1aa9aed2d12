"""Block sizes, warps and pipeline stages: chosen here and nowhere else.

Every launcher asks ``launch_config(family, target, **sizes)`` for its tile; on a GPU with
autotuning on, ``autotune_configs(family, **sizes)`` gives the small set a launch is tuned over
(``archc.runtime.tuning``): prefill matmuls and attention, and decode GEMVs with their split-K
counts.
Two targets:
- ``gpu``: tiles from the Triton tutorials and FlashAttention-2 for sm_80/sm_90, registers and
  spills checked with `archc compile --target sm_90a` (ptxas 13): a prefill matmul compiles to
  wgmma with no spills (115 registers with a paired epilogue and the norm prologue).
- ``interpret``: Triton's CPU interpreter pays per operation, not per element (~0.1–0.2 ms per
  tl op on this project's CI machine), so tiles are as large as the problem allows: fewer programs
  and fewer loop iterations.
"""

from __future__ import annotations

from typing import Any

from archc.gpus import GPUS, default_gpu

TARGETS = ("gpu", "interpret")

# Decode attention: the split-KV (flash-decoding) kernel while the query rows of one KV head,
# G·T, fit one tile of at most 128 rows (MQA with 71 heads included); otherwise the prefill kernel.
DECODE_MAX_ROWS = 128
# Decode launches aim for two programs per SM: `sms` in a launch's sizes is the GPU's SM count
# (the runtime's device, the occupancy report's modelled GPU), by default sm_90a's GPU's.
DEFAULT_SMS = GPUS[default_gpu("sm_90a")].sms
DECODE_TARGET_PROGRAMS = 2 * DEFAULT_SMS


def target_programs(sizes: dict[str, int]) -> int:
    """Programs a decode launch aims for: two per SM of the GPU in `sizes` (``sms``)."""
    return 2 * sizes.get("sms", DEFAULT_SMS)
# Keys the decode-attention splits are dealt in: the smallest tile (tl.dot's 16), not the key
# block a program steps by, so a short context still has a unit for every busy split.
DECODE_DEAL = 16
DOT_MIN = 16        # tl.dot's smallest tile side on a GPU
# At most this many splits per (batch, KV head): the last to finish merges them in one tile.
DECODE_MAX_SPLITS = 128
# A decode launch that moves this many bytes must fill the GPU: two programs per SM with work
# (the occupancy report's verdict); decode attention keeps all its splits busy from there.
STREAMING_BYTES = 4 << 20
# Launches of at most this many rows (matmul M, attention T) are decode steps: a matmul is tuned
# over GEMV tiles and split-K counts (DECODE_TILES), attention not at all.
DECODE_ROWS = 16
# Decode GEMVs split their K loop (split-K) into parts of at least this many BLOCK_K steps:
# shorter parts would spend more on writing and re-reading partial sums than on streaming weights.
DECODE_MIN_SPLIT_STEPS = 4


# Decode attention over heads wider than this takes a KV group's G·T rows in tiles of 16, a
# program each: latent attention's 128 heads of 512 as one tile would hold a [128, 512] f32
# accumulator
ROW_TILED_D = 256


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def tile_columns(sizes: dict[str, int]) -> int:
    """What a matmul's column tiles cover: its N output columns, or the ⌈N / 2⌉ pairs of a
    paired epilogue (GLU's gate and up rows, RoPE's rotation partners and an odd tail's last
    column)."""
    return -(-sizes["N"] // 2) if sizes.get("paired") else sizes["N"]


def _clamp_pow2(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, next_pow2(n)))


def _cfg(warps: int = 4, stages: int = 1, **blocks: int) -> dict[str, Any]:
    return dict(blocks, num_warps=warps, num_stages=stages)


def launch_config(family: str, target: str, **sizes: int) -> dict[str, Any]:
    """Block sizes (constexprs) plus num_warps and num_stages for one launch."""
    gpu = target == "gpu"
    if family == "matmul":
        m, paired = sizes["M"], sizes.get("paired", 0)
        if not gpu:
            # the interpreter holds a program's weight tile as numpy arrays (int64 pointers,
            # masks, codes, values): for SmolLM2's Q4_1 kernels a step's first matmul raised
            # the resident peak by ~30 MiB with 1024 × 512 tiles, ~20 MiB with 512 × 512, for
            # a step ~10% slower (this project's CI machine)
            cfg = _cfg(BLOCK_M=_clamp_pow2(m, 16, 64),
                       BLOCK_N=_clamp_pow2(sizes["N"], 32 if paired else 16, 512),
                       BLOCK_K=_clamp_pow2(sizes["K"], 16, 512))
        elif m <= 16:
            # decode streams the weight once: narrow column tiles and long K steps, each
            # program with 4 loads in flight; split-K (below) adds programs where the tiles
            # alone are fewer than two per SM
            cfg = _cfg(4, 4, BLOCK_M=16, BLOCK_N=32, BLOCK_K=256)
        elif m <= 64:
            cfg = _cfg(4, 4, BLOCK_M=64, BLOCK_N=128, BLOCK_K=64)
        elif sizes.get("head_norm") or (paired and sizes.get("layer_norm")):
            # heavy epilogues spill at 128 rows: a per-head norm (368 bytes), or two
            # accumulators with LayerNorm's two statistics (falcon-7b's QKV+MLP: 348 bytes);
            # 64 rows × 8 warps fit (140 registers for the per-head norm)
            cfg = _cfg(8, 3, BLOCK_M=64, BLOCK_N=128, BLOCK_K=64)
        elif sizes.get("adjacent") and not sizes.get("rope"):
            # GLU over paired-adjacent weight rows: one 128 × 256 accumulator, wgmma m64n256,
            # TMA loads and the norm's row statistics from the pre-pass: 176 registers, no
            # spill (RoPE's cos/sin tiles spill at 256 columns: 128 × 128 below)
            cfg = _cfg(8, 3, BLOCK_M=128, BLOCK_N=256, BLOCK_K=64)
        else:
            cfg = _cfg(8, 3, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64)
        if gpu and sizes.get("quant"):
            # a quantized weight's tile is dequantized in registers (codes, scales, offsets and
            # their addresses live together): sm_90a spills at decode's 256-column K steps (q4_k:
            # 972 bytes) and at 128 × 128 prefill tiles (q4_k QKV: 16 bytes); 128-column steps
            # and 64-row weight tiles fit (165 and 255 registers, no spill)
            cfg["BLOCK_K"] = min(cfg["BLOCK_K"], 128)
            if m > 16:
                cfg["BLOCK_N"] = min(cfg["BLOCK_N"], 64)
        # epilogues that reduce over a head (QK-norm) need whole heads in a tile
        base = cfg["BLOCK_N"] * cfg["BLOCK_K"]
        cfg["BLOCK_N"] = max(cfg["BLOCK_N"], sizes.get("align", 16))
        if gpu and m <= 16:
            # a decode GEMV widened to whole heads keeps its weight tile's size in shorter K
            # steps (and more of them to split): on sm_90a (ptxas 13), gemma3-12b's QKV (heads
            # of 256) at 256 × 256 asked 408 KiB of shared memory and spilled 3000 bytes over 96
            # programs, at 256 × 32 it takes 51 KiB, 136 registers, 288 programs; qwen3-8b's
            # (heads of 128) 216 KiB, 255 registers, 192 programs at 128 × 256, 54 KiB, 106
            # registers, 288 programs at 128 × 64
            cfg["BLOCK_K"] = max(16, min(cfg["BLOCK_K"], base // cfg["BLOCK_N"]))
        cfg["GROUP_M"] = 8
        cfg["SPLIT_K"] = 1
        # prefill on a GPU loads its tiles by TMA where the layouts allow (the kernel decides
        # that at codegen); decode keeps its pointer loads, and the interpreter too unless a test
        # forces TMA = 1 (it runs tensor descriptors as well)
        cfg["TMA"] = int(gpu and m > 16 and not sizes.get("quant"))   # quantized: never TMA
        # prefill: a folded norm's row statistics once per row, by a pre-pass the launcher adds,
        # not in every column tile's K loop; decode keeps one launch a projection
        cfg["ROW_STATS"] = int(m > 16)
        if gpu and m <= 16 and sizes.get("operands", 1) == 1:
            tile_n = cfg["BLOCK_N"] // 2 if paired else cfg["BLOCK_N"]
            tiles = _cdiv(m, cfg["BLOCK_M"]) * _cdiv(tile_columns(sizes), tile_n)
            want = target_programs(sizes)
            # a short K loop splits too few times at long K steps (smollm3-3b's QKV, K = 2048:
            # 8 steps of 256, 2 splits of 96 tiles, 192 programs): shorter steps, down to 64
            # columns (128 for a quantized weight's dequantized tile), until the splits reach
            # two programs an SM
            floor = 128 if sizes.get("quant") else 64
            while cfg["BLOCK_K"] > floor and \
                    tiles * split_k_count(tiles, sizes["K"], cfg["BLOCK_K"], want) < want:
                cfg["BLOCK_K"] //= 2
            cfg["SPLIT_K"] = split_k_count(tiles, sizes["K"], cfg["BLOCK_K"], want)
        return cfg
    if family == "matmul_rowstats":
        # a folded norm's row statistics ahead of a prefill matmul: rows of K values, a
        # [BLOCK_R, BLOCK_K] tile a step; fewer programs than the matmul it serves
        return _cfg(4, BLOCK_R=16 if gpu else _clamp_pow2(sizes["M"], 1, 64),
                    BLOCK_K=_clamp_pow2(sizes["K"], 16, 512))
    if family == "kv_quant":
        # a quantized KV cache's new rows after the projection that computed them: BLOCK_R
        # (token, head) rows of BLOCK_D values a program, codes and a scale each
        return _cfg(BLOCK_R=16 if gpu else _clamp_pow2(sizes["M"], 1, 16),
                    BLOCK_D=next_pow2(sizes["D"]))
    if family == "attention":
        # TMA: Q, K, V tiles through tensor descriptors on a GPU, where the layout allows
        # (`tma`: the build found it 16-byte aligned) and the products run on tensor cores
        # (16-bit operands: f32 multiplies in IEEE on the CUDA cores, its tiles in registers,
        # which descriptor loads spill); the interpreter reads through pointers
        wide = sizes.get("bytes", 2) > 2
        tma = int(gpu and bool(sizes.get("tma", 0)) and not wide)
        if sizes["D"] > ROW_TILED_D:   # the value columns in tiles, a program each
            if not gpu:
                return _cfg(BLOCK_M=_clamp_pow2(sizes["T"], 16, 128),
                            BLOCK_N=_clamp_pow2(sizes["L"], 16, 128), BLOCK_DV=128, TMA=0)
            # DeepSeek-V3's latent (512 + 64 RoPE dims, bf16, sm_90a, Triton 3.9): 64 queries,
            # 16 keys a step and 128 value columns fit in 250 registers, both products on wgmma;
            # 32 keys a step spill 76 bytes (52 at one stage)
            return _cfg(8, 2, BLOCK_M=64, BLOCK_N=16, BLOCK_DV=128, TMA=0)
        if not gpu:
            return _cfg(BLOCK_M=_clamp_pow2(sizes["T"], 16, 128),
                        BLOCK_N=_clamp_pow2(sizes["L"], 16, 128), TMA=tma)
        if sizes["D"] > 128:  # head_dim 256: 4 warps spill (255 registers); 8 warps fit in 205
            return _cfg(8, 2, BLOCK_M=64, BLOCK_N=32, TMA=tma)
        if sizes.get("t5", 0) or wide:  # T5's buckets are integer tiles per score, f32
            return _cfg(8, 3, BLOCK_M=128, BLOCK_N=64, TMA=tma)   # products too: 128 keys spill
        if sizes.get("sm", 90) < 90:  # mma.sync holds Q, S and P in registers: 128 keys spill
            return _cfg(8, 3, BLOCK_M=128, BLOCK_N=64, TMA=tma)
        # 128×128 tiles: both products at wgmma m64n128 (each of the 8 warps' groups holds 64
        # query rows); 2 stages of K and V (64 KiB in bf16 at head_dim 128) compile without spills
        return _cfg(8, 2, BLOCK_M=128, BLOCK_N=128, TMA=tma)
    if family == "attention_ring":
        # a ring step's block: the prefill tiles, through pointers (a block is a plain buffer).
        # Every block is masked by its keys' loaded positions: at 128 × 128 that spills on
        # sm_90a (255 registers, 16 bytes, llama3-8b bf16); 64 keys a step fit (223, none)
        cfg = {k: v for k, v in launch_config("attention", target, **sizes).items()
               if k != "TMA"}
        if gpu:
            cfg["BLOCK_N"] = min(cfg["BLOCK_N"], 64)
        return cfg
    if family == "attention_decode":
        block_d = _clamp_pow2(sizes["D"], 16, 1 << 16)
        # the G·T query rows of a KV head; past head dims of 256 in tiles of 16
        rows = _clamp_pow2(sizes["R"], 16, DECODE_MAX_ROWS if block_d <= ROW_TILED_D else 16)
        splits = sizes.get("splits") or decode_split_count(
            target, sizes.get("KVH", 1), sizes["L"], sizes.get("sms", DEFAULT_SMS))
        per_split = decode_split_keys(target, sizes["D"], sizes.get("bytes", 2),
                                      sizes.get("sms", DEFAULT_SMS))
        # the merge takes every split at once (BLOCK_S ≥ splits), the rows and columns of a
        # [BLOCK_S, BLOCK_MR, BLOCK_DM] tile at a time
        block_s = next_pow2(splits)
        if not gpu:  # about one block per split (decode_split_count: four), so short test
            # sequences still exercise the merge and splits that end inside a block; the merge
            # in one tile (the interpreter pays per operation)
            return _cfg(BLOCK_R=rows, BLOCK_N=_clamp_pow2(sizes["L"] // 4, 16, 128),
                        SPLIT_KEYS=per_split, BLOCK_S=block_s,
                        BLOCK_MR=next_pow2(sizes["R"]), BLOCK_DM=block_d)
        # key blocks of about 4096 values (32 keys of head_dim 128, 64 of 64, 16 of 256); the
        # splits are dealt in units of DECODE_DEAL keys (decode_split_keys: all of them busy
        # once a layer's KV reaches STREAMING_BYTES, 4 MiB)
        block_n = max(16, min(64, 4096 // block_d))
        # 8 warps, the merge's tile 32 values a thread (llama3-8b at batch 1, 33 splits of 4
        # rows: 64 × 4 × 32, 4 column blocks of a head of 128), and ptxas held to 128 registers
        # (two programs an SM): left to choose, ptxas spills a few bytes at 72–96 registers under
        # one Triton or the other (4 warps: llama3-8b under 3.6, 8 bytes; gemma2-9b under 3.9,
        # 40; 8 warps: t5-small's cross-attention under 3.6, 8 at 80 registers, none at 108
        # with the budget)
        warps = 8
        tile = 32 * 32 * warps
        block_mr = min(next_pow2(sizes["R"]), max(1, tile // (block_s * 8)))
        block_dm = min(block_d, max(1, tile // (block_s * block_mr)))
        cfg = _cfg(warps, 2 if rows > 16 or block_d > 256 else 3, BLOCK_R=rows,
                   BLOCK_N=block_n, SPLIT_KEYS=per_split, BLOCK_S=block_s, BLOCK_MR=block_mr,
                   BLOCK_DM=block_dm)
        if block_d > ROW_TILED_D:
            # latent attention's rows of 512 (+ 64 RoPE dims), 16 rows: 173 registers and no
            # spill with the full budget and 2 stages; held to 128 they spill 808 bytes at 3
            # stages, 956 at 1 (sm_90a, bf16, ptxas of Triton 3.9)
            return cfg
        return dict(cfg, maxnreg=128)
    if family == "attention_paged":
        # one program per (token, KV head): the group's query heads as ≥ 16 rows for tl.dot,
        # keys 64 at a time on a GPU (16 in the interpreter, which pays per element)
        return _cfg(4, 2, BLOCK_R=_clamp_pow2(sizes["R"], 16, 1 << 16),
                    BLOCK_N=64 if gpu else 16)
    if family == "router":
        cfg = _cfg(4, 3 if gpu else 1, BLOCK_M=16 if gpu or sizes["M"] <= 16 else 64,
                   BLOCK_K=_clamp_pow2(sizes["K"], 16, 128 if gpu else 512))
        if sizes.get("route"):  # its last program routes the pairs (see "moe_routing")
            cfg.update(_routing_blocks(target, sizes["M"], sizes["N"]))
            # ... as long as one chunk holds every token; more are routed chunks in parallel
            cfg["ROUTE_LAST"] = int(sizes["M"] <= cfg["BLOCK_R"])
        return cfg
    if family == "norm":
        block_n = next_pow2(sizes["N"])
        if not gpu:
            return _cfg(BLOCK_R=_clamp_pow2(sizes["M"], 1, 64), BLOCK_N=block_n)
        return _cfg(4 if block_n <= 1024 else 8 if block_n <= 4096 else 16,
                    BLOCK_R=max(1, min(16, 2048 // block_n)), BLOCK_N=block_n)
    if family == "head_linear":   # one head's [BLOCK_M, BLOCK_N] tile, a K loop
        block_n, block_k = _clamp_pow2(sizes["N"], 16, 128), _clamp_pow2(sizes["K"], 16, 64)
        return _cfg(4, 3 if gpu else 1, BLOCK_M=_clamp_pow2(sizes["M"], 16, 64),
                    BLOCK_N=block_n, BLOCK_K=block_k)
    if family in ("pointwise", "embedding"):
        # rows of BLOCK_C columns, about `elements` values a program
        wide = 1024 if gpu else 4096
        elements = 16384 if not gpu else 4096
        block_c = min(next_pow2(sizes["C"]), wide)
        return _cfg(BLOCK_R=min(max(1, elements // block_c), _clamp_pow2(sizes["M"], 1, 1 << 20)),
                    BLOCK_C=block_c)
    if family == "moe":
        if not gpu:
            cfg = _cfg(BLOCK_M=16, BLOCK_N=_clamp_pow2(sizes["N"], 32, 1024),
                       BLOCK_K=_clamp_pow2(sizes["K"], 16, 512))
        elif sizes["M"] <= 32:
            block_n = _moe_decode_block_n(sizes)
            cfg = _cfg(4, 4, BLOCK_M=moe_block_m(target, sizes["M"]), BLOCK_N=block_n,
                       BLOCK_K=256 if block_n < 64 else 128)
        else:
            # prefill: 256 weight rows for a gated tile (one accumulator over interleaved gate
            # and up rows: m64n256 wgmma, 128 outputs), 128 otherwise (m64n128); a warpgroup
            # per 64 pairs (128 pairs, 8 warps: 165 and 179 registers on mixtral-8x7b)
            block_m = moe_block_m(target, sizes["M"])
            cfg = _cfg(block_m // 16, 3, BLOCK_M=block_m,
                       BLOCK_N=256 if sizes.get("gated") else 128, BLOCK_K=64)
            if sizes.get("bias") and not sizes.get("gated") and block_m >= 128:
                # the experts' bias tile beside the accumulator: 255 registers and 64 bytes of
                # spills at 128 × 128 on gpt-oss-20b's down projection (sm_90a); 64 columns fit
                # (64 × 128 fits: 186 registers)
                cfg["BLOCK_N"] = 64
        if gpu and sizes.get("quant"):
            # dequantized expert tiles (codes, scales, offsets and their addresses in registers)
            # spill on sm_90a at the float tiles (mixtral-8x7b q4_k: 11980 bytes at 64 × 256,
            # 7816 at decode's 16 × 64 × 128); 64 weight rows in 32-column K steps with 8 warps
            # in prefill (223 registers at 128 pairs) and, at decode, 16 × 32 × 64 gated (239: a
            # gated tile needs 16 columns per half) or 16 × 16 × 128 (121) fit
            if sizes["M"] <= 32:
                cfg.update(BLOCK_N=32, BLOCK_K=64) if sizes.get("gated") else cfg.update(
                    BLOCK_N=16, BLOCK_K=128)
            else:
                cfg.update(BLOCK_N=64, BLOCK_K=32, num_warps=max(8, cfg["num_warps"]))
        if sizes.get("tma"):
            # the weight's rows allow a tensor descriptor: a GPU prefill loads its weight tiles
            # with TMA; decode keeps the pointer loads its narrow split tiles were shaped for
            cfg["TMA"] = int(gpu and sizes["M"] > 32)
        return cfg
    if family == "moe_routing":
        return _cfg(4, 1, **_routing_blocks(target, sizes["M"], sizes["E"]))
    # The recurrent kernels run one program per (sequence, channel block) or (sequence, KV head),
    # each looping over the new tokens in order: the grid is fixed by the model, not by T.
    if family == "causal_conv":
        # narrow channel blocks: mamba-130m's 1536 channels make 48 programs per sequence
        if gpu:
            return _cfg(BLOCK_T=_clamp_pow2(sizes["T"], 1, 32), BLOCK_C=32)
        return _cfg(BLOCK_T=_clamp_pow2(sizes["T"], 1, 64),
                    BLOCK_C=_clamp_pow2(sizes["C"], 16, 256))
    if family == "ssm_scan":
        # h is [BLOCK_D, N] f32 in registers for the whole call: 32 × 16 over 2 warps is 8
        # values a thread; the sequential loop over T wants many small programs on a GPU
        block_n = max(2, next_pow2(sizes["N"]))
        if gpu:
            return _cfg(2, BLOCK_D=32, BLOCK_N=block_n)
        return _cfg(BLOCK_D=_clamp_pow2(sizes["C"], 16, 256), BLOCK_N=block_n)
    if family == "linear_attention":
        # S [D, Dv] f32 stays in registers; tl.dot wants ≥ 16 rows per chunk
        if not gpu:
            return _cfg(BLOCK_T=_clamp_pow2(sizes["T"], 16, 64))
        big = sizes["D"] * sizes["DV"] > 64 * 64
        return _cfg(8 if big else 4, BLOCK_T=16 if sizes["T"] <= 16 or big else 32)
    if family in ("delta_rule_recurrent", "delta_rule_chunked"):
        # one program per (sequence, head, BLOCK_DV value columns) holds S [Dk, BLOCK_DV] f32 in
        # registers; the interpreter takes a head's whole state at once
        if not gpu:
            return _cfg(BLOCK_DV=next_pow2(sizes["DV"]))
        if family == "delta_rule_recurrent":
            return _cfg(4, BLOCK_DV=32)
        # tl.dot wants ≥ 16 value columns. sm_90a at Dk = Dv = 128, chunk 64, bf16 (ptxas via
        # archc.codegen.aot): 16 columns × 8 warps take 255 registers, no spill; 32 columns spill
        # 272 bytes, 64 spill 384; 4 warps spill at every width (144 bytes at 16)
        return _cfg(8, BLOCK_DV=16)
    raise ValueError(f"no launch configuration for kernel family {family!r}")


def delta_rule_block_dk(dk: int) -> int:
    """The key dims a delta-rule program holds: all Dk of its state, a power of two at least a
    tl.dot tile's side."""
    return max(DOT_MIN, next_pow2(dk))


def split_k_count(tiles: int, k: int, block_k: int, want: int = DECODE_TARGET_PROGRAMS) -> int:
    """Splits of the K loop for a decode GEMV of `tiles` output tiles: the fewest that make
    tiles × splits ≥ `want` (two programs per SM), each split at least
    DECODE_MIN_SPLIT_STEPS steps of `block_k` columns. A split spans cdiv(steps, splits) steps,
    so the count is trimmed to the splits that then have work (none is empty)."""
    if tiles >= want:
        return 1
    steps = _cdiv(k, block_k)
    splits = min(_cdiv(want, max(tiles, 1)),
                 max(1, steps // DECODE_MIN_SPLIT_STEPS))
    return _cdiv(steps, _cdiv(steps, splits))


def split_k_range(k: int, block_k: int, splits: int, split: int) -> tuple[int, int]:
    """K columns [lo, hi) that split `split` of `splits` sums: the same number of whole
    `block_k` steps for each split, so the last is short, or empty when the steps run out first.
    The matmul kernel computes the same on the device."""
    span = _cdiv(_cdiv(k, block_k), splits) * block_k
    return min(split * span, k), min((split + 1) * span, k)


def moe_block_m(target: str, tokens: int) -> int:
    """(token, slot) pairs per program of an expert matmul: the block each expert's run of the
    routing table is padded to. A long prefill takes 128 (each weight tile read by half as many
    programs); a short one 64, since each expert's run is padded to a whole block (512 tokens of
    Mixtral: 128 pairs per expert when balanced)."""
    if target != "gpu" or tokens <= 32:
        return 16
    return 64 if tokens <= 512 else 128


def _routing_blocks(target: str, tokens: int, experts: int) -> dict[str, int]:
    """The routing of MoE pairs: BLOCK_P, the expert matmuls' rows (the table's block), and
    BLOCK_R rows of [rows, experts] tiles of about `elements` values (E = 256: 8 rows on a GPU),
    no more rows than tokens — one program loops over such chunks of tokens, or a prefill's
    are routed a program a chunk."""
    block_e = max(16, next_pow2(experts))
    elements = 2048 if target == "gpu" else 16384
    return dict(BLOCK_P=moe_block_m(target, tokens),
                BLOCK_R=_clamp_pow2(tokens, 1, max(1, elements // block_e)))


def _moe_decode_block_n(sizes: dict[str, int]) -> int:
    """Column tile of a decode-size expert matmul: the widest of 64, 32, 16 that still gives
    two programs per SM with work (``target_programs``). Only the routed experts' blocks have
    pairs — at most min(E, M·k) blocks of 16 — and a gated tile holds BLOCK_N // 2 output
    columns (≥ 16 for tl.dot). Mixtral at batch 1: 2 blocks × 4096 / 16 columns = 512 programs
    for the down projection, 2 × 14336 / 32 = 896 for the gated up projection."""
    gated = bool(sizes.get("gated", 0))
    busy = min(sizes.get("E", 1), sizes["M"] * sizes.get("top_k", 1))
    out_cols = sizes["N"] // 2 if gated else sizes["N"]
    for block_n in (64, 32, 16 if not gated else 32):
        tile = block_n // 2 if gated else block_n
        if busy * _cdiv(out_cols, tile) >= target_programs(sizes):
            return block_n
    return 32 if gated else 16


def aot_config(family: str, sizes: dict[str, int], sm: int = 90) -> dict[str, Any]:
    """The launch configuration an ahead-of-time compile for compute capability `sm` (80, 90)
    assumes: a full-size prefill, and decode with 4 heads per KV head."""
    full = {"M": 4096, "T": 4096, "L": 4096, "R": 4 if family == "attention_decode" else 32,
            "sm": sm, **sizes}
    return launch_config(family, "gpu", **full)


# Decode GEMV tiles a GPU tunes over (M ≤ 16 rows: BLOCK_M = 16): output columns, K step, warps,
# stages — the heuristic's first — each with the split-K count split_k_count gives it, and half
# and twice that (within the K loop's steps)
DECODE_TILES = ((32, 256, 4, 4), (16, 256, 4, 4), (64, 128, 4, 4), (32, 128, 8, 3))


def autotune_configs(family: str, **sizes: int) -> list[dict[str, Any]]:
    """The small config set a launch at `sizes` is tuned over on a GPU (block sizes + warps +
    stages; ``archc.runtime.tuning`` lays each over the heuristic ``launch_config``). A decode
    GEMV (a matmul of M ≤ 16 rows) is tuned over DECODE_TILES and their split-K counts; decode
    attention (T ≤ 16) and the families that are not tuned have none."""
    if family == "matmul" and sizes.get("M", DECODE_ROWS + 1) <= DECODE_ROWS:
        return _decode_matmul_configs(sizes)
    if sizes.get("M" if family == "matmul" else "T", DECODE_ROWS + 1) <= DECODE_ROWS:
        return []
    if family == "matmul":
        tiles = [(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (64, 128, 64, 8, 3),
                 (128, 64, 64, 4, 4), (16, 32, 256, 4, 4), (16, 64, 128, 4, 4),
                 (32, 128, 64, 4, 4)]
        # one split: the scratch a split-K launch needs is sized before the autotuner chooses;
        # the row statistics (ROW_STATS) are the heuristic's, from the pre-pass every tuned
        # launch runs (tuning.candidates lays each tile over the heuristic config)
        return [_cfg(w, s, BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, GROUP_M=8, SPLIT_K=1,
                     TMA=int(m > 16 and not sizes.get("quant")))
                for m, n, k, w, s in tiles if n % sizes.get("align", 16) == 0]
    if family == "attention":
        if sizes.get("D", 128) > 128:
            tiles = [(64, 32, 8, 2), (64, 16, 4, 2), (32, 32, 4, 2)]
        elif sizes.get("t5", 0):
            tiles = [(128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 4, 4)]
        else:
            tiles = [(128, 128, 8, 2), (128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 4, 4)]
        tma = int(bool(sizes.get("tma", 0)) and sizes.get("bytes", 2) <= 2)
        return [_cfg(w, s, BLOCK_M=m, BLOCK_N=n, TMA=tma) for m, n, w, s in tiles]
    # attention_decode is not tuned: its split count, chosen before the launch, depends on the
    # key block
    return []


def _decode_matmul_configs(sizes: dict[str, int]) -> list[dict[str, Any]]:
    """A decode GEMV's candidates: DECODE_TILES that hold the epilogue (a paired tile 16 pairs
    or more, a head-aligned one whole heads; a quantized weight's K steps of 128 at most), each
    at its split-K counts — none for concatenated operands, which do not split. Pointer loads,
    the row statistics in the K loop: decode's launch count stays."""
    paired, quant = sizes.get("paired", 0), sizes.get("quant")
    out = []
    for n, k, warps, stages in DECODE_TILES:
        if (paired and n < 32) or n < sizes.get("align", 16) or (quant and k > 128):
            continue
        splits = [1]
        if sizes.get("operands", 1) == 1:
            tiles = _cdiv(sizes["M"], 16) * _cdiv(tile_columns(sizes), n // 2 if paired else n)
            steps = _cdiv(sizes["K"], k)
            base = split_k_count(tiles, sizes["K"], k, target_programs(sizes))
            splits = sorted({max(1, base // 2), base, min(steps, 2 * base)})
        out += [_cfg(warps, stages, BLOCK_M=16, BLOCK_N=n, BLOCK_K=k, GROUP_M=8, SPLIT_K=split,
                     TMA=0, ROW_STATS=0) for split in splits]
    return out


def decode_split_count(target: str, programs: int, max_keys: int, sms: int = DEFAULT_SMS
                       ) -> int:
    """Flash-decoding's split count: fixed for a launch plan, so the grid (`programs` =
    batch × KV heads, × splits) replays under CUDA graphs at any past length. Each program finds
    its keys on the device from the live length (``split_keys``). On a GPU, enough splits for two
    waves of the GPU's `sms` SMs, at most DECODE_MAX_SPLITS (the merge takes them in one tile);
    under the interpreter four (short test sequences still exercise the merge). Never more
    splits than the cache has units of DECODE_DEAL keys."""
    want = min(_cdiv(2 * sms, max(programs, 1)), DECODE_MAX_SPLITS) if target == "gpu" else 4
    return max(1, min(want, _cdiv(max(max_keys, 1), DECODE_DEAL)))


def decode_split_keys(target: str, head_dim: int, elem_bytes: int, sms: int = DEFAULT_SMS
                      ) -> int:
    """Keys a busy split of decode attention reads, at least, on average (the kernel's
    SPLIT_KEYS): one split is busy per SPLIT_KEYS live keys, so a short context runs few splits
    and its merge reads few partials. On a GPU a split's share of a launch that streams
    STREAMING_BYTES of keys and values over two programs per SM — a context that large keeps
    every split of the two-wave grid busy (llama3-8b: 31 keys, all 33 splits from 1024 keys;
    512 keys keep 17). Under the interpreter DECODE_DEAL: short test sequences keep every split
    busy."""
    if target != "gpu":
        return DECODE_DEAL
    key_bytes = 2 * head_dim * elem_bytes         # its key and its value
    return max(DECODE_DEAL, STREAMING_BYTES // (2 * sms) // key_bytes)


def decode_work(keys: int, splits: int, per_split: int = DECODE_DEAL) -> int:
    """Splits of a decode-attention grid that have keys at live length `keys`: one per
    `per_split` keys (the kernel's SPLIT_KEYS), at most `splits`; the others return at once."""
    return max(1, min(splits, _cdiv(keys, per_split)))


def split_keys(keys: int, splits: int, split: int, per_split: int = DECODE_DEAL
               ) -> tuple[int, int]:
    """Keys [first, end) of split `split` at live length `keys`: the cdiv(keys, DECODE_DEAL)
    units of DECODE_DEAL keys dealt out evenly (⌊s·n / busy⌋) over the busy splits
    (``decode_work``), each of which has work; a split past them has none. The decode kernel
    computes the same on the device (its loop steps by its own key block, masked at the split's
    end)."""
    n, busy = _cdiv(keys, DECODE_DEAL), decode_work(keys, splits, per_split)
    if split >= busy:
        return keys, keys
    return (min(split * n // busy * DECODE_DEAL, keys),
            min((split + 1) * n // busy * DECODE_DEAL, keys))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)
