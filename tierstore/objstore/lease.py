"""ObjectLease: "one gc evictor at a time" on an object tier, as one object and conditional PUTs.

Contract: the lease is the object ``PREFIX/.tierstore/gc-lease`` holding JSON
``{"tierstore_gc_lease": 1, "state": "held"|"free", "owner", "ttl", "host", "pid"}``. Every
write of it is conditional, so of several nodes racing exactly one wins each step:

- acquire: ``put_new`` (``If-None-Match: *``) of a held lease. If an object is there, it is read
  (HEAD, then GET; the two must show the same ETag, else it is read again) and taken over with
  ``put_if_match`` on the ETag read (a node that lost the race gets 412 and is ``busy``) when
  it is free (released), garbage (not a lease of this format, too large, a bad ``ttl``), this
  owner's own, or expired. Expired is judged by the server's clock alone: the lease lives
  until its ``LastModified`` (set by the server at its last write; HEAD gives whole seconds,
  so one second is added) plus its ``ttl`` plus ``skew_s``, compared with the server's now: the
  ``LastModified`` of the clock object ``PREFIX/.tierstore/gc-clock`` that this node has just
  written (PUT, then HEAD; any node may have written it since, which only makes "now" a value
  between this node's write and its HEAD: never later than the server's real now). A node's
  own clock is never asked, so a node whose clock runs ahead does not take a live lease.
- renew (``renew_if_due``, before each step of a pass that changes something): once
  ``renew_every_s`` (a third of the ttl) has passed since the last write, ``put_if_match`` on
  this node's last ETag; 412 means another node took the lease over: lost. A holder that has
  not renewed for a whole ttl (by its monotonic clock, counted from before its last write was
  sent, so never later than the server's expiry) counts the lease as lost without asking. A
  renewal that fails otherwise (a timeout) is tried again at the next check while less than
  two thirds of the ttl has passed, and counts as lost after that.
- release: ``put_if_match`` of a free lease on this node's last ETag (RGW ignores conditional
  DELETE, so the lease is never deleted); 412 means it had been taken over (``release``
  returns False: the pass overlapped another's).

``acquired_server``/``released_server``: the ``LastModified`` (server clock, whole seconds) of
this node's acquiring and releasing writes; ``taken_over``: the owner of an expired or garbage
lease this node took over (None when it was absent, free or its own).

Failure policy: a request that fails (``PageError``: timeout, refused connection) in
``acquire`` propagates (the caller's pass fails; nothing was evicted); in ``renew_if_due`` it
is retried as above; in ``release`` it is logged (the lease expires by itself).
Threading: an ``ObjectLease`` belongs to one thread.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import time
import uuid
from dataclasses import dataclass

from tierstore.errors import PageError, PageMissing
from tierstore.objstore.client import ObjectClient, ObjectPreconditionFailed

log = logging.getLogger("tierstore.tiers.gc")  # gc's one logger (tiers/gc_report.GC_LOG)

LEASE_KEY = ".tierstore/gc-lease"
CLOCK_KEY = ".tierstore/gc-clock"
FORMAT = 1  # the "tierstore_gc_lease" value
MAX_LEASE_BYTES = 4096
MAX_TTL_S = 86400.0  # a lease claiming longer is garbage
HEAD_GRANULARITY_S = 1.0  # HEAD's Last-Modified is whole seconds, rounded down
READ_ATTEMPTS = 3  # a lease rewritten between its HEAD and its GET is read again


@dataclass(frozen=True)
class LeaseRecord:
    """What the lease object says: its holder (None: free or garbage), ttl, ETag and the
    server time of its last write."""

    owner: str | None
    ttl: float
    etag: str
    written: float  # LastModified, Unix seconds of the server's clock (rounded down)
    garbage: bool = False


def parse_lease(body: bytes) -> tuple[str | None, float] | None:
    """(owner or None when free, ttl) of a lease body; None when it is not a lease of this format."""
    try:
        doc = json.loads(bytes(body)) if len(body) <= MAX_LEASE_BYTES else None
    except (ValueError, RecursionError):
        return None
    if not isinstance(doc, dict) or doc.get("tierstore_gc_lease") != FORMAT:
        return None
    ttl = doc.get("ttl")
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not (0 < ttl <= MAX_TTL_S) or not math.isfinite(ttl):
        return None
    if doc.get("state") == "free":
        return None, float(ttl)
    owner = doc.get("owner")
    if doc.get("state") != "held" or not isinstance(owner, str) or not owner:
        return None
    return owner, float(ttl)


class ObjectLease:
    """The gc lease of one bucket prefix (module docstring)."""

    def __init__(self, client: ObjectClient, *, ttl_s: float = 60.0, skew_s: float = 5.0,
                 renew_every_s: float | None = None, owner: str | None = None) -> None:
        if not 0 < ttl_s <= MAX_TTL_S:
            raise ValueError(f"lease ttl must be in (0, {MAX_TTL_S:g}] seconds, got {ttl_s}")
        self.client = client
        self.key = client.location.key(LEASE_KEY)
        self.clock_key = client.location.key(CLOCK_KEY)
        self.ttl_s = ttl_s
        self.skew_s = skew_s
        self.renew_every_s = ttl_s / 3 if renew_every_s is None else renew_every_s
        self.owner = owner or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"
        self.held = False
        self.problem: str | None = None  # the directory lease's field; an object lease has none
        self.holder: str | None = None  # busy: who holds it
        self.taken_over: str | None = None
        self.acquired_server: float | None = None
        self.released_server: float | None = None
        self.etag = ""
        self.written_at = 0.0  # monotonic, taken before the last successful write was sent

    @property
    def url(self) -> str:
        return f"s3://{self.client.location.bucket}/{self.key}"

    def body(self, held: bool) -> bytes:
        return json.dumps({"tierstore_gc_lease": FORMAT, "state": "held" if held else "free", "owner": self.owner,
                           "ttl": self.ttl_s, "host": socket.gethostname(), "pid": os.getpid()}).encode()

    # ----------------------------------------------------------------- reading
    def server_now(self) -> float:
        """The server's clock now (module docstring: the clock object, written then HEADed)."""
        self.client.put(self.clock_key, self.owner.encode())
        info = self.client.head(self.clock_key)
        if info is None:  # removed in between (by hand): its write was ours, so ask again
            self.client.put(self.clock_key, self.owner.encode())
            info = self.client.head(self.clock_key)
        if info is None:
            raise PageMissing("the gc clock object vanished right after it was written", path=self.clock_key)
        return info.last_modified.timestamp()

    def read(self) -> LeaseRecord | None:
        """The lease object as it is now; None when there is none."""
        for _ in range(READ_ATTEMPTS):
            info = self.client.head(self.key)
            if info is None:
                return None
            if info.size > MAX_LEASE_BYTES:
                return LeaseRecord(None, self.ttl_s, info.etag, info.last_modified.timestamp(), garbage=True)
            try:
                body, etag = self.client.get(self.key)
            except PageMissing:
                return None
            if etag != info.etag:
                continue  # rewritten between the HEAD and the GET
            parsed = parse_lease(body)
            if parsed is None:
                return LeaseRecord(None, self.ttl_s, etag, info.last_modified.timestamp(), garbage=True)
            return LeaseRecord(parsed[0], parsed[1], etag, info.last_modified.timestamp())
        # rewritten at every read: several takers at once; no ETag, so the caller is busy
        return LeaseRecord("(changing)", self.ttl_s, "", 0.0)

    def live_until(self, rec: LeaseRecord) -> float:
        """The server time until which the lease ``rec`` is held."""
        return rec.written + HEAD_GRANULARITY_S + rec.ttl + self.skew_s

    # ----------------------------------------------------------------- the protocol
    def acquire(self) -> bool:
        """Take the lease (or renew it, when it is this owner's); True when held afterwards."""
        self.held, self.holder, self.taken_over = False, None, None
        self.acquired_server = self.released_server = None
        sent = time.monotonic()
        try:
            return self._took(self.client.put_new(self.key, self.body(True)), sent)
        except ObjectPreconditionFailed:
            pass
        cur = self.read()
        if cur is None:  # released and removed by hand since: one more create-only try
            sent = time.monotonic()
            try:
                return self._took(self.client.put_new(self.key, self.body(True)), sent)
            except ObjectPreconditionFailed:
                self.holder = "(another node)"
                return False
        if not cur.etag:
            self.holder = cur.owner
            return False
        if cur.owner is not None and cur.owner != self.owner:
            now = self.server_now()
            if now <= self.live_until(cur):
                self.holder = cur.owner
                return False
            self.taken_over = cur.owner
            log.info("tierstore gc %s: taking over the lease of %s (written at %s by the server's clock, ttl %g s, "
                     "now %s)", self.url, cur.owner, cur.written, cur.ttl, now)
        elif cur.garbage:
            self.taken_over = "(garbage)"
        sent = time.monotonic()
        try:
            return self._took(self.client.put_if_match(self.key, self.body(True), cur.etag), sent)
        except ObjectPreconditionFailed:
            self.holder, self.taken_over = "(another node, first)", None
            return False

    def _took(self, etag: str, sent: float) -> bool:
        self.held, self.etag, self.written_at = True, etag, sent
        info = self.client.head(self.key)
        if info is not None and info.etag == etag:
            self.acquired_server = info.last_modified.timestamp()
        return True

    def renew_if_due(self) -> bool:
        """Renew once ``renew_every_s`` has passed; False once the lease is lost (module docstring)."""
        if not self.held:
            return False
        since = time.monotonic() - self.written_at
        if since >= self.ttl_s:
            log.warning("tierstore gc %s: the lease was not renewed for %.1f s (ttl %g s): counted as lost",
                        self.url, since, self.ttl_s)
            self.held = False
            return False
        if since < self.renew_every_s:
            return True
        sent = time.monotonic()
        try:
            self.etag = self.client.put_if_match(self.key, self.body(True), self.etag)
        except ObjectPreconditionFailed:
            log.warning("tierstore gc %s: the lease was taken over by another node: eviction stops", self.url)
            self.held = False
            return False
        except PageError as exc:
            keep = since < self.ttl_s * 2 / 3
            log.warning("tierstore gc %s: renewing the lease failed (%s); %s", self.url, exc,
                        "tried again at the next step" if keep else "counted as lost")
            self.held = keep
            return keep
        self.written_at = sent
        return True

    def release(self) -> bool:
        """Mark the lease free (a CAS on this owner's ETag); whether it was still ours."""
        if not self.held:
            return False
        self.held = False
        try:
            etag = self.client.put_if_match(self.key, self.body(False), self.etag)
        except ObjectPreconditionFailed:
            return False
        except PageError as exc:
            log.warning("tierstore gc %s: releasing the lease failed (%s); it expires by itself", self.url, exc)
            return True
        try:
            info = self.client.head(self.key)
        except PageError:
            info = None
        if info is not None and info.etag == etag:
            self.released_server = info.last_modified.timestamp()
        return True
