"""The bundled spec zoo (``specs/*.yaml``) and resolving a SPEC argument to a file."""

from __future__ import annotations

import difflib
from pathlib import Path

from archc.errors import SpecError
from archc.spec.load import load_yaml
from archc.spec.schema import Spec

ZOO_DIR = Path(__file__).resolve().parents[2] / "specs"


def zoo_names() -> list[str]:
    """Names of the bundled specs, real sizes first, then the tiny ones."""
    return sorted((p.stem for p in ZOO_DIR.glob("*.yaml")),
                  key=lambda name: (name.startswith("tiny-"), name))


def resolve_spec_path(spec: str | Path) -> Path:
    """A path to a YAML file, or the name of a zoo spec."""
    path, zoo = Path(spec), ZOO_DIR / f"{spec}.yaml"
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise SpecError("", "no such file", source=str(path))
        return path
    if zoo.is_file():
        return zoo
    close = difflib.get_close_matches(str(spec), zoo_names(), n=3)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise SpecError("", f"{spec!r} is neither a spec file nor a zoo name{hint}",
                    allowed="a .yaml path or one of `archc specs`")


def load_spec(spec: str | Path) -> Spec:
    """Load a spec by zoo name or path."""
    return load_yaml(resolve_spec_path(spec))
