"""GPU <-> staging-slot transfer path for one KV-cache group (never blocks the forward pass).

``PageTransfer(copier, ...)`` moves pages between the engine's KV cache and host staging
buffers (the IOEngine's ``StagingSlot`` tensors; pinned when the engine has ``pin=True`` on CUDA):

- store: ``start_store(block_ids, slots)`` makes a side stream wait for the work already
  queued on the caller's current stream (the forward pass that wrote the KV), gathers the
  blocks into a bounded device scratch ring, then copies scratch -> pinned slots
  asynchronously (one copy per slot, or one in all when the slots lie back to back). ``handle.blocks_free()`` turns true once the gather has read the
  blocks (vLLM may reuse them), ``handle.done()`` once the slots hold the pages (then submit
  them to the IOEngine).
- load: ``start_load(slots, block_ids, expect)`` copies pinned slots -> scratch -> scatter
  into the cache, all on the side stream, after the work queued on the caller's current
  stream. ``handle.slots_free()`` once the slots may be released, ``handle.done()`` once the
  blocks hold the pages; ``handle.wait_on(stream)`` makes a stream (e.g. the forward pass's)
  wait on the GPU without blocking the CPU.

Checksums on the GPU (``checksums_on_gpu``: CUDA, Triton copier, every section hashable by
``kernels.checksum.SectionHasher``): a store hashes the gathered pages in the scratch and
copies the section checksums back with the pages (``handle.sums``, for
``IOEngine.submit_store(sums=)``), so the I/O threads never hash. A load with ``expect`` (the
header's sums of pages the engine read with ``verify=False``) hashes the pages after the H2D
copy and scatters only the pages that match: the block ids of a mismatching page are masked
(negative), so its blocks are never written; ``handle.failed`` lists such pages once done.
This checks the bytes the GPU actually received (after PCIe), not just those on the host.

Nothing here synchronizes the host with the GPU except ``synchronize()``/``wait()``: callers
poll. Device memory is bounded by ``scratch_pages`` x page size; pinned memory is the
caller's slots (bounded by the IOEngine's pool; pinned only when it was created with
``pin=True`` on a CUDA host, else host copies block the calling thread and a warning says so)
plus per-scratch-row buffers for block ids, checksums and check results, allocated once
(``_alloc_row_buffers``): no pinned allocation per call.

Canonical bytes: a store's gather writes whole scratch rows (sections and zero alignment
gaps, ``GroupCopier.gather``) and the whole row is copied to the slot, so neither an earlier
page in the scratch nor one in the slot reaches a file. A start that does not fit in the free scratch returns None
(try again after ``poll``); a batch larger than the scratch raises ValueError.

On CPU (sources on the CPU) there is no scratch and no stream: the copier gathers straight
into the slots and scatters straight from them; handles are complete on return (and are
still handed back by ``poll``, like GPU ones).

Threading: one PageTransfer per group, driven by one thread (the vLLM worker's); handles may
be polled from that thread only.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from tierstore.format import U64_MASK, checksum_as_int64, section_checksums
from tierstore.kernels import GroupCopier

logger = logging.getLogger(__name__)


def _slot_tensor(slot: Any) -> torch.Tensor:
    """A StagingSlot (``.tensor``) or a plain 1-D uint8 tensor."""
    return slot.tensor if hasattr(slot, "tensor") else slot


def _as_rows(tensors: Sequence[torch.Tensor], nbytes: int) -> torch.Tensor | None:
    """One contiguous [n, nbytes] view when the buffers lie back to back in one allocation
    (one copy instead of n), else None. (A strided host view would make torch stage the copy
    through a pageable temporary, synchronously.)"""
    if not tensors:
        return None
    storage = tensors[0].untyped_storage()
    base = storage.data_ptr()
    if any(t.untyped_storage().data_ptr() != base for t in tensors):
        return None
    offs = [t.data_ptr() - base for t in tensors]
    if any(b - a != nbytes for a, b in zip(offs, offs[1:], strict=False)):
        return None
    out = torch.empty(0, dtype=torch.uint8, device=tensors[0].device)
    return out.set_(storage, offs[0], (len(tensors), nbytes), (nbytes, 1))


class TransferHandle:
    """One started store or load; poll ``done()``."""

    def __init__(self, op: str, slots: list[Any], rows: list[tuple[int, int]] | None,
                 first: Any = None, last: Any = None, sums_host: torch.Tensor | None = None,
                 ok_host: torch.Tensor | None = None, failed: list[int] | None = None,
                 keep: tuple[Any, ...] = ()) -> None:
        self.op = op
        self.slots = slots
        self.rows = rows  # scratch ring spans held until done (GPU only)
        self._first = first  # store: gather finished; load: H2D finished
        self._last = last  # everything finished
        # Rows of the transfer's pinned result buffers, filled by the stream; read into Python
        # lists when the handle retires (its rows may be reused right after).
        self._sums_host = sums_host  # store: [n, sections] int64
        self._ok_host = ok_host  # load: [n] bool
        self._sums: list[tuple[int, ...]] | None = None
        self._failed = failed  # load: known at once on CPU, else at retirement
        self._keep = keep  # device tensors the queued work still reads

    def _materialize(self) -> None:
        """Copy the results out of the shared pinned rows (called once done, before reuse)."""
        if self._sums_host is not None:
            self._sums = [tuple(v & U64_MASK for v in row) for row in self._sums_host.tolist()]
            self._sums_host = None
        if self._ok_host is not None:
            self._failed = [i for i, ok in enumerate(self._ok_host.tolist()) if not ok]
            self._ok_host = None
        self._keep = ()

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
        return ev is None or bool(ev.query())

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
            stream.wait_event(self._last)

    def blocks_wait_on(self, stream: Any) -> None:
        """Store: make ``stream`` wait (on the GPU) only until the gather has read the blocks,
        not for the copy to the host: work queued after it may then overwrite the blocks."""
        if self._first is not None:
            stream.wait_event(self._first)

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
        if self.on_gpu:
            if scratch_pages < 1:
                raise ValueError(f"scratch_pages must be >= 1, got {scratch_pages}")
            self.capacity = scratch_pages
            self.scratch = torch.empty(scratch_pages, self.nbytes, dtype=torch.uint8, device=self.device)
            self.stream = stream if stream is not None else torch.cuda.Stream(device=self.device)
            self._warned_unpinned = False
            self._pinned_seen: set[int] = set()  # slot addresses checked by _check_pinned
        else:
            self.capacity = 0
        self.hasher: Any = None
        self.checksum_reason: str | None = "checksums=False"
        if checksums and self.on_gpu:
            self.checksum_reason = self._make_hasher()
        self.checksums_on_gpu = self.hasher is not None
        if self.on_gpu:
            self._alloc_row_buffers()

    def _alloc_row_buffers(self) -> None:
        """Per scratch row: block ids, expected and computed checksums, check results; pinned on
        the host (and a device copy where the GPU reads them). A transfer uses the rows of its
        scratch span, which the ring keeps to itself until it retires: no per-call pinned
        allocations, and pinned memory stays bounded by the scratch size."""
        cap, bpp, n_sec = self.capacity, self.copier.blocks_per_page, max(1, len(self.layout.sections))
        self._ids_host = torch.empty(cap, bpp, dtype=torch.int64, pin_memory=True)
        self._ids_dev = torch.empty(cap, bpp, dtype=torch.int64, device=self.device)
        self._sums_host = torch.empty(cap, n_sec, dtype=torch.int64, pin_memory=True)
        self._want_host = torch.empty(cap, n_sec, dtype=torch.int64, pin_memory=True)
        self._want_dev = torch.empty(cap, n_sec, dtype=torch.int64, device=self.device)
        self._skip_host = torch.empty(cap, dtype=torch.bool, pin_memory=True)
        self._skip_dev = torch.empty(cap, dtype=torch.bool, device=self.device)
        self._ok_host = torch.empty(cap, dtype=torch.bool, pin_memory=True)

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
        """Compile (and load) every kernel variant a transfer can launch, then wait for them.

        Triton specializes integer arguments equal to 1 and divisible by 16, so batches of 1, 2
        and 16 pages cover every variant. Loading a compiled module can synchronize the device,
        which must not happen behind a forward pass, so callers do this at startup. Nothing in
        the cache is written (the scatter's block ids are all masked) and no slot is touched.
        """
        if not self.on_gpu:
            return
        bpp = self.copier.blocks_per_page
        with torch.cuda.stream(self.stream):
            for n in sorted({1, min(2, self.capacity), min(16, self.capacity)}):
                rows = self.scratch[:n]
                ids = torch.zeros(n, bpp, dtype=torch.int64, device=self.device)
                self.copier.gather(ids, rows)
                if self.hasher is not None:
                    self.hasher.verify(rows, self.hasher.hash(rows))
                self.copier.scatter(rows, torch.full_like(ids, -1))
        self.stream.synchronize()

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
        self._ids_host[a:b].copy_(block_ids.reshape(b - a, -1))
        dev = self._ids_dev[a:b]
        dev.copy_(self._ids_host[a:b], non_blocking=True)
        return dev

    def _check_pinned(self, tensors: Sequence[torch.Tensor]) -> None:
        # Each slot once: ``is_pinned`` asks the CUDA allocator (~µs a call, and the worker
        # thread's time is the pipeline's cap: docs/measurements/scaling.md).
        if self._warned_unpinned:
            return
        new = [t for t in tensors if t.data_ptr() not in self._pinned_seen]
        if any(not t.is_pinned() for t in new):
            logger.warning(
                "staging slots are not pinned: host<->GPU copies will block the calling thread; "
                "create the IOEngine with pin=True")
            self._warned_unpinned = True
        self._pinned_seen.update(t.data_ptr() for t in new)

    def _slot_tensors(self, slots: list[Any], block_ids: torch.Tensor) -> list[torch.Tensor]:
        tensors = [_slot_tensor(s) for s in slots]
        if len(tensors) != block_ids.shape[0]:
            raise ValueError(f"{block_ids.shape[0]} pages but {len(tensors)} slots")
        return tensors

    def _claim_scratch(self, tensors: list[torch.Tensor]) -> tuple[list[tuple[int, int]], torch.Tensor] | None:
        """(ring spans, scratch rows) for a batch of pages; None when the scratch is full."""
        span = self._reserve(len(tensors))
        if span is None:
            return None
        self._check_pinned(tensors)
        return span, self.scratch[span[-1][0] : span[-1][1]]

    def _copy_host(self, tensors: list[torch.Tensor], rows: torch.Tensor, *, to_host: bool) -> None:
        """Scratch rows <-> staging slots, asynchronously: one copy when the slots lie back to back."""
        host = _as_rows(tensors, self.nbytes)
        pairs = [(host, rows)] if host is not None else list(zip(tensors, rows, strict=True))
        for h, r in pairs:
            if to_host:
                h.copy_(r, non_blocking=True)
            else:
                r.copy_(h, non_blocking=True)

    def start_store(self, block_ids: torch.Tensor, slots: Sequence[Any]) -> TransferHandle | None:
        """Gather ``block_ids`` [n, blocks_per_page] into ``slots`` (n staging slots)."""
        slots = list(slots)
        tensors = self._slot_tensors(slots, block_ids)
        if not self.on_gpu:
            self.copier.gather(block_ids, tensors)
            h = TransferHandle("store", slots, None)
            self._inflight.append(h)  # complete already; poll() hands it back like a GPU one
            return h
        claimed = self._claim_scratch(tensors)
        if claimed is None:
            return None
        span, rows = claimed
        producer = torch.cuda.current_stream(self.device)
        gathered = torch.cuda.Event()
        finished = torch.cuda.Event()
        with torch.cuda.stream(self.stream):
            self.stream.wait_stream(producer)  # the KV written by queued forward work
            a, b = span[-1]
            self.copier.gather(self._ids(block_ids, a, b), rows)
            gathered.record(self.stream)
            self._copy_host(tensors, rows, to_host=True)
            sums_host = None
            if self.hasher is not None:
                sums_host = self._sums_host[a:b]
                sums_host.copy_(self.hasher.hash(rows), non_blocking=True)
            finished.record(self.stream)
        h = TransferHandle("store", slots, span, gathered, finished, sums_host=sums_host)
        self._inflight.append(h)
        return h

    def start_load(self, slots: Sequence[Any], block_ids: torch.Tensor,
                   expect: Sequence[Sequence[int] | None] | None = None) -> TransferHandle | None:
        """Scatter the pages in ``slots`` into ``block_ids`` [n, blocks_per_page].

        ``expect[i]``: the section checksums page i must have (None: already verified). A page
        that does not match is not scattered and is listed in ``handle.failed``.
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

    def _start_load_gpu(self, slots: list[Any], block_ids: torch.Tensor,
                        expect: Sequence[Sequence[int] | None] | None) -> TransferHandle | None:
        tensors = self._slot_tensors(slots, block_ids)
        claimed = self._claim_scratch(tensors)
        if claimed is None:
            return None
        span, rows = claimed
        copied = torch.cuda.Event()
        finished = torch.cuda.Event()
        producer = torch.cuda.current_stream(self.device)
        ok_host = None
        keep: tuple[Any, ...] = ()
        with torch.cuda.stream(self.stream):
            # Blocks are written only after the caller's queued work (which may still read them).
            self.stream.wait_stream(producer)
            # scratch rows may still be read by an older op on this same stream: stream order covers it
            self._copy_host(tensors, rows, to_host=False)
            copied.record(self.stream)
            a, b = span[-1]
            ids = self._ids(block_ids, a, b)
            if expect is not None:
                n_sec = len(self.layout.sections)
                want = [[checksum_as_int64(v) for v in e] if e is not None else [0] * n_sec for e in expect]
                self._want_host[a:b, :n_sec].copy_(torch.tensor(want, dtype=torch.int64).view(b - a, n_sec))
                self._skip_host[a:b].copy_(torch.tensor([e is None for e in expect], dtype=torch.bool))
                want_dev, skip_dev = self._want_dev[a:b, :n_sec], self._skip_dev[a:b]
                want_dev.copy_(self._want_host[a:b, :n_sec], non_blocking=True)
                skip_dev.copy_(self._skip_host[a:b], non_blocking=True)
                ok = self.hasher.verify(rows, want_dev) | skip_dev
                ids = torch.where(ok[:, None], ids.view(len(slots), -1), -1)
                ok_host = self._ok_host[a:b]
                ok_host.copy_(ok, non_blocking=True)
                keep = (ok, ids)
            self.copier.scatter(rows, ids)
            finished.record(self.stream)
        h = TransferHandle("load", slots, span, copied, finished, ok_host=ok_host, keep=keep)
        self._inflight.append(h)
        return h

    def wait(self) -> list[TransferHandle]:
        """Block until every started transfer finished (tests, shutdown)."""
        for h in list(self._inflight):
            h.synchronize()
        return self.poll()
