"""Local rewrites as data: a table of (pattern, rewrite) rules, applied to a fixed point.

The operands of a commutative op (the op table says which) match in either order, so a rule over
`add` or `mul` is written once. Conditions that make a structural match illegal — an intermediate
value read elsewhere — are checked after the structure matches, so a refusal can say which
condition failed. A rewrite returns the node that replaces the root, or ``None`` when the match
does not apply after all; it may raise ``Refusal`` to say why not.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

from archc.errors import IRError
from archc.ir.graph import Node
from archc.ir.ops import OP_TABLE, Op
from archc.passes.rewrite import Refusal, Rewriter, register_rewrite_pass

Bindings = dict[str, int]


@dataclass(frozen=True)
class Pat:
    ops: Collection[Op] | None = None      # None: any node
    name: str = ""                         # bind the matched node under this name
    src: tuple[Pat | None, ...] = ()       # patterns of the first inputs (None: any)
    one_use: bool = False                  # its value must be read by the matched parent only
    where: Callable[[Node], bool] | None = None   # a predicate on the node and its attributes


@dataclass(frozen=True)
class Rule:
    name: str
    pattern: Pat
    rewrite: Callable[[Rewriter, Bindings], int | None]


def match(rw: Rewriter, pat: Pat, i: int, parent: int | None = None
          ) -> tuple[Bindings, list[str]] | None:
    """The bindings of `pat` at node i and the conditions that fail there, or None when the
    structure does not match. Of a commutative op's two operand orders, the first that matches
    cleanly wins, else the first that matches."""
    n = rw.nodes[i]
    if (pat.ops is not None and n.op not in pat.ops) or len(n.inputs) < len(pat.src) or \
            (pat.where is not None and not pat.where(n)):
        return None
    own: list[str] = []
    others = [u for u in rw.users(i) if u != parent] if pat.one_use and parent is not None else []
    if others:
        own.append(f"%{i} ({n.op.value}) is also read by "
                   + ", ".join(f"%{u} ({rw.op(u).value})" for u in others))
    orders = [n.inputs]
    if OP_TABLE[n.op].commutative and len(pat.src) >= 2:
        orders.append((n.inputs[1], n.inputs[0], *n.inputs[2:]))
    found: list[tuple[Bindings, list[str]]] = []
    for inputs in orders:
        subs = [({}, []) if sub is None else match(rw, sub, j, i)
                for sub, j in zip(pat.src, inputs)]
        ok = [m for m in subs if m is not None]
        if len(ok) == len(subs):
            bound = {k: v for b, _ in ok for k, v in b.items()}
            found.append(({**bound, pat.name: i} if pat.name else bound,
                          own + [p for _, ps in ok for p in ps]))
    return min(found, key=lambda f: len(f[1]) > len(own), default=None)


def apply_rules(rw: Rewriter, rules: Collection[Rule], *, max_rounds: int = 64) -> None:
    """Try every rule at every node until nothing changes; records each decision. Rules that
    keep rewriting past `max_rounds` sweeps are a bug in the rules: an error, not a stop."""
    refused: dict[tuple[str, int], str] = {}
    for _ in range(max_rounds):
        progress = False
        for i in rw.order():
            if rw.is_dead(i):
                continue
            for rule in rules:
                found = match(rw, rule.pattern, i)
                if found is None:
                    continue
                try:
                    if found[1]:
                        raise Refusal("; ".join(found[1]))
                    new = rule.rewrite(rw, found[0])
                except Refusal as r:
                    refused[(rule.name, i)] = r.why
                    continue
                if new is None:
                    continue
                rw.ctx.applied(rule.name, rw.describe(i))
                rw.replace(i, new)
                refused.pop((rule.name, i), None)
                progress = True
                break
        if not progress:
            break
    else:
        names = ", ".join(sorted({r.name for r in rules}))
        raise IRError(f"pass {rw.ctx.pass_name}: the rules {names} still rewrite after "
                      f"{max_rounds} sweeps of the graph")
    for (rule_name, i), why in refused.items():
        # a node this pass made is already a fusion; only the graph's own nodes are reported
        if i < len(rw.g.nodes) and not rw.is_dead(i):
            rw.ctx.refused(rule_name, i, why)


def register_rule_pass(name: str, summary: str, *tables: Collection[Rule]) -> None:
    """Register a pass that applies rule tables, one after another, each to a fixed point."""
    @register_rewrite_pass(name, summary)
    def run(rw: Rewriter) -> None:
        for rules in tables:
            apply_rules(rw, rules)
