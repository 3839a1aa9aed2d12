"""Per-token inputs of attention expressions (``attention.inputs``: a document id per packed
token, `doc[q_pos] == doc[kv_pos]`): given by the caller with the tokens of each call, held by
the session across calls, since an expression reads them at every key position 0 … P + T − 1.

A call that gives no value for an input continues each sequence's last value (its new tokens
belong to the document its last token did: what generation wants); the first call of a
sequence without one takes the input's declared default, or is refused where there is none.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from archc.errors import RunError
from archc.ir.graph import Program
from archc.ir.ops import Op, full_attrs, roles_of
from archc.ir.ops.modifiers import modifiers_of

MODIFIER_OPS = (Op.ATTENTION, Op.MASK, Op.SCORE_MOD)


def declared_inputs(program: Program) -> dict[str, int | None]:
    """The graph inputs an attention's expressions read per token, each with its default."""
    out: dict[str, int | None] = {}
    for g in program:
        for n in g.nodes:
            if n.op not in MODIFIER_OPS:
                continue
            at = full_attrs(n.op, n.attrs)
            tokens = set(modifiers_of(at).env.token_inputs) - {"padding"}
            for role, i in zip(roles_of(n.op, at, len(n.inputs)), n.inputs):
                if role in tokens and g.nodes[i].op == Op.INPUT:
                    out[g.nodes[i].name] = g.nodes[i].attr("default")
    return out


class TokenInputs:
    """The per-token inputs of one session: what each call adds, and what the graph reads."""

    def __init__(self, program: Program) -> None:
        self.declared = declared_inputs(program)
        self.held: dict[str, torch.Tensor] = {}

    def reset(self) -> None:
        self.held = {}

    def take(self, given: Mapping[str, torch.Tensor] | None, b: int, t: int, past: int
             ) -> dict[str, torch.Tensor]:
        """Each input over positions 0 … past + t − 1, [B, past + t] int32, with this call's
        values for its `t` tokens (`given`: name → [B, t] integers) appended."""
        given = dict(given or {})
        unknown = sorted(set(given) - set(self.declared))
        if unknown:
            takes = ", ".join(self.declared) or "none"
            raise RunError(f"this model's attention reads no per-token input {unknown[0]!r} "
                           f"(it reads: {takes})")
        out = {}
        for name, default in self.declared.items():
            x = given.get(name)
            held = self.held.get(name) if past > 0 else None
            if x is None:
                if held is not None:
                    x = held[:, -1:].expand(b, t)
                elif default is not None:
                    x = torch.full((b, t), default, dtype=torch.int32)
                else:
                    raise RunError(f"this model's attention reads the per-token input {name!r}, "
                                   f"which has no default (attention.inputs.{name}: null): pass "
                                   f"inputs={{{name!r}: ids [B, T]}}, or give it a default")
            x = torch.as_tensor(x)
            if x.dim() == 1:
                x = x[None]
            if tuple(x.shape) != (b, t) or x.dtype.is_floating_point or x.dtype == torch.bool:
                raise RunError(f"per-token input {name!r} must be integers [B, T] = [{b}, {t}], "
                               f"got {x.dtype}{list(x.shape)}")
            x = x.to(torch.int32)
            self.held[name] = x if held is None else torch.cat([held, x.to(held.device)], dim=1)
            out[name] = self.held[name]
        return out
