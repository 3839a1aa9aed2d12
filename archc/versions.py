"""The software a number was produced with. Registers, spills and speed change with the Triton
(and torch) version — the same kernel compiles to 72 registers and spills under one Triton, 86
and none under another — so every report names the versions that made it: the ahead-of-time
compile, the occupancy report, `archc bench` and the GPU check's summary.

    python -m archc.versions        # software: triton 3.9.0, torch 2.13.0+cpu, python 3.11.7
"""

from __future__ import annotations

import importlib.metadata
import platform

ARCHC = "0.1.0"          # this package's version (pyproject.toml states it for packaging)
PACKAGES = ("triton", "torch")


def version(package: str) -> str | None:
    """The installed version of `package`, None where it is not installed. Read from the
    package's metadata, not by importing it: importing Triton fixes, for the whole process,
    whether its kernels are compiled or interpreted."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def software() -> dict[str, str | None]:
    """Triton's, torch's and Python's versions."""
    return {**{name: version(name) for name in PACKAGES}, "python": platform.python_version()}


def software_text(versions: dict[str, str | None] | None = None) -> str:
    """`software: triton 3.9.0, torch 2.13.0+cpu, python 3.11.7` (of `versions`, default
    this process's)."""
    versions = software() if versions is None else versions
    return "software: " + ", ".join(f"{name} {v or 'not installed'}"
                                    for name, v in versions.items())


if __name__ == "__main__":
    print(software_text())
