"""Under CI=true a skip fails the run unless tests/conftest.py's ALLOWED_CI_SKIPS names its reason.

Each case runs pytest in a subprocess on a generated test file, with the suite's conftest loaded
as a plugin, so the policy that guards CI is itself checked: a skip for a missing tool fails the
run and is named; a GPU skip does not; without CI=true neither fails. Under pytest-xdist (how
tools/test.sh runs) a module skipped at import fails the run too: the reports reach the
controller through other hooks than in one process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

PROBE = """
import pytest

def test_needs_a_tool():
    pytest.skip({reason!r})

def test_passes():
    pass
"""


# A module whose import needs a module that is not installed, skipped at collection.
MODULE_SKIP = """
import pytest

pytest.importorskip("tierstore_no_such_module")

def test_never_runs():
    pass
"""


def _run(tmp_path: Path, reason: str, ci: bool, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_probe.py").write_text(PROBE.format(reason=reason))
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTHONPATH"] = str(TESTS)
    if ci:
        env["CI"] = "true"
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest",
                           "-c", os.devnull, "--rootdir", str(tmp_path), *args, "test_probe.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)  # a fresh interpreter and an xdist worker on a saturated CI machine


@pytest.mark.parametrize(("reason", "ci", "fails"), [
    ("sshfs unavailable: not installed", True, True),
    ("needs a CUDA device (compiled Triton)", True, False),
    ("vLLM-CPU's fp8 KV cache needs AVX-512 or AMX, and this CPU has neither", True, False),
    ("sshfs unavailable: not installed", False, False),
])
def test_a_skip_fails_a_ci_run_unless_its_reason_is_allowed(tmp_path: Path, reason: str, ci: bool,
                                                            fails: bool) -> None:
    proc = _run(tmp_path, reason, ci)
    out = proc.stdout + proc.stderr
    assert "1 passed, 1 skipped" in out, out
    assert proc.returncode == (1 if fails else 0), out
    assert ("SKIP NOT ALLOWED test_probe.py::test_needs_a_tool: " + reason in out) == fails, out


def test_under_xdist_a_module_skipped_at_import_fails_a_ci_run(tmp_path: Path) -> None:
    (tmp_path / "test_probe_module.py").write_text(MODULE_SKIP)
    proc = _run(tmp_path, "needs a CUDA device (compiled Triton)", True, "-n", "1", "--dist", "loadfile",
                "test_probe_module.py")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "SKIP NOT ALLOWED test_probe_module.py: could not import 'tierstore_no_such_module'" in out, out
    assert "SKIP NOT ALLOWED test_probe.py" not in out, out  # its CUDA skip is allowed
    assert out.rstrip().splitlines()[-1].startswith("SKIP NOT ALLOWED"), out  # the tail CI keeps
