"""Access journals: which pages of an object tier were hit, and when, for gc's LRU ranking.

An object's ``LastModified`` is its creation (pages are create-only), so without help gc
would evict a page hit a second ago before one stored a minute ago and never read. Each
``ObjectTier`` therefore keeps an ``AccessJournal``: ``note(key)`` (the tier's load hook, on a
hit) records the page key and the monotonic time in memory; a background thread writes what
was noted every ``interval_s`` as one new object
``PREFIX/.tierstore/access/<host>-<pid>-<random>-<seq>.json``:
``{"tierstore_access": 1, "ages_ms": {"<object key under PREFIX>": ms before the write}}``.
A page's access time is the journal's ``LastModified`` (the server's clock) minus its age, so
no node's clock is asked. gc (``tiers/object_gc.py``) merges every journal (newest access per
page), ranks, evicts, then writes the merged accesses of the pages left as one summary journal
(``"at_ms"``: absolute server milliseconds) and deletes the journals it merged: the number of
journals stays small and a hit is not forgotten by the next pass.

``read_accesses(body, written, location)``: the accesses of a journal body written at
``written`` (server Unix seconds), as ``{object key: server Unix seconds}``; garbage is None.
``summary_body(accesses, location)``: a summary journal's body.

Bounded: at most ``max_pending`` distinct pages are held between writes (a hit of a page not
held once full is dropped and counted in ``dropped``: gc then ranks it by its creation, which
costs ranking accuracy, never a wrong page); a write that fails is dropped (``failed``), never
retried. ``note`` never waits on a request: it takes a lock held only for a dict update.

Failure policy: a failed write is logged at debug and counted; nothing is raised to the tier.
Threading: ``note`` from any thread; ``flush`` from any thread (the writer thread calls it every
``interval_s``; ``close`` once more); the writer is a daemon thread stopped by ``close``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import socket
import threading
import time
from collections.abc import Callable

from tierstore.config import ObjectLocation
from tierstore.errors import PageError
from tierstore.objstore.client import ObjectClient

log = logging.getLogger(__name__)

JOURNAL_DIR = ".tierstore/access"
FORMAT = 1  # the "tierstore_access" value
INTERVAL_S = 30.0
MAX_PENDING = 65536  # distinct pages held between writes (~10 MB at most)
MAX_JOURNAL_BYTES = 64 << 20  # gc reads no larger journal
MAX_SUMMARY_PAGES = 1_000_000  # the newest accesses a summary keeps


def journal_prefix(location: ObjectLocation) -> str:
    """The key prefix of the access journals of ``location`` (ends with "/")."""
    return location.key(JOURNAL_DIR) + "/"


def _relative(location: ObjectLocation, key: str) -> str:
    return key[len(location.prefix) + 1:] if location.prefix else key


def read_accesses(body: bytes, written: float, location: ObjectLocation) -> dict[str, float] | None:
    """{object key: access time, server Unix seconds} of a journal body (``ages_ms`` from
    ``written``, its LastModified; ``at_ms`` absolute); None when it is not a journal."""
    try:
        doc = json.loads(bytes(body))
    except (ValueError, RecursionError):
        return None
    if not isinstance(doc, dict) or doc.get("tierstore_access") != FORMAT:
        return None
    out: dict[str, float] = {}
    for field in ("ages_ms", "at_ms"):
        entries = doc.get(field, {})
        if not isinstance(entries, dict):
            return None
        for rel, ms in entries.items():
            if isinstance(ms, bool) or not isinstance(ms, (int, float)) or not math.isfinite(ms) or ms < 0:
                continue
            t = written - ms / 1000 if field == "ages_ms" else ms / 1000
            key = location.key(rel)
            if t > out.get(key, -math.inf):
                out[key] = t
    return out


def summary_body(accesses: dict[str, float], location: ObjectLocation) -> bytes:
    """The body of a summary journal of ``accesses`` (the newest ``MAX_SUMMARY_PAGES``)."""
    items = sorted(accesses.items(), key=lambda kv: kv[1], reverse=True)[:MAX_SUMMARY_PAGES]
    return json.dumps({"tierstore_access": FORMAT,
                       "at_ms": {_relative(location, k): int(t * 1000) for k, t in items}}).encode()


def writer_name() -> str:
    """``<host>-<pid>-<random>``: a journal writer's name (host name reduced to [A-Za-z0-9.-])."""
    host = re.sub(r"[^A-Za-z0-9.-]", "-", socket.gethostname())[:64] or "host"
    return f"{host}-{os.getpid()}-{os.urandom(6).hex()}"


class AccessJournal:
    """One tier's hits, written as journal objects (module docstring)."""

    def __init__(self, client: ObjectClient, object_key: Callable[[bytes], str], *,
                 interval_s: float = INTERVAL_S, max_pending: int = MAX_PENDING) -> None:
        self.client = client
        self.object_key = object_key
        self.interval_s = interval_s
        self.max_pending = max_pending
        self.prefix = journal_prefix(client.location)
        self.name = writer_name()
        self.written = self.dropped = self.failed = 0
        self._pending: dict[bytes, float] = {}
        self._seq = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="tierstore-access-journal", daemon=True)
        self._thread.start()

    def note(self, key: bytes) -> None:
        """Page ``key`` was hit now (never waits on a request)."""
        now = time.monotonic()
        with self._lock:
            if key in self._pending or len(self._pending) < self.max_pending:
                self._pending[key] = now
            else:
                self.dropped += 1

    def flush(self) -> str | None:
        """Write what was noted as one journal object now; its key (None: nothing to write, or
        the write failed)."""
        with self._lock:
            batch, self._pending = self._pending, {}
            self._seq += 1
            key = f"{self.prefix}{self.name}-{self._seq:06d}.json"
        if not batch:
            return None
        now = time.monotonic()
        loc = self.client.location
        ages = {_relative(loc, self.object_key(k)): max(0, int((now - t) * 1000)) for k, t in batch.items()}
        body = json.dumps({"tierstore_access": FORMAT, "ages_ms": ages}).encode()
        try:
            self.client.put(key, body)
        except PageError as exc:
            self.failed += 1
            log.debug("tierstore: writing the access journal %s failed (%d hits dropped): %s", key, len(batch), exc)
            return None
        self.written += 1
        return key

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.flush()

    def close(self, flush: bool = True) -> None:
        """Stop the writer; with ``flush``, write what is left first (one request at most)."""
        self._stop.set()
        if flush:
            self.flush()
