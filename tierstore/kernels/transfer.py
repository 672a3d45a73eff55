"""GPU <-> staging-slot transfer path for one KV-cache group (never blocks the forward pass).

``PageTransfer(copier, ...)`` moves pages between the engine's KV cache and host staging
buffers (the IOEngine's ``StagingSlot`` tensors; pinned when the engine has ``pin=True`` on CUDA):

- store: ``start_store(block_ids, slots)`` makes a side stream wait for the work already
  queued on the caller's current stream (the forward pass that wrote the KV), gathers the
  blocks into a bounded device scratch ring, then copies scratch -> pinned slots
  asynchronously. ``handle.blocks_free()`` turns true once the gather has read the blocks
  (vLLM may reuse them), ``handle.done()`` once the slots hold the pages (then submit them to
  the IOEngine).
- load: ``start_load(slots, block_ids, expect)`` copies pinned slots -> scratch -> scatter
  into the cache, all on the side stream, after the work queued on the caller's current
  stream. ``handle.slots_free()`` once the slots may be released, ``handle.done()`` once the
  blocks hold the pages; ``handle.wait_on(stream)`` makes a stream (e.g. the forward pass's)
  wait on the GPU without blocking the CPU.

Host copies: one per run of adjacent slots. The scratch rows take the spacing of the staging
slots' frames (``ScratchRows.adopt_pitch``, when nothing is in flight and the frame fits a row's room),
so a run of slots whose frames follow each other in one allocation, given in address order
(``slot_address``; the pipelines sort their batches), moves in one contiguous copy. A store's
copy of a run also writes the header room and padding between the run's pages: those belong
to the run's own slots, and the page store fills the header and cuts the padding before a file
is published, so no file byte depends on them. Frames outside the batch, the header room
before its first page and the padding after its last are never written.

Checksums on the GPU (``checksums_on_gpu``: CUDA, Triton copier, every section hashable by
``kernels.checksum.SectionHasher``): a store hashes the gathered pages in the scratch, the
kernels writing the sums straight into pinned rows (``handle.sums``, for
``IOEngine.submit_store(sums=)``), so the I/O threads never hash. A load with ``expect`` (the
header's sums of pages the engine read with ``verify=False``) hashes the pages after the H2D
copy and scatters only the pages that match (``checksum.check_and_mask``: the block ids of a
mismatching page become -1, so its blocks are never written); ``handle.failed`` lists such
pages once done. This checks the bytes the GPU actually received (after PCIe), not just those
on the host.

The driving thread's cost: it competes for the GIL with the engine's I/O threads, and every
torch call that releases the GIL (a copy, an event record or query) costs it a wait to get
the GIL back (docs/measurements/scaling.md). So a start builds no tensors: the
per-row host buffers are filled through numpy, copies, event records and queries go through
``cuda_driver`` (libcuda calls that keep the GIL; torch's calls where it cannot be bound),
each scratch row owns two reusable events, and the copier and hasher take scratch rows as
strided views with no per-batch tables.

Nothing here synchronizes the host with the GPU except ``synchronize()``/``wait()``: callers
poll. Device memory is bounded by ``scratch_pages`` x a row's room (page size rounded up to
ALIGN, plus room for a frame's header); pinned memory is the caller's slots (bounded by the
IOEngine's pool; pinned only when it was created with ``pin=True`` on a CUDA host, else host
copies block the calling thread and a warning says so) plus per-scratch-row buffers for block
ids, checksums and check results, allocated once (``_alloc_row_buffers``): no pinned
allocation per call.

Canonical bytes: a store's gather writes whole scratch rows (sections and zero alignment
gaps, ``GroupCopier.gather``) and the whole row is copied to the slot, so neither an earlier
page in the scratch nor one in the slot reaches a file. A start that does not fit in the free
scratch returns None (try again after ``poll``); a batch larger than the scratch raises
ValueError.

On CPU (sources on the CPU) there is no scratch and no stream: the copier gathers straight
into the slots and scatters straight from them; handles are complete on return (and are
still handed back by ``poll``, like GPU ones).

Threading: one PageTransfer per group, driven by one thread (the vLLM worker's); handles may
be polled from that thread only. A handle that ``poll`` returned is complete for good (its
events go back to its scratch row).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from tierstore.format.checksums import U64_MASK, checksum_as_int64, section_checksums
from tierstore.fs.directio import round_up
from tierstore.kernels import GroupCopier
from tierstore.kernels.scratch import ScratchRows

logger = logging.getLogger(__name__)


def _slot_tensor(slot: Any) -> torch.Tensor:
    """A StagingSlot (``.tensor``) or a plain 1-D uint8 tensor."""
    return slot.tensor if hasattr(slot, "tensor") else slot


def slot_address(slot: Any) -> int:
    """A slot's page address: sort a batch's slots by it, so that adjacent frames form runs
    that ``PageTransfer`` copies in one piece."""
    return int(_slot_tensor(slot).data_ptr())


def stack_rows(rows: list[torch.Tensor]) -> torch.Tensor:
    """The [1, blocks_per_page] block-id rows of a batch's pages as one [pages, blocks_per_page]
    tensor; CPU rows through numpy (``torch.cat`` would hand the GIL to the I/O threads)."""
    if len(rows) == 1:
        return rows[0]
    try:
        return torch.from_numpy(np.concatenate([r.numpy() for r in rows]))
    except (TypeError, RuntimeError):  # device rows: torch's own
        return torch.cat(rows)


class TransferHandle:
    """One started store or load; poll ``done()``."""

    def __init__(self, op: str, slots: list[Any], rows: list[tuple[int, int]] | None,
                 first: Any = None, last: Any = None, sums_host: np.ndarray | None = None,
                 ok_host: np.ndarray | None = None, failed: list[int] | None = None,
                 keep: tuple[Any, ...] = (), drv: Any = None) -> None:
        self.op = op
        self.slots = slots
        self.rows = rows  # scratch ring spans held until done (GPU only)
        self._first = first  # store: gather finished; load: H2D finished
        self._last = last  # everything finished
        # numpy views of the transfer's pinned result rows, filled by the stream; read into
        # Python lists when the handle retires (its rows may be reused right after).
        self._sums_host = sums_host  # store: [n, sections] int64
        self._ok_host = ok_host  # load: [n] uint8 (1: matched)
        self._sums: list[tuple[int, ...]] | None = None
        self._failed = failed  # load: known at once on CPU, else at retirement
        self._keep = keep  # device tensors the queued work still reads
        self._drv = drv  # cuda_driver.Driver: event calls that keep the GIL (None: torch's)

    def _materialize(self) -> None:
        """Copy the results out of the shared pinned rows (called once done, before reuse).
        numpy views: one C call per handle instead of a Python step per checksum."""
        if self._sums_host is not None:
            self._sums = [tuple(row) for row in self._sums_host.view(np.uint64).tolist()]
            self._sums_host = None
        if self._ok_host is not None:
            self._failed = np.flatnonzero(self._ok_host == 0).tolist()
            self._ok_host = None
        self._keep = ()
        # complete for good: the events are the transfer's per-row ones, which the next
        # transfer from the same scratch row records again
        self._first = self._last = None

    @property
    def sums(self) -> list[tuple[int, ...]] | None:
        """Store, once ``done()``: each page's section checksums (unsigned), or None when the
        GPU did not hash (CPU, or a layout the hasher cannot take: the engine hashes)."""
        if self._sums_host is not None:
            self._materialize()
        return self._sums

    @property
    def failed(self) -> list[int]:
        """Load, once ``done()``: indexes of the pages that did not match ``expect`` (their
        blocks were not written)."""
        if self._ok_host is not None:
            self._materialize()
        return self._failed or []

    def _query(self, ev: Any) -> bool:
        if ev is None:
            return True
        return self._drv.query(ev.cuda_event) if self._drv is not None else bool(ev.query())

    def _wait(self, stream: Any, ev: Any) -> None:
        if self._drv is not None:
            self._drv.wait_event(stream.cuda_stream, ev.cuda_event)
        else:
            stream.wait_event(ev)

    def done(self) -> bool:
        return self._query(self._last)

    def blocks_free(self) -> bool:
        """Store: the KV blocks were read (the engine may overwrite them)."""
        return self._query(self._first)

    def slots_free(self) -> bool:
        """Load: the staging slots were read (they may be released)."""
        return self._query(self._first)

    def wait_on(self, stream: Any) -> None:
        """Make ``stream`` wait for this transfer on the GPU (no host blocking)."""
        if self._last is not None:
            self._wait(stream, self._last)

    def blocks_wait_on(self, stream: Any) -> None:
        """Store: make ``stream`` wait (on the GPU) only until the gather has read the blocks,
        not for the copy to the host: work queued after it may then overwrite the blocks."""
        if self._first is not None:
            self._wait(stream, self._first)

    def synchronize(self) -> None:
        """Block the calling thread until done (tests and shutdown only)."""
        if self._last is not None:
            self._last.synchronize()


class PageTransfer:
    """Moves pages between one group's KV cache and host staging slots."""

    def __init__(self, copier: GroupCopier, device: torch.device | str | None = None,
                 scratch_pages: int = 32, stream: Any = None, checksums: bool = True) -> None:
        self.copier = copier
        self.layout = copier.layout
        self.nbytes = copier.layout.nbytes
        self.device = torch.device(device) if device is not None else copier.device
        self.on_gpu = self.device.type == "cuda"
        self._inflight: deque[TransferHandle] = deque()  # started, not finished (scratch held)
        self._finished: list[TransferHandle] = []  # finished, not yet returned by poll()
        self.batches = 0  # transfers started on the GPU
        if self.on_gpu:
            if scratch_pages < 1:
                raise ValueError(f"scratch_pages must be >= 1, got {scratch_pages}")
            self.capacity = scratch_pages
            self.stream = stream if stream is not None else torch.cuda.Stream(device=self.device)
            self._scr = ScratchRows(self.nbytes, scratch_pages, self.device, self.stream)
        else:
            self.capacity = 0
        self.hasher: Any = None
        self.checksum_reason: str | None = "checksums=False"
        if checksums and self.on_gpu:
            self.checksum_reason = self._make_hasher()
        self.checksums_on_gpu = self.hasher is not None
        if self.on_gpu:
            self._alloc_row_buffers()

    @property
    def scratch(self) -> torch.Tensor:
        """The device scratch as [capacity, nbytes] rows (row stride: the current pitch)."""
        return self._scr.rows(0, self.capacity)

    @property
    def host_copies(self) -> int:
        """Host<->device page copies issued so far (one per run of adjacent slots; 0 on CPU)."""
        return self._scr.host_copies if self.on_gpu else 0

    @property
    def driver_calls(self) -> bool:
        """Copies and events go through ``cuda_driver`` (GIL kept), not torch's calls."""
        return self.on_gpu and self._scr.drv is not None

    def _alloc_row_buffers(self) -> None:
        """Per scratch row: block ids, expected and computed checksums, check results; pinned on
        the host (and a device copy where the GPU reads them). A transfer uses the rows of its
        scratch span, which the ring keeps to itself until it retires: no per-call pinned
        allocations, and pinned memory stays bounded by the scratch size. The host side is
        filled through numpy views (no torch call: each one is a GIL hand-off)."""
        cap, bpp, n_sec = self.capacity, self.copier.blocks_per_page, max(1, len(self.layout.sections))
        self._ids_host = torch.empty(cap, bpp, dtype=torch.int64, pin_memory=True)
        self._ids_np = self._ids_host.numpy()
        self._ids_dev = torch.empty(cap, bpp, dtype=torch.int64, device=self.device)
        self._sums_host = torch.empty(cap, n_sec, dtype=torch.int64, pin_memory=True)  # store: the GPU writes it
        self._sums_np = self._sums_host.numpy()
        # load checks: per row [block ids | expected sums | skip flag], one H2D copy per batch
        self._meta_host = torch.empty(cap, bpp + n_sec + 1, dtype=torch.int64, pin_memory=True)
        self._meta_np = self._meta_host.numpy()
        self._meta_dev = torch.empty_like(self._meta_host, device=self.device)
        self._sums_dev = torch.empty(cap, n_sec, dtype=torch.int64, device=self.device)  # load: computed
        self._ok_host = torch.empty(cap, dtype=torch.uint8, pin_memory=True)  # load: the GPU writes it
        self._ok_np = self._ok_host.numpy()

    def _make_hasher(self) -> str | None:
        """Build the GPU section hasher; the reason when the engine must hash instead."""
        if self.copier.backend != "triton":
            return f"the copier uses the {self.copier.backend} backend (masked scatter needs Triton)"
        try:
            from tierstore.kernels.checksum import SectionHasher

            hasher = SectionHasher(self.layout, self.device)
        except Exception as exc:  # an unusable hasher costs speed, never correctness
            logger.warning("GPU checksums unavailable (%s); the I/O threads hash pages", exc)
            return f"SectionHasher failed: {exc}"
        if not hasher.supported:
            return hasher.reason or "SectionHasher does not support this layout"
        self.hasher = hasher
        return None

    def warm_up(self) -> None:
        """Compile (and load) every kernel variant a transfer can launch, then wait for them
        (``warm_up_kernels``). Callers do this at startup: loading a compiled module can
        synchronize the device, which must not happen behind a forward pass."""
        warm_up_kernels(self)

    # -- scratch ring ---------------------------------------------------------------------
    def _reserve(self, n: int) -> list[tuple[int, int]] | None:
        """Scratch row spans for a batch of ``n`` pages, in ring order; the last span holds the
        rows used (an earlier one is the unused ring tail skipped on wrap-around). None: no room."""
        if n > self.capacity:
            raise ValueError(f"a batch of {n} pages exceeds the transfer scratch of {self.capacity} pages; "
                             f"split the batch or raise scratch_pages")
        self._retire()
        if not self._inflight:
            return [(0, n)]
        tail = self._inflight[0].rows[0][0]  # oldest held row
        head = self._inflight[-1].rows[-1][1]  # one past the newest held row
        if head > tail:  # held rows do not wrap: free = [head, capacity) + [0, tail)
            if self.capacity - head >= n:
                return [(head, head + n)]
            if tail >= n:
                return ([(head, self.capacity)] if head < self.capacity else []) + [(0, n)]
            return None
        if tail - head >= n:  # held rows wrap: free = [head, tail)
            return [(head, head + n)]
        return None

    def _retire(self) -> None:
        """Move finished handles (in start order) out of the ring; their rows become free."""
        while self._inflight and self._inflight[0].done():
            h = self._inflight.popleft()
            h._materialize()  # before the next start reuses its rows of the result buffers
            self._finished.append(h)

    def poll(self) -> list[TransferHandle]:
        """Handles finished since the last poll, oldest first (each returned exactly once)."""
        self._retire()
        out, self._finished = self._finished, []
        return out

    @property
    def in_flight(self) -> int:
        return len(self._inflight)

    # -- transfers ------------------------------------------------------------------------
    def _ids(self, block_ids: torch.Tensor, a: int, b: int) -> torch.Tensor:
        """Block ids on the device, through the span's pinned rows (queued on the current stream)."""
        if block_ids.device.type == "cuda":
            return block_ids
        self._ids_np[a:b] = block_ids.numpy()
        dev = self._ids_dev[a:b]
        self._scr.copy(dev, self._ids_host[a:b])
        return dev

    def _slot_tensors(self, slots: list[Any], block_ids: torch.Tensor) -> list[torch.Tensor]:
        tensors = [_slot_tensor(s) for s in slots]
        if len(tensors) != block_ids.shape[0]:
            raise ValueError(f"{block_ids.shape[0]} pages but {len(tensors)} slots")
        return tensors

    def _begin(self, slots: list[Any]) -> tuple[list[tuple[int, int]], int, int, Any] | None:
        """Claim scratch rows for a batch and order the side stream after the caller's queued
        work: (ring spans, first row, one past the last, caller's stream); None when full."""
        self._retire()
        self._scr.adopt_pitch(slots, idle=not self._inflight)
        span = self._reserve(len(slots))
        if span is None:
            return None
        producer = torch.cuda.current_stream(self.device)
        self._scr.wait_for(producer)
        self.batches += 1
        a, b = span[-1]
        return span, a, b, producer

    def start_store(self, block_ids: torch.Tensor, slots: Sequence[Any]) -> TransferHandle | None:
        """Gather ``block_ids`` [n, blocks_per_page] into ``slots`` (n staging slots).

        Slots given in address order copy in fewer pieces (runs of adjacent frames)."""
        slots = list(slots)
        tensors = self._slot_tensors(slots, block_ids)
        if not self.on_gpu:
            self.copier.gather(block_ids, tensors)
            h = TransferHandle("store", slots, None)
            self._inflight.append(h)  # complete already; poll() hands it back like a GPU one
            return h
        begun = self._begin(slots)
        if begun is None:
            return None
        span, a, b, _ = begun
        scr = self._scr
        rows = scr.rows(a, b - a)
        gathered, finished = scr.ev_first[a], scr.ev_last[a]
        with torch.cuda.stream(self.stream):
            self.copier.gather(self._ids(block_ids, a, b), rows)
            scr.record(gathered, self.stream)
            scr.copy_host(tensors, a, to_host=True)
            sums_host = None
            if self.hasher is not None:  # straight into the pinned rows: no copy back
                self.hasher.hash(rows, out=self._sums_host[a:b])
                sums_host = self._sums_np[a:b]
            scr.record(finished, self.stream)
        h = TransferHandle("store", slots, span, gathered, finished, sums_host=sums_host, drv=scr.drv)
        self._inflight.append(h)
        return h

    def start_load(self, slots: Sequence[Any], block_ids: torch.Tensor,
                   expect: Sequence[Sequence[int] | None] | None = None) -> TransferHandle | None:
        """Scatter the pages in ``slots`` into ``block_ids`` [n, blocks_per_page].

        ``expect[i]``: the section checksums page i must have (None: already verified). A page
        that does not match is not scattered and is listed in ``handle.failed``. Slots given in
        address order copy in fewer pieces.
        """
        slots = list(slots)
        tensors = self._slot_tensors(slots, block_ids)
        if expect is not None and len(expect) != len(tensors):
            raise ValueError(f"{len(tensors)} pages but {len(expect)} checksum lists")
        check = expect is not None and any(e is not None for e in expect)
        if not self.on_gpu or (check and self.hasher is None):
            failed = self._check_on_host(tensors, expect) if check else []
            good = [i for i in range(len(tensors)) if i not in failed]
            if good:
                if not self.on_gpu:
                    self.copier.scatter([tensors[i] for i in good], block_ids[good])
                else:  # a GPU without the hasher: the slots were checked on the host above
                    h = self._start_load_gpu([slots[i] for i in good], block_ids[good], None)
                    if h is None:
                        return None
                    h.slots, h._failed = slots, failed
                    return h
            h = TransferHandle("load", slots, None, failed=failed)
            self._inflight.append(h)
            return h
        return self._start_load_gpu(slots, block_ids, expect if check else None)

    def _check_on_host(self, tensors: list[torch.Tensor], expect: Sequence[Sequence[int] | None] | None) -> list[int]:
        failed = []
        for i, (t, want) in enumerate(zip(tensors, expect or [], strict=True)):
            if want is None:
                continue
            if section_checksums(self.layout, memoryview(t.numpy())) != tuple(w & U64_MASK for w in want):
                failed.append(i)
        return failed

    def _fill_meta(self, block_ids: torch.Tensor | None, expect: Sequence[Sequence[int] | None], a: int,
                   b: int) -> None:
        """The span's pinned meta rows: [block ids (host ids only) | expected sums (int64 bits) |
        skip flag], through numpy (no torch call)."""
        bpp, n_sec = self.copier.blocks_per_page, len(self.layout.sections)
        meta = self._meta_np[a:b]
        if block_ids is not None:
            meta[:, :bpp] = block_ids.numpy()
        zeros = (0,) * n_sec
        want = [zeros if e is None else e for e in expect]
        try:  # unsigned sums (the header's): one C conversion
            meta[:, bpp : bpp + n_sec] = np.array(want, dtype=np.uint64).reshape(b - a, n_sec).view(np.int64)
        except OverflowError:  # signed bit patterns among them
            meta[:, bpp : bpp + n_sec] = [[checksum_as_int64(v) for v in w] for w in want]
        meta[:, bpp + n_sec] = [e is None for e in expect]

    def _start_load_gpu(self, slots: list[Any], block_ids: torch.Tensor,
                        expect: Sequence[Sequence[int] | None] | None) -> TransferHandle | None:
        tensors = self._slot_tensors(slots, block_ids)
        begun = self._begin(slots)
        if begun is None:
            return None
        span, a, b, _ = begun
        scr = self._scr
        rows = scr.rows(a, b - a)
        copied, finished = scr.ev_first[a], scr.ev_last[a]
        ok_host = None
        with torch.cuda.stream(self.stream):
            # scratch rows may still be read by an older op on this same stream: stream order covers it
            scr.copy_host(tensors, a, to_host=False)
            scr.record(copied, self.stream)
            if expect is not None:
                from tierstore.kernels.checksum import check_and_mask

                bpp = self.copier.blocks_per_page
                on_host = block_ids.device.type != "cuda"
                self._fill_meta(block_ids if on_host else None, expect, a, b)
                meta = self._meta_dev[a:b]
                scr.copy(meta, self._meta_host[a:b])  # ids, sums, flags: one copy
                sums = self.hasher.hash(rows, out=self._sums_dev[a:b])
                ids = self._ids_dev[a:b]
                check_and_mask(sums, meta, bpp, meta[:, :bpp] if on_host else block_ids, ids, self._ok_host[a:b])
                ok_host = self._ok_np[a:b]
            else:
                ids = self._ids(block_ids, a, b)
            self.copier.scatter(rows, ids)
            scr.record(finished, self.stream)
        h = TransferHandle("load", slots, span, copied, finished, ok_host=ok_host, drv=scr.drv)
        self._inflight.append(h)
        return h

    def wait(self) -> list[TransferHandle]:
        """Block until every started transfer finished (tests, shutdown)."""
        for h in list(self._inflight):
            h.synchronize()
        return self.poll()


def warm_up_kernels(t: PageTransfer) -> None:
    """Compile (and load) every kernel variant a transfer can launch, then wait for them.

    Triton specializes integer arguments equal to 1 and divisible by 16, and the copier
    picks words by alignment, so batches of 1, 2 and 16 pages, from scratch row 0 and row 1,
    at the page-size row pitch and at a frame-stride pitch (any multiple of ALIGN: what
    ``ScratchRows.adopt_pitch`` may switch to) cover every variant. Loading a compiled module can
    synchronize the device, which must not happen behind a forward pass, so callers do
    this at startup. Nothing in the cache is written (the scatter's block ids are all
    masked) and no slot is touched.
    """
    if not t.on_gpu:
        return
    from tierstore.kernels.checksum import check_and_mask

    bpp = t.copier.blocks_per_page
    scr = t._scr
    pitches = [t.nbytes] + ([round_up(t.nbytes)] if round_up(t.nbytes) <= scr.room else [])
    saved = scr.pitch
    with torch.cuda.stream(t.stream):
        for pitch in pitches:
            scr.set_pitch(pitch)
            for n in sorted({1, min(2, t.capacity), min(16, t.capacity)}):
                for a in sorted({0, min(1, t.capacity - n)}):
                    rows = scr.rows(a, n)
                    ids = torch.zeros(n, bpp, dtype=torch.int64, device=t.device)
                    t.copier.gather(ids, rows)
                    if t.hasher is not None:
                        sums = t.hasher.hash(rows, out=t._sums_dev[a : a + n])
                        t.hasher.hash(rows, out=t._sums_host[a : a + n])
                        meta = t._meta_dev[a : a + n]
                        meta.fill_(-1)  # expected sums that no page has: every id masked
                        meta[:, -1] = 0
                        check_and_mask(sums, meta, bpp, meta[:, :bpp], t._ids_dev[a : a + n],
                                       t._ok_host[a : a + n])
                    t.copier.scatter(rows, torch.full_like(ids, -1))
    t.stream.synchronize()
    scr.set_pitch(saved)
