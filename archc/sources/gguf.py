"""GGUF files of the llama architecture → Model: metadata → spec, tensors dequantised with the
`gguf` package, the tokenizer and chat template stored in the file.

llama.cpp's converter reorders the rows of each head of the Q and K projections so that its RoPE
can rotate interleaved pairs; archc's Llama rotates halves (as the original checkpoint does), so
the loader puts the rows back. Metadata in the `llama.` namespace that archc does not know is
refused by name, as config.json fields are.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from archc.errors import ArchcError, SpecError, WeightsError
from archc.model import Model
from archc.sources.hf_config import HFConfig, spec_name
from archc.spec import from_dict
from archc.spec.schema import Spec

ARCH = "llama"
Progress = Callable[[int, int], None]
# Tensors are dequantised by the gguf package: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K and Q6_K
# are tested here, and any other type its `quants` module implements is read the same way.


def _gguf() -> Any:
    try:
        import gguf
    except ImportError:  # pragma: no cover - an optional dependency
        raise ArchcError("reading GGUF files needs the `gguf` package "
                         "(pip install 'archc[gguf]')") from None
    return gguf


class GGUFFile:
    """Metadata fields and tensors of one GGUF file."""

    def __init__(self, path: Path) -> None:
        gguf = _gguf()
        self.path = path
        if not path.is_file():
            raise WeightsError(f"{path}: no such file")
        try:
            self.reader = gguf.GGUFReader(str(path))
        except Exception as err:  # gguf raises ValueError, struct and numpy errors
            raise WeightsError(f"{path}: not a readable GGUF file ({err}); is it truncated "
                               "or not GGUF at all?") from None
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.fields: dict[str, Any] = {}
        for name, f in self.reader.fields.items():
            if name.startswith("GGUF."):
                continue
            try:
                self.fields[name] = f.contents()
            except Exception as err:
                raise WeightsError(f"{path}: metadata {name!r} cannot be read ({err})") from None

    def shape(self, name: str) -> tuple[int, ...]:
        """[out, in] as torch orders it (GGUF lists dims innermost first)."""
        return tuple(int(d) for d in reversed(self.tensors[name].shape))

    def load(self, name: str) -> torch.Tensor:
        gguf = _gguf()
        t = self.tensors[name]
        kind = t.tensor_type.name
        try:
            values = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise WeightsError(f"tensor {name!r} is stored as {kind}, which the gguf package "
                               f"cannot dequantise") from None
        except Exception as err:
            raise WeightsError(f"{self.path}: tensor {name!r} ({kind}) cannot be read "
                               f"({err}); is the file truncated?") from None
        values = np.asarray(values, dtype=np.float32).reshape(self.shape(name))
        if not values.flags.writeable or not values.flags.c_contiguous:
            values = values.copy()
        return torch.from_numpy(values)


def _f32(value: float) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not 9.99999975e-06)."""
    return float(f"{value:.7g}")


def llama3_scaling(f: GGUFFile, theta: float, rotary_dim: int) -> dict[str, Any]:
    """Llama 3.1's RoPE scaling from the per-frequency divisors llama.cpp stores instead of its
    parameters (`rope_freqs.weight`, θ_j / f_j).

    The llama3 rule keeps short wavelengths (f = 1), divides long ones by `factor` (f = factor)
    and between them blends: 1/f = (1 − s)/factor + s with s = (L/λ − low)/(high − low), which
    is linear in 1/λ. The middle band's points give that line; its slope L/(high − low) and
    intercept −low/(high − low) fix the rule up to one common scale of L, low and high, so
    low = 1 is taken. The parameters are accepted only if archc's llama3 frequencies computed
    from them reproduce θ_j / f_j (to f32 rounding); anything else is refused."""
    from archc.ir.paramexpr import rope_inv_freq

    where = "rope_freqs.weight"
    factors = f.load(where).double().flatten()
    if factors.numel() != rotary_dim // 2 or not bool((factors >= 1.0 - 1e-6).all()):
        raise SpecError(where, f"{factors.numel()} factors, expected {rotary_dim // 2} of ≥ 1 "
                        "(one divisor per rotary pair)", source=str(f.path))
    base = rope_inv_freq(rotary_dim, theta).double()
    factor = float(factors.max())
    medium = (factors > 1.0 + 1e-6) & (factors < factor * (1 - 1e-6))
    if factor <= 1.0 + 1e-6 or int(medium.sum()) < 2:
        raise SpecError(where, "per-frequency RoPE factors that are not Llama 3's scaling "
                        "(it needs factors > 1 and at least two blended frequencies)",
                        source=str(f.path))
    inv_wavelen = base[medium] / (2 * math.pi)
    blend = (1 / factors[medium] - 1 / factor) / (1 - 1 / factor)
    design = torch.stack([inv_wavelen, torch.ones_like(inv_wavelen)], dim=1)
    slope, intercept = (float(v) for v in torch.linalg.lstsq(design, blend[:, None]).solution)
    params: dict[str, Any] = {"kind": "llama3", "factor": _f32(factor)}
    if intercept < 0 and slope > 0:
        params.update(original_max_seq_len=round(-slope / intercept), low_freq_factor=1.0,
                      high_freq_factor=_f32(1.0 - 1.0 / intercept))
        got = rope_inv_freq(rotary_dim, theta, **{k: v for k, v in params.items()
                                                  if k != "kind"}, kind="llama3").double()
        if torch.allclose(got, (base / factors).float().double(), rtol=1e-5, atol=0.0):
            return params
    raise SpecError(where, "per-frequency RoPE factors that do not follow Llama 3's scaling "
                    "rule", source=str(f.path))


def _spec_data(f: GGUFFile) -> tuple[dict[str, Any], HFConfig]:
    arch = f.fields.get("general.architecture")
    if arch != ARCH:
        raise SpecError("general.architecture", f"{arch!r} is not supported: archc reads "
                        "llama-architecture GGUF files", source=str(f.path), allowed=ARCH)
    meta = HFConfig({k[len(ARCH) + 1:]: v for k, v in f.fields.items()
                     if k.startswith(ARCH + ".")}, f"{f.path} (metadata {ARCH}.*)")
    meta.model_type = ARCH
    d = meta.number("embedding_length")
    heads = meta.number("attention.head_count")
    kv = meta.get("attention.head_count_kv", heads)
    if isinstance(kv, list):  # per-layer counts: only a uniform list is a spec
        if len(set(kv)) != 1:
            raise meta.refuse("attention.head_count_kv", kv, "every layer must have the same "
                              "number of KV heads")
        kv = kv[0]
    head_dim = meta.number("attention.key_length", d // heads)
    value_dim = meta.number("attention.value_length", head_dim)
    if value_dim != head_dim:
        raise meta.refuse("attention.value_length", value_dim, f"keys and values of different "
                          f"widths ({head_dim})")
    rotary = meta.number("rope.dimension_count", head_dim)
    if rotary != head_dim:
        raise meta.refuse("rope.dimension_count", rotary, f"llama rotates the whole head "
                          f"({head_dim} dims)")
    embed_rows = f.shape("token_embd.weight")[0] if "token_embd.weight" in f.tensors else None
    vocab = meta.number("vocab_size", embed_rows or len(f.fields.get("tokenizer.ggml.tokens",
                                                                      [])))
    max_seq = meta.number("context_length", 2048)
    position: dict[str, Any] = {"kind": "rope",
                                "theta": _f32(meta.number("rope.freq_base", 10000.0, kind=float))}
    scaling = meta.get("rope.scaling.type", "none")
    factor = meta.number("rope.scaling.factor", 1.0, kind=float)
    if scaling == "linear" and factor != 1.0:
        position["scaling"] = {"kind": "linear", "factor": factor}
    elif scaling == "yarn":
        position["scaling"] = {"kind": "yarn", "factor": factor, "original_max_seq_len":
                               meta.number("rope.scaling.original_context_length", max_seq)}
    elif scaling not in ("none", "linear"):
        raise meta.refuse("rope.scaling.type", scaling, "archc reads none, linear and yarn")
    if "rope_freqs.weight" in f.tensors:
        if "scaling" in position:
            raise meta.refuse("rope.scaling.type", scaling, "the file also holds per-frequency "
                              "factors (rope_freqs.weight): one scaling at a time")
        position["scaling"] = llama3_scaling(f, position["theta"], rotary)
    experts = meta.number("expert_count", 0)
    ffn: dict[str, Any] = {"kind": "swiglu", "d_ff": meta.number("feed_forward_length")}
    if experts:
        ffn = {"kind": "moe", "d_ff": ffn["d_ff"], "moe": {
            "experts": experts, "top_k": meta.number("expert_used_count", 2)}}
    bias = {p: f"blk.0.attn_{n}.bias" in f.tensors
            for p, n in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "output"))}
    layers = meta.number("block_count")
    eps = _f32(meta.number("attention.layer_norm_rms_epsilon", 1e-5, kind=float))
    meta.check_all_understood(())
    data = {
        "name": spec_name(f.path.stem, str(f.fields.get("general.name") or "")),
        "description": f"{f.fields.get('general.name') or f.path.stem} from {f.path.name}",
        "family": "decoder", "vocab_size": vocab, "d_model": d,
        "layers": layers, "max_seq_len": max_seq, "dtype": "f32",
        "attention": {"heads": heads, "kv_heads": kv, "head_dim": head_dim, "bias": bias},
        "ffn": ffn,
        "norm": {"kind": "rmsnorm", "eps": eps},
        "position": position,
        "embedding": {"tied": "output.weight" not in f.tensors},
    }
    return data, meta


def spec_of_file(f: GGUFFile) -> Spec:
    data, _ = _spec_data(f)
    return from_dict(data, source=str(f.path))


def unpermute_rope_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's reordering of Q/K rows: within each head it stores rows as interleaved
    pairs (0, d/2, 1, d/2+1, ...) of the original half-split order."""
    rows = w.shape[0]
    # (heads, D/2, 2, ...) → (heads, 2, D/2, ...)
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(
        w.shape).contiguous()


def _tensor_plan(spec: Spec, f: GGUFFile) -> list[tuple[str, str, Callable[[torch.Tensor],
                                                                            torch.Tensor]]]:
    """(GGUF tensor, archc tensor, fix-up) for every tensor."""
    same: Callable[[torch.Tensor], torch.Tensor] = lambda x: x
    heads, kv = spec.attention.heads, spec.attention.kv_heads
    q_fix = lambda x: unpermute_rope_rows(x, heads)
    k_fix = lambda x: unpermute_rope_rows(x, kv)
    plan = [("token_embd.weight", "embed.weight", same),
            ("output_norm.weight", "final_norm.weight", same)]
    if not spec.embedding.tied:
        plan.append(("output.weight", "head.weight", same))
    bias = spec.attention.bias
    for i in range(spec.layers):
        b, a = f"blk.{i}.", f"layers.{i}."
        plan += [(b + "attn_norm.weight", a + "attn_norm.weight", same),
                 (b + "ffn_norm.weight", a + "ffn_norm.weight", same),
                 (b + "attn_q.weight", a + "attn.q.weight", q_fix),
                 (b + "attn_k.weight", a + "attn.k.weight", k_fix),
                 (b + "attn_v.weight", a + "attn.v.weight", same),
                 (b + "attn_output.weight", a + "attn.o.weight", same)]
        for p, n, fix in (("q", "q", q_fix), ("k", "k", k_fix), ("v", "v", same),
                          ("o", "output", same)):
            if getattr(bias, p):
                plan.append((f"{b}attn_{n}.bias", f"{a}attn.{p}.bias", fix))
        if spec.ffn.kind == "moe":
            plan.append((b + "ffn_gate_inp.weight", a + "ffn.router.weight", same))
            for p in ("gate", "up", "down"):
                plan.append((f"{b}ffn_{p}_exps.weight", f"{a}ffn.experts.{p}.weight", same))
        else:
            for p in ("gate", "up", "down"):
                plan.append((f"{b}ffn_{p}.weight", f"{a}ffn.{p}.weight", same))
    return plan


def load_gguf(path: Path, *, progress: Progress | None = None, dtype: str | None = None) -> Model:
    """The model of a GGUF file, its tensors dequantised to f32 (or `dtype`, one at a time)."""
    from archc.devices import check_fits, checkpoint_elements
    from archc.ir.lower import lower
    from archc.runtime.weights import TORCH_DTYPES, checkpoint_shapes

    f = GGUFFile(path)
    spec = spec_of_file(f)
    program = lower(spec)
    want = checkpoint_shapes(program)
    plan = _tensor_plan(spec, f)
    for name, target, _ in plan:  # check everything before dequantising anything
        if name not in f.tensors:
            raise WeightsError(f"{path}: tensor {name!r} is missing (expected shape "
                               f"{list(want[target])})")
        if f.shape(name) != want[target]:
            raise WeightsError(f"{path}: tensor {name!r} has shape {list(f.shape(name))}, "
                               f"expected {list(want[target])}")
    # rope_freqs.weight, when there, was read into the spec's RoPE scaling
    extra = sorted(set(f.tensors) - {name for name, _, _ in plan} - {"rope_freqs.weight"})
    if extra:
        more = f" and {len(extra) - 3} more" if len(extra) > 3 else ""
        raise WeightsError(f"{path}: tensors the model does not use: {', '.join(extra[:3])}"
                           f"{more}")
    held = dtype or "f32"
    check_fits(spec.name, "its weights", checkpoint_elements(program), held, spec.family)
    weights: dict[str, torch.Tensor] = {}
    for done, (name, target, fix) in enumerate(plan):
        weights[target] = fix(f.load(name)).to(TORCH_DTYPES[held])
        if progress is not None:
            progress(done + 1, len(plan))
    tokenizer = gguf_tokenizer(f)
    return Model(spec, weights, tokenizer=tokenizer,
                 chat_template=tokenizer.chat_template if tokenizer else None,
                 source=str(path), eos_token_ids=tokenizer.eos_token_ids if tokenizer else ())


def gguf_tokenizer(f: GGUFFile) -> Any:
    """The tokenizer stored in the file's `tokenizer.ggml.*` metadata (None if it has none)."""
    from archc.tokenizer import from_gguf_vocab
    fields = f.fields
    tokens = fields.get("tokenizer.ggml.tokens")
    if not tokens:
        return None
    eos = [fields[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                               "tokenizer.ggml.eom_token_id") if isinstance(fields.get(k), int)]
    return from_gguf_vocab(
        model=str(fields.get("tokenizer.ggml.model", "gpt2")), tokens=tokens,
        token_types=fields.get("tokenizer.ggml.token_type"),
        merges=fields.get("tokenizer.ggml.merges"), scores=fields.get("tokenizer.ggml.scores"),
        pre=fields.get("tokenizer.ggml.pre"), bos_id=fields.get("tokenizer.ggml.bos_token_id"),
        eos_ids=list(dict.fromkeys(eos)), add_bos=fields.get("tokenizer.ggml.add_bos_token"),
        add_space_prefix=fields.get("tokenizer.ggml.add_space_prefix"),
        chat_template=fields.get("tokenizer.chat_template"), source=str(f.path))
