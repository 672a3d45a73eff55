"""A lease file with an expiry: "one evictor at a time" on a shared export, without locks.

Contract: ``ROOT/.tierstore-gc.lease`` holds JSON ``{"owner", "ttl", "expires", "host",
"pid", "writer"}`` (``writer``: ``mapper.host_tag``, the host name, boot and PID namespace). It is only ever replaced atomically (temp file + rename), so a reader sees a whole
lease or none. To take the lease a node reads it (open + read: NFS close-to-open gives the
server's current content), and if it is absent, unparsable, its own, or expired, publishes its
own, waits ``settle_s`` and reads it back: only a node that reads its own owner id holds the
lease.

Expiry is judged by the server's clock, never a client's: a lease lives until its file's mtime
(set by the file server when the holder published or renewed it) plus its ``ttl`` plus
``skew_s`` (mtime granularity, a slow rename), compared with the server's "now": the mtime of a
file this node has just written under the root (``server_now``: a probe file, created, written,
fstat'ed and removed; on a full or over-quota export, where no byte fits, a file's times set to
the server's own now, which needs no space). A node whose clock lags or runs ahead therefore
neither takes a live lease nor keeps a dead one. ``expires`` (the writer's clock) is still written for older
tierstore versions; a lease without ``ttl`` (written by one of them) is judged by it against
this node's clock, as they judge it.

This is advisory, not a lock: NFS gives no mutual exclusion that survives every race (two
nodes may both publish, a paused holder may outlive its expiry). Eviction is designed to be
safe with two evictors anyway (renames to trash are idempotent, readers verify), so the lease
only keeps the usual case to one evictor and prevents a thundering herd of scans. A holder
renews before ``ttl/3`` has passed and stops evicting as soon as a renewal fails.

Hostile content (the root is untrusted): the lease is read through a checked fd
(safefs: no symlink, no FIFO, at most ``MAX_LEASE_BYTES``); an expiry that is not a finite
number or lies beyond now + ttl + skew (year 3000, ``Infinity``), a ``ttl`` that is not a finite
number in (0, ``MAX_TTL_S``], and a file mtime beyond the server's now + ttl + skew are garbage;
a holder on this host whose pid is out of range or no longer alive is dead (on this host: its
``writer`` is ours, so its pid is one of our PID namespace's; a lease of an older version, with
no ``writer``, by its host name); all of these count as absent. A
directory (or anything that cannot be replaced by a file) at the lease path is reported in
``problem`` and the lease is not taken (``acquire`` returns False with ``problem`` set).

Threading: a ``Lease`` object belongs to one thread.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import socket
import stat
import time
import uuid
from pathlib import Path

from tierstore.fs import safefs
from tierstore.fs.mapper import host_tag
from tierstore.fs.stale_temps import pid_possible, process_alive

LEASE_NAME = ".tierstore-gc.lease"
MAX_LEASE_BYTES = 4096
MAX_TTL_S = 86400.0  # a lease claiming longer is garbage (a holder renews every ttl/3)
_CLOCK_PREFIX = f"{LEASE_NAME}.clock."  # the server-clock probe files (reserved names: walks skip them)
# a file kept under the root whose times are set to the server's now where no byte fits (server_now);
# a reserved name outside the probes' prefix, which gc sweeps once old
CLOCK_NAME = ".tierstore-gc.clock"
_NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})


def server_now(root_fd: int) -> float | None:
    """The file server's clock now: the mtime of a probe file just created and written under
    the root (the server sets it), which is then removed. Where the export is full or over a
    quota (ENOSPC, EDQUOT: gc needs the server's clock most there), a file's times are set to
    the server's own now instead (``_server_time_of``): the probe file when it could be created,
    else ``CLOCK_NAME``, kept under the root for this. None when neither works (a read-only
    export: the caller falls back to this node's clock; it cannot publish a lease either)."""
    name = f"{_CLOCK_PREFIX}{uuid.uuid4().hex[:12]}.tmp"
    try:
        fd = safefs.create_file(name, root_fd)
    except OSError as exc:
        if exc.errno not in _NO_SPACE or (clock_fd := _open_clock_file(root_fd)) is None:
            return None
        try:
            return _server_time_of(clock_fd)
        finally:
            os.close(clock_fd)
    try:
        os.write(fd, b"t")
        now: float | None = os.fstat(fd).st_mtime_ns / 1e9  # NFS flushes the write first: the server's mtime
    except OSError as exc:
        now = _server_time_of(fd) if exc.errno in _NO_SPACE else None
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=root_fd)
    if now is not None and (clock_fd := _open_clock_file(root_fd)) is not None:
        os.close(clock_fd)  # the clock file kept for the day the export is full
    return now


def _open_clock_file(root_fd: int) -> int | None:
    """``CLOCK_NAME`` under the root, created empty if missing (no data block needed); None on
    any error. O_NONBLOCK: a FIFO planted there never blocks the open."""
    try:
        return os.open(CLOCK_NAME, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600,
                       dir_fd=root_fd)
    except OSError:
        return None


def _server_time_of(fd: int) -> float | None:
    """Set ``fd``'s times to the server's now and return it: ``futimens`` with no times, which
    an NFS client sends as "set to the server's time"; no space needed. None on any error."""
    try:
        os.utime(fd)
        return os.fstat(fd).st_mtime_ns / 1e9
    except OSError:
        return None


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a lease expiry")


class Lease:
    def __init__(self, root: str | os.PathLike[str], *, ttl_s: float = 60.0, skew_s: float = 5.0,
                 settle_s: float = 0.2, owner: str | None = None):
        self.root = Path(root)
        self.path = self.root / LEASE_NAME
        self.ttl_s = ttl_s
        self.skew_s = skew_s
        self.settle_s = settle_s
        self.owner = owner or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"
        self.held = False
        self.problem: str | None = None  # what was wrong with the lease path, for reports
        self.problem_errno: int | None = None  # the errno of a lease that could not be written
        self._renewed_at = 0.0

    def _read_raw(self, root_fd: int) -> tuple[bytes, float] | None:
        """The lease file's bytes and mtime (the server's clock when it was published)."""
        try:
            fd, st = safefs.open_regular(LEASE_NAME, root_fd)
            try:
                if st.st_size > MAX_LEASE_BYTES:
                    raise safefs.UnsafeEntry("too_large", LEASE_NAME, f"{st.st_size} bytes, more than {MAX_LEASE_BYTES}")
                return safefs.read_fd_capped(fd, MAX_LEASE_BYTES, LEASE_NAME), st.st_mtime_ns / 1e9
            finally:
                os.close(fd)
        except FileNotFoundError:
            return None
        except safefs.UnsafeEntry as exc:
            self.problem = f"{self.path} is not a lease file ({exc.reason}); it is treated as absent"
            try:
                if stat.S_ISDIR(safefs.lstat_at(LEASE_NAME, root_fd).st_mode):
                    self.problem = f"{self.path} is a directory, not a lease file: remove it (gc cannot run)"
            except OSError:
                pass
            return None
        except OSError as exc:
            if exc.errno == getattr(os, "ENXIO", 6):  # a socket or FIFO without a writer
                self.problem = f"{self.path} is not a lease file; it is treated as absent"
                return None
            raise

    def _valid(self, data: object, mtime: float, root_fd: int) -> dict | None:
        if not isinstance(data, dict) or not isinstance(data.get("owner"), str):
            return None
        if "ttl" in data:  # judged by the server's clock (module docstring)
            ttl = data["ttl"]
            if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 0 < ttl <= MAX_TTL_S:
                return None
            if data["owner"] == self.owner:  # our own: its liveness is not asked (no probe)
                return {**data, "live_until": mtime + ttl + self.skew_s, "server_now": mtime}
            now = server_now(root_fd)
            now = time.time() if now is None else now
            if mtime > now + ttl + self.skew_s:
                self.problem = f"{self.path} was written in the file server's future: garbage, taken over"
                return None
            data = {**data, "live_until": mtime + ttl + self.skew_s, "server_now": now}
        else:  # an older tierstore's lease: its writer's clock, as it judges it
            expires = data.get("expires")
            if isinstance(expires, bool) or not isinstance(expires, (int, float)) or not math.isfinite(expires):
                return None
            if expires > time.time() + self.ttl_s + self.skew_s:
                self.problem = f"{self.path} expires at {expires:.0f}, beyond now + ttl + skew: garbage, taken over"
                return None
            data = {**data, "live_until": expires + self.skew_s, "server_now": time.time()}
        pid, host = data.get("pid"), data.get("host")
        dead_pid = isinstance(pid, bool) or not isinstance(pid, int) or not pid_possible(pid) or not process_alive(pid)
        # Its pid means something here only in our PID namespace: "written here" is the one rule
        # of temp names (``host_tag``: host name, boot, PID namespace), so a pod with our host name
        # in another namespace (hostNetwork) is judged by expiry alone. A lease of a tierstore
        # before ``writer`` was recorded falls back to its host name.
        here = data["writer"] == host_tag() if "writer" in data else host == socket.gethostname()
        if here and data["owner"] != self.owner and dead_pid:
            return None  # a dead holder on this host
        return data

    def read(self) -> dict | None:
        """The current lease, or None if absent, garbage or held by a dead process here; with
        ``live_until`` and ``server_now`` added (one clock: the server's, for a lease of this
        version)."""
        try:
            root_fd = safefs.open_root(self.root)
        except OSError:
            return None
        try:
            got = self._read_raw(root_fd)
            if got is None:
                return None
            raw, mtime = got
            try:
                return self._valid(json.loads(raw, parse_constant=_reject_constant), mtime, root_fd)
            except (ValueError, RecursionError):
                return None
        except OSError:
            return None
        finally:
            os.close(root_fd)

    def _blocked(self) -> bool:
        """Whether something that a file cannot replace sits at the lease path."""
        try:
            return stat.S_ISDIR(os.stat(self.path, follow_symlinks=False).st_mode)
        except OSError:
            return False

    def _publish(self) -> None:
        body = {"owner": self.owner, "ttl": self.ttl_s, "expires": time.time() + self.ttl_s,
                "host": socket.gethostname(), "pid": os.getpid(), "writer": host_tag()}
        root_fd = safefs.open_root(self.root)
        try:
            safefs.write_file_atomic(LEASE_NAME, root_fd, json.dumps(body).encode(),
                                     f"{LEASE_NAME}.{uuid.uuid4().hex[:12]}.tmp", safefs.PRIVATE)
        finally:
            os.close(root_fd)

    def acquire(self) -> bool:
        """Take or renew the lease; True if this owner holds it afterwards."""
        self.problem, self.problem_errno = None, None
        cur = self.read()
        if cur is not None and cur["owner"] != self.owner and cur["server_now"] < cur["live_until"]:
            self.held = False
            return False
        if self._blocked():
            self.problem = f"{self.path} is a directory, not a lease file: remove it (gc cannot run)"
            self.held = False
            return False
        try:
            self._publish()
        except OSError as exc:
            self.problem = f"cannot write the lease {self.path}: {exc}"
            self.problem_errno = exc.errno  # ENOSPC/EDQUOT: gc makes room without it (gc.collect)
            self.held = False
            return False
        if self.settle_s:
            time.sleep(self.settle_s)
        cur = self.read()
        self.held = cur is not None and cur["owner"] == self.owner
        self._renewed_at = time.monotonic()
        return self.held

    def renew_if_due(self) -> bool:
        """Renew when a third of the ttl has passed; False once the lease is lost."""
        if not self.held:
            return False
        if time.monotonic() - self._renewed_at < self.ttl_s / 3:
            return True
        cur = self.read()
        if cur is None or cur["owner"] != self.owner:
            self.held = False
            return False
        return self.acquire()

    def release(self) -> bool:
        """Give the lease up; whether it was still ours (False: another holder took it after
        ours expired unrenewed, or it was lost at a renewal: the pass overlapped another's)."""
        if not self.held:
            return False
        cur = self.read()
        kept = cur is not None and cur["owner"] == self.owner
        if kept:
            try:
                root_fd = safefs.open_root(self.root)
                try:
                    safefs.unlink_at(LEASE_NAME, root_fd)
                finally:
                    os.close(root_fd)
            except OSError:
                pass
        self.held = False
        return kept
