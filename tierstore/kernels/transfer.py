"""GPU <-> staging-slot transfer path for one KV-cache group (never blocks the forward pass).

``PageTransfer(copier, ...)`` moves pages between the engine's KV cache and host staging
buffers (the IOEngine's ``StagingSlot`` tensors, pinned when CUDA is available):

- store: ``start_store(block_ids, slots)`` makes a side stream wait for the work already
  queued on the caller's current stream (the forward pass that wrote the KV), gathers the
  blocks into a bounded device scratch ring, then copies scratch -> pinned slots
  asynchronously (one copy per slot, or one in all when the slots lie back to back). ``handle.blocks_free()`` turns true once the gather has read the
  blocks (vLLM may reuse them), ``handle.done()`` once the slots hold the pages (then submit
  them to the IOEngine).
- load: ``start_load(slots, block_ids)`` copies pinned slots -> scratch -> scatter into the
  cache, all on the side stream. ``handle.slots_free()`` once the slots may be released,
  ``handle.done()`` once the blocks hold the pages; ``handle.wait_on(stream)`` makes a stream
  (e.g. the forward pass's) wait on the GPU without blocking the CPU.

Nothing here synchronizes the host with the GPU except ``synchronize()``/``wait()``: callers
poll. Device memory is bounded by ``scratch_pages`` x page size; pinned memory is the
caller's slots (bounded by the IOEngine's pool) plus tiny per-call block-id buffers from
torch's caching host allocator. A start that does not fit in the free scratch returns None
(try again after ``poll``); a batch larger than the scratch raises ValueError.

On CPU (sources on the CPU) there is no scratch and no stream: the copier gathers straight
into the slots and scatters straight from them; handles are complete on return (and are
still handed back by ``poll``, like GPU ones).

Threading: one PageTransfer per group, driven by one thread (the vLLM worker's); handles may
be polled from that thread only.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from tierstore.kernels import GroupCopier


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
                 first: Any = None, last: Any = None) -> None:
        self.op = op
        self.slots = slots
        self.rows = rows  # scratch ring spans held until done (GPU only)
        self._first = first  # store: gather finished; load: H2D finished
        self._last = last  # everything finished

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

    def synchronize(self) -> None:
        """Block the calling thread until done (tests and shutdown only)."""
        if self._last is not None:
            self._last.synchronize()


class PageTransfer:
    """Moves pages between one group's KV cache and host staging slots."""

    def __init__(self, copier: GroupCopier, device: torch.device | str | None = None,
                 scratch_pages: int = 32, stream: Any = None) -> None:
        self.copier = copier
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
        else:
            self.capacity = 0

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
            self._finished.append(self._inflight.popleft())

    def poll(self) -> list[TransferHandle]:
        """Handles finished since the last poll, oldest first (each returned exactly once)."""
        self._retire()
        out, self._finished = self._finished, []
        return out

    @property
    def in_flight(self) -> int:
        return len(self._inflight)

    # -- transfers ------------------------------------------------------------------------
    def _ids(self, block_ids: torch.Tensor) -> torch.Tensor:
        if block_ids.device.type == "cuda":
            return block_ids
        ids = block_ids.to(torch.int64).contiguous()
        return ids.pin_memory().to(self.device, non_blocking=True)

    def _check_pinned(self, tensors: Sequence[torch.Tensor]) -> None:
        if not self._warned_unpinned and any(not t.is_pinned() for t in tensors):
            import logging

            logging.getLogger(__name__).warning(
                "staging slots are not pinned: host<->GPU copies will block the calling thread; "
                "create the IOEngine with pin=True")
            self._warned_unpinned = True

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
            self.copier.gather(self._ids(block_ids), rows)
            gathered.record(self.stream)
            self._copy_host(tensors, rows, to_host=True)
            finished.record(self.stream)
        h = TransferHandle("store", slots, span, gathered, finished)
        self._inflight.append(h)
        return h

    def start_load(self, slots: Sequence[Any], block_ids: torch.Tensor) -> TransferHandle | None:
        """Scatter the pages in ``slots`` into ``block_ids`` [n, blocks_per_page]."""
        slots = list(slots)
        tensors = self._slot_tensors(slots, block_ids)
        if not self.on_gpu:
            self.copier.scatter(tensors, block_ids)
            h = TransferHandle("load", slots, None)
            self._inflight.append(h)
            return h
        claimed = self._claim_scratch(tensors)
        if claimed is None:
            return None
        span, rows = claimed
        copied = torch.cuda.Event()
        finished = torch.cuda.Event()
        with torch.cuda.stream(self.stream):
            # scratch rows may still be read by an older op on this same stream: stream order covers it
            self._copy_host(tensors, rows, to_host=False)
            copied.record(self.stream)
            self.copier.scatter(rows, self._ids(block_ids))
            finished.record(self.stream)
        h = TransferHandle("load", slots, span, copied, finished)
        self._inflight.append(h)
        return h

    def wait(self) -> list[TransferHandle]:
        """Block until every started transfer finished (tests, shutdown)."""
        for h in list(self._inflight):
            h.synchronize()
        return self.poll()
