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

PLUGIN = 'pytest_plugins = ["tests.triton_state"]\n'
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


def _pytest(tmp_path: Path, conftest: str, tests: str, *args: str,
            **env: str) -> subprocess.CompletedProcess[str]:
    """pytest on `tests` in a directory of its own, with `conftest`; the environment this
    process started with (less the interpreter this suite chose), and `env`."""
    (tmp_path / "conftest.py").write_text(conftest)
    (tmp_path / "test_it.py").write_text(tests)
    base = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs",
                           *args, "test_it.py"], cwd=tmp_path, capture_output=True, text=True,
                          env={**base, "PYTHONPATH": path, **env}, timeout=300)


def test_a_test_that_leaves_triton_state_behind_fails(tmp_path: Path) -> None:
    report = tmp_path / "report.xml"
    run = _pytest(tmp_path, PLUGIN, LEAKS, f"--junitxml={report}")
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


# the plugin as on a machine with a CUDA GPU: torch says there is one
ON_A_GPU = "import torch\ntorch.cuda.is_available = lambda: True\n" + PLUGIN
CPU_SESSION = '''
import os

import torch

from archc.runtime import triton_backend


def test_a_session_on_the_cpu_is_skipped_before_it_changes_anything():
    triton_backend.prepare_triton(torch.device("cpu"))
    raise AssertionError("not skipped")


def test_the_interpreter_was_not_chosen():
    assert os.environ.get("TRITON_INTERPRET") is None
'''


def test_with_a_gpu_a_test_that_needs_the_interpreter_is_skipped(tmp_path: Path) -> None:
    """On a GPU machine a test that would choose Triton's interpreter (a triton session on the
    CPU) is skipped at that point, and TRITON_INTERPRET set at the start stops the run."""
    run = _pytest(tmp_path, ON_A_GPU, CPU_SESSION)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 passed, 1 skipped" in run.stdout
    assert "needs Triton's interpreter, which one test cannot choose" in run.stdout
    refused = _pytest(tmp_path, ON_A_GPU, CPU_SESSION, TRITON_INTERPRET="1")
    assert refused.returncode == 4      # a usage error
    assert "TRITON_INTERPRET is set on a machine with a CUDA GPU" in refused.stderr


def test_the_suite_does_not_tune_unless_a_test_asks() -> None:
    """tests/conftest.py: sessions built without saying (``archc.load(...).compile("triton")``
    and ``TritonOptions()``) do not tune; tests/test_autotune.py asks for the users' default."""
    from archc.runtime.triton_backend import TritonOptions
    assert TritonOptions().autotune is False
    assert TritonOptions(autotune=True).autotune is True
