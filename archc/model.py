"""A model and its compiled form: what ``archc.load`` returns and what it compiles to.

    model = archc.load(source)            # zoo name, spec YAML, HF directory or .gguf file
    compiled = model.compile(backend="eager")
    logits = compiled(input_ids)                          # decoder: [B, T, vocab]
    hidden = compiled(input_ids, attention_mask=mask)     # encoder: [B, T, d]
    logits = compiled(input_ids, decoder_input_ids=dec)   # encoder-decoder
    ids = compiled.generate(input_ids, max_new_tokens=20) # prompt + new tokens
    text = compiled.generate("Once upon a time")          # the continuation (needs a tokenizer)

``model.spec``, ``model.graph`` (the unfused program) and ``model.weights`` are public; dtypes,
devices and the memory weights may take are as ``archc.devices`` says."""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from archc.devices import (
    check_compilable,
    check_fits,
    default_dtype,
    dtype_name,
    resolve_device,
)
from archc.dist import groups, parallel_sizes
from archc.errors import ArchcError
from archc.ir.graph import Program
from archc.ir.lower import lower
from archc.memory import release_freed
from archc.passes.slices import presliced, rank_slices, take_slice
from archc.quant import QTensor
from archc.runtime.eager import EagerSession
from archc.runtime.generate import Sampler, Sampling
from archc.runtime.weights import (
    TORCH_DTYPES,
    Handover,
    check_checkpoint,
    quant_schemes,
    quantizable,
    random_weights,
)
from archc.spec.load import longrope_switch
from archc.spec.schema import Spec

if TYPE_CHECKING:
    from archc.runtime.paged import PagedEngine

Progress = Callable[[int, int], None]     # (done, total), while weights load


class Session(Protocol):
    """What a backend provides: run the encoder, or decoder steps over a KV cache."""

    def reset(self) -> None: ...

    def encode(self, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None,
               token_types: torch.Tensor | None = None,
               inputs: Mapping[str, torch.Tensor] | None = None) -> torch.Tensor: ...

    def step(self, tokens: torch.Tensor, *, encoder_hidden: torch.Tensor | None = None,
             encoder_mask: torch.Tensor | None = None, last: bool = False,
             inputs: Mapping[str, torch.Tensor] | None = None) -> torch.Tensor: ...


@dataclass
class Model:
    """A spec, its unfused program, and a checkpoint — ready to compile."""

    spec: Spec
    weights: dict[str, torch.Tensor] | None = None   # None: seeded random weights
    seed: int = 0
    tokenizer: Any = None                 # set by loaders that find one (HF, GGUF)
    chat_template: str | None = None
    source: str = ""
    eos_token_ids: tuple[int, ...] = ()   # generation stops at any of these
    notes: tuple[str, ...] = ()           # what the loader wants the user to know
    weights_dtype: str = "f32"            # the dtype random weights are held in
    # (tp, rank): the weights are tensor-parallel rank `rank`'s slices of the checkpoint, for
    # a program sharded over tp ranks (``archc.load(…, tp=…, rank=…)``); None: whole
    shard: tuple[int, int] | None = None
    graph: Program = field(init=False)
    random_weights: bool = field(init=False)   # no checkpoint: the weights mean nothing

    def __post_init__(self) -> None:
        self.graph = lower(self.spec, quant=self.quant)
        self.random_weights = self.weights is None
        if self.weights is None:
            check_fits(self.spec, self.graph, self.weights_dtype, random=True)
            self.weights = random_weights(self.graph, seed=self.seed, dtype=self.weights_dtype)
            self.notes += (f"{self.spec.name} is a spec, not a checkpoint: its weights are "
                           f"random (seed {self.seed}), so what it computes means nothing",)
        check_checkpoint(self.graph if self.shard is None else
                         presliced(self.graph, self.shard[0]), self.weights)


    def sliced(self, tp: int, rank: int) -> Model:
        """This model holding only tensor-parallel rank `rank`'s slices of the weights a program
        sharded over tp ranks reads through ``shard()`` (the rest whole)."""
        cuts = rank_slices(self.graph, tp)
        weights = {k: take_slice(w, cuts[k], rank) if k in cuts else w
                   for k, w in (self.weights or {}).items()}
        out = dataclasses.replace(self, weights=weights, shard=(tp, rank))
        out.random_weights = self.random_weights
        return out

    def quantized(self, kind: str, group: int = 128) -> Model:
        """This model with the weights of its linear layers and experts quantized (weight-only,
        round-to-nearest: `kind` "int8" per output channel, "int4" in groups of `group`)."""
        from archc.quant.pack import quantize
        names = quantizable(self.graph)
        already = sorted({w.dtype for w in (self.weights or {}).values()
                          if isinstance(w, QTensor)})
        if already:
            raise ArchcError(f"{self.source or self.spec.name} is already quantized "
                             f"({', '.join(already)}); quantize a float checkpoint (--dequantize "
                             "or dequantize=True reads a GGUF file as one)")
        weights = dict(self.weights or {})
        for name in names:
            weights[name] = quantize(weights[name], kind, group)
        scheme = next((w.dtype for w in weights.values() if isinstance(w, QTensor)), None)
        notes = self.notes + ((f"{len(names)} weight tensors quantized to {scheme} "
                               "(round-to-nearest) at load",) if scheme else ())
        out = dataclasses.replace(self, weights=weights, notes=notes)
        out.random_weights = self.random_weights
        return out

    @property
    def quant(self) -> dict[str, str]:
        """Checkpoint tensor → scheme, for the weights kept quantized (empty when none is)."""
        return quant_schemes(self.weights or {})

    def compile(self, backend: str = "eager", *, tp: int = 1, cp: int = 1,
                dtype: str | torch.dtype | None = None, device: str | torch.device = "cpu",
                keep_weights: bool = True, **options: Any) -> CompiledModel:
        """Ready the model to run on `backend` ("eager" or "triton") on `device`, in `dtype`.

        With keep_weights=False the weights are handed to the compiled model: each leaves
        ``model.weights`` as the backend takes what it needs of it, so a backend that merges
        weights never holds them twice (what a program that compiles once wants); the model
        cannot be compiled again.

        With `tp` > 1 (tensor parallel) or `cp` > 1 (context parallel) it runs as one rank of
        an initialized torch.distributed default group of tp · cp processes, every rank calling
        compile alike: the program is sharded (``archc.passes.shard``, ``archc.passes.context``),
        this rank's groups are made (tp-major: ``archc.dist``), its parameters are its slices of
        the weights, and every rank's calls return the full logits."""
        if backend not in BACKENDS:
            raise ArchcError(f"backend={backend!r} is not a backend (known: "
                             f"{', '.join(BACKENDS)})")
        tp, cp = parallel_sizes(tp, cp)
        if self.shard is not None and tp != self.shard[0]:
            raise ArchcError(f"the model holds its weights' slices for tp={self.shard[0]} (rank "
                             f"{self.shard[1]}); compile it with tp={self.shard[0]}")
        torch_device = resolve_device(device)
        name = default_dtype(self.spec.dtype, torch_device) if dtype is None else \
            dtype_name(dtype)
        kv_cache = options.pop("kv_cache", None)
        check_compilable(backend, name, torch_device, kv_cache)
        # A backend evaluates the parameters into new tensors unless it runs the checkpoint's
        # own: the eager backend without weight-rewriting passes, in their dtype and place; or
        # the checkpoint is handed over, each tensor let go as its replacement is made.
        if keep_weights and (backend != "eager" or options.get("passes") not in (None, "none")
                             or any(w.dtype != TORCH_DTYPES[name] or w.device != torch_device
                                    for w in (self.weights or {}).values()
                                    if isinstance(w, torch.Tensor))):
            check_fits(self.spec, self.graph, name, torch_device, random=self.random_weights,
                       what="the compiled copy of its weights")
        program = self.graph if name == "f32" and kv_cache is None else \
            lower(self.spec, name, self.quant, kv_cache=kv_cache)
        if tp * cp > 1:
            program, options["comms"] = self._parallel(program, tp, cp)
        module, factory = BACKENDS[backend]
        weights = (self.weights or {}) if keep_weights else Handover(self.weights or {})
        session = getattr(importlib.import_module(module), factory)(
            self, weights, program, name, torch_device, options)
        if getattr(session, "module_path", None) is not None:   # a backend that generates code
            from archc.kernel_cache import used
            used(Path(session.module_path))
        release_freed()     # the passes' and the code generator's transients
        return CompiledModel(self, program, session, backend)

    def _parallel(self, program: Program, tp: int, cp: int) -> tuple[Program, dict[str, Any]]:
        """`program` sharded over tp ranks and cp ranks, and this rank's communicators."""
        # the program first: a model that does not split is refused before any process waits
        if tp > 1:
            from archc.passes.shard import shard_program
            program = shard_program(program, tp) if self.shard is None else \
                presliced(program, tp)
        if cp > 1:
            from archc.passes.context import context_parallel
            program = context_parallel(program, cp)
        comms = groups(tp, cp)
        if self.shard is not None and comms["tp"].rank != self.shard[1]:
            raise ArchcError(f"the model holds tp rank {self.shard[1]}'s slices of its weights; "
                             f"this process is tp rank {comms['tp'].rank}")
        return program, comms


# What the eager backend interprets unless told otherwise: the unfused program with each
# attention chain (scores → … → value sum) collapsed into one `attention` node, which runs through
# PyTorch's fused attention unless its score is more than the scores plus a bias (a soft-cap) or
# it normalizes otherwise than by softmax (`ops.attention.modified_attention`) — so a long prompt
# never stores its [B, H, T, L] scores. passes="none" interprets the program exactly as lowered.
EAGER_PIPELINE = ("share-kv-heads", "flash-attention")


def _eager_backend(model: Model, weights: Mapping[str, Any], program: Program, dtype: str,
                   device: torch.device, options: Mapping[str, Any]) -> Session:
    from archc.passes import optimize
    unknown = sorted(set(options) - {"passes", "comms"})
    if unknown:
        raise ArchcError(f"the eager backend takes one option, passes (got {', '.join(unknown)})")
    passes = options.get("passes")
    program = optimize(program, EAGER_PIPELINE if passes is None else passes)
    return EagerSession(program, weights, max_seq_len=model.spec.max_seq_len,
                        device=device, comms=options.get("comms"))


# name → (module, factory(model, weights, program, dtype, device, options) → Session); a
# backend's module is imported when it is first compiled for
BACKENDS = {"eager": ("archc.model", "_eager_backend"),
            "triton": ("archc.runtime.triton_backend", "triton_backend")}


class CompiledModel:
    def __init__(self, model: Model, program: Program, session: Session, backend: str) -> None:
        self.model = model
        self.spec = model.spec
        self.program = program
        self.session = session
        self.backend = backend
        # the tokens whose keys and values the session's cache holds after a generate of one
        # sequence, which a later generate(keep_cache=True) continues from
        self.cached: list[int] = []

    def __call__(self, input_ids: torch.Tensor | str, *,
                 attention_mask: torch.Tensor | None = None,
                 decoder_input_ids: torch.Tensor | None = None,
                 token_type_ids: torch.Tensor | None = None,
                 inputs: Mapping[str, torch.Tensor] | None = None) -> torch.Tensor:
        """Full forward pass: logits (decoder, encoder-decoder) or hidden states (encoder).
        `input_ids`: token ids [B, T], or text when the model has a tokenizer; `inputs`: the
        attention's per-token inputs (``attention.inputs``), each [B, T] integers."""
        input_ids = self._ids(input_ids)
        family, extra = self.spec.family, {}
        if family == "encoder":
            return self.session.encode(input_ids, attention_mask, token_type_ids, inputs)
        if family == "encoder-decoder":
            if decoder_input_ids is None:
                raise ArchcError("an encoder-decoder needs decoder_input_ids")
            extra = {"encoder_hidden": self.session.encode(input_ids, attention_mask),
                     "encoder_mask": attention_mask}
            input_ids = _as_ids(decoder_input_ids, "decoder_input_ids")
        elif attention_mask is not None and not bool(attention_mask.bool().all()):
            raise ArchcError("padding masks are supported for encoders; a decoder forward "
                             "takes unpadded sequences")
        self.session.reset()
        self.cached = []
        return self.session.step(input_ids, **extra, inputs=inputs)

    def generate(self, input_ids: torch.Tensor | str, max_new_tokens: int = 20, *,
                 temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                 seed: int | None = None, eos_token_id: int | Sequence[int] | None = None,
                 attention_mask: torch.Tensor | None = None,
                 decoder_start_token_id: int = 0,
                 on_token: Callable[[torch.Tensor], None] | None = None,
                 inputs: Mapping[str, torch.Tensor] | None = None,
                 keep_cache: bool = False) -> Any:
        """Prompt followed by up to `max_new_tokens` new tokens (greedy unless a temperature is
        given). Given text (a model with a tokenizer), returns the text of the new tokens.

        Stops early when every row has produced an end-of-sequence id: by default the
        checkpoint's (``model.eos_token_ids``); `eos_token_id` replaces them (one id or
        several; ``()`` never stops early). `on_token` sees each new column of tokens [B] as it
        is chosen. For an encoder-decoder, returns the decoder tokens (starting with
        `decoder_start_token_id`). `inputs`: the attention's per-token inputs of the prompt
        (``attention.inputs``), each [B, T]; new tokens continue each row's last value.

        With `keep_cache`, a prompt of one sequence that begins with tokens the cache already
        holds from the last generate (``cached``: its prompt and every token it fed back)
        prefills only the rest — a conversation's next turn prefills only the new messages.
        Attention caches are cut back to the longest common prefix; a recurrent state, which
        cannot be cut back, is kept only when all of it is a prefix (``reusable``)."""
        if self.spec.family == "encoder":
            raise ArchcError(f"{self.spec.name} is an encoder: it has no output head to "
                             "generate with")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or \
                max_new_tokens < 0:
            raise ArchcError(f"max_new_tokens must be a whole number ≥ 0, got "
                             f"{max_new_tokens!r}")
        eos = self.model.eos_token_ids if eos_token_id is None else eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos)
        if any(isinstance(i, bool) or not isinstance(i, int) for i in eos):
            raise ArchcError(f"eos_token_id must be a token id or a sequence of them, got "
                             f"{eos_token_id!r}")
        stop = torch.tensor(eos, dtype=torch.long)
        text = isinstance(input_ids, str)
        tokens = input_ids = self._ids(input_ids)
        sampler = Sampler(Sampling(temperature, top_k, top_p, seed))
        extra: dict[str, Any] = {}
        if self.spec.family == "encoder-decoder":
            extra = {"encoder_hidden": self.session.encode(input_ids, attention_mask),
                     "encoder_mask": attention_mask}
            tokens = torch.full((input_ids.shape[0], 1), decoder_start_token_id,
                                dtype=torch.long)
        if tokens.shape[1] + max_new_tokens > self.spec.max_seq_len:
            raise ArchcError(f"{tokens.shape[1]} prompt tokens + {max_new_tokens} new exceed "
                             f"max_seq_len = {self.spec.max_seq_len}")
        switch = longrope_switch(self.spec)
        past = self.reusable(tokens, inputs) if keep_cache else 0
        if past:
            self.session.rewind(past)
        else:
            self.session.reset()
        self.cached = []        # until this generate ends: one interrupted leaves it unknown
        out = [tokens]
        done = torch.zeros(tokens.shape[0], dtype=torch.bool)
        for step in range(max_new_tokens):
            feed = out[-1] if step else tokens[:, past:]
            if switch is not None and 0 < past <= switch < past + feed.shape[1]:
                # LongRoPE: the first call past the trained context rotates every position by
                # the long factors, so the sequence so far is computed again (as transformers
                # generates): its cached keys were rotated by the short ones
                self.session.reset()
                feed, past = torch.cat(out, dim=1), 0
            first = past == 0
            past += feed.shape[1]
            # the next token reads the last logits alone: the prompt's LM head runs on its last
            # row only (archc.passes.logits)
            nxt = sampler(self.session.step(feed, **extra, last=True,
                                            inputs=inputs if first else None)[:, -1])
            if eos:
                # a finished row repeats its first stop token
                nxt = torch.where(done, stop[0].expand_as(nxt), nxt)
                done |= torch.isin(nxt, stop)
            out.append(nxt[:, None])
            if on_token is not None:
                on_token(nxt)
            if eos and bool(done.all()):
                break
        result = torch.cat(out, dim=1)
        self.cached = [int(t) for t in result[0, :past]] if result.shape[0] == 1 else []
        if text:
            return self.model.tokenizer.decode(
                [int(i) for i in result[0, tokens.shape[1]:] if int(i) not in eos])
        return result

    def reusable(self, tokens: torch.Tensor, inputs: Mapping[str, torch.Tensor] | None
                 ) -> int:
        """How many of the prompt's first tokens the cache holds as they are (``cached``),
        leaving at least one to feed: 0 for several sequences, an encoder-decoder, per-token
        inputs, a prefix-LM mask (its prefix is the first prompt's), a context-parallel ring,
        LongRoPE's switch of factors, or a recurrent state that is not wholly a prefix."""
        spec = self.spec
        if tokens.shape[0] != 1 or spec.family != "decoder" or inputs or \
                longrope_switch(spec) is not None or "cp" in getattr(self.session, "comms", {}) \
                or (spec.attends and spec.attention.mask == "prefix"):
            return 0
        prompt, held = [int(t) for t in tokens[0]], self.cached
        common = next((i for i, (a, b) in enumerate(zip(prompt, held, strict=False)) if a != b),
                      min(len(prompt), len(held)))
        common = min(common, len(prompt) - 1)
        if common < len(held) and set(spec.layer_mixers()) != {"attention"}:
            return 0        # a state past the common prefix cannot be taken back
        return common

    def engine(self, block_size: int = 16, blocks: int | None = None,
               max_batch: int = 16, prefix_cache: bool = True) -> PagedEngine:
        """Many sequences over one pool of `blocks` KV-cache blocks of `block_size` tokens,
        decoded `max_batch` at a time (``archc.runtime.batch.BatchEngine``). blocks=None: enough
        for max_batch sequences of max_seq_len each; prefix_cache: full blocks of finished
        sequences stay cached for later prompts. Decoder-only models on one device."""
        from archc.runtime.paged import PagedEngine
        return PagedEngine(self, block_size, blocks, max_batch, prefix_cache)

    def _ids(self, x: Any) -> torch.Tensor:
        """Token ids [B, T] from ids, or from text through the model's tokenizer."""
        if not isinstance(x, str):
            return _as_ids(x, "input_ids")
        if self.model.tokenizer is None:
            why = " (it is a spec: its weights are random)" if self.model.random_weights else ""
            raise ArchcError(f"{self.spec.name} has no tokenizer{why}, so it cannot take text: "
                             "pass token ids [B, T], or load a checkpoint that carries a tokenizer "
                             "(a Hugging Face directory with tokenizer.json, or a .gguf file)")
        ids = self.model.tokenizer.encode(x)
        if not ids:
            raise ArchcError("the text encodes to no tokens")
        return torch.tensor([ids])


def _as_ids(x: Any, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        try:
            x = torch.as_tensor(x)
        except (TypeError, ValueError, RuntimeError):
            raise ArchcError(f"{name} must be integer token ids shaped [B, T] (a tensor or "
                             f"nested lists of ints), got {type(x).__name__}") from None
    if x.dim() == 1:
        x = x[None]
    if x.dim() != 2 or x.dtype not in (torch.int64, torch.int32):
        raise ArchcError(f"{name} must be integer token ids shaped [B, T], got "
                         f"{x.dtype}{list(x.shape)}")
    return x.long()
