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

Inside the guest the host's ``/`` is read-only and ``/tmp``, ``/var/tmp``, ``/run``, ``/mnt``,
``/var/lib/nfs`` and ``/dev/shm`` are the guest's own tmpfs (the NFS server's state, the exports
and the nodes' local tiers live there). The host paths a job needs stay visible at their host
paths even under those mount points: the results directory, the working directory, the
interpreter's prefixes and the guest cache (``guest_paths``; a checkout and its ``.venv`` under
``/tmp``, or with a space in its path, run as anywhere else), and ``visible=`` adds more. The
job script checks each is there before the command runs, so a path the guest cannot show fails
the run with ``GuestError`` naming it instead of a ``not found`` from inside. The guest runs under
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
- ``nfsd_counters()``: the server's per-operation counters (``/proc/net/rpc/nfsd``; ``PROC3``
  and ``PROC4OPS`` name the fields): what a client's calls cost the server.
- ``quota_export()``: ``QUOTA_EXPORT``, an ext4 file system (a loop device) with user quotas,
  every request squashed to ``QUOTA_UID``; ``set_user_quota`` and ``user_quota_used`` (the
  ``quotactl`` system call: no quota tools needed). ``load_modules`` loads guest kernel modules.

Exports (inside the guest): ``EXPORT`` (a tmpfs of ``export_mib``) and ``SMALL_EXPORT`` (a tmpfs
of ``small_export_mib``: a full export gives ENOSPC), and ``QUOTA_EXPORT`` once a job made it
(``quota_export``). Clients mount them by path over NFSv3, v4.1 or v4.2.

Failure policy: a boot that has not started the job within ``BOOT_DEADLINE_S`` is killed and
booted again (``BOOT_ATTEMPTS`` in all: under a starved host a TCG guest once stopped taking timer
interrupts early in boot and never came back). ``run_in_guest`` raises ``GuestError`` (with the
console's tail) when the guest cannot boot or does not power off within its timeout (the QEMU
process it started is killed); the job's own exit status is returned, not raised. The guest-side calls raise
``subprocess.CalledProcessError`` when a command fails.

Threading: no shared state; each ``run_in_guest`` boots its own guest (blocking the caller).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

GUEST_DIR_ENV = "TIERSTORE_NFS_GUEST_DIR"
QEMU_ENV = "TIERSTORE_NFS_GUEST_QEMU"  # the QEMU binary (default: qemu-system-x86_64 on the PATH)
# host seconds from QEMU's start to the job's start before a boot counts as hung and is tried
# again: a boot takes about 3 s alone; under a busy CI worker a TCG guest once stopped taking
# timer interrupts at 1.7 s of uptime and never reached its job (RCU stalls on the console)
BOOT_DEADLINE_S = 60.0
BOOT_ATTEMPTS = 3
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
# the guest's own tmpfs mounts (tools/nfs-guest.sh's init): host paths below them are hidden unless
# the init binds them back (guest_paths)
GUEST_TMPFS = ("/tmp", "/var/tmp", "/run", "/mnt", "/var/lib/nfs")
UNSEEN_FILE = "unseen"  # written by the job script: a host path the guest could not show


class GuestError(RuntimeError):
    """The guest did not boot, or did not power off in time (message: what and the console)."""


@dataclass(frozen=True)
class GuestRun:
    rc: int  # the job's exit status
    log: str  # the job's stdout and stderr
    console: str  # the guest's serial console (kernel messages)
    boot_s: float  # guest uptime when the job began
    wall_s: float  # QEMU start to power-off (of the boot that ran the job)
    boot_attempts: int = 1  # boots started: more than 1 when a boot hung (BOOT_DEADLINE_S)


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


def _qemu() -> str | None:
    return os.environ.get(QEMU_ENV) or _which("qemu-system-x86_64")


def guest_available() -> str | None:
    """None if the guest can boot here, else the reason (what is missing and what to run)."""
    if _qemu() is None:
        return f"qemu-system-x86_64 not installed ({QEMU_ENV} names another): {SETUP_HINT}"
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


def _under(path: Path, top: str) -> bool:
    return path == Path(top) or Path(top) in path.parents


def guest_paths(cwd: Path, visible: tuple[Path, ...] = ()) -> list[Path]:
    """The host paths a job needs inside the guest: ``cwd``, the running interpreter's
    prefixes and executable, the guest cache and ``visible``, resolved (a symlinked ``/tmp`` or
    venv is shown at its target too, which is where the kernel looks). Only those below the
    guest's tmpfs mounts need binding; ``run_in_guest`` checks all of them inside the guest."""
    wanted = [cwd, Path(sys.prefix), Path(sys.base_prefix), Path(sys.executable).parent, guest_dir(), *visible]
    out: list[Path] = []
    for path in wanted:
        for form in (Path(os.path.abspath(path)), Path(path).resolve()):
            if form not in out:
                out.append(form)
    return out


def guest_binds(paths: list[Path]) -> list[Path]:
    """Of ``paths``, the host directories the guest's init binds back over its tmpfs mounts,
    outermost only (a bind shows everything below it). A path missing on the host is left out:
    the job script's check then names it."""
    hidden = sorted({p if p.is_dir() else p.parent for p in paths
                     if p.exists() and any(_under(p, top) for top in GUEST_TMPFS)}, key=lambda p: len(p.parts))
    out: list[Path] = []
    for path in hidden:
        if not any(_under(path, kept) for kept in out):
            out.append(path)
    return out


def _seen_test(path: Path) -> str:
    """A shell test that ``path`` shows inside the guest what it holds on the host: a directory
    with entries must list some (an empty directory in its place is the guest's tmpfs)."""
    quoted = shlex.quote(str(path))
    with contextlib.suppress(OSError):
        if path.is_dir() and any(path.iterdir()):
            return f'[ -n "$(ls -A {quoted} 2>/dev/null)" ]'
    return f"[ -e {quoted} ]"


def _job_script(command: str, results: Path, export_mib: int, small_export_mib: int, cwd: Path,
                needed: list[Path]) -> str:
    """The shell script the guest runs in the host's root: every needed host path checked, the
    NFS server up, then ``command`` in ``cwd``."""
    cache = guest_dir()
    version = _kernel_version(cache)
    kernel = shlex.quote(str(cache / "kernel"))
    unseen = shlex.quote(str(results / UNSEEN_FILE))
    checks = "\n".join(f"{_seen_test(p)} || {{ echo {shlex.quote(str(p))} > {unseen}; exit 125; }}" for p in needed)
    return f"""#!/bin/sh
# written by tierstore/testing/nfs_guest.py: the kernel NFS server, then the test's command
export PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/var/tmp TMPDIR=/var/tmp
# the guest-side helpers find the kernel's modules through it (HOME is the guest's own here)
export {GUEST_DIR_ENV}={shlex.quote(str(cache))}
# the host paths the job needs (guest_paths): a missing one is named to the host, not a 127 later
{checks}
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
cd {shlex.quote(str(cwd))}
{command}
rc=$?
step "job exited with $rc"
exit $rc
"""


def run_in_guest(command: str, results: Path, *, timeout_s: float = 420.0, memory_mib: int = 2048,
                 cpus: int = 2, export_mib: int = 512, small_export_mib: int = 24, cwd: Path | None = None,
                 visible: tuple[Path, ...] = (), boot_deadline_s: float = BOOT_DEADLINE_S) -> GuestRun:
    """Boot the guest, start the NFS server, run ``command`` (shell) and wait for power-off.

    ``results`` (a host directory, created if needed) is writable inside the guest at the same
    path; the job script, ``guest.log`` (the job's output) and ``console.log`` live there. The
    working directory inside is ``cwd`` (default: the caller's); it, the interpreter and
    ``visible`` are shown at their host paths (``guest_paths``). A boot that has not started the
    job within ``boot_deadline_s`` is killed and started again, ``BOOT_ATTEMPTS`` boots at most;
    ``timeout_s`` bounds them all together. Raises ``GuestError`` when the guest is not there
    (``guest_available()``), fails to boot, cannot show a needed host path (the message names
    it), or runs past ``timeout_s`` (QEMU is killed).
    """
    reason = guest_available()
    if reason:
        raise GuestError(reason)
    results = Path(results).resolve()
    results.mkdir(parents=True, exist_ok=True)
    cwd = Path(cwd or os.getcwd()).resolve()
    needed = guest_paths(cwd, tuple(visible))
    binds = guest_binds(needed)
    for path in (results, *binds):
        if "\n" in str(path):
            raise GuestError(f"the host path {path!r} has a line break: the guest's init reads paths a line each")
    job = _job_script(command, results, export_mib, small_export_mib, cwd, needed)
    argv = _qemu_argv(results, memory_mib, cpus)
    deadline = time.monotonic() + timeout_s
    for attempt in range(1, BOOT_ATTEMPTS + 1):
        _clear_results(results, binds, job)
        started = time.monotonic()
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        try:
            qemu_out = _wait_for_power_off(proc, results, deadline, boot_deadline_s)
        except _BootHung:
            if attempt < BOOT_ATTEMPTS and time.monotonic() < deadline:
                continue
            raise GuestError(f"the guest did not start the job within {boot_deadline_s:g} s of a boot, in any of "
                             f"{attempt} boots (a starved host, or a broken guest: run tools/nfs-guest.sh); "
                             f"console tail:\n{_tail(results / 'console.log')}") from None
        except subprocess.TimeoutExpired:
            raise GuestError(f"the guest ran past {timeout_s:.0f} s; job log tail:\n"
                             f"{_tail(results / 'guest.log')}\nconsole tail:\n"
                             f"{_tail(results / 'console.log')}") from None
        return _finished_run(proc, qemu_out, results, time.monotonic() - started, attempt)
    raise AssertionError("unreachable: the last attempt returns or raises")


class _BootHung(Exception):
    """The guest did not start its job within the boot deadline (its QEMU was killed)."""


def _qemu_argv(results: Path, memory_mib: int, cpus: int) -> list[str]:
    cache = guest_dir()
    version = _kernel_version(cache)
    return [
        _qemu() or "qemu-system-x86_64",
        # KVM hangs nested guests on the machines this was built on: TCG unless asked
        "-accel", os.environ.get("TIERSTORE_NFS_GUEST_ACCEL", "tcg"),
        "-cpu", "max", "-m", str(memory_mib), "-smp", str(cpus),
        "-nic", "none", "-display", "none", "-monitor", "none", "-no-reboot",
        "-serial", f"file:{results / 'console.log'}",
        "-kernel", str(cache / "kernel" / "boot" / f"vmlinuz-{version}"),
        "-initrd", str(cache / "initramfs.cpio.gz"),
        "-append", "console=ttyS0 quiet loglevel=4 panic=-1 tierstore.job=job.sh",
        "-virtfs", "local,path=/,mount_tag=hostroot,security_model=passthrough,readonly=on,multidevs=remap",
        "-virtfs", f"local,path={_qemu_option(str(results))},mount_tag=results,security_model=passthrough,"
                   "multidevs=remap",
    ]


def _clear_results(results: Path, binds: list[Path], job: str) -> None:
    """The results directory as a boot expects it: no files of an earlier boot, the paths for
    the init to bind and the job script."""
    for stale in ("rc", "guest.log", "booted_s", "server_up", "console.log", UNSEEN_FILE):
        with contextlib.suppress(FileNotFoundError):
            (results / stale).unlink()
    (results / "guest.paths").write_text("".join(f"{p}\n" for p in (results, *binds)))
    (results / "job.sh").write_text(job)


def _wait_for_power_off(proc: subprocess.Popen[str], results: Path, deadline: float, boot_deadline_s: float) -> str:
    """QEMU's output once it exits. Kills it and raises ``_BootHung`` when the init has not
    written ``booted_s`` within ``boot_deadline_s``, ``subprocess.TimeoutExpired`` at ``deadline``."""
    boot_by = time.monotonic() + boot_deadline_s
    booted = False
    while True:
        booted = booted or (results / "booted_s").exists()
        now = time.monotonic()
        if now >= deadline or (not booted and now >= boot_by):
            proc.kill()  # the QEMU this call started
            proc.communicate()
            if now >= deadline:
                raise subprocess.TimeoutExpired(proc.args, deadline - now)
            raise _BootHung()
        with contextlib.suppress(subprocess.TimeoutExpired):
            # communicate may be called again after a timeout without losing output
            out, _ = proc.communicate(timeout=min(0.25 if not booted else 1.0, deadline - now))
            return out


def _finished_run(proc: subprocess.Popen[str], qemu_out: str, results: Path, wall: float, attempts: int) -> GuestRun:
    """The ``GuestRun`` of a guest that powered off, or ``GuestError`` when its job did not run."""
    console = results / "console.log"
    rc_text = _read(results / "rc").strip()
    unseen = _read(results / UNSEEN_FILE).strip()
    if unseen:
        raise GuestError(f"the host path {unseen} is not visible inside the kernel-NFS guest, so the job cannot "
                         f"run; the guest shows host paths under {', '.join(GUEST_TMPFS)} only when "
                         "tools/nfs-guest.sh built its current recipe: run tools/nfs-guest.sh again, or pass the "
                         f"path in run_in_guest(visible=...); job log tail:\n{_tail(results / 'guest.log')}")
    if not rc_text:
        raise GuestError(f"the guest powered off without running the job (qemu exit {proc.returncode}): "
                         f"{qemu_out[-2000:]}\nconsole tail:\n{_tail(console)}\njob log tail:\n"
                         f"{_tail(results / 'guest.log')}")
    booted = _read(results / "booted_s").strip()
    return GuestRun(rc=int(rc_text), log=_read(results / "guest.log"), console=_read(console),
                    boot_s=float(booted) if booted else float("nan"), wall_s=wall, boot_attempts=attempts)


def _qemu_option(value: str) -> str:
    """``value`` inside a QEMU ``-virtfs`` option list, where a comma is written twice."""
    return value.replace(",", ",,")


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
    file times from the server untouched); needs the Debian package faketime. ``FAKE_UTIME=1``
    passes ``utime(path, None)`` through as it is (libfaketime 0.9.10 otherwise rewrites it into
    an explicit faked "now", where a real client with a wrong clock asks the NFS server for its
    own time). Python's ``time.sleep`` fails EINVAL under libfaketime 0.9.10 (its absolute
    monotonic ``clock_nanosleep``): a Python program run this way sleeps another way."""
    env = ["env", "FAKETIME_DONT_FAKE_MONOTONIC=1", "FAKE_UTIME=1"]
    return [*env, "faketime", "-f", f"{offset_s:+.0f}s", *argv]


def load_modules(*modules: str) -> None:
    """Load the guest kernel's ``modules`` (and their dependencies) from the guest cache: the
    host's ``modprobe`` would look in the host kernel's directory, which has none of them."""
    cache = guest_dir()
    version = _kernel_version(cache)
    if version is None:
        raise FileNotFoundError(f"no guest kernel in {cache} ({GUEST_DIR_ENV})")
    _run(["modprobe", "-d", str(cache / "kernel"), "-S", version, "-a", *modules])


def nfsd_counters() -> dict[str, list[int]]:
    """The kernel NFS server's per-operation counters (``/proc/net/rpc/nfsd``): each line's
    name (``proc3``, ``proc4ops``, ...) and its numbers, the count of fields first as the
    kernel writes it (``proc3``: NULL, GETATTR, SETATTR, LOOKUP, ACCESS, ... in RFC 1813 order;
    ``proc4ops``: by NFSv4 operation number)."""
    out: dict[str, list[int]] = {}
    for line in Path("/proc/net/rpc/nfsd").read_text().splitlines():
        name, *numbers = line.split()
        with contextlib.suppress(ValueError):
            out[name] = [int(float(n)) for n in numbers]
    return out


# NFSv3 procedures in /proc/net/rpc/nfsd's ``proc3`` order (RFC 1813 numbering)
PROC3 = ("null", "getattr", "setattr", "lookup", "access", "readlink", "read", "write", "create", "mkdir",
         "symlink", "mknod", "remove", "rmdir", "rename", "link", "readdir", "readdirplus", "fsstat", "fsinfo",
         "pathconf", "commit")
# NFSv4 operation numbers (RFC 8881 / 7862) of ``proc4ops`` that a directory listing and a stat use
PROC4OPS = {3: "access", 9: "getattr", 10: "getfh", 15: "lookup", 22: "putfh", 24: "putrootfh", 26: "readdir",
            53: "sequence"}

QUOTA_EXPORT = "/mnt/quota"  # an ext4 file system with user quotas (``quota_export``)
QUOTA_UID = 1000  # every request to QUOTA_EXPORT is squashed to this user: root would ignore the limit


def quota_export(size_mib: int = 64, fsid: int = 3) -> str:
    """Export ``QUOTA_EXPORT``: an ext4 file system on a loop device (an image on the guest's
    tmpfs) with quota accounting and enforcement for users (``mkfs.ext4 -O quota``, mounted
    ``usrquota``), every request squashed to ``QUOTA_UID`` (the server's root would be exempt
    from the limit: CAP_SYS_RESOURCE). Returns the loop device (``set_user_quota``'s ``device``).
    The guest kernel's tmpfs has no quota (``usrquota`` needs Linux 6.6); e2fsprogs and
    util-linux (tools/nfs-guest.sh installs them) are all this needs, no quota tools: the
    limit is set with the ``quotactl`` system call."""
    load_modules("loop", "ext4", "quota_v2")
    image = Path("/var/tmp/quota-export.img")
    with open(image, "wb") as f:
        f.truncate(size_mib << 20)
    _run(["mkfs.ext4", "-q", "-F", "-O", "quota", "-E", "quotatype=usrquota", str(image)])
    device = subprocess.run(["losetup", "-f", "--show", str(image)], check=True, capture_output=True,
                            text=True, timeout=60).stdout.strip()
    Path(QUOTA_EXPORT).mkdir(parents=True, exist_ok=True)
    _run(["mount", "-t", "ext4", "-o", "usrquota", device, QUOTA_EXPORT])
    os.chown(QUOTA_EXPORT, QUOTA_UID, QUOTA_UID)
    os.chmod(QUOTA_EXPORT, 0o755)
    _run(["exportfs", "-o", f"{EXPORT_OPTIONS},all_squash,anonuid={QUOTA_UID},anongid={QUOTA_UID},fsid={fsid}",
          f"127.0.0.1:{QUOTA_EXPORT}"])
    return device


class _DiskQuota(ctypes.Structure):
    """``struct if_dqblk`` of <linux/quota.h>: block limits in 1 KiB units, space in bytes."""

    _fields_ = [("bhardlimit", ctypes.c_uint64), ("bsoftlimit", ctypes.c_uint64), ("curspace", ctypes.c_uint64),
                ("ihardlimit", ctypes.c_uint64), ("isoftlimit", ctypes.c_uint64), ("curinodes", ctypes.c_uint64),
                ("btime", ctypes.c_uint64), ("itime", ctypes.c_uint64), ("valid", ctypes.c_uint32)]


_Q_GETQUOTA, _Q_SETQUOTA, _USRQUOTA, _QIF_BLIMITS = 0x800007, 0x800008, 0, 1


def _quotactl(command: int, device: str, uid: int, block: _DiskQuota) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    cmd = ctypes.c_int(((command << 8) | _USRQUOTA) - (1 << 32))  # QCMD(): an int with the top bit set
    if libc.quotactl(cmd, device.encode(), ctypes.c_int(uid), ctypes.byref(block)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"quotactl({command:#x}, {device}, uid {uid}): {os.strerror(err)}")


def user_quota_used(device: str, uid: int = QUOTA_UID) -> int:
    """Bytes charged to ``uid`` on ``device`` (``quotactl(Q_GETQUOTA)``)."""
    block = _DiskQuota()
    _quotactl(_Q_GETQUOTA, device, uid, block)
    return int(block.curspace)


def set_user_quota(device: str, limit_bytes: int, uid: int = QUOTA_UID) -> None:
    """Set ``uid``'s hard (and soft) block limit on ``device`` to ``limit_bytes`` (rounded up
    to 1 KiB): a write past it fails with EDQUOT."""
    kib = -(-limit_bytes // 1024)
    _quotactl(_Q_SETQUOTA, device, uid, _DiskQuota(bhardlimit=kib, bsoftlimit=kib, valid=_QIF_BLIMITS))
