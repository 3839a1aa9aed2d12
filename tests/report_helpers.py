"""What the report's tests share: the report's JSON as `archc report --json` prints it, the
JSON a page embeds, and `archc passes`' table read back from what that command prints."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from archc.cli import main
from archc.spec import ZOO_DIR


def report_json(capsys: pytest.CaptureFixture[str], source: str, *flags: str) -> dict[str, Any]:
    capsys.readouterr()
    status = main(["report", source, "--json", *flags])
    out, err = capsys.readouterr()
    assert status == 0, err
    return json.loads(out)


def embedded(page: Path) -> dict[str, Any]:
    """The data a written page embeds."""
    html = page.read_text(encoding="utf-8")
    found = re.search(r'<script type="application/json" id="report-data">(.*?)</script>', html,
                      re.S)
    assert found, "no embedded data"
    return json.loads(found.group(1))


def passes_table(capsys: pytest.CaptureFixture[str], source: str) -> list[tuple[str, int, int]]:
    """(pass, nodes, kernels) of each row `archc passes SOURCE` prints, "lowered" first; a
    row whose "changed" text wraps continues on lines with an empty pass column."""
    capsys.readouterr()
    assert main(["passes", source]) == 0
    rows = []
    for line in capsys.readouterr().out.splitlines():
        cells = [c.strip() for c in line.strip().strip("│").split("│")]
        if len(cells) == 9 and cells[1] and cells[1] != "pass":
            rows.append((cells[1], int(cells[3]), int(cells[4])))
    assert rows, "archc passes printed no table"
    return rows


def one_layer_yaml(tmp_path: Path, zoo_name: str) -> Path:
    """A zoo spec with its `layers:` line set to 1, as a file (written by text substitution, not
    by the code under test)."""
    text = (ZOO_DIR / f"{zoo_name}.yaml").read_text()
    cut, n = re.subn(r"(?m)^layers: \d+$", "layers: 1", text)
    assert n == 1, f"{zoo_name}.yaml has no top-level layers line"
    path = tmp_path / f"{zoo_name}-one-layer.yaml"
    path.write_text(cut)
    return path
