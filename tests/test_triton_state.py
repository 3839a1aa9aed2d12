"""No test leaves Triton's process-wide state behind (``tests/triton_state.py``): a test run of
its own, with that plugin, over tests that leak — one sets ``TRITON_INTERPRET``, one rebinds a
function of ``triton.language`` as choosing the interpreter would — fails each of them, naming
the change, and the test after them finds the state the run started with."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

LEAKS = '''
import os

import triton
import triton.language as tl

START = os.environ.get("TRITON_INTERPRET"), tl.cdiv


def test_sets_the_interpreter_variable():
    os.environ["TRITON_INTERPRET"] = "leaked"


def test_rebinds_a_function_of_triton_language():
    tl.cdiv = triton.jit(tl.cdiv.fn)


def test_later_tests_find_the_state_at_the_start():
    assert (os.environ.get("TRITON_INTERPRET"), tl.cdiv) == START
'''


def test_a_test_that_leaves_triton_state_behind_fails(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["tests.triton_state"]\n')
    (tmp_path / "test_leaks.py").write_text(LEAKS)
    report = tmp_path / "report.xml"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q",
                          f"--junitxml={report}", "test_leaks.py"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stdout + run.stderr
    errors: dict[str, list[str]] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        errors.setdefault(case.get("name", ""), []).extend(
            e.get("message", "") for e in case.iter("error"))
    leaked, rebound, later = (errors[name] for name in (
        "test_sets_the_interpreter_variable", "test_rebinds_a_function_of_triton_language",
        "test_later_tests_find_the_state_at_the_start"))
    assert len(leaked) == 1 and "TRITON_INTERPRET is 'leaked'" in leaked[0]
    assert len(rebound) == 1 and "functions of triton.language rebound" in rebound[0]
    assert "triton.language.cdiv" in rebound[0]
    assert later == []


def test_the_suite_does_not_tune_unless_a_test_asks() -> None:
    """tests/conftest.py: sessions built without saying (``archc.load(...).compile("triton")``
    and ``TritonOptions()``) do not tune; tests/test_autotune.py asks for the users' default."""
    from archc.runtime.triton_backend import TritonOptions
    assert TritonOptions().autotune is False
    assert TritonOptions(autotune=True).autotune is True
