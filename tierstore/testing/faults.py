"""FaultInjectingStore: any ``PageStore`` with failures injected, for tests (no monkeypatching).

Contract: the wrapper is a ``PageStore`` (``tierstore/store.py``) that forwards every call to
``inner`` except where a ``Fault`` matches the operation:
- ``kind``: the job completes at once with that typed ``PageError`` (``"missing"``,
  ``"checksum"``, ``"timeout"``, ``"enospc"``, ...) and never reaches ``inner``; a store's
  slot is released into ``inner``. For ``contains`` a kind answers False.
- ``delay_s`` / ``hang``: the job runs in ``inner`` but its result is held back that long (a
  hang: until ``release()``); ``wait`` and ``poll`` see it only then. ``contains`` sleeps.
- ``corrupt`` (loads): one byte of the loaded page is flipped. An unverified result
  (``verify=False``) is handed over with the bytes damaged, so the caller's check fails; a
  verified one becomes a ``checksum`` failure, as the verifying store would have reported it.
- Which jobs: ``probability`` (from a seeded RNG), ``keys`` (a predicate on the key), and
  ``times`` (at most that many injections; None: unlimited).
Every other attribute (``layout``, ``mapper``, ``name``, ``metrics`` ...) is ``inner``'s, so
the wrapper can stand around an ``IOEngine`` or replace a tier in a chain
(``TierChain.wrap_tier``). ``injected`` counts injections by (op, effect); ``settled`` lists
the (key, ok) verdicts passed on.

Threading: thread-safe (one condition guards the held results and the counters).
"""

from __future__ import annotations

import errno as _errno
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from tierstore import errors
from tierstore.store import IOResult, JobTicket

_STORE_ERRNOS = {"enospc": _errno.ENOSPC, "readonly": _errno.EROFS, "permission": _errno.EACCES, "io": _errno.EIO}


def make_error(kind: str, key: bytes, op: str = "load") -> errors.PageError:
    """A typed ``PageError`` of ``kind`` as a store would raise it."""
    if op == "store" and kind in _STORE_ERRNOS:
        return errors.PageStoreError(f"injected {kind}", key=key, errno=_STORE_ERRNOS[kind])
    for cls in (errors.PageMissing, errors.PageTruncated, errors.PageCorrupt, errors.PageFormatError,
                errors.PageForeign, errors.PageKeyMismatch, errors.PageTimeout, errors.PageCancelled,
                errors.PageQueueFull, errors.PageIOError):
        if cls.kind == kind:
            return cls(f"injected {kind}", key=key)
    err = errors.PageError(f"injected {kind}", key=key)
    err.kind = kind
    return err


@dataclass
class Fault:
    """One rule: which jobs of ``op`` ("load" | "store" | "contains") fail, and how."""

    op: str
    kind: str | None = None
    probability: float = 1.0
    keys: Callable[[bytes], bool] | None = None
    delay_s: float = 0.0
    hang: bool = False
    corrupt: bool = False
    times: int | None = None


class FaultInjectingStore:
    """A ``PageStore`` around ``inner`` that injects ``faults``; see the module docstring."""

    def __init__(self, inner: Any, faults: Iterable[Fault] = (), *, seed: int = 0) -> None:
        self.inner = inner
        self.faults = list(faults)
        self.injected: Counter[tuple[str, str]] = Counter()
        self.settled: list[tuple[bytes, bool]] = []
        self._rng = random.Random(seed)
        self._cond = threading.Condition(threading.Lock())
        self._injected: set[int] = set()  # ids of jobs the wrapper completed (the inner store never saw them)
        self._due: dict[int, tuple[float, Fault]] = {}  # job id -> (hand out at, fault) of held jobs
        self._held: dict[int, IOResult] = {}  # results waiting for their time (or an injected one)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    # ------------------------------------------------------------------ rules
    def _match(self, op: str, key: bytes) -> Fault | None:
        with self._cond:
            for f in self.faults:
                if f.op != op or (f.keys is not None and not f.keys(key)) or f.times == 0:
                    continue
                if f.probability < 1.0 and self._rng.random() >= f.probability:
                    continue
                if f.times is not None:
                    f.times -= 1
                return f
        return None

    def release(self) -> None:
        """Hand out every result held by a ``hang`` fault."""
        with self._cond:
            now = time.monotonic()
            self._due = {i: (min(at, now), f) for i, (at, f) in self._due.items()}
            self._cond.notify_all()

    def _fail_now(self, op: str, key: bytes, kind: str, ticket: JobTicket | None) -> int:
        ticket = JobTicket.given(ticket)
        tier = getattr(self.inner, "name", None) or getattr(self.inner, "tier_name", "disk")
        with self._cond:
            self._injected.add(ticket.id)
            self._held[ticket.id] = IOResult(ticket.id, op, key, False, make_error(kind, key, op), None, False, 0,
                                             time.monotonic() - ticket.submitted, tier=tier)
            self.injected[(op, kind)] += 1
            self._cond.notify_all()
        return ticket.id

    def _hold(self, jid: int, fault: Fault) -> int:
        with self._cond:
            self._due[jid] = (float("inf") if fault.hang else time.monotonic() + fault.delay_s, fault)
        return jid

    # ------------------------------------------------------------------ PageStore
    def submit_load(self, key: bytes, verify: bool = True, *, ticket: JobTicket | None = None) -> int:
        fault = self._match("load", bytes(key))
        if fault is not None and fault.kind:
            return self._fail_now("load", bytes(key), fault.kind, ticket)
        jid = self.inner.submit_load(key, verify, ticket=ticket)
        return self._hold(jid, fault) if fault is not None else jid

    def submit_store(self, key: bytes, slot: Any, token_count: int, sums: Sequence[int] | None = None, *,
                     ticket: JobTicket | None = None) -> int:
        fault = self._match("store", bytes(key))
        if fault is not None and fault.kind:
            self.inner.release_slot(slot)
            return self._fail_now("store", bytes(key), fault.kind, ticket)
        jid = self.inner.submit_store(key, slot, token_count, sums, ticket=ticket)
        return self._hold(jid, fault) if fault is not None else jid

    def store_copy(self, key: bytes, page: Any, token_count: int, sums: Sequence[int] | None = None, *,
                   ticket: JobTicket | None = None, **kw: Any) -> int:
        """A chain tier's copy-store (``ChainTier.store_copy``), with the store faults."""
        fault = self._match("store", bytes(key))
        if fault is not None and fault.kind:
            return self._fail_now("store", bytes(key), fault.kind, ticket)
        jid = self.inner.store_copy(key, page, token_count, sums, ticket=ticket, **kw)
        return self._hold(jid, fault) if fault is not None else jid

    def _admit(self, results: Iterable[IOResult]) -> None:
        """Apply the held jobs' faults to fresh inner results and keep them (condition held)."""
        for r in results:
            fault = self._due.get(r.job_id, (0.0, None))[1]
            if fault is not None and fault.corrupt and r.ok and r.slot is not None:
                r.slot.view[len(r.slot.view) - 1] ^= 0xFF
                self.injected[(r.op, "corrupt")] += 1
                if r.verified:  # a verifying store would have caught it
                    self.inner.release_slot(r.slot)
                    r = replace(r, ok=False, slot=None, error=make_error("checksum", r.key))
            elif fault is not None:
                self.injected[(r.op, "hang" if fault.hang else "delay")] += 1
            self._held[r.job_id] = r

    def _ready(self, ids: Iterable[int] | None) -> list[IOResult]:
        now = time.monotonic()
        out = []
        for i in list(self._held) if ids is None else ids:
            if i in self._held and self._due.get(i, (0.0, None))[0] <= now:
                self._due.pop(i, None)
                self._injected.discard(i)
                out.append(self._held.pop(i))
        return out

    def poll(self) -> list[IOResult]:
        fresh = self.inner.poll()
        with self._cond:
            self._admit(fresh)
            return self._ready(None)

    def wait(self, job_ids: Iterable[int], timeout: float | None) -> list[IOResult]:
        ids = list(job_ids)
        end = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            inner_ids = [i for i in ids if i not in self._injected]
        fresh = self.inner.wait(inner_ids, timeout) if inner_ids else []
        with self._cond:
            self._admit(fresh)
            while True:  # held results come out when their time has come (or at ``release``)
                now = time.monotonic()
                waiting = [self._due[i][0] for i in ids if i in self._held and i in self._due]
                if not waiting or min(waiting) <= now or (end is not None and now >= end):
                    break
                until = min(waiting) if end is None else min(min(waiting), end)
                self._cond.wait(None if until == float("inf") else until - now)
            return self._ready(ids)

    def contains(self, key: bytes) -> bool:
        fault = self._match("contains", bytes(key))
        if fault is not None:
            with self._cond:
                self.injected[("contains", fault.kind or "delay")] += 1
            if fault.delay_s:
                time.sleep(fault.delay_s)
            if fault.kind:
                return False
        return bool(self.inner.contains(key))

    def settle(self, result: IOResult, ok: bool, reason: str = "") -> None:
        with self._cond:
            self.settled.append((result.key, ok))
        self.inner.settle(result, ok, reason)
