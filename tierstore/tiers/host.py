"""Host-memory tier: an LRU of verified page buffers, bounded by ``host_bytes``.

Contract: ``put`` copies the page (callers keep their buffer); ``get`` returns the stored
``bytes`` (immutable, so a reader can never see a half-replaced page) and refreshes its
recency. Pages are only ever put after a verified load or from the page being stored, so
the host tier holds no unverified bytes. Keys are ``(scope, key)`` where scope names the
(namespace, group, rank) so one ``HostTier`` can serve every group of a process and the cap
holds for the whole process. A page larger than the cap is not kept.

``HostStore`` puts one chain's scope of a ``HostTier`` behind the ``PageStore`` API (the first
tier of a chain).

Threading: thread-safe (one lock); copies happen outside the lock.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

from tierstore.errors import PageError, PageMissing, PageQueueFull
from tierstore.metrics import TierMetrics
from tierstore.store import IOResult, JobTicket


class HostTier:
    def __init__(self, cap_bytes: int, metrics: TierMetrics | None = None) -> None:
        self.cap_bytes = cap_bytes
        self.metrics = metrics
        self._pages: OrderedDict[tuple[str, bytes], bytes] = OrderedDict()
        self._used = 0
        self._lock = threading.Lock()
        self._publish_capacity()

    def _publish_capacity(self) -> None:
        if self.metrics is not None:
            self.metrics.set_capacity(self._used, self.cap_bytes, pages=len(self._pages))

    def get(self, scope: str, key: bytes) -> bytes | None:
        with self._lock:
            data = self._pages.get((scope, key))
            if data is not None:
                self._pages.move_to_end((scope, key))
            return data

    def contains(self, scope: str, key: bytes) -> bool:
        with self._lock:
            return (scope, key) in self._pages

    def put(self, scope: str, key: bytes, page: bytes | memoryview) -> bool:
        """Keep a copy of ``page``; False if it does not fit at all."""
        n = len(page)
        if n > self.cap_bytes:
            return False
        data = bytes(page)
        evicted = evicted_bytes = 0
        with self._lock:
            old = self._pages.pop((scope, key), None)
            if old is not None:
                self._used -= len(old)
            while self._used + n > self.cap_bytes and self._pages:
                _, victim = self._pages.popitem(last=False)
                self._used -= len(victim)
                evicted += 1
                evicted_bytes += len(victim)
            self._pages[(scope, key)] = data
            self._used += n
            used = self._used
            held = len(self._pages)  # residency gauge (tierstore_tier_resident_pages)
        if self.metrics is not None:
            if evicted:
                self.metrics.evicted(evicted, evicted_bytes)
            self.metrics.set_capacity(used, self.cap_bytes, pages=held)
        return True

    def discard(self, scope: str, key: bytes) -> None:
        with self._lock:
            old = self._pages.pop((scope, key), None)
            if old is None:
                return
            self._used -= len(old)
            used, held = self._used, len(self._pages)
        if self.metrics is not None:  # the residency gauges follow a discard too
            self.metrics.set_capacity(used, self.cap_bytes, pages=held)

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._used

    def __len__(self) -> int:
        with self._lock:
            return len(self._pages)


class HostStore:
    """The host tier of one chain: ``HostTier`` pages of one scope behind the ``PageStore`` API.

    Every operation completes at once (a dict lookup and a copy); results wait in a list for
    ``poll``/``wait``. The host tier owns no staging slots: a hit is copied into a slot of
    ``slots`` (the chain's front tier), which also takes back the slot of a store. Its pages are
    verified bytes, so its results are always ``verified``; ``durable`` is False (a page kept
    only here is not stored). Thread-safe (one lock over the result list).
    """

    durable = False
    available = True

    def __init__(self, host: HostTier, scope: str, slots: Any, metrics: TierMetrics, tokens_per_page: int) -> None:
        self.name = "host"
        self.host = host
        self.scope = scope
        self.metrics = metrics
        self.tokens_per_page = tokens_per_page
        self._slots = slots
        self._lock = threading.Lock()
        self._done: dict[int, IOResult] = {}

    def _complete(self, ticket: JobTicket | None, op: str, key: bytes, error: PageError | None = None,
                  slot: Any = None, nbytes: int = 0) -> int:
        """The job's result, made here (every host job finishes in its submit)."""
        ticket = JobTicket.given(ticket)
        with self._lock:
            if ticket.id in self._done:
                raise ValueError(f"job id {ticket.id} is in use in the host tier already: a ticket is for one job")
            self._done[ticket.id] = IOResult(ticket.id, op, key, error is None, error, slot,
                                             op == "store" and error is None, nbytes,
                                             time.monotonic() - ticket.submitted, tier=self.name)
        return ticket.id

    @property
    def layout(self) -> Any:
        return self._slots.layout

    @property
    def free_slots(self) -> int:
        return int(self._slots.free_slots)

    def acquire_slot(self, timeout: float | None = 0) -> Any:
        return self._slots.acquire_slot(timeout)

    def release_slot(self, slot: Any) -> None:
        self._slots.release_slot(slot)

    def refuse(self, key: bytes) -> PageError:
        raise AssertionError("the host tier is always available")

    def submit_load(self, key: bytes, verify: bool = True, *, ticket: JobTicket | None = None) -> int:
        t0 = time.monotonic()
        data = self.host.get(self.scope, key)
        if data is None:
            self.metrics.miss(self.tokens_per_page)
            return self._complete(ticket, "load", key, PageMissing("not in host memory", key=key))
        slot = self._slots.acquire_slot(0)
        if slot is None:
            self.metrics.failure("queue_full")
            return self._complete(ticket, "load", key, PageQueueFull(
                "no free staging slot for a host-tier hit; release the slots of finished loads", key=key))
        slot.view[:] = data
        self.metrics.hit(self.tokens_per_page, len(data), time.monotonic() - t0)
        return self._complete(ticket, "load", key, slot=slot, nbytes=len(data))

    def store_copy(self, key: bytes, page: memoryview | bytes, token_count: int,
                   sums: Sequence[int] | None = None, *, no_slot: str = "", ticket: JobTicket | None = None) -> int:
        kept = self.host.put(self.scope, key, page)
        return self._complete(ticket, "store", key,
                              None if kept else PageQueueFull("larger than host_bytes", key=key), nbytes=len(page))

    def submit_store(self, key: bytes, slot: Any, token_count: int, sums: Sequence[int] | None = None, *,
                     ticket: JobTicket | None = None) -> int:
        try:
            return self.store_copy(key, slot.view, token_count, sums, ticket=ticket)
        finally:
            self._slots.release_slot(slot)

    def poll(self) -> list[IOResult]:
        with self._lock:
            out = list(self._done.values())
            self._done.clear()
            return out

    def wait(self, job_ids: Iterable[int], timeout: float | None) -> list[IOResult]:
        with self._lock:
            return [self._done.pop(i) for i in job_ids if i in self._done]

    def contains(self, key: bytes) -> bool:
        return self.host.contains(self.scope, key)

    def settle(self, result: IOResult, ok: bool, reason: str = "") -> None:
        """Host pages are always verified; a caller that found one bad anyway drops it."""
        if not ok:
            self.metrics.failure("checksum")
            self.host.discard(self.scope, result.key)

    def flush(self, timeout: float | None) -> bool:
        return True

    def close(self, timeout: float | None = None) -> None:
        pass

    @property
    def stats(self) -> dict[str, Any]:
        return {"pages": len(self.host), "used_bytes": self.host.used_bytes, "cap_bytes": self.host.cap_bytes}
