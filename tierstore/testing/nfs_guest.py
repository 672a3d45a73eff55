"""A kernel NFS server and kernel NFS clients for tests, in a QEMU guest (issue 33).

The host has no NFS client in its kernel, so tests that need real NFS semantics (attribute and
lookup caches, ESTALE, ``hard``/``soft`` mounts, a server that stops) boot a guest built by
``tools/nfs-guest.sh``: Debian's kernel and a busybox initramfs that mounts the host's ``/``
read-only over 9p, chroots into it and runs a job script. Inside, the host's own programs run:
``rpc.nfsd`` and friends serve tmpfs exports on the guest's loopback, and the host's venv runs
the test's node scripts against kernel NFS mounts of them. No traffic leaves the guest
(``-nic none``).

Host side:
- ``guest_available()``: None, or why the guest cannot run here (for ``pytest.skip``).
- ``run_in_guest(command, results)``: boots the guest once, starts the NFS server, runs
  ``command`` (a shell command line) in the host's root and returns a ``GuestRun`` when the
  guest has powered off. Results come back through ``results``, a host directory shared
  writable (9p, mount tag ``results``) at the same path inside the guest: a second share rather
  than the serial console, because the console also carries the kernel's messages, is slow under
  emulation and would need framing for binary or large outputs; files need none.

Inside the guest the host's ``/`` is read-only and ``/tmp``, ``/var/tmp``, ``/run``, ``/mnt`` and
``/dev/shm`` are the guest's own tmpfs (a host file under ``/tmp`` is not visible there, except the
results directory); node scripts keep their local tiers under ``/var/tmp``. The guest runs under
software emulation (TCG: a nested KVM guest hangs at boot on the machines this was built on);
``TIERSTORE_NFS_GUEST_ACCEL=kvm:tcg`` asks QEMU for KVM where it works. Boot: about 4 s;
importing torch inside: 60-100 s (batch the checks of a test module into one boot).

Guest side (called by a script running inside the guest):
- ``mount_export(export, mountpoint, options)``, ``unmount(mountpoint)``: kernel NFS mounts of
  the guest's server on 127.0.0.1.
- ``server_stop()`` (``rpc.nfsd 0``: every call on a ``hard`` mount blocks, a ``soft`` one
  times out) and ``server_start()`` (a restart: NFSv4 clients then wait out the grace period,
  set to ``GRACE_S``).
- ``clock_offset_command(offset_s, argv)``: argv run under ``faketime`` with its wall clock
  offset (monotonic clocks untouched): one node with a skewed clock.

Exports (inside the guest): ``EXPORT`` (a tmpfs of ``export_mib``) and ``SMALL_EXPORT`` (a tmpfs
of ``small_export_mib``: a full export gives ENOSPC). Clients mount them by path over NFSv3,
v4.1 or v4.2.

Failure policy: ``run_in_guest`` raises ``GuestError`` (with the console's tail) when the guest
cannot boot or does not power off within its timeout (the QEMU process it started is killed);
the job's own exit status is returned, not raised. The guest-side calls raise
``subprocess.CalledProcessError`` when a command fails.

Threading: no shared state; each ``run_in_guest`` boots its own guest (blocking the caller).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

GUEST_DIR_ENV = "TIERSTORE_NFS_GUEST_DIR"
SETUP_HINT = "run tools/nfs-guest.sh (installs the packages and builds the guest)"
# inside the guest (tmpfs mounts of the job prologue)
V4_ROOT = "/mnt"  # the NFSv4 pseudo root (fsid=0; a tmpfs): v4 paths are relative to it
EXPORT = "/mnt/export"
SMALL_EXPORT = "/mnt/small"
GRACE_S = 10  # NFSv4 grace and lease time: the kernel's minimum (10 s), not the default 90 s
NFSD_THREADS = 4
# tmpfs has no UUID: each export names its fsid; sync so a reply means the server has the bytes
EXPORT_OPTIONS = "rw,no_root_squash,insecure,no_subtree_check,sync"
# programs the job runs inside the guest (the host's, seen through 9p)
GUEST_PROGRAMS = ("rpcbind", "rpc.nfsd", "rpc.mountd", "exportfs", "modprobe", "mount", "ip")


class GuestError(RuntimeError):
    """The guest did not boot, or did not power off in time (message: what and the console)."""


@dataclass(frozen=True)
class GuestRun:
    rc: int  # the job's exit status
    log: str  # the job's stdout and stderr
    console: str  # the guest's serial console (kernel messages)
    boot_s: float  # guest uptime when the job began
    wall_s: float  # QEMU start to power-off


def guest_dir() -> Path:
    """The cache tools/nfs-guest.sh fills (``TIERSTORE_NFS_GUEST_DIR`` overrides it)."""
    env = os.environ.get(GUEST_DIR_ENV)
    return Path(env) if env else Path.home() / ".cache" / "tierstore" / "nfs-guest"


def _kernel_version(cache: Path) -> str | None:
    try:
        _recipe, version = (cache / "ready").read_text().split()
    except (OSError, ValueError):
        return None
    return version


def _which(program: str) -> str | None:
    return shutil.which(program, path="/usr/sbin:/usr/bin:/sbin:/bin:" + os.environ.get("PATH", ""))


def guest_available() -> str | None:
    """None if the guest can boot here, else the reason (what is missing and what to run)."""
    if _which("qemu-system-x86_64") is None:
        return f"qemu-system-x86_64 not installed: {SETUP_HINT}"
    cache = guest_dir()
    version = _kernel_version(cache)
    if version is None:
        return f"no guest cache at {cache} ({GUEST_DIR_ENV}): {SETUP_HINT}"
    for needed in (cache / "kernel" / "boot" / f"vmlinuz-{version}", cache / "initramfs.cpio.gz",
                   cache / "kernel" / "lib" / "modules" / version / "modules.dep"):
        if not needed.exists():
            return f"{needed} missing: {SETUP_HINT}"
    for program in GUEST_PROGRAMS:
        if _which(program) is None:
            return f"{program} not installed: {SETUP_HINT}"
    if os.geteuid() != 0:
        return "the guest needs root (its 9p share passes host ownership through)"
    return None


def _job_script(command: str, results: Path, export_mib: int, small_export_mib: int) -> str:
    """The shell script the guest runs in the host's root: NFS server up, then ``command``."""
    cache = guest_dir()
    version = _kernel_version(cache)
    kernel = shlex.quote(str(cache / "kernel"))
    return f"""#!/bin/sh
# written by tierstore/testing/nfs_guest.py: the kernel NFS server, then the test's command
export PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/var/tmp TMPDIR=/var/tmp
set -e
step() {{ echo "nfs-guest: $*"; }}
step "modules"
modprobe -d {kernel} -S {version} -a nfsd nfsv3 nfsv4 sunrpc
ip link set lo up
mkdir -p /var/lib/nfs/rpc_pipefs /var/lib/nfs/v4recovery /run/rpcbind {EXPORT} {SMALL_EXPORT}
touch /var/lib/nfs/etab /var/lib/nfs/rmtab /var/lib/nfs/xtab
mount -t rpc_pipefs sunrpc /var/lib/nfs/rpc_pipefs
mount -t nfsd nfsd /proc/fs/nfsd
mount -t tmpfs -o size={export_mib}m,mode=0755 export {EXPORT}
mount -t tmpfs -o size={small_export_mib}m,mode=0755 small {SMALL_EXPORT}
echo {GRACE_S} > /proc/fs/nfsd/nfsv4gracetime
echo {GRACE_S} > /proc/fs/nfsd/nfsv4leasetime
step "server"
rpcbind -w
exportfs -o {EXPORT_OPTIONS},fsid=0 127.0.0.1:{V4_ROOT}
exportfs -o {EXPORT_OPTIONS},fsid=1 127.0.0.1:{EXPORT}
exportfs -o {EXPORT_OPTIONS},fsid=2 127.0.0.1:{SMALL_EXPORT}
rpc.mountd --no-udp
rpc.nfsd -H 127.0.0.1 {NFSD_THREADS}
date +%s.%N > {shlex.quote(str(results))}/server_up
set +e
step "job"
cd {shlex.quote(os.getcwd())}
{command}
rc=$?
step "job exited with $rc"
exit $rc
"""


def run_in_guest(command: str, results: Path, *, timeout_s: float = 420.0, memory_mib: int = 2048,
                 cpus: int = 2, export_mib: int = 512, small_export_mib: int = 24) -> GuestRun:
    """Boot the guest, start the NFS server, run ``command`` (shell) and wait for power-off.

    ``results`` (a host directory, created if needed) is writable inside the guest at the same
    path; the job script, ``guest.log`` (the job's output) and ``console.log`` live there. The
    working directory inside is the caller's. Raises ``GuestError`` when the guest is not there
    (``guest_available()``), fails to boot, or runs past ``timeout_s`` (QEMU is killed).
    """
    reason = guest_available()
    if reason:
        raise GuestError(reason)
    results = Path(results).resolve()
    results.mkdir(parents=True, exist_ok=True)
    for stale in ("rc", "guest.log", "booted_s", "server_up", "console.log"):
        with contextlib.suppress(FileNotFoundError):
            (results / stale).unlink()
    if any(c.isspace() for c in str(results)):
        raise GuestError(f"the results path {results} has white space (the kernel command line splits it)")
    (results / "job.sh").write_text(_job_script(command, results, export_mib, small_export_mib))
    cache = guest_dir()
    version = _kernel_version(cache)
    console = results / "console.log"
    argv = [
        _which("qemu-system-x86_64") or "qemu-system-x86_64",
        # KVM hangs nested guests on the machines this was built on: TCG unless asked
        "-accel", os.environ.get("TIERSTORE_NFS_GUEST_ACCEL", "tcg"),
        "-cpu", "max", "-m", str(memory_mib), "-smp", str(cpus),
        "-nic", "none", "-display", "none", "-monitor", "none", "-no-reboot",
        "-serial", f"file:{console}",
        "-kernel", str(cache / "kernel" / "boot" / f"vmlinuz-{version}"),
        "-initrd", str(cache / "initramfs.cpio.gz"),
        "-append", f"console=ttyS0 quiet loglevel=4 panic=-1 tierstore.results={results} tierstore.job=job.sh",
        "-virtfs", "local,path=/,mount_tag=hostroot,security_model=passthrough,readonly=on,multidevs=remap",
        "-virtfs", f"local,path={results},mount_tag=results,security_model=passthrough,multidevs=remap",
    ]
    started = time.monotonic()
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        qemu_out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()  # the QEMU this call started
        proc.communicate()
        raise GuestError(f"the guest ran past {timeout_s:.0f} s; job log tail:\n"
                         f"{_tail(results / 'guest.log')}\nconsole tail:\n{_tail(console)}") from None
    wall = time.monotonic() - started
    rc_text = _read(results / "rc").strip()
    if not rc_text:
        raise GuestError(f"the guest powered off without running the job (qemu exit {proc.returncode}): "
                         f"{qemu_out[-2000:]}\nconsole tail:\n{_tail(console)}\njob log tail:\n"
                         f"{_tail(results / 'guest.log')}")
    booted = _read(results / "booted_s").strip()
    return GuestRun(rc=int(rc_text), log=_read(results / "guest.log"), console=_read(console),
                    boot_s=float(booted) if booted else float("nan"), wall_s=wall)


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


def _tail(path: Path, chars: int = 3000) -> str:
    return _read(path)[-chars:]


# --- guest side ------------------------------------------------------------------------------

def _run(argv: list[str], timeout: float = 60.0) -> None:
    subprocess.run(argv, check=True, timeout=timeout, stdin=subprocess.DEVNULL,
                   capture_output=True, text=True)


def mount_export(export: str, mountpoint: str | os.PathLike[str], options: str) -> None:
    """Mount ``export`` of the guest's server at ``mountpoint`` (created) with ``options``
    (``vers=...`` and the rest, as for ``mount -o``); 3 minutes at most (a v4 mount waits out a
    grace period)."""
    Path(mountpoint).mkdir(parents=True, exist_ok=True)
    path = export
    if any(o.startswith(("vers=4", "nfsvers=4")) for o in options.split(",")):
        path = "/" + os.path.relpath(export, V4_ROOT)  # v4 names paths below the pseudo root
    _run(["mount", "-t", "nfs", "-o", options, f"127.0.0.1:{path}", str(mountpoint)], timeout=180)


def unmount(mountpoint: str | os.PathLike[str]) -> None:
    """Unmount (forced and lazy where a hung server or an open file holds it)."""
    try:
        _run(["umount", str(mountpoint)], timeout=30)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
        _run(["umount", "-f", "-l", str(mountpoint)], timeout=30)


def server_stop() -> None:
    """Stop every nfsd thread (``rpc.nfsd 0``): calls to the server get no answer."""
    _run(["rpc.nfsd", "0"])


def server_start(threads: int = NFSD_THREADS) -> None:
    """Start nfsd again on 127.0.0.1 (NFSv4 clients reclaim state during the grace period)."""
    _run(["rpc.nfsd", "-H", "127.0.0.1", str(threads)])


def clock_offset_command(offset_s: float, argv: list[str]) -> list[str]:
    """``argv`` under faketime with its wall clock ``offset_s`` seconds off (monotonic clocks and
    file times from the server untouched); needs the Debian package faketime."""
    env = ["env", "FAKETIME_DONT_FAKE_MONOTONIC=1"]
    return [*env, "faketime", "-f", f"{offset_s:+.0f}s", *argv]
