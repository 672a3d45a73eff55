"""A guest boot that hangs is killed and booted again (tierstore/testing/nfs_guest.py).

Under a starved CI worker a TCG guest once stopped taking timer interrupts 1.7 s into its boot
and never reached its job: the run waited out its whole timeout and failed. ``run_in_guest`` now
gives a boot ``boot_deadline_s`` to start the job (the init writes ``booted_s``), kills a boot
that misses it and boots again, ``BOOT_ATTEMPTS`` times in all. A hang cannot be ordered from a
real kernel, so these runs use a stand-in for QEMU (``TIERSTORE_NFS_GUEST_QEMU``) that acts one
scripted boot per call: hang before the job, run the job, or start the job and never finish.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from tierstore.testing import nfs_guest
from tierstore.testing.nfs_guest import GuestError, guest_available, run_in_guest

FAKE_QEMU = """\
import os, sys, time
from pathlib import Path
script = Path(__file__).with_name("boots")
boots = script.read_text().split()
done = Path(__file__).with_name("started")
n = len(done.read_text().split()) if done.exists() else 0
with done.open("a") as f:
    f.write("boot\\n")
results = next(a.split("path=", 1)[1].split(",mount_tag=results")[0] for a in sys.argv if "mount_tag=results" in a)
results = Path(results.replace(",,", ","))
kind = boots[min(n, len(boots) - 1)]
(results / "console.log").write_text(f"fake boot {n + 1}: {kind}\\n")
if kind == "hang":  # the kernel never reaches the init's job
    time.sleep(3600)
(results / "booted_s").write_text("1.5\\n")
if kind == "slow":  # the job started and does not finish
    time.sleep(3600)
(results / "guest.log").write_text("job ran\\n")
(results / "rc").write_text("0\\n")
"""


@pytest.fixture
def fake_qemu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A guest cache and a QEMU stand-in; write the boots' kinds to ``<returned>/boots``."""
    cache = tmp_path / "cache"
    version = "6.1.0-fake"
    for rel in (f"kernel/boot/vmlinuz-{version}", "initramfs.cpio.gz", f"kernel/lib/modules/{version}/modules.dep"):
        (cache / rel).parent.mkdir(parents=True, exist_ok=True)
        (cache / rel).write_text("")
    (cache / "ready").write_text(f"fake-recipe {version}\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    qemu = bin_dir / "qemu"
    qemu.write_text(f"#!{sys.executable}\n{FAKE_QEMU}")
    qemu.chmod(0o755)
    monkeypatch.setenv(nfs_guest.GUEST_DIR_ENV, str(cache))
    monkeypatch.setenv(nfs_guest.QEMU_ENV, str(qemu))
    reason = guest_available()
    if reason:
        pytest.skip(f"the guest's programs are not here: {reason}")
    return bin_dir


def _boots(bin_dir: Path) -> int:
    return len((bin_dir / "started").read_text().split())


def test_a_hung_boot_is_killed_and_booted_again(fake_qemu: Path, tmp_path: Path) -> None:
    (fake_qemu / "boots").write_text("hang ok")
    started = time.monotonic()
    # 2 s: the stand-in's boot that runs the job must meet it on a busy worker too
    run = run_in_guest("true", tmp_path / "results", timeout_s=60, boot_deadline_s=2, cwd=tmp_path)
    assert run.rc == 0 and run.log == "job ran\n"
    assert run.boot_attempts == 2 and _boots(fake_qemu) == 2
    assert time.monotonic() - started >= 2  # the first boot was given its deadline


def test_boots_that_all_hang_fail_after_the_last_attempt(fake_qemu: Path, tmp_path: Path) -> None:
    (fake_qemu / "boots").write_text("hang")
    with pytest.raises(GuestError, match=f"did not start the job within 0.5 s of a boot, in any of {nfs_guest.BOOT_ATTEMPTS} boots"):
        run_in_guest("true", tmp_path / "results", timeout_s=60, boot_deadline_s=0.5, cwd=tmp_path)
    assert _boots(fake_qemu) == nfs_guest.BOOT_ATTEMPTS


@pytest.mark.slow  # 3 s of waiting: the full run only
def test_a_job_that_started_is_not_killed_by_the_boot_deadline(fake_qemu: Path, tmp_path: Path) -> None:
    """The boot deadline is for reaching the job: a running job has the whole timeout, and
    past it the run fails as ran-past, not as a hung boot, without booting again."""
    (fake_qemu / "boots").write_text("slow ok")
    started = time.monotonic()
    with pytest.raises(GuestError, match="the guest ran past 3 s"):
        run_in_guest("true", tmp_path / "results", timeout_s=3, boot_deadline_s=2, cwd=tmp_path)
    assert time.monotonic() - started >= 3
    assert _boots(fake_qemu) == 1
