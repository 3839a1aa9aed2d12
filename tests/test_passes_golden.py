"""Golden text: the IR of a few specs after the default pipeline, with provenance, checked in.

A change to a pass that changes what it produces shows up as a diff of these files. When the
change is intended, regenerate the file the failure names:

    archc ir tiny-llama3 --passes default --provenance -o tests/golden/ir/tiny-llama3.txt
"""

from __future__ import annotations

from pathlib import Path

import pytest

from archc.ir.lower import lower
from archc.ir.text import format_program
from archc.passes import optimize
from archc.spec import load_spec
from tests.golden_text import assert_matches_golden

GOLDEN = Path(__file__).parent / "golden" / "ir"
# serial pre-norm + GQA; LayerNorm with biases; parallel block + MQA; sandwich norms, soft-caps
# and windows; encoder-decoder with relative bias; mixture of experts; the recurrent hybrids
SPECS = ["tiny-llama3", "tiny-gpt2", "tiny-falcon", "tiny-gemma2", "tiny-t5", "tiny-mixtral",
         "tiny-jamba", "tiny-linear-attention", "tiny-qwen3-next"]


@pytest.mark.parametrize("name", SPECS)
def test_ir_after_the_default_pipeline_matches_golden_text(name: str) -> None:
    path = GOLDEN / f"{name}.txt"
    text = format_program(optimize(lower(load_spec(name))), provenance=True)
    regenerate = f"archc ir {name} --passes default --provenance -o tests/golden/ir/{name}.txt"
    assert_matches_golden(path, text, f"the IR of {name} after the default pipeline", regenerate)
