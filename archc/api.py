"""The public API.

    model = archc.load(source)            # zoo name, spec YAML, HF directory or .gguf file
    compiled = model.compile(backend="eager")
    logits = compiled(input_ids)                          # decoder: [B, T, vocab]
    hidden = compiled(input_ids, attention_mask=mask)     # encoder: [B, T, d]
    logits = compiled(input_ids, decoder_input_ids=dec)   # encoder-decoder
    ids = compiled.generate(input_ids, max_new_tokens=20) # prompt + new tokens

``model.spec``, ``model.graph`` (the unfused program) and ``model.weights`` (the checkpoint: tensor
name → tensor) are public. A spec without weights gets seeded random ones.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from archc.errors import ArchcError
from archc.ir.graph import Program
from archc.ir.lower import lower
from archc.runtime.eager import EagerSession
from archc.runtime.generate import Sampler, Sampling
from archc.runtime.weights import check_checkpoint, random_weights
from archc.spec.schema import Spec

DTYPES = ("f32", "f16", "bf16")


class Session(Protocol):
    """What a backend provides: run the encoder, or decoder steps over a KV cache."""

    past: int

    def reset(self) -> None: ...

    def encode(self, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None,
               token_types: torch.Tensor | None = None) -> torch.Tensor: ...

    def step(self, tokens: torch.Tensor, *, encoder_hidden: torch.Tensor | None = None,
             encoder_mask: torch.Tensor | None = None) -> torch.Tensor: ...


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
    graph: Program = field(init=False)

    def __post_init__(self) -> None:
        self.graph = lower(self.spec)
        if self.weights is None:
            self.weights = random_weights(self.graph, seed=self.seed)
        check_checkpoint(self.graph, self.weights)

    def compile(self, backend: str = "eager", *, dtype: str = "f32",
                device: str | torch.device = "cpu", **options: Any) -> CompiledModel:
        """Ready the model to run on `backend` ("eager" or "triton")."""
        if dtype not in DTYPES:
            raise ArchcError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
        if backend not in BACKENDS and backend in LAZY_BACKENDS:
            import importlib
            importlib.import_module(LAZY_BACKENDS[backend])  # registers itself
        factory = BACKENDS.get(backend)
        if factory is None:
            known = ", ".join(sorted(set(BACKENDS) | set(LAZY_BACKENDS)))
            raise ArchcError(f"unknown backend {backend!r} (known: {known})")
        program = self.graph if dtype == "f32" else lower(self.spec, dtype)
        session = factory(self, program, dtype, torch.device(device), options)
        return CompiledModel(self, program, session, backend)


def _eager_backend(model: Model, program: Program, dtype: str, device: torch.device,
                   options: Mapping[str, Any]) -> Session:
    unknown = sorted(set(options) - {"passes"})
    if unknown:
        raise ArchcError(f"the eager backend takes one option, passes (got {', '.join(unknown)})")
    if options.get("passes") is not None:
        # a pipeline ("default", or pass names): the interpreter runs the kernel-level graph
        from archc.passes import optimize
        program = optimize(program, options["passes"])
    return EagerSession(program, model.weights, max_seq_len=model.spec.max_seq_len,
                        device=device)


BackendFactory = Callable[[Model, Program, str, torch.device, Mapping[str, Any]], Session]
BACKENDS: dict[str, BackendFactory] = {"eager": _eager_backend}
# backends imported on first use (they register themselves with register_backend)
LAZY_BACKENDS: dict[str, str] = {"triton": "archc.runtime.triton_backend"}


def register_backend(name: str, factory: BackendFactory) -> None:
    BACKENDS[name] = factory


class CompiledModel:
    def __init__(self, model: Model, program: Program, session: Session, backend: str) -> None:
        self.model = model
        self.spec = model.spec
        self.program = program
        self.session = session
        self.backend = backend

    def __call__(self, input_ids: torch.Tensor, *, attention_mask: torch.Tensor | None = None,
                 decoder_input_ids: torch.Tensor | None = None,
                 token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Full forward pass: logits (decoder, encoder-decoder) or hidden states (encoder)."""
        input_ids = _as_ids(input_ids, "input_ids")
        family = self.spec.family
        if family == "encoder":
            return self.session.encode(input_ids, attention_mask, token_type_ids)
        if family == "encoder-decoder":
            if decoder_input_ids is None:
                raise ArchcError("an encoder-decoder needs decoder_input_ids")
            hidden = self.session.encode(input_ids, attention_mask)
            self.session.reset()
            return self.session.step(_as_ids(decoder_input_ids, "decoder_input_ids"),
                                     encoder_hidden=hidden, encoder_mask=attention_mask)
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            raise ArchcError("padding masks are supported for encoders; a decoder forward "
                             "takes unpadded sequences")
        self.session.reset()
        return self.session.step(input_ids)

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int = 20, *,
                 temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                 seed: int | None = None, eos_token_id: int | Sequence[int] | None = None,
                 attention_mask: torch.Tensor | None = None,
                 decoder_start_token_id: int = 0,
                 on_token: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """Prompt followed by up to `max_new_tokens` new tokens (greedy unless a temperature is
        given); stops early when every row has produced `eos_token_id` (one id or several).
        `on_token` sees each new column of tokens [B] as it is chosen. For an encoder-decoder,
        returns the decoder tokens (starting with `decoder_start_token_id`)."""
        if self.spec.family == "encoder":
            raise ArchcError(f"{self.spec.name} is an encoder: it has no output head to "
                             "generate with")
        if max_new_tokens < 0:
            raise ArchcError(f"max_new_tokens must be ≥ 0, got {max_new_tokens}")
        input_ids = _as_ids(input_ids, "input_ids")
        sampler = Sampler(Sampling(temperature, top_k, top_p, seed))
        extra: dict[str, Any] = {}
        tokens = input_ids
        if self.spec.family == "encoder-decoder":
            extra = {"encoder_hidden": self.session.encode(input_ids, attention_mask),
                     "encoder_mask": attention_mask}
            tokens = torch.full((input_ids.shape[0], 1), decoder_start_token_id,
                                dtype=torch.long)
        if tokens.shape[1] + max_new_tokens > self.spec.max_seq_len:
            raise ArchcError(f"{tokens.shape[1]} prompt tokens + {max_new_tokens} new exceed "
                             f"max_seq_len = {self.spec.max_seq_len}")
        self.session.reset()
        out = [tokens]
        stop = torch.tensor([eos_token_id] if isinstance(eos_token_id, int) else
                            list(eos_token_id or ()), dtype=torch.long)
        done = torch.zeros(tokens.shape[0], dtype=torch.bool)
        step_in = tokens
        for _ in range(max_new_tokens):
            logits = self.session.step(step_in, **extra)
            nxt = sampler(logits[:, -1])
            if len(stop):
                # a finished row repeats its first stop token
                nxt = torch.where(done, stop[0].expand_as(nxt), nxt)
                done |= torch.isin(nxt, stop)
            out.append(nxt[:, None])
            if on_token is not None:
                on_token(nxt)
            if len(stop) and bool(done.all()):
                break
            step_in = nxt[:, None]
        return torch.cat(out, dim=1)


def _as_ids(x: Any, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        x = torch.as_tensor(x)
    if x.dim() == 1:
        x = x[None]
    if x.dim() != 2 or x.dtype not in (torch.int64, torch.int32):
        raise ArchcError(f"{name} must be integer token ids shaped [B, T], got "
                         f"{x.dtype}{list(x.shape)}")
    return x.long()


# ---- sources -------------------------------------------------------------------------------

Progress = Callable[[int, int], None]     # (done, total), while weights load
SourceLoader = Callable[..., Model]        # loader(path, progress=...) → Model
SOURCES: list[tuple[Callable[[Path], bool], SourceLoader]] = []


def register_source(matches: Callable[[Path], bool], loader: SourceLoader) -> None:
    """Teach `load` a new kind of source (HF directories, GGUF files). `loader` is called as
    `loader(path, progress=callback_or_None)`."""
    SOURCES.append((matches, loader))


def from_spec(spec: Spec, *, seed: int = 0) -> Model:
    """A model of `spec` with seeded random weights."""
    return Model(spec, seed=seed, source=spec.name)


def load(source: str | Path, *, seed: int = 0, progress: Progress | None = None) -> Model:
    """A zoo name, spec YAML, HF directory or GGUF file → a Model (random weights for specs).
    `progress(done, total)` is called as weights load."""
    import archc.native  # noqa: F401  (registers archc's own checkpoint directories)
    import archc.sources  # noqa: F401  (registers the HF and GGUF loaders)
    from archc.spec.zoo import load_spec
    path = Path(source)
    for matches, loader in SOURCES:
        if matches(path):
            return loader(path, progress=progress)
    return from_spec(load_spec(source), seed=seed)
