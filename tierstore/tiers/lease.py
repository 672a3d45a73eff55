"""A lease file with an expiry: "one evictor at a time" on a shared export, without locks.

Contract: ``ROOT/.tierstore-gc.lease`` holds JSON ``{"owner", "expires", "host", "pid"}``
(``expires`` in Unix seconds). It is only ever replaced atomically (temp file + rename), so a
reader sees a whole lease or none. To take the lease a node reads it (open + read: NFS
close-to-open gives the server's current content), and if it is absent, unparsable, its own,
or expired for longer than ``skew_s`` (clock skew between nodes), publishes its own, waits
``settle_s`` and reads it back: only a node that reads its own owner id holds the lease.

This is advisory, not a lock: NFS gives no mutual exclusion that survives every race (two
nodes may both publish, a paused holder may outlive its expiry). Eviction is designed to be
safe with two evictors anyway (renames to trash are idempotent, readers verify), so the lease
only keeps the usual case to one evictor and prevents a thundering herd of scans. A holder
renews before ``ttl/3`` has passed and stops evicting as soon as a renewal fails.

Threading: a ``Lease`` object belongs to one thread.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import uuid
from pathlib import Path

LEASE_NAME = ".tierstore-gc.lease"


class Lease:
    def __init__(self, root: str | os.PathLike[str], *, ttl_s: float = 60.0, skew_s: float = 5.0,
                 settle_s: float = 0.2, owner: str | None = None):
        self.path = Path(root) / LEASE_NAME
        self.ttl_s = ttl_s
        self.skew_s = skew_s
        self.settle_s = settle_s
        self.owner = owner or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"
        self.held = False
        self._renewed_at = 0.0

    def read(self) -> dict | None:
        """The current lease, or None if absent or unreadable (garbage counts as absent)."""
        try:
            with open(self.path, "rb") as f:
                data = json.loads(f.read(4096))
            if isinstance(data, dict) and isinstance(data.get("owner"), str) and isinstance(data.get("expires"), (int, float)):
                return data
        except (OSError, ValueError):
            pass
        return None

    def _publish(self) -> None:
        body = {"owner": self.owner, "expires": time.time() + self.ttl_s,
                "host": socket.gethostname(), "pid": os.getpid()}
        tmp = self.path.with_name(f"{LEASE_NAME}.{uuid.uuid4().hex[:12]}.tmp")
        try:
            tmp.write_bytes(json.dumps(body).encode())
            os.replace(tmp, self.path)
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink()

    def acquire(self) -> bool:
        """Take or renew the lease; True if this owner holds it afterwards."""
        cur = self.read()
        if cur is not None and cur["owner"] != self.owner and time.time() < cur["expires"] + self.skew_s:
            self.held = False
            return False
        self._publish()
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

    def release(self) -> None:
        if not self.held:
            return
        cur = self.read()
        if cur is not None and cur["owner"] == self.owner:
            with contextlib.suppress(OSError):
                self.path.unlink()
        self.held = False
