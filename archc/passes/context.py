"""What a pass reports while it runs: the fusions it made and the ones it refused, with the rule.

Every candidate a pass looks at ends in a ``Decision``: applied, or refused by a *legality* rule
("may I?" — doing it would change the function) or a *profitability* rule ("should I?" — legal, but
it would cost more than it saves). ``archc explain`` prints the refusals; ``archc passes`` counts
the applications. The context is passed explicitly to every pass; nothing is global.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from archc.ir.graph import Graph
from archc.ir.text import format_node

Verdict = Literal["applied", "legality", "profitability"]


@dataclass(frozen=True)
class Decision:
    pass_name: str
    graph: str
    rule: str              # the rule that decided, e.g. "key-bias", "fold-rmsnorm"
    node: str              # the candidate node in text form, numbered as the pass saw it
    verdict: Verdict
    reason: str = ""       # what was done, or why not

    @property
    def applied(self) -> bool:
        return self.verdict == "applied"


@dataclass
class PassContext:
    """Collects the decisions of one pass over one graph."""

    pass_name: str
    graph: Graph
    decisions: list[Decision] = field(default_factory=list)
    kept: dict[int, int] | None = None   # old id → new id of the nodes kept, set on renumbering

    def describe(self, i: int) -> str:
        """Node i of the graph as the pass received it, in text form."""
        return format_node(i, self.graph.nodes[i]) if 0 <= i < len(self.graph.nodes) else \
            f"%{i} (made by this pass)"

    def decide(self, rule: str, where: int | str, verdict: Verdict, reason: str) -> None:
        """`where`: a node id of the graph as the pass received it, or a node's text."""
        text = where if isinstance(where, str) else self.describe(where)
        self.decisions.append(Decision(self.pass_name, self.graph.name, rule, text, verdict,
                                       reason))

    def applied(self, rule: str, where: int | str, what: str = "") -> None:
        self.decide(rule, where, "applied", what)

    def refused(self, rule: str, where: int | str, why: str, *,
                profitability: bool = False) -> None:
        self.decide(rule, where, "profitability" if profitability else "legality", why)


class Refusal(Exception):
    """Raised inside a rewrite to refuse it: `why` names the rule that said no."""

    def __init__(self, why: str, *, profitability: bool = False) -> None:
        super().__init__(why)
        self.why, self.profitability = why, profitability
