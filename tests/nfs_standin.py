"""Two-"node" shared-filesystem stand-in for NFS tests, built on sshfs (FUSE).

The recipe, its cache profiles and what they reproduce are in this docstring and in
``PROFILES`` below; what the tests measured on it is in docs/measurements/tiers-nfs.md.
``server_pids(mount)`` and ``hung(mount)`` SIGSTOP the mount's sftp-server so every
file operation on that mount blocks, like a hard NFS mount whose server went away, and
SIGCONT it afterwards (the mount comes back).

One export directory is mounted at two mount points by two independent
sshfs processes.  Each mount is its own FUSE connection, so each has its
own kernel dentry/attribute/negative-entry cache and its own page cache;
that is the property we want from "two NFS clients".

Two transports:
  * "direct" (default): sshfs runs /usr/lib/openssh/sftp-server itself via
    -o ssh_command=<wrapper>; no sshd, no TCP port, no keys.  ~10 ms/mount.
  * "sshd": a throwaway sshd on 127.0.0.1:<free port> with throwaway keys,
    sshfs goes through ssh.  Closer to a real remote mount (encryption,
    a network hop); ~1 s setup.

Needs: root (here /dev/fuse is 0600), /dev/fuse, fuse in /proc/filesystems,
Debian packages sshfs (+ fuse3), openssh-sftp-server; openssh-server and
openssh-client for the "sshd" transport.  Stdlib only.

    with TwoNodeMount(tmp_path) as fs:       # fs.export, fs.a, fs.b
        ...
"""
from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

SFTP_SERVER_CANDIDATES = ("/usr/lib/openssh/sftp-server", "/usr/lib/sftp-server")

# Mount option profiles.  Timeouts are seconds.
PROFILES = {
    # close-to-open like NFS: page cache dropped at every open (no
    # kernel_cache/auto_cache), attributes always fetched (attr_timeout=0:
    # with >0 an open() after a stat() can trust a stale size and return a
    # short read, which a real NFS client's open-time revalidation avoids),
    # names and negative lookups cached for 3 s.
    "nfs": "dir_cache=no,attr_timeout=0,entry_timeout=3,negative_timeout=3",
    # like NFS mounted with "nocto"/actimeo=3: stat() results AND the size
    # used by open()+read() may be 3 s stale (short reads after a replace).
    "nfs-nocto": "dir_cache=no,attr_timeout=3,entry_timeout=3,negative_timeout=3",
    # no client caching at all: every lookup goes to the "server".
    "strict": "dir_cache=no,attr_timeout=0,entry_timeout=0,negative_timeout=0",
    # deliberately worse than NFS: sshfs dir cache (20 s) + kernel_cache
    # (page cache kept across opens; 1 s mtime granularity in SFTP v3
    # means same-size replaces are not noticed -> stale and TORN reads).
    "stale": "dir_cache=yes,kernel_cache,attr_timeout=5,entry_timeout=5,negative_timeout=5",
}


def _sftp_server() -> str | None:
    for p in SFTP_SERVER_CANDIDATES:
        if os.access(p, os.X_OK):
            return p
    return None


def unavailable_reason(transport: str = "direct") -> str | None:
    """None if the stand-in can run here, else a human-readable reason."""
    if os.geteuid() != 0 and not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return "no access to /dev/fuse (not root)"
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse missing"
    try:
        if "fuse" not in Path("/proc/filesystems").read_text().split():
            return "kernel has no fuse filesystem"
    except OSError:
        return "/proc/filesystems unreadable"
    for tool in ("sshfs", "fusermount3"):
        if shutil.which(tool) is None:
            return f"{tool} not installed (apt-get install -y sshfs)"
    if _sftp_server() is None:
        return "sftp-server not installed (apt-get install -y openssh-sftp-server)"
    if transport == "sshd":
        for tool in ("/usr/sbin/sshd", "ssh-keygen", "ssh"):
            if shutil.which(tool) is None and not os.access(tool, os.X_OK):
                return f"{tool} not installed (apt-get install -y openssh-server)"
    return None


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc)."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        with contextlib.suppress(OSError):
            out += [int(x) for x in task.read_text().split()]
    return out


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(pred, timeout: float, what: str, proc: subprocess.Popen | None = None):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if pred():
            return
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what}: process exited rc={proc.returncode}")
        time.sleep(0.01)
    raise TimeoutError(what)


@dataclass
class TwoNodeMount:
    base: Path                       # scratch dir (e.g. pytest tmp_path)
    profile_a: str = "nfs"           # key of PROFILES or a raw -o string
    profile_b: str = "nfs"
    transport: str = "direct"        # "direct" | "sshd"
    extra_opts: str = ""             # appended to both, e.g. "hard_remove"
    export: Path = field(init=False)
    a: Path = field(init=False)
    b: Path = field(init=False)
    _procs: list = field(default_factory=list, init=False)
    _sshd: subprocess.Popen | None = field(default=None, init=False)
    _ssh_config: Path | None = field(default=None, init=False)
    _stopped: list = field(default_factory=list, init=False)

    def __post_init__(self):
        self.base = Path(self.base)
        self.export = self.base / "export"
        self.a = self.base / "node_a"
        self.b = self.base / "node_b"

    # -- setup -------------------------------------------------------------
    def __enter__(self) -> TwoNodeMount:
        reason = unavailable_reason(self.transport)
        if reason:
            raise RuntimeError(reason)
        for d in (self.export, self.a, self.b):
            d.mkdir(parents=True, exist_ok=True)
        try:
            if self.transport == "sshd":
                self._start_sshd()
            self._mount(self.a, self.profile_a)
            self._mount(self.b, self.profile_b)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _opts(self, profile: str) -> str:
        o = PROFILES.get(profile, profile)
        return ",".join(x for x in (o, self.extra_opts) if x)

    def _mount(self, mnt: Path, profile: str):
        cmd = ["sshfs", "-f"]
        if self.transport == "direct":
            # one wrapper per mount: it records the server's pid (exec keeps it) for hung()
            wrapper = self.base / f"sftp-direct-{mnt.name}.sh"
            wrapper.write_text(f"#!/bin/sh\necho $$ > {self._pidfile(mnt)}\nexec {_sftp_server()}\n")
            wrapper.chmod(0o755)
            cmd += [f"localnode:{self.export}", str(mnt),
                    "-o", f"ssh_command={wrapper}"]
        else:
            cmd += ["-F", str(self._ssh_config), f"tierstore-nfs:{self.export}", str(mnt)]
        cmd += ["-o", self._opts(profile)]
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self._procs.append((mnt, proc))
        _wait(lambda: os.path.ismount(mnt), 15, f"sshfs mount {mnt}", proc)

    def _start_sshd(self):
        d = self.base / "sshd"
        d.mkdir(exist_ok=True)
        d.chmod(0o700)
        for k in ("host_key", "client_key"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / k)],
                           check=True)
        shutil.copy(d / "client_key.pub", d / "authorized_keys")
        port = _free_port()
        (d / "sshd_config").write_text(
            f"ListenAddress 127.0.0.1:{port}\nHostKey {d}/host_key\n"
            f"PidFile {d}/sshd.pid\nAuthorizedKeysFile {d}/authorized_keys\n"
            "PermitRootLogin prohibit-password\nPasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
            "Subsystem sftp internal-sftp\nLogLevel ERROR\n")
        self._ssh_config = d / "ssh_config"
        self._ssh_config.write_text(
            f"Host tierstore-nfs\n  HostName 127.0.0.1\n  Port {port}\n  User {pwd.getpwuid(os.geteuid()).pw_name}\n"
            f"  IdentityFile {d}/client_key\n  IdentitiesOnly yes\n"
            "  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n"
            "  LogLevel ERROR\n  BatchMode yes\n")
        os.makedirs("/run/sshd", exist_ok=True)  # privilege-separation dir
        # -D: stay in the foreground so we own the PID; -e: log to stderr
        self._sshd = subprocess.Popen(
            ["/usr/sbin/sshd", "-D", "-e", "-f", str(d / "sshd_config")],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

        def listening():
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                return True
            except OSError:
                return False
        _wait(listening, 10, "sshd listening", self._sshd)

    # -- hung server -------------------------------------------------------
    def _pidfile(self, mnt: Path) -> Path:
        return self.base / f"sftp-server-{Path(mnt).name}.pid"

    def server_pids(self, mnt: Path) -> list[int]:
        """PIDs of the processes serving ``mnt`` (direct: its sftp-server; sshd: its ssh)."""
        if self.transport == "direct":
            try:
                return [int(self._pidfile(mnt).read_text().split()[0])]
            except (OSError, ValueError, IndexError):
                return []
        for m, proc in self._procs:
            if Path(m) == Path(mnt):
                return _children(proc.pid)
        raise KeyError(mnt)

    @contextlib.contextmanager
    def hung(self, mnt: Path):
        """Inside the block, the server of ``mnt`` is stopped: every operation there blocks."""
        pids = self.server_pids(mnt)
        if not pids:
            raise RuntimeError(f"no server process found for {mnt}")
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        self._stopped.extend(pids)
        try:
            yield pids
        finally:
            self._resume()

    def _resume(self):
        for pid in self._stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        self._stopped.clear()

    # -- teardown ----------------------------------------------------------
    def __exit__(self, *exc):
        self._resume()
        for mnt, proc in reversed(self._procs):
            self._unmount(mnt, proc)
        self._procs.clear()
        if self._sshd is not None:
            self._sshd.terminate()          # only the listener we started
            try:
                self._sshd.wait(5)
            except subprocess.TimeoutExpired:
                self._sshd.kill()
                self._sshd.wait(5)
            self._sshd = None
        return False

    @staticmethod
    def _unmount(mnt: Path, proc: subprocess.Popen):
        for _attempt in range(50):          # EBUSY while a test leaks an fd
            if not os.path.ismount(mnt):
                break
            if subprocess.run(["fusermount3", "-u", "-q", str(mnt)]).returncode == 0:
                break
            time.sleep(0.1)
        else:
            subprocess.run(["fusermount3", "-u", "-z", "-q", str(mnt)])  # lazy
        try:
            proc.wait(10)                    # sshfs exits after unmount
        except subprocess.TimeoutExpired:
            proc.kill()                      # only the sshfs we started
            proc.wait(5)
            subprocess.run(["fusermount3", "-u", "-z", "-q", str(mnt)])
