"""The eager interpreter: runs any graph, unfused or kernel-level, with plain torch ops.

It is the reference every other backend is validated against. Each node runs the eager semantics
its op declares in the op table; its result is checked against the node's symbolic shape at the
concrete B, T, P, S, and a failure names the node (``while running %42 = attention(...)``).
Values are freed after their last use, so a real-size model runs in the memory of its weights
plus a few activations. Without its checks (``checks=False``) it is a plain torch program, what
torch costs and what ``torch.compile`` traces: the PyTorch baselines of ``archc bench``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import sympy
import torch

from archc.dtypes import KV_CODES, TORCH_DTYPES
from archc.errors import ArchcError, RunError
from archc.ir.attrs import Attrs, Call
from archc.ir.graph import CROSS_KV, LAST_TOKEN, Graph, Node, Program
from archc.ir.ops import OP_TABLE, Op, full_attrs, roles_of
from archc.ir.ops.attention import kv_dequantize, kv_quantize, paged_slots
from archc.ir.shapes import DIMS, QUANT_DTYPES
from archc.ir.text import format_node
from archc.memory import zeros
from archc.passes.context import zigzag
from archc.passes.logits import last_token_graph
from archc.quant import QTensor, Weight
from archc.runtime.comm import Comm, LocalComm
from archc.runtime.token_inputs import TokenInputs
from archc.runtime.weights import Handover, materialize


@functools.lru_cache(maxsize=4096)
def _dim_value(expr: sympy.Expr, dims: tuple[tuple[str, int], ...]) -> int:
    return int(expr.xreplace({DIMS[k]: v for k, v in dims}))


class KVCache:
    """A static cache per (layer, k|v): [B, H_kv, max_len, D], written at offset P. A quantized
    one (`quant` int8 or fp8) holds codes [B, H_kv, max_len, D] and f32 scales [B, H_kv,
    max_len] instead, and reads back code·scale in the dtype written: what an attention kernel
    reading that cache sees."""

    def __init__(self, max_len: int) -> None:
        self.max_len = max_len
        self.store: dict[tuple[int, str], torch.Tensor] = {}
        self.scales: dict[tuple[int, str], torch.Tensor] = {}   # a quantized cache's scales
        self.dtypes: dict[tuple[int, str], torch.dtype] = {}    # the dtype its rows read back in

    def append(self, layer: int, kind: str, x: torch.Tensor, past: int,
               quant: str | None = None) -> torch.Tensor:
        b, h, t, d = x.shape
        key = (layer, kind)
        code_dtype = x.dtype if quant is None else KV_CODES[quant].torch
        buf = self.store.get(key)
        if buf is None or buf.shape[0] != b or buf.dtype != code_dtype or \
                self.dtypes[key] != x.dtype:
            if buf is not None and past > 0:
                raise RunError(f"the KV cache holds a batch of {buf.shape[0]} {buf.dtype} "
                               f"sequences; got {b} {x.dtype} — reset before changing the batch")
            # rows past those written stay unmapped zero pages on the host (`zeros`)
            buf = self.store[key] = zeros((b, h, self.max_len, d), code_dtype, x.device)
            self.dtypes[key] = x.dtype
            self.scales.pop(key, None)
            if quant is not None:
                self.scales[key] = zeros((b, h, self.max_len), torch.float32, x.device)
        if quant is None:
            buf[:, :, past:past + t] = x
        else:
            buf[:, :, past:past + t], self.scales[key][:, :, past:past + t] = \
                kv_quantize(x, quant)
        return self.read(layer, kind, past + t)

    def read(self, layer: int, kind: str, length: int) -> torch.Tensor:
        """The first `length` positions of a layer's k or v cache, as attention reads them."""
        key = (layer, kind)
        codes = self.store[key][:, :, :length]
        scale = self.scales.get(key)
        return codes if scale is None else kv_dequantize(codes, scale[:, :, :length],
                                                         self.dtypes[key])


class RecurrentState:
    """The eager interpreter's per-(layer, kind) state tensors of one batch of sequences: what
    Mamba and linear-attention layers keep instead of a KV cache (``archc.ir.ops.state``)."""

    def __init__(self) -> None:
        self.store: dict[tuple[int, str], torch.Tensor] = {}

    def read(self, layer: int, kind: str, shape: tuple[int, ...], dtype: torch.dtype,
             device: torch.device, past: int) -> torch.Tensor:
        """The state the last call left, or zeros when a sequence starts (P = 0)."""
        have = self.store.get((layer, kind))
        if past == 0:
            return torch.zeros(shape, dtype=dtype, device=device)
        if have is None:
            raise RunError(f"layer {layer} continues a sequence at P = {past} but holds no "
                           f"{kind} state: reset and prefill first")
        if tuple(have.shape) != tuple(shape) or have.dtype != dtype:
            raise RunError(f"layer {layer}'s {kind} state is {have.dtype}{list(have.shape)}; "
                           f"this call needs {dtype}{list(shape)} — reset before changing the "
                           "batch")
        return have


class PagedPool:
    """The pools of a paged KV cache (``archc.passes.paged``): per (layer, k|v) one tensor
    [blocks, H_kv, block_size, D], allocated at the first write, of the dtype written."""

    def __init__(self, blocks: int, block_size: int) -> None:
        self.blocks = blocks
        self.block_size = block_size
        self.store: dict[tuple[int, str], torch.Tensor] = {}

    def write(self, layer: int, kind: str, x: torch.Tensor, positions: torch.Tensor,
              table: torch.Tensor) -> None:
        """Rows x [1, H_kv, T, D] of T tokens into their blocks, at their positions."""
        pool = self.store.get((layer, kind))
        if pool is None:
            pool = self.store[(layer, kind)] = zeros(
                (self.blocks, x.shape[1], self.block_size, x.shape[3]), x.dtype, x.device)
        block, offset = paged_slots(positions, table, self.block_size)
        pool[block.to(pool.device), :, offset.to(pool.device)] = x[0].transpose(0, 1).to(
            pool.dtype)                                                         # (T, H_kv, D)

    def read(self, layer: int, kind: str) -> torch.Tensor:
        pool = self.store.get((layer, kind))
        if pool is None:
            raise RunError(f"layer {layer} reads its paged {kind} pool before anything wrote it")
        return pool


@dataclass
class EagerContext:
    """What eager op semantics may read besides their inputs."""

    dims: Mapping[str, int]
    cache: KVCache | None = None
    state: RecurrentState = field(default_factory=RecurrentState)
    comms: Mapping[str, Comm] = field(default_factory=dict)   # by group: "tp", "cp"
    paged: PagedPool | None = None

    def paged_write(self, layer: int, kind: str, x: torch.Tensor, positions: torch.Tensor,
                    table: torch.Tensor) -> None:
        self._pool().write(layer, kind, x, positions, table)

    def paged_pool(self, layer: int, kind: str) -> torch.Tensor:
        return self._pool().read(layer, kind)

    def _pool(self) -> PagedPool:
        if self.paged is None:
            raise RunError("this graph reads a paged KV cache but no block pool was given")
        return self.paged

    def comm(self, group: str) -> Comm:
        """This rank's communicator of `group` (a group of one when the run has none)."""
        return self.comms.get(group) or LocalComm()

    def state_read(self, layer: int, kind: str, shape: tuple[int, ...], dtype: torch.dtype,
                   device: torch.device) -> torch.Tensor:
        return self.state.read(layer, kind, shape, dtype, device, self.dims["P"])

    def state_write(self, layer: int, kind: str, value: torch.Tensor) -> None:
        self.state.store[(layer, kind)] = value

    def cache_append(self, layer: int, kind: str, x: torch.Tensor,
                     quant: str | None = None) -> torch.Tensor:
        if self.cache is None:
            raise RunError("this graph writes a KV cache but none was given")
        return self.cache.append(layer, kind, x, self.dims["P"], quant)

    def cache_read(self, layer: int, kind: str) -> torch.Tensor:
        """The first P + T positions of a layer's cache (written earlier in this step)."""
        if self.cache is None or (layer, kind) not in self.cache.store:
            raise RunError(f"layer {layer} reads its {kind} cache before anything wrote it")
        return self.cache.read(layer, kind, self.dims["P"] + self.dims["T"])


@dataclass
class Trace:
    """Values of every compute node, kept for inspection (validation, debugging)."""

    values: dict[int, torch.Tensor] = field(default_factory=dict)
    graph: str | None = None           # only this graph's nodes (None: every graph run)


# A node as it runs: its index, the node, its eager semantics (None: an input or a parameter),
# its operands' roles, its full attributes, and the values no later node reads (freed after it)
Planned = tuple[int, Node, Callable[..., torch.Tensor] | None, tuple[str, ...], Attrs,
                tuple[int, ...]]


def plan(graph: Graph) -> list[Planned]:
    """`graph` ready to run: what ``run_graph`` looks up for each node, looked up once."""
    last_use = {j: i for i, n in enumerate(graph.nodes) for j in n.inputs}
    out: list[Planned] = []
    for i, n in enumerate(graph.nodes):
        frees = tuple(j for j in dict.fromkeys(n.inputs) if last_use[j] == i)
        if n.op in (Op.INPUT, Op.PARAM):
            out.append((i, n, None, (), n.attrs, frees))
            continue
        attrs = full_attrs(n.op, n.attrs)
        out.append((i, n, OP_TABLE[n.op].eager, tuple(roles_of(n.op, attrs, len(n.inputs))),
                    attrs, frees))
    return out


def run_graph(graph: Graph, params: Mapping[str, torch.Tensor],
              inputs: Mapping[str, torch.Tensor], ctx: EagerContext, *,
              trace: Trace | None = None, checks: bool = True,
              planned: list[Planned] | None = None) -> dict[str, torch.Tensor]:
    """Run `graph` once; returns its outputs by name. `planned`: ``plan(graph)``, made once by a
    caller that runs the graph often. checks=False: no value is checked against its node's shape
    and dtype, and an op that fails raises its own error, not one naming the node."""
    dims = tuple(sorted(ctx.dims.items())) if checks else ()
    values: list[torch.Tensor | None] = [None] * len(graph.nodes)
    outputs: dict[str, torch.Tensor] = {}
    for i, n, eager, roles, attrs, frees in plan(graph) if planned is None else planned:
        if n.op == Op.INPUT:
            if n.name not in inputs:
                raise RunError(f"graph {graph.name} needs input {n.name!r}")
            value = inputs[n.name]
        elif eager is None:
            value = params[n.name]
        elif not checks:
            value = eager(ctx, dict(zip(roles, [values[j] for j in n.inputs])), attrs)
        else:
            try:
                value = eager(ctx, dict(zip(roles, [values[j] for j in n.inputs])), attrs)
            except ArchcError as err:
                raise RunError(f"while running {format_node(i, n)}: {err}") from None
            except Exception as err:  # an op's torch code failed: name the node
                raise RunError(f"while running {format_node(i, n)}: "
                               f"{type(err).__name__}: {err}") from err
        if checks:
            _check(i, n, value, dims)
        values[i] = value
        if n.op == Op.OUTPUT:
            outputs[n.name] = value
        if trace is not None and eager is not None and trace.graph in (None, graph.name):
            trace.values[i] = value
        for j in frees:
            values[j] = None
    return outputs


def _check(i: int, n: Node, value: torch.Tensor, dims: tuple[tuple[str, int], ...]) -> None:
    """Refuse a value that is not node i's shape at `dims` and dtype."""
    want = tuple(_dim_value(d, dims) for d in n.shape)
    if isinstance(value, QTensor) or n.dtype in QUANT_DTYPES:   # held quantized, or not
        wrong = value.dtype != n.dtype if isinstance(value, QTensor) else not \
            value.is_floating_point()
    else:
        wrong = value.dtype != TORCH_DTYPES[n.dtype]
    if tuple(value.shape) != want or wrong:
        raise RunError(f"while running {format_node(i, n)}: produced "
                       f"{value.dtype}{list(value.shape)}, the IR says {n.dtype}{list(want)}")


def rope_table_length(program: Program) -> int | None:
    """Positions the program's RoPE cos/sin tables cover (None without one)."""
    rows = [int(n.shape[0]) for g in program for n in g if n.op == Op.PARAM
            and isinstance(n.attr("expr"), Call) and n.attr("expr").fn == "rope_cos_sin"]
    return min(rows, default=None)


class SessionBase:
    """What every backend's session keeps between calls — past length P, the prefix length, the
    cross-attention inputs — and its surface: ``encode`` runs an encoder graph; ``step`` runs the
    decoder graph on new tokens after the P already cached (P = 0 after ``reset``). A backend
    runs one graph: ``_run(name, inputs, *, B, T, P, S, held=None)`` → outputs by name."""

    def __init__(self, program: Program, max_seq_len: int, device: torch.device,
                 comms: Mapping[str, Comm] | None = None) -> None:
        self.program = program
        # what `_run` runs, by name: the program's graphs, and the decoder's last-token-logits
        # variant (archc.passes.logits) for a step that asks for the last logits only — made
        # when first needed (``has_last_token``)
        self.runs: dict[str, Graph] = {g.name: g for g in program}
        self.program_graphs = set(self.runs)
        self._variant_made = False
        self.max_seq_len = max_seq_len
        self.rope_rows = rope_table_length(program)
        self.device = device
        self.past = 0
        self.prefix_len: int | None = None
        self.has_cross_kv = any(g.name == CROSS_KV for g in program)
        self.cross_kv: dict[str, torch.Tensor] = {}    # the outputs of the cross_kv graph
        self.cross_kv_source: torch.Tensor | None = None
        self.comms = dict(comms or {})      # a sharded program's groups: this rank's view
        self._ring_positions: torch.Tensor | None = None    # this rank's tokens in a ring step
        self._ring_keys = 0     # and the longest rank's token count: a ring's K/V block rows
        self.token_inputs = TokenInputs(program)    # an attention's per-token inputs, held

    _run: Callable[..., dict[str, torch.Tensor]]

    def rewind(self, past: int) -> None:
        """Keep the first `past` tokens of the sequence: the next step writes its keys and
        values after them (an attention cache's rows past P are overwritten, never read).
        The caller knows no recurrent state went past them (``CompiledModel.reusable``)."""
        if not 0 < past <= self.past:
            raise RunError(f"cannot rewind a sequence of {self.past} tokens to {past}")
        self.past = past

    def _hand_over(self, checkpoint: Mapping[str, Weight]) -> None:
        """A checkpoint handed over (``Model.compile(keep_weights=False)``) lets each tensor go
        once this session's program has read it for the last time."""
        if isinstance(checkpoint, Handover):
            checkpoint.plan(self.program)

    def has_last_token(self) -> bool:
        """Does the last-token-logits variant run here (``LAST_TOKEN`` in `runs`)? Made from the
        program on first asking; a program the pass does not apply to has none."""
        if not self._variant_made:
            self._variant_made = True
            last = last_token_graph(self.program)
            if last is not None:
                self.runs[LAST_TOKEN] = last
        return LAST_TOKEN in self.runs

    def _check_positions(self, length: int) -> None:
        """Positions 0 … length − 1 index the RoPE cos/sin table: refuse a sequence it does not
        cover (an encoder's input, a session longer than the model's max_seq_len): the kernels
        mask rows past the table, so unchecked they would rotate by the wrong angle."""
        if self.rope_rows is not None and length > self.rope_rows:
            raise RunError(f"sequence of {length} tokens is longer than the RoPE table's "
                           f"{self.rope_rows} positions (the model's max_seq_len)")

    def reset(self) -> None:
        self.past = 0
        self.prefix_len = None
        self.token_inputs.reset()
        self.cross_kv_source = None     # a new generation: the cross-KV inputs are computed again

    def _cross_kv_inputs(self, encoder_hidden: torch.Tensor) -> dict[str, torch.Tensor]:
        """The outputs of the `cross_kv` graph (the cross-attention K and V projections, hoisted
        there by `hoist-cross-kv`), decoder inputs of the same names: computed at the first step
        after a reset or when a step brings another `encoder_hidden` tensor. Recomputed values
        are copied into the tensors already held when the shapes match, so a captured decode
        step keeps reading the same addresses."""
        if self.has_cross_kv and self.cross_kv_source is not encoder_hidden:
            b, s = encoder_hidden.shape[:2]
            out = self._run(CROSS_KV, {"encoder_hidden": encoder_hidden}, B=b, T=1, P=0, S=s)
            for name, x in out.items():
                held = self.cross_kv.get(name)
                if held is not None and held.shape == x.shape:
                    held.copy_(x)
                else:
                    self.cross_kv[name] = x
            self.cross_kv_source = encoder_hidden
        return dict(self.cross_kv)

    def _encode(self, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_types: torch.Tensor | None = None,
                inputs: Mapping[str, torch.Tensor] | None = None) -> torch.Tensor:
        """Hidden states [B, T, d] of the encoder graph: without a mask every token is real,
        without types all are 0; `inputs`: the attention's per-token inputs."""
        b, t = tokens.shape
        self._check_positions(t)
        mask = torch.ones(b, t) if attention_mask is None else attention_mask
        types = torch.zeros(b, t) if token_types is None else token_types
        given = self.token_inputs.take(inputs, b, t, 0)
        inputs = {"tokens": tokens, "attention_mask": mask.long(), "token_types": types.long(),
                  **given}
        return self._run("encoder", inputs, B=b, T=t, P=0, S=0)["hidden"]

    def _step(self, tokens: torch.Tensor, *, encoder_hidden: torch.Tensor | None = None,
              encoder_mask: torch.Tensor | None = None, last: bool = False,
              inputs: Mapping[str, torch.Tensor] | None = None) -> torch.Tensor:
        """Logits [B, T, vocab] for `tokens` following the P tokens already in the cache; with
        `last`, of the last token only, [B, 1, vocab] (the variant, where there is one);
        `inputs`: the attention's per-token inputs for these tokens."""
        given = inputs
        b, t = tokens.shape
        if self.past + t > self.max_seq_len:
            raise RunError(f"sequence of {self.past + t} tokens exceeds the KV cache "
                           f"(max_seq_len = {self.max_seq_len})")
        self._check_positions(self.past + t)
        if self.prefix_len is None:
            self.prefix_len = t  # prefix-LM: the first call's tokens are the prefix
        s = 0
        inputs = {"tokens": tokens, **self.token_inputs.take(given, b, t, self.past)}
        held: dict[str, torch.Tensor] = {}
        if encoder_hidden is not None:
            s = encoder_hidden.shape[1]
            held = self._cross_kv_inputs(encoder_hidden)     # once per generation
            mask = torch.ones(b, s) if encoder_mask is None else encoder_mask
            inputs.update(held, encoder_hidden=encoder_hidden, encoder_mask=mask.long())
        name = LAST_TOKEN if last and t > 1 and self.has_last_token() else "decoder"
        logits = self._run(name, inputs, B=b, T=t, P=self.past, S=s, held=held)["logits"]
        self.past += t
        return logits[:, -1:] if last else logits

    # ---- context parallel: a prefill as a ring over the "cp" group ---------------------------

    def _ring_split(self, length: int, past: int = 0) -> list[torch.Tensor] | None:
        """Every rank's zig-zag positions when a run of `length` tokens after `past` runs as a
        ring (a "cp" group of several ranks, at P = 0, with a chunk for each of 2·cp); else
        None: the run is whole on every rank."""
        comm = self.comms.get("cp")
        if comm is None or comm.size == 1:
            return None
        if not any(n.op == Op.ATTENTION and n.attr("ring") is not None
                   for g in self.program for n in g):
            # each rank would attend over its own slice only
            raise RunError(f"a cp group of {comm.size} ranks runs a program with ring "
                           f"attention: apply context_parallel(program, {comm.size}) first")
        if past > 0 or length < 2 * comm.size:
            return None
        return zigzag(length, comm.size)

    def _in_order(self, x: torch.Tensor, dim: int, parts: list[torch.Tensor]) -> torch.Tensor:
        """Every rank's rows of x along `dim` (rank r's at positions parts[r]) gathered from the
        "cp" group and put in sequence order, on every rank. Rows are filled to the longest
        rank's count first: a process group gathers equal shapes."""
        comm = self.comms["cp"]
        longest = max(len(p) for p in parts)
        shape = list(x.shape)
        shape[dim] = longest - x.shape[dim]
        filled = torch.cat([x, x.new_zeros(shape)], dim=dim)
        blocks = comm.all_gather(filled.contiguous(), dim).split(longest, dim=dim)
        rows = torch.cat([blk.narrow(dim, 0, len(p)) for blk, p in zip(blocks, parts)], dim=dim)
        order = torch.cat(parts).argsort().to(x.device)
        return rows.index_select(dim, order)

    def _cache_tensors(self) -> list[torch.Tensor]:
        """Every tensor of the KV cache — [B, H_kv, max_len, …], codes and scales of a quantized
        one alike — in the same order on every rank."""
        raise NotImplementedError

    def _gather_cache(self, parts: list[torch.Tensor]) -> None:
        """After a ring prefill every rank holds its tokens' K/V; gather every layer's cache so
        that each rank holds the whole sequence's, in order: the steps that follow run whole on
        every rank."""
        mine, length = len(parts[self.comms["cp"].rank]), sum(len(p) for p in parts)
        for held in self._cache_tensors():
            held[:, :, :length] = self._in_order(held[:, :, :mine], 2, parts)

    def _ring(self, parts: list[torch.Tensor], run: Callable[[torch.Tensor], torch.Tensor],
              ) -> torch.Tensor:
        """run(this rank's positions) as a ring step; its [B, T_rank, ·] result gathered in
        sequence order."""
        self._ring_positions = parts[self.comms["cp"].rank]
        self._ring_keys = max(len(p) for p in parts)
        try:
            local = run(self._ring_positions)
        finally:
            self._ring_positions, self._ring_keys = None, 0
        return self._in_order(local, 1, parts)

    def step(self, tokens: torch.Tensor, *, encoder_hidden: torch.Tensor | None = None,
             encoder_mask: torch.Tensor | None = None, last: bool = False,
             inputs: Mapping[str, torch.Tensor] | None = None) -> torch.Tensor:
        """Logits [B, T, vocab]; with `last`, the last token's only, [B, 1, vocab] — computed
        for that row alone (``LAST_TOKEN``). With a "cp" group, a prefill runs as a ring (module
        ``archc.passes.context``) and every rank returns the whole sequence's logits."""
        t = tokens.shape[1]
        parts = self._ring_split(t, self.past)
        if parts is None:
            return self._step(tokens, encoder_hidden=encoder_hidden, encoder_mask=encoder_mask,
                              last=last, inputs=inputs)
        if t > self.max_seq_len:
            raise RunError(f"sequence of {t} tokens exceeds the KV cache (max_seq_len = "
                           f"{self.max_seq_len})")
        self._check_positions(t)
        if self.prefix_len is None:
            self.prefix_len = t     # the whole prompt, not this rank's part of it
        logits = self._ring(parts, lambda mine: self._step(
            tokens[:, mine], encoder_hidden=encoder_hidden, encoder_mask=encoder_mask))
        self.past = t
        self._gather_cache(parts)
        return logits[:, -1:] if last else logits   # a ring's ranks each hold some rows

    def encode(self, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None,
               token_types: torch.Tensor | None = None,
               inputs: Mapping[str, torch.Tensor] | None = None) -> torch.Tensor:
        """Hidden states [B, T, d]; with a "cp" group, computed as a ring, whole on every rank."""
        t = tokens.shape[1]
        parts = self._ring_split(t)
        if parts is None:
            return self._encode(tokens, attention_mask, token_types, inputs)
        self._check_positions(t)
        return self._ring(parts, lambda mine: self._encode(
            tokens[:, mine], None if attention_mask is None else attention_mask[:, mine],
            None if token_types is None else token_types[:, mine]))


class EagerSession(SessionBase):
    """A program ready to run eagerly: parameters evaluated once, a KV cache, a recurrent state.

    Quantized weights stay quantized, as the kernels keep them: an op dequantizes the rows of a
    weight it reads a block at a time as it computes (``archc.quant.by_rows``), so a model runs
    in the memory of its quantized weights, not of a dense copy (an 8B model's 4.7 GB of Q4
    would be 32 GB in f32).

    checks=False runs every node unchecked (``run_graph``), and ``logits(tokens, past)`` takes P
    as an argument: a plain torch program that ``torch.compile`` traces once for every P."""

    def __init__(self, program: Program, checkpoint: Mapping[str, torch.Tensor], *,
                 max_seq_len: int, device: str | torch.device = "cpu",
                 comms: Mapping[str, Comm] | None = None, checks: bool = True) -> None:
        super().__init__(program, max_seq_len, torch.device(device), comms)
        self.checks = checks
        self.plans: dict[str, tuple[list[Planned], bool]] = {}   # and: does it read prefix_len?
        rank = self.comms["tp"].rank if "tp" in self.comms else 0
        self._hand_over(checkpoint)
        self.params = {g.name: materialize(g, checkpoint, self.device, rank=rank)
                       for g in program}
        self.cache = KVCache(max_seq_len)
        self.state = RecurrentState()
        self.trace: Trace | None = None

    def reset(self) -> None:
        super().reset()
        self.cache = KVCache(self.cache.max_len)
        self.state = RecurrentState()

    def _run(self, name: str, inputs: dict[str, torch.Tensor], *, B: int, T: int,  # noqa: N803
             P: int, S: int, held: Mapping[str, torch.Tensor] | None = None,  # noqa: N803
             ) -> dict[str, torch.Tensor]:
        # positions are archc's own, P … P + T − 1, as is the prefix length; in a ring step, the
        # global positions of this rank's tokens. Outside one the "cp" group is left out: its
        # ring attentions then run whole over what every rank holds.
        inputs = {k: x.to(self.device) for k, x in inputs.items()}
        ring = self._ring_positions is not None and name != CROSS_KV
        inputs["positions"] = self._ring_positions.to(self.device) if ring else \
            torch.arange(P, P + T, device=self.device)
        graph = self.runs[name]       # a variant reads its graph's parameters
        if name not in self.plans:
            self.plans[name] = plan(graph), "prefix_len" in graph.inputs
        planned, prefixed = self.plans[name]
        # read only where taken: under torch.compile a read is a guard, and a new prompt length
        # would recompile a causal model's decode
        if prefixed and self.prefix_len is not None:
            inputs["prefix_len"] = torch.tensor(self.prefix_len, device=self.device)
        comms = self.comms if ring else {k: c for k, c in self.comms.items() if k != "cp"}
        return run_graph(graph, self.params[graph.name], inputs,
                         EagerContext(dict(B=B, T=T, P=P, S=S), self.cache, self.state, comms),
                         trace=self.trace, checks=self.checks, planned=planned)

    def logits(self, tokens: torch.Tensor, past: int) -> torch.Tensor:
        """The decoder's logits [B, T, vocab] for `tokens` after the `past` tokens already in the
        KV cache (past = 0 starts a sequence, its tokens the prefix). P is the caller's, not
        kept: under torch.compile it becomes a symbolic integer after the first decode step, so
        decoding does not recompile at every length."""
        if past == 0:
            self.prefix_len = tokens.shape[1]
        b, t = tokens.shape
        return self._run("decoder", {"tokens": tokens}, B=b, T=t, P=past, S=0)["logits"]

    def _cache_tensors(self) -> list[torch.Tensor]:
        return [held[key] for held in (self.cache.store, self.cache.scales)
                for key in sorted(held)]
