"""The text of docs/passes-reference.md, from the pass registry and the architecture steps."""

from __future__ import annotations

from archc.passes.manager import DEFAULT_PIPELINE, PASSES
from archc.spec.steps import DEFAULT_STEPS, STEPS


def reference() -> str:
    lines = [   # an item ending in "\n" ends a paragraph
        "# archc pass reference\n",
        "Generated from the pass registry by `python -m archc.passes.reference`; a test keeps "
        "this file current.\n",
        "## The default pipeline\n",
        "Exact passes keep the model's function (each is translation-validated on every tiny "
        "spec: the eager interpreter before and after, on random weights, prefill and decode). "
        "In this order; `archc passes SPEC` shows what each did to a spec, `archc ir SPEC "
        "--diff PASS` the IR it changed, `archc explain SPEC` the fusions it refused and why.\n",
        "| # | pass | what it does |",
        "|---|---|---|",
    ]
    for k, name in enumerate(DEFAULT_PIPELINE, 1):
        p = PASSES[name]
        scope = " (over the whole program)" if p.program else ""
        lines.append(f"| {k} | `{name}` | {p.summary}{scope} |")
    others = sorted(n for n, p in PASSES.items() if n not in DEFAULT_PIPELINE)
    if others:
        lines += ["\nRegistered but not in the default pipeline (with their options, each "
                  "given as `NAME:OPTION=N` in a pipeline; N: required):\n"]
        lines += [f"- `{PASSES[n].usage()}` ({PASSES[n].kind}): {PASSES[n].summary}"
                  for n in others]
    lines += [
        "\n## Architecture steps\n",
        "Steps change the model on purpose; they never run unless named "
        "(`archc modernize SPEC --steps a,b:N`). Each is a spec → spec transform. "
        f"The default walk: {', '.join(f'`{s}`' for s in DEFAULT_STEPS)}, each that applies to "
        "the model (on a checkpoint, each that converts its weights).\n",
        "| step | what it does | argument | on loaded weights |",
        "|---|---|---|---|",
    ]
    for s in STEPS.values():
        arg = "required" if s.needs_arg else ("optional" if s.takes_arg else "—")
        weights = "converts them" if s.converts_weights else "refused (needs training)"
        lines.append(f"| `{s.name}` | {s.doc} | {arg} | {weights} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(reference(), end="")
