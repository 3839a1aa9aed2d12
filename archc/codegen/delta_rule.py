"""The gated delta rule's kernels (templates/delta_rule.py.j2), rendered into a module of their own.

1. ``DeltaRuleKernels`` names what the text depends on — heads, key and value head dims, the
   inputs' dtype — and checks each (positive ints, a known dtype) before anything renders.
2. ``render`` fills the template once per form ("recurrent", "chunked") and heads the module with
   a ``KERNELS`` table in the shape ``render.generate`` writes (family, unit, sizes, constexpr
   sizes to compile ahead of time, argument types), so ``aot.compile_module`` reads it as it reads
   a model's module.
3. ``launch_constexprs`` gives a launch's constexprs: the block sizes from ``blocks.launch_config``
   (families ``delta_rule_recurrent`` and ``delta_rule_chunked``), the chunk, whether an initial
   state is read — each block size checked to be a power of two.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from archc.codegen.blocks import DOT_MIN, delta_rule_block_dk, launch_config
from archc.codegen.layout import CodegenError
from archc.codegen.render import ENV

FORMS = ("recurrent", "chunked")
DTYPES = {"f32": "fp32", "f16": "fp16", "bf16": "bf16"}     # archc dtype → Triton's
UNIT = "delta_rule_0"


# what each input of the kernels holds
DOCS = {"q": "L2-normalized queries", "k": "L2-normalized keys", "v": "values",
        "g": "log decay (≤ 0)", "beta": "write strength"}


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise CodegenError(f"delta rule: {name} must be a positive integer, not {value!r}")
    return value


def _power_of_two(name: str, value: object) -> int:
    n = _positive(name, value)
    if n & (n - 1):
        raise CodegenError(f"delta rule: {name} must be a power of two, not {n}")
    return n


@dataclass(frozen=True)
class DeltaRuleKernels:
    """What the kernels' text depends on: heads, key and value head dims, the inputs' dtype."""

    heads: int
    dk: int
    dv: int
    dtype: str = "f32"

    def __post_init__(self) -> None:
        for name in ("heads", "dk", "dv"):
            _positive(name, getattr(self, name))
        if self.dtype not in DTYPES:
            raise CodegenError(f"delta rule: dtype must be one of {', '.join(DTYPES)}, "
                               f"not {self.dtype!r}")

    @property
    def sizes(self) -> dict[str, int]:
        return {"H": self.heads, "DK": self.dk, "DV": self.dv}

    def kernel(self, form: str) -> str:
        return f"{UNIT}_{form}"


def launch_constexprs(kernels: DeltaRuleKernels, form: str, target: str, *, chunk: int,
                      initial: bool) -> dict[str, Any]:
    """A launch's constexprs and options (num_warps, num_stages) for `form` on `target`
    ("gpu" or the interpreter's "cpu")."""
    if form not in FORMS:
        raise CodegenError(f"delta rule: form must be one of {', '.join(FORMS)}, not {form!r}")
    cfg = launch_config(f"delta_rule_{form}", target, **kernels.sizes)
    _power_of_two("BLOCK_DV", cfg["BLOCK_DV"])
    cfg["HAS_INITIAL"] = int(initial)
    if form == "chunked":
        cfg["CHUNK"] = _power_of_two("chunk", chunk)
        if target == "gpu" and chunk < DOT_MIN:
            raise CodegenError(f"delta rule: chunk must be at least {DOT_MIN} on a GPU (its "
                               f"products are tl.dot tiles), not {chunk}")
    return cfg


def render(kernels: DeltaRuleKernels, *, chunk: int = 64) -> str:
    """The module: both forms' kernels and their KERNELS table (its AOT sizes at `chunk`)."""
    _power_of_two("chunk", chunk)
    h, dk, dv = kernels.heads, kernels.dk, kernels.dv

    def packed(width: int) -> dict[str, str]:   # [B, T, H, width], contiguous
        return dict(base=f"b * T * {h * width}", stride_t=str(h * width))
    dot_kw = ', input_precision="ieee"' if kernels.dtype == "f32" else ""
    widths = {"q": dk, "k": dk, "v": dv, "g": 1, "beta": 1}
    docs = {r: f"[B, T, {h}{'' if w == 1 else f', {w}'}] {DOCS[r]}" for r, w in widths.items()}
    context = dict(name=UNIT, H=h, DK=dk, DV=dv, G=1, l2_eps=None, launcher=False,
                   BLOCK_DK=delta_rule_block_dk(dk), dot_kw=dot_kw, docs=docs,
                   **{r: packed(w) for r, w in widths.items()})
    template = ENV.get_template("delta_rule.py.j2")
    sources = [template.render(forms=[form], **context).rstrip("\n") for form in FORMS]
    dt = DTYPES[kernels.dtype]
    types = {**{f"{p}_ptr": f"*{dt}" for p in ("o", "q", "k", "v", "g", "beta")},
             "s0_ptr": "*fp32", "s_ptr": "*fp32", "T": "i32", "scale": "fp32"}
    table = {kernels.kernel(form): {
        "family": f"delta_rule_{form}", "unit": UNIT, "sizes": kernels.sizes,
        "static": [{"HAS_INITIAL": 1, **({"CHUNK": chunk} if form == "chunked" else {})}],
        "types": types} for form in FORMS}
    entries = "".join(f"    {k!r}: {v!r},\n" for k, v in table.items())
    return (f'"""The gated delta rule: heads {kernels.heads}, Dk {kernels.dk}, Dv {kernels.dv}, '
            f'{kernels.dtype} inputs."""\n\nimport triton\nimport triton.language as tl\n\n\n'
            + "\n\n\n".join(sources) + f"\n\n\nKERNELS = {{\n{entries}}}\n")


def write(kernels: DeltaRuleKernels, directory: Path, *, chunk: int = 64) -> Path:
    """The rendered module, written under `directory` in a file named by its text's hash."""
    source = render(kernels, chunk=chunk)
    digest = hashlib.sha256(source.encode()).hexdigest()[:24]
    path = directory / f"delta_rule_{digest}.py"
    if not path.exists() or path.read_text() != source:
        directory.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".py.{os.getpid()}.tmp")
        tmp.write_text(source)
        tmp.replace(path)
    return path
