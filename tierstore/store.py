"""PageStore: the one interface every page store implements (an ``IOEngine`` on one root, a
tier of a chain, the ``TierChain`` itself, a fault-injecting wrapper in tests).

A store holds the page files of one (namespace, KV-cache group, rank). Callers (the vLLM
worker, the benchmarks, the chain driving its tiers) use nothing else, so any store can be put
where another was. The contract, method by method, is on the ``PageStore`` class below.

Who owns what:
- A ``StagingSlot`` belongs to the store whose pool it came from. The caller holds it between
  ``acquire_slot`` (or a load result) and ``release_slot``/``submit_store``; a store consumes
  the slot given to ``submit_store`` and releases it itself when the write is over.
- Verification has one owner per load: the store verifies the section checksums unless the
  caller asked for ``verify=False``; then the result says ``verified=False`` and carries the
  header's ``sums``, the caller checks the bytes (the GPU, after the copy) and reports its
  verdict with ``settle`` exactly once. Bytes are used only when ``verified`` is True or the
  caller's check passed. The store that served the page (``IOResult.tier``) counts the hit or
  removes the damaged file: nobody else does.

One job id for a page: the outermost store a page's job is submitted to makes its
``JobTicket`` (a process-wide id and the submit time) and passes it down with ``ticket=`` to
every store under it that works on that page (a chain's tiers, a tier's engine, a wrapper's
inner store). Each files the job under the ticket's id, so the id the caller got is the id of
the job in every layer, and the ``IOResult`` is made once, where the work finishes (an engine's
I/O thread, or a layer that completes the job itself), and handed up unchanged.

Threading: every method may be called from any thread unless an implementation says otherwise.
No method blocks on file-system I/O except ``wait``, ``flush`` and ``close`` (bounded by their
timeouts) and ``acquire_slot`` with a timeout.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from tierstore.errors import PageError


class StagingSlot(Protocol):
    """A page buffer of a store (``rootstore.staging.StagingSlot`` is the one every store
    allocates; the interface names only what callers use)."""

    index: int
    tensor: Any  # torch.Tensor, 1-D uint8, the page's bytes
    view: memoryview  # the same memory, writable


_JOB_IDS = itertools.count(1)  # one counter for every store of the process: ids never collide


@dataclass(frozen=True)
class JobTicket:
    """A page job's identity: its id and when the caller submitted it (``time.monotonic()``).
    A store given one files the job under ``id``; its result carries that id and counts
    ``seconds`` from ``submitted``."""

    id: int
    submitted: float

    @classmethod
    def new(cls) -> JobTicket:
        return cls(next(_JOB_IDS), time.monotonic())

    @classmethod
    def given(cls, ticket: JobTicket | None) -> JobTicket:
        """``ticket``, or a new one for a job submitted here first."""
        return ticket if ticket is not None else cls.new()


@dataclass
class IOResult:
    """How one job ended: exactly one per job id, success or a typed ``PageError``."""

    job_id: int  # the job's ``JobTicket`` id
    op: str  # "load" | "store"
    key: bytes
    ok: bool
    error: PageError | None
    slot: StagingSlot | None  # load OK: the page; the caller releases it with ``release_slot``
    stored: bool  # store OK: False if an identical page already existed
    nbytes: int
    seconds: float  # the caller's submit (the ticket's ``submitted``) to completion
    # Load OK: True when the store checked the section checksums. False only for a load
    # submitted with ``verify=False``; then ``sums`` holds the header's section checksums and
    # the caller must check the bytes against them before using them, then call ``settle``.
    verified: bool = True
    sums: tuple[int, ...] | None = None
    # The tier that served a load or took a store ("disk" for a lone engine; "host", "local",
    # "shared" in a chain). ``settle`` is routed by it.
    tier: str = "disk"
    # The part of ``seconds`` an I/O thread spent on the job's file (read and checksum, or
    # write); 0.0 when it never ran. A batch's time is shared evenly among its jobs.
    io_seconds: float = 0.0


@runtime_checkable
class PageStore(Protocol):
    """Loads and stores of the pages of one (namespace, group, rank); see the module docstring.

    Failure policy for every method: a per-page failure is never an exception in the caller's
    thread; it is a typed ``PageError`` in that job's ``IOResult``. Exceptions are reserved for
    caller mistakes (a slot that is not the caller's, a wrong number of checksums, a key outside
    1..MAX_KEY_BYTES), raised as ``ValueError`` before anything is queued.
    """

    layout: Any  # tierstore.format.page_layout.PageLayout: the byte layout of every page of this store

    def acquire_slot(self, timeout: float | None = 0) -> StagingSlot | None:
        """A free staging slot for the caller to fill, or None if none frees within ``timeout``
        (0: do not wait). The caller must hand it back: ``submit_store`` or ``release_slot``."""
        ...

    @property
    def free_slots(self) -> int:
        """Slots free right now (a hint for batching; may change at once)."""
        ...

    def release_slot(self, slot: StagingSlot) -> None:
        """Give back a slot the caller holds (acquired, or from a load result)."""
        ...

    def submit_store(self, key: bytes, slot: StagingSlot, token_count: int,
                     sums: Sequence[int] | None = None, *, ticket: JobTicket | None = None) -> int:
        """Queue a store of the page in ``slot`` under ``key``; never blocks, returns the job
        id (``ticket``'s when given: see the module docstring).

        The store owns the slot from here. ``sums`` (the caller's xxh3-64 of each section, e.g.
        computed on the GPU) are written to the header instead of hashing again; a wrong sum is
        caught by every later read. An existing page under ``key`` completes the job with
        ``stored=False`` (names are content addresses). Publishing is atomic: a reader sees a
        whole page or none."""
        ...

    def submit_load(self, key: bytes, verify: bool = True, *, ticket: JobTicket | None = None) -> int:
        """Queue a load of ``key``; never blocks, returns the job id (``ticket``'s when given).
        On success the result's ``slot`` holds the page (the caller releases it).
        ``verify=False``: see ``IOResult``."""
        ...

    def poll(self) -> list[IOResult]:
        """Results completed since the last poll/wait (non-blocking)."""
        ...

    def wait(self, job_ids: Iterable[int], timeout: float | None) -> list[IOResult]:
        """Block until every job in ``job_ids`` is complete or ``timeout`` passes; returns the
        results of those that completed (others stay pending and come through ``poll``)."""
        ...

    def contains(self, key: bytes) -> bool:
        """Whether a load of ``key`` would probably find a page (a hint: the load verifies)."""
        ...

    def settle(self, result: IOResult, ok: bool, reason: str = "") -> None:
        """The caller's verdict on an unverified load result (``verified=False``): ``ok`` counts
        the hit in the tier that served it; not ``ok`` counts a checksum failure there and
        removes the damaged file (once, by that tier). Call exactly once per such result."""
        ...

    def flush(self, timeout: float | None) -> bool:
        """Wait until every queued store has completed; False if ``timeout`` passed first."""
        ...

    def close(self, timeout: float | None = None) -> None:
        """Flush (up to ``timeout``), stop the threads, drop pending loads. Idempotent."""
        ...

    @property
    def stats(self) -> dict[str, Any]:
        """Counters for tests, benchmarks and metrics (a snapshot)."""
        ...
