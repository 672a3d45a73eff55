"""A single-node Ceph cluster for tests: an S3 endpoint (the RADOS Gateway) and, optionally, CephFS.

Host side (everything runs on this host and listens on 127.0.0.1 only):
- ``ceph_available(cephfs=False)``: None, or why the lab cannot run here (for ``pytest.skip``).
- ``CephLab.start(data_dir, cephfs=False, timeout=120)``: a started cluster, also a context
  manager. One monitor, one manager, one OSD (BlueStore on an 8 GiB sparse file; pools of size
  1, 8 PGs) and ``radosgw`` serving S3 at ``lab.endpoint`` to ``lab.access_key``/``secret_key``
  (``lab.env()``: the ``AWS_*`` variables obstore and boto3 read; ``lab.make_bucket(name)``,
  ``lab.s3_client()``: boto3). ``cephfs=True`` adds a file system (``FS_NAME``) and an MDS:
  ``lab.mount_cephfs(mountpoint, client_name)`` mounts it with ``ceph-fuse``, each mount under
  its own client name (the MDS refuses a second mount of one), ``lab.unmount_cephfs(mountpoint)``.
- Faults, by pid (``lab.pids``): ``kill_rgw()`` (SIGKILL), ``restart_rgw()`` (same port; returns
  once it answers); ``stop_osd()``/``cont_osd()`` (SIGSTOP/SIGCONT: requests that reach the OSD,
  RGW's too, wait; nothing marks a lone OSD down); ``restart_osd()`` (SIGKILL, start; returns
  once a write succeeded and every PG is active+clean).
- ``lab.stop()`` (idempotent): unmounts, ends every process it started (SIGTERM, SIGKILL after
  ``STOP_GRACE_S``; the MDS at once; waited for) and removes ``data_dir``.
- ``tools/ceph-lab.sh start DIR [--cephfs]`` (``ceph_lab_cli``): a lab for a shell (one JSON line).

Everything lives under ``data_dir`` (``start`` creates it; it must not exist or be empty): the
configuration, the stores, logs (``log/``: Ceph's ``<name>.log``, each process's output in
``<proc>.out``), admin sockets and pid files; every command gets ``-c`` the lab's configuration,
nothing touches /etc/ceph or /var/lib/ceph. Authentication is off (``auth_*_required = none``
and the messenger's ``crc`` mode, without which radosgw fails with ``get_initial_auth_request
returned -13``): no keyrings. The monitor's and radosgw's ports are free ones picked at start,
below the ephemeral range; the others bind in Ceph's 6800-7300, skipping used ports: labs in
concurrent processes (pytest-xdist workers) stay apart. ``data_dir`` must support O_DIRECT (BlueStore):
not tmpfs before Linux 6.6. On the 2-core dev machine: start 25-30 s, 0.5 GiB RSS in all.

Failure policy: ``start`` raises ``CephLabError`` naming the phase that failed (a command's exit
status, a daemon that exited, the deadline passed) with that daemon's log tail, after stopping
what it started; fault helpers and mounts likewise. ``stop`` leaves no process running; it
raises ``CephLabError`` only when ``data_dir`` cannot be removed.

Threading: not thread-safe. Its processes die with the thread that started them (PDEATHSIG: a
killed test leaves no daemons): start and restart them from one that outlives the lab.
"""

from __future__ import annotations

import contextlib
import ctypes
import http.client
import json
import os
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

SETUP_HINT = "run tools/ceph-lab.sh (installs Debian's Ceph packages)"
PROGRAMS = ("monmaptool", "ceph-mon", "ceph-mgr", "ceph-osd", "radosgw", "radosgw-admin", "ceph", "rados")
CEPHFS_PROGRAMS = ("ceph-mds", "ceph-fuse", "umount")  # as root: no fusermount (fuse3, only recommended)
ACCESS_KEY = "TIERSTORELABACCESS01"
SECRET_KEY = "tierstore-lab-secret-key-000000000000000"
REGION = "us-east-1"  # RGW checks the signature, not the region in it
FS_NAME = "labfs"
PROBE_POOL = "lab"  # restart_osd and start write a probe object here: the cluster serves I/O
PG_NUM = 8
RGW_CONTROL_POOL = "default.rgw.control"  # radosgw watches notify.0-7 there
STOP_GRACE_S = 5.0  # SIGTERM, then SIGKILL: the daemons take < 1 s (stopped in order; the MDS, 7-8 s, is killed)
_POLL_S = 0.25
_TAIL_CHARS = 3000
_PR_SET_PDEATHSIG = 1
# the daemons by name: their program and Ceph name (log file: log/<Ceph name>.log)
_DAEMONS = {"mon": ("ceph-mon", "mon.a"), "mgr": ("ceph-mgr", "mgr.x"), "osd": ("ceph-osd", "osd.0"),
            "rgw": ("radosgw", "client.rgw.lab"), "mds": ("ceph-mds", "mds.a")}


class CephLabError(RuntimeError):
    """A lab phase failed; ``phase`` names it and the message ends with the daemon's log tail."""

    def __init__(self, phase: str, message: str, log_tail: str = "") -> None:
        self.phase = phase
        super().__init__(f"ceph lab, {phase}: {message}" + (f"\n--- log tail ---\n{log_tail}" if log_tail else ""))


def _which(program: str) -> str | None:
    return shutil.which(program) or shutil.which(program, path="/usr/sbin:/sbin")


def ceph_available(cephfs: bool = False) -> str | None:
    """None, or why a lab (with ``cephfs``: and its CephFS) cannot run here."""
    if not sys.platform.startswith("linux"):
        return "the Ceph lab needs Linux"
    if os.geteuid() != 0:
        return "the Ceph lab runs its daemons (and ceph-fuse) as root: not root here"
    missing = [p for p in PROGRAMS + (CEPHFS_PROGRAMS if cephfs else ()) if _which(p) is None]
    if missing:
        return f"Ceph programs missing: {' '.join(missing)} ({SETUP_HINT})"
    if cephfs and not os.path.exists("/dev/fuse"):
        return "ceph-fuse needs /dev/fuse, which is missing"
    return None


def _free_ports(count: int) -> list[int]:
    """Distinct TCP ports free on 127.0.0.1, below the ephemeral range where it can: a daemon
    binds its port seconds later, and a client's connection can take an ephemeral one meanwhile."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    found: list[int] = []
    with contextlib.ExitStack() as stack:  # all stay bound until the last is found: distinct
        # SystemRandom: a library seeding ``random`` alike in every pytest-xdist worker made two
        # labs draw the same ports, and one lab's monitor answered at the other's radosgw port.
        below = range(10000, max(10000, low))
        for port in [*random.SystemRandom().sample(below, min(100, len(below))), *[0] * count]:
            sock = stack.enter_context(socket.socket())
            with contextlib.suppress(OSError):  # in use; port 0 (the kernel picks): a fallback
                sock.bind(("127.0.0.1", port))
                found.append(sock.getsockname()[1])
            if len(found) == count:
                return found
    raise CephLabError("config", "no free TCP ports on 127.0.0.1")


def _tail(path: Path, chars: int) -> str:
    with contextlib.suppress(OSError), open(path, "rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - chars))
        return f.read().decode(errors="replace")
    return ""


def _config(top: Path, fsid: str, mon_port: int, rgw_port: int) -> str:
    """The lab's ceph.conf: every path under ``top``, one replica, no authentication."""
    return f"""[global]
fsid = {fsid}
mon host = v2:127.0.0.1:{mon_port}
public addr = 127.0.0.1
ms bind msgr1 = false
auth cluster required = none
auth service required = none
auth client required = none
ms mon client mode = crc
ms client mode = crc
keyring = {top}/keyring
run dir = {top}/run
pid file = {top}/run/$name.pid
admin socket = {top}/run/$name.asok
log file = {top}/log/$name.log
mon data = {top}/mon/$id
mgr data = {top}/mgr/$id
osd data = {top}/osd/$id
mds data = {top}/mds/$id
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = {PG_NUM}
osd pool default pgp num = {PG_NUM}
osd pool default pg autoscale mode = off
mon allow pool size one = true
mon warn on pool no redundancy = false
mon warn on insecure global id reclaim allowed = false
mon data avail warn = 1
mon data avail crit = 1
mgr initial modules =
osd crush chooseleaf type = 0
osd memory target = 939524096
bluestore block create = true
bluestore block size = {8 << 30}
bluestore fsck on mkfs = false

[client]
admin socket = {top}/run/$name.$pid.asok

[client.rgw.lab]
admin socket = {top}/run/$name.asok
# tcp_nodelay: else a response with a body waits 40 ms (Nagle against the client's delayed ACK)
rgw frontends = beast endpoint=127.0.0.1:{rgw_port} tcp_nodelay=1
rgw data = {top}/rgw
rgw gc obj min wait = 30  # deleted data freed in a minute, not 2 h (benches fill the OSD)
rgw gc processor period = 30
"""


def _pdeathsig(parent: int) -> Callable[[], None]:
    """A ``preexec_fn``: the child gets SIGKILL when the thread that started it exits."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def child() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl
            os._exit(1)

    return child


class _Procs:
    """The processes a lab started, by name; each one's output goes to ``log/<name>.out``."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.live: dict[str, subprocess.Popen[bytes]] = {}
        self.started: list[int] = []  # every pid ever started, restarted ones too
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("CEPH_")}

    def spawn(self, name: str, argv: list[str]) -> None:
        assert name not in self.live, name
        with open(self.log_dir / f"{name}.out", "ab") as out:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    cwd=self.log_dir.parent, env=self.env, start_new_session=True,
                                    preexec_fn=_pdeathsig(os.getpid()))
        self.live[name] = proc
        self.started.append(proc.pid)

    def kill(self, name: str) -> None:
        proc = self.live.pop(name)
        proc.kill()
        proc.wait()

    def end(self, names: list[str] | None = None, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM (and SIGCONT, for a stopped one) each, SIGKILL what is left after ``grace_s``;
        returns once every one has exited."""
        procs = [self.live.pop(n) for n in (list(self.live) if names is None else names) if n in self.live]
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
                proc.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + grace_s
        for proc in procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def exited(self) -> tuple[str, int] | None:
        """A process that exited on its own (its name and status), or None."""
        return next(((n, p.returncode) for n, p in self.live.items() if p.poll() is not None), None)

    def tail(self, name: str) -> str:
        """The end of the process's Ceph log and of its output."""
        ceph_name = _DAEMONS[name][1] if name in _DAEMONS else name.replace("fuse.", "client.", 1)
        parts = [(f"{ceph_name}.log", _tail(self.log_dir / f"{ceph_name}.log", _TAIL_CHARS)),
                 (f"{name}.out", _tail(self.log_dir / f"{name}.out", _TAIL_CHARS // 2))]
        return "\n".join(f"[{label}]\n{text}" for label, text in parts if text.strip())


class _Cli:
    """The lab's client commands, each with ``-c`` the lab's configuration; the queries answer
    None or False while the cluster does not."""

    def __init__(self, conf: Path, procs: _Procs) -> None:
        self.conf, self.procs = conf, procs

    def argv(self, program: str, *args: str) -> list[str]:
        timeout = ("--connect-timeout", "10") if program == "ceph" else ()
        return [_which(program) or program, "-c", str(self.conf), *timeout, *args]

    def run(self, phase: str, program: str, *args: str, log: str | None = None) -> str:
        """Run a command to its end: its stdout, or ``CephLabError`` with its stderr and the
        tail of ``log``'s (a process name's) logs."""
        argv = self.argv(program, *args)
        try:
            res = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                 cwd=self.conf.parent, env=self.procs.env, timeout=60)
        except subprocess.TimeoutExpired:
            raise CephLabError(phase, f"`{shlex.join(argv)}` ran over 60 s",
                               self.procs.tail(log) if log else "") from None
        if res.returncode != 0:
            tail = res.stderr.strip()[-_TAIL_CHARS:] + ("\n" + self.procs.tail(log) if log else "")
            raise CephLabError(phase, f"`{shlex.join(argv)}` exited with status {res.returncode}", tail)
        return res.stdout

    def succeeds(self, program: str, *args: str) -> str | None:
        """The command's stdout, or None when it fails or runs over 20 s."""
        try:
            res = subprocess.run(self.argv(program, *args), stdin=subprocess.DEVNULL,
                                 capture_output=True, text=True, env=self.procs.env, timeout=20)
        except subprocess.TimeoutExpired:
            return None
        return res.stdout if res.returncode == 0 else None

    def json(self, *args: str) -> Any:
        """``ceph ARGS --format json``, parsed; None when the monitor does not answer."""
        out = self.succeeds("ceph", *args, "--format", "json")
        with contextlib.suppress(ValueError):
            return json.loads(out) if out is not None else None
        return None

    def status(self, *keys: str) -> Any:
        value = self.json("-s")  # ``ceph -s`` (its item ``keys``) or None
        for key in keys:
            value = value.get(key) if isinstance(value, dict) else None
        return value

    def osd_up_in(self) -> bool:
        osdmap = self.status("osdmap") or {}
        return osdmap.get("num_up_osds") == 1 and osdmap.get("num_in_osds") == 1

    def osd_up_from(self) -> int:
        """The osdmap epoch since which the OSD is up, or 0 when it is down or unknown."""
        osds = (self.json("osd", "dump") or {}).get("osds", [])
        return next((o["up_from"] for o in osds if o.get("osd") == 0 and o.get("up") == 1), 0)

    def pgs_clean(self) -> bool:
        pgmap = self.status("pgmap") or {}
        clean = sum(s["count"] for s in pgmap.get("pgs_by_state", []) if s["state_name"] == "active+clean")
        return pgmap.get("num_pgs", 0) > 0 and clean == pgmap["num_pgs"]

    def mds_active(self) -> bool:
        return any(rank.get("status") == "up:active" for rank in self.status("fsmap", "by_rank") or [])

    def probe_io(self) -> bool:
        """A write of a small object to ``PROBE_POOL`` succeeds within 10 s."""
        return self.succeeds("rados", "--rados-osd-op-timeout", "10", "-p", PROBE_POOL, "put", "probe",
                             str(self.conf)) is not None


class CephLab:
    """A started single-node cluster (see the module docstring); make one with ``start``."""

    def __init__(self, data_dir: Path, *, cephfs: bool, timeout: float) -> None:
        self.data_dir = Path(data_dir).absolute()
        self.cephfs = cephfs
        self.timeout = timeout
        self.conf = self.data_dir / "ceph.conf"
        self.mon_port, self.rgw_port = _free_ports(2)
        self.endpoint = f"http://127.0.0.1:{self.rgw_port}"
        self.access_key, self.secret_key, self.region = ACCESS_KEY, SECRET_KEY, REGION
        self.fs_name = FS_NAME if cephfs else None
        self.phase_s: dict[str, float] = {}  # seconds each phase of start took
        self._procs = _Procs(self.data_dir / "log")
        self._cli = _Cli(self.conf, self._procs)
        self._mounts: dict[Path, str] = {}  # mount point -> its ceph-fuse process's name
        self._stopped = False
        self._http = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    @classmethod
    def start(cls, data_dir: str | os.PathLike[str], *, cephfs: bool = False,
              timeout: float = 120.0) -> CephLab:
        """Start a lab in ``data_dir`` (created; it must not exist or be empty) within
        ``timeout`` seconds; on failure whatever was started is stopped."""
        path = Path(data_dir)
        if path.exists() and any(path.iterdir()):
            raise ValueError(f"{path} is not empty: the lab removes its data directory when it stops")
        path.mkdir(parents=True, exist_ok=True)
        lab = cls(path, cephfs=cephfs, timeout=timeout)
        try:
            lab._bring_up(time.monotonic() + timeout)
        except BaseException as exc:
            try:
                lab.stop()
            except Exception as stop_exc:  # noqa: BLE001 - the start's error is the one to raise
                exc.add_note(f"and stopping the half-started lab failed: {stop_exc}")
            raise
        return lab

    def __enter__(self) -> CephLab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @contextlib.contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        began = time.monotonic()
        yield
        self.phase_s[name] = round(time.monotonic() - began, 2)

    def _bring_up(self, deadline: float) -> None:
        cli = self._cli
        with self._phase("config"):
            self._make_config()
        with self._phase("mon"):
            self._spawn("mon", "-i", "a")
            self._wait("mon", "mon", "a monitor quorum", lambda: cli.status("quorum_names"), deadline)
        with self._phase("mgr"):
            self._spawn("mgr", "-i", "x")
            self._wait("mgr", "mgr", "an active manager", lambda: cli.status("mgrmap", "available"), deadline)
        with self._phase("osd"):
            osd_uuid = str(uuid.uuid4())
            if (osd_id := cli.run("osd", "ceph", "osd", "new", osd_uuid).strip()) != "0":
                raise CephLabError("osd", f"`ceph osd new` gave OSD id {osd_id!r}, not 0")
            cli.run("osd", "ceph-osd", "-i", "0", "--mkfs", "--osd-uuid", osd_uuid, log="osd")
            self._spawn("osd", "-i", "0")
            self._wait("osd", "osd", "the OSD up and in", cli.osd_up_in, deadline)
        with self._phase("io"):
            cli.run("io", "ceph", "osd", "pool", "create", PROBE_POOL, str(PG_NUM))
            cli.run("io", "ceph", "osd", "pool", "application", "enable", PROBE_POOL, "rados")
            self._wait("io", "osd", "a write to the cluster", cli.probe_io, deadline)
        with self._phase("rgw"):
            self._spawn("rgw", "-n", "client.rgw.lab")
            self._wait("rgw", "rgw", f"an HTTP answer at {self.endpoint}", self._rgw_answers, deadline)
        with self._phase("user"):
            cli.run("user", "radosgw-admin", "user", "create", "--uid", "lab", "--display-name", "lab",
                    "--access-key", ACCESS_KEY, "--secret-key", SECRET_KEY, log="rgw")
        if self.cephfs:
            with self._phase("cephfs"):
                for pool in ("cephfs_data", "cephfs_meta"):
                    cli.run("cephfs", "ceph", "osd", "pool", "create", pool, str(PG_NUM))
                cli.run("cephfs", "ceph", "fs", "new", FS_NAME, "cephfs_meta", "cephfs_data")
                self._spawn("mds", "-i", "a")
                self._wait("cephfs", "mds", "an active MDS", cli.mds_active, deadline)
        with self._phase("clean"):
            self._wait("clean", "osd", "every PG active+clean", cli.pgs_clean, deadline)

    def _make_config(self) -> None:
        for sub in ("log", "run", "mon/a", "mgr/x", "osd/0", "rgw", "mds/a"):
            (self.data_dir / sub).mkdir(parents=True, exist_ok=True)
        try:  # BlueStore opens its block file with O_DIRECT
            os.close(os.open(self.data_dir / "osd" / "0" / "block", os.O_CREAT | os.O_WRONLY | os.O_DIRECT))
        except OSError as exc:
            raise CephLabError("config", f"{self.data_dir} has no O_DIRECT (tmpfs before Linux 6.6?): {exc}") from None
        fsid = str(uuid.uuid4())
        self.conf.write_text(_config(self.data_dir, fsid, self.mon_port, self.rgw_port))
        monmap = str(self.data_dir / "monmap")
        self._cli.run("config", "monmaptool", "--create", "--fsid", fsid, "--addv", "a",
                      f"[v2:127.0.0.1:{self.mon_port}]", monmap)
        self._cli.run("config", "ceph-mon", "-i", "a", "--mkfs", "--monmap", monmap, log="mon")

    def _spawn(self, name: str, *args: str) -> None:
        """Start a daemon in the foreground (``-f``: its pid is the daemon's)."""
        program = _DAEMONS[name][0] if name in _DAEMONS else "ceph-fuse"
        self._procs.spawn(name, self._cli.argv(program, "-f", *args))

    def _wait(self, phase: str, daemon: str, what: str, check: Callable[[], Any], deadline: float) -> None:
        """Poll ``check`` until it is true; ``CephLabError`` if a process exits or at ``deadline``."""
        while True:
            if (gone := self._procs.exited()) is not None:
                name, status = gone
                raise CephLabError(phase, f"{name} exited with status {status} while waiting for "
                                   f"{what}", self._procs.tail(name))
            if check():
                return
            if time.monotonic() > deadline:
                raise CephLabError(phase, f"no {what} within {self.timeout:.0f} s",
                                   self._procs.tail(daemon))
            time.sleep(_POLL_S)

    def _rgw_answers(self) -> bool:
        try:
            with self._http.open(self.endpoint + "/", timeout=2) as resp:
                return resp.status < 500
        except urllib.error.HTTPError as exc:
            return exc.code < 500
        except http.client.HTTPException as exc:  # a program that is not radosgw holds the port
            raise CephLabError("rgw", f"port {self.rgw_port} answers, but not in HTTP ({exc!r}): another "
                               "program took it; start the lab again (it picks new ports)") from None
        except OSError:
            return False

    # --- S3 ------------------------------------------------------------------------------------
    def env(self) -> dict[str, str]:
        """The environment obstore (and boto3) read for this lab's S3 endpoint."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": self.access_key,
                "AWS_SECRET_ACCESS_KEY": self.secret_key, "AWS_REGION": self.region,
                "AWS_DEFAULT_REGION": self.region, "AWS_ALLOW_HTTP": "true"}

    def s3_client(self) -> Any:
        """A boto3 S3 client of the lab's user (path-style addressing; needs boto3)."""
        import boto3
        from botocore.config import Config

        config = Config(s3={"addressing_style": "path"}, connect_timeout=2, read_timeout=20,
                        retries={"max_attempts": 2, "mode": "standard"})
        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=self.access_key,
                            aws_secret_access_key=self.secret_key, region_name=self.region,
                            config=config)

    def make_bucket(self, name: str) -> str:
        """Create the bucket ``name`` (3-63 lowercase letters, digits, '-' or '.'); returns it."""
        self.s3_client().create_bucket(Bucket=name)
        return name

    # --- processes and faults ------------------------------------------------------------------
    @property
    def pids(self) -> dict[str, int]:
        """The running daemons' pids by name: mon, mgr, osd, rgw and (CephFS) mds."""
        return {n: p.pid for n, p in self._procs.live.items() if not n.startswith("fuse.")}

    @property
    def started_pids(self) -> tuple[int, ...]:
        """Every process the lab started (restarted daemons and ceph-fuse too)."""
        return tuple(self._procs.started)

    def kill_rgw(self) -> None:
        """SIGKILL radosgw (and reap it): its port refuses connections. Its watches on RGW's
        control objects go at once (the dead client is blocklisted): every notify, so every
        metadata change (a new bucket, a new user), would otherwise wait them out (30 s)."""
        self._procs.kill("rgw")
        watchers = self._cli.run("kill_rgw", "rados", "--rados-osd-op-timeout", "10", "-p",
                                 RGW_CONTROL_POOL, "listwatchers", "notify.0")
        for addr in sorted(set(re.findall(r"watcher=(\S+)", watchers))):
            self._cli.run("kill_rgw", "ceph", "osd", "blocklist", "add", addr)

    def restart_rgw(self) -> None:
        """Start radosgw again on its port (killing a running one first); returns once it answers."""
        if "rgw" in self._procs.live:
            self.kill_rgw()
        self._spawn("rgw", "-n", "client.rgw.lab")
        self._wait("restart_rgw", "rgw", f"an HTTP answer at {self.endpoint}", self._rgw_answers,
                   time.monotonic() + self.timeout)

    def stop_osd(self) -> None:
        """SIGSTOP the OSD: I/O blocks until ``cont_osd``."""
        self._procs.live["osd"].send_signal(signal.SIGSTOP)

    def cont_osd(self) -> None:
        """SIGCONT the OSD."""
        self._procs.live["osd"].send_signal(signal.SIGCONT)

    def restart_osd(self) -> None:
        """SIGKILL the OSD and start it again; returns once it is up in a new epoch, a write
        succeeded and every PG is active+clean."""
        before, cli = self._cli.osd_up_from(), self._cli
        self._procs.kill("osd")
        self._spawn("osd", "-i", "0")
        deadline = time.monotonic() + self.timeout
        self._wait("restart_osd", "osd", "the OSD up again", lambda: cli.osd_up_from() > before, deadline)
        self._wait("restart_osd", "osd", "a write to the cluster", cli.probe_io, deadline)
        self._wait("restart_osd", "osd", "every PG active+clean", cli.pgs_clean, deadline)

    # --- CephFS --------------------------------------------------------------------------------
    def mount_cephfs(self, mountpoint: str | os.PathLike[str], client_name: str) -> Path:
        """Mount the lab's CephFS at ``mountpoint`` (created) with ``ceph-fuse`` as
        ``client.<client_name>``, a name no other mount of this lab uses; returns the mount point."""
        if not self.cephfs:
            raise ValueError("this lab has no CephFS: start it with cephfs=True")
        mp, name = Path(mountpoint).absolute(), f"fuse.{client_name}"
        if name in self._procs.live or mp in self._mounts:
            raise ValueError(f"client.{client_name} or {mp} is mounted already: one client name per mount")
        mp.mkdir(parents=True, exist_ok=True)
        self._mounts[mp] = name
        self._spawn(name, "-n", f"client.{client_name}", f"--client_fs={FS_NAME}", str(mp))
        self._wait("mount_cephfs", name, f"a CephFS mount at {mp}", lambda: os.path.ismount(mp),
                   time.monotonic() + self.timeout)
        return mp

    def unmount_cephfs(self, mountpoint: str | os.PathLike[str], *, lazy: bool = False) -> None:
        """Unmount a mount of ``mount_cephfs`` (``lazy``: even while busy) and end its ceph-fuse."""
        mp = Path(mountpoint).absolute()
        name = self._mounts[mp]
        argv = [_which("umount") or "umount", *(["-l"] if lazy else []), str(mp)]
        res = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True)
        with open("/proc/self/mounts") as mounts:  # a dead ceph-fuse's mount is no ismount()
            mounted = any(line.split()[1].replace("\\040", " ") == str(mp) for line in mounts)
        if res.returncode != 0 and mounted:
            raise CephLabError("unmount_cephfs", f"`{shlex.join(argv)}` failed: {res.stderr.strip()}")
        del self._mounts[mp]
        self._procs.end([name])

    def stop(self) -> None:
        """Unmount, end every process the lab started and remove ``data_dir`` (idempotent)."""
        if self._stopped:
            return
        for mp in list(self._mounts):
            with contextlib.suppress(CephLabError, OSError):
                self.unmount_cephfs(mp, lazy=True)
        for tier in (["rgw"], ["mds"], ["osd"], None):  # None: the rest (mgr, mon, ceph-fuse)
            # a daemon stops at once while those it reports to still run; the MDS only after 7-8 s,
            # so it is killed at once: its data directory is removed next
            self._procs.end(tier, grace_s=0.0 if tier == ["mds"] else STOP_GRACE_S)
        self._stopped = True
        shutil.rmtree(self.data_dir, ignore_errors=True)
        if self.data_dir.exists():
            raise CephLabError("stop", f"{self.data_dir} could not be removed (a mount left in it?)")

    def describe(self) -> dict[str, Any]:
        """What a client needs, as JSON-able values (``ceph_lab_cli`` prints it)."""
        return {"endpoint": self.endpoint, "access_key": self.access_key, "secret_key": self.secret_key,
                "region": self.region, "env": self.env(), "fs_name": self.fs_name, "conf": str(self.conf),
                "data_dir": str(self.data_dir), "pids": self.pids, "phase_s": self.phase_s}
