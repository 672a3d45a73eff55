"""The kernel-NFS guest runs a job from wherever the checkout lives (tierstore/testing/nfs_guest.py).

The guest mounts its own tmpfs over ``/tmp``, ``/var/tmp``, ``/run`` and ``/mnt``, which hid a
checkout and its ``.venv`` under the host's ``/tmp``: the job then died with ``python: not
found`` (exit 127). These boots run a job from a checkout-shaped directory under ``/tmp`` whose
path has a space, with its own venv and results directory there, and check that a host path
the guest cannot show fails the run with a ``GuestError`` that names it. Each boot imports no
torch: about 10 s under software emulation.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tierstore.testing.nfs_guest import (
    GuestError,
    guest_available,
    guest_binds,
    guest_paths,
    run_in_guest,
)

PROBE = """\
import json, os, sys
out = {"prefix": sys.prefix, "cwd": os.getcwd(), "listing": sorted(os.listdir("."))}
with open(os.path.join(sys.argv[1], "probe.json"), "w") as f:
    json.dump(out, f)
"""


@pytest.fixture
def checkout_under_tmp() -> Iterator[Path]:
    """A directory shaped like a checkout under the host's /tmp (not pytest's basetemp, which a
    run may put elsewhere), its path with a space, holding a script and a venv of its own."""
    with tempfile.TemporaryDirectory(prefix="tierstore guest ", dir="/tmp") as top:
        checkout = Path(top) / "my checkout"
        checkout.mkdir()
        (checkout / "probe.py").write_text(PROBE)
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(checkout / ".venv")], check=True,
                       timeout=60)
        yield checkout


def _need_guest() -> None:
    reason = guest_available()
    if reason:
        pytest.skip(f"kernel-NFS guest unavailable: {reason}")


def test_paths_under_the_guest_tmpfs_are_bound_outermost_only(tmp_path: Path) -> None:
    inner = tmp_path / "a" / "b"
    inner.mkdir(parents=True)
    paths = guest_paths(tmp_path, (inner, Path("/usr/lib")))
    binds = guest_binds(paths)
    assert tmp_path.resolve() in binds
    assert inner.resolve() not in binds  # shown through its parent's bind
    assert Path("/usr/lib") not in binds  # the host's / is shown as it is
    assert all(str(b).startswith(("/tmp", "/var/tmp", "/run", "/mnt", "/var/lib/nfs")) for b in binds)


def test_a_job_runs_from_a_checkout_and_venv_under_tmp_with_a_space(checkout_under_tmp: Path) -> None:
    _need_guest()
    results = checkout_under_tmp / "results dir"
    python = checkout_under_tmp / ".venv" / "bin" / "python"
    command = f"{shlex.quote(str(python))} probe.py {shlex.quote(str(results))}"
    run = run_in_guest(command, results, timeout_s=240, cwd=checkout_under_tmp)
    assert run.rc == 0, f"the job exited {run.rc}:\n{run.log[-3000:]}"
    probe = json.loads((results / "probe.json").read_text())
    assert probe["cwd"] == str(checkout_under_tmp)
    assert probe["prefix"] == str(checkout_under_tmp / ".venv")  # the checkout's venv, not the host's
    assert {"probe.py", ".venv", "results dir"} <= set(probe["listing"])


def test_a_path_the_guest_cannot_show_is_named_not_exit_127(checkout_under_tmp: Path) -> None:
    _need_guest()
    missing = checkout_under_tmp.parent / "gone before boot"
    results = checkout_under_tmp / "results"
    with pytest.raises(GuestError, match="gone before boot.*not visible inside the kernel-NFS guest"):
        run_in_guest("true", results, timeout_s=240, cwd=checkout_under_tmp, visible=(missing,))
