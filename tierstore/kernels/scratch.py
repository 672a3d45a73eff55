"""ScratchRows: the device scratch of one ``PageTransfer``, its rows' events, and the copies
between its rows and host staging slots.

Contract:
- ``capacity`` rows of ``nbytes`` page bytes on the device, ``pitch`` bytes apart
  (``rows(a, n)``: a strided [n, nbytes] view). The pitch starts at ``nbytes``;
  ``adopt_pitch`` re-spaces the rows like the staging slots' frames (only while no transfer
  holds a row, and when the frame fits a row's ``room``: the page rounded up to ALIGN plus
  room for a frame's header), so that slots whose frames follow each other in one
  allocation, given in address order, form a run that ``copy_host`` moves in ONE copy. A
  run's copy to the host also writes the header room and padding between its pages (its own
  slots' bytes: the page store fills the header and cuts the padding before publishing);
  nothing before the run's first page or after its last is written.
- Two events per row (``ev_first[a]``, ``ev_last[a]``: a transfer uses those of its first
  row; the ring never gives one row to two transfers in flight) and one for the caller's
  stream (``wait_for``).
- Copies, event records, queries and stream waits go through ``cuda_driver`` (libcuda calls
  that keep the GIL) when it can be bound on this thread, else through torch (``drv`` None).
  Why: each torch call that releases the GIL costs the driving thread a wait for the GIL,
  which 16 I/O threads also want (docs/measurements/scaling.md).

Threading: owned by one PageTransfer, used by the thread that drives it.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from tierstore.fs.directio import ALIGN, round_up

logger = logging.getLogger(__name__)

_SEEN_MAX = 4096  # host buffers remembered by ScratchRows.host_info


def frame_pitch(slot: Any) -> int | None:
    """Bytes from one staging slot's page to the next slot's in its pool's slab (the frame
    stride: ``StagingSlot.frame`` spans one frame), or None for a plain tensor."""
    frame = getattr(slot, "frame", None)
    return len(frame) if frame is not None else None


# The automatic transfer scratch (setting transfer_scratch_mib unset): at least this much ...
AUTO_SCRATCH_MIN_BYTES = 64 << 20
# ... raised to hold this many pages per I/O thread, but never above AUTO_SCRATCH_MAX_BYTES.
AUTO_SCRATCH_PAGES_PER_THREAD = 2
AUTO_SCRATCH_MAX_BYTES = 512 << 20


def transfer_scratch_pages(staging_slots: int, page_bytes: int, scratch_bytes: int | None, io_threads: int) -> int:
    """Scratch pages of one group's PageTransfer (device memory on CUDA, outside vLLM's KV
    budget: setting ``transfer_scratch_mib``): never more than the staging slots (a page in
    flight holds one), at most ``scratch_bytes``, at least one page.

    ``scratch_bytes`` None (the default): 64 MiB, raised to 2 x ``io_threads`` pages, at most
    512 MiB. The scratch caps the pages of one transfer, and a transfer of fewer pages than
    there are I/O threads leaves threads waiting: at 16 threads with 4-8 MiB pages, 64 MiB
    kept them busy 0.75-0.89 of the time and the automatic size 0.84-0.89; +8% stores and +4%
    loads at the worker's 72 staging slots, 6-21% with 96 (docs/measurements/scaling.md).
    Small pages or few threads keep 64 MiB."""
    page = max(page_bytes, 1)
    if scratch_bytes is None:
        pages = max(AUTO_SCRATCH_MIN_BYTES // page, AUTO_SCRATCH_PAGES_PER_THREAD * io_threads)
        pages = min(pages, AUTO_SCRATCH_MAX_BYTES // page)
    else:
        pages = scratch_bytes // page
    return max(1, min(staging_slots, pages))

class ScratchRows:
    """Device scratch rows, their events and host copies; see the module docstring."""

    def __init__(self, nbytes: int, capacity: int, device: torch.device, stream: Any) -> None:
        self.nbytes = nbytes
        self.capacity = capacity
        self.stream = stream
        self.room = round_up(nbytes) + max(4 * ALIGN, round_up(nbytes // 64))  # bytes a row may take
        self.flat = torch.empty(capacity * self.room, dtype=torch.uint8, device=device)
        self._flat_ptr = self.flat.data_ptr()
        self.set_pitch(nbytes)
        self.host_copies = 0  # copies issued, for benchmarks
        self._warned_unpinned = False
        # per host tensor seen (by id, the tensor kept so that the id stays its own): its
        # storage's [base, end). Bounded: cleared when it grows past _SEEN_MAX.
        self._seen: dict[int, tuple[torch.Tensor, int, int]] = {}
        self._init_events(device)

    def _init_events(self, device: torch.device) -> None:
        """Each event is recorded once here, so that torch creates it; then the driver check."""
        from tierstore.kernels.cuda_driver import driver

        cur = torch.cuda.current_stream(device)
        self.producer_done = torch.cuda.Event()
        self.ev_first = [torch.cuda.Event() for _ in range(self.capacity)]
        self.ev_last = [torch.cuda.Event() for _ in range(self.capacity)]
        for ev in (self.producer_done, *self.ev_first, *self.ev_last):
            ev.record(cur)
        self._stream_h = self.stream.cuda_stream
        self.drv = driver()
        if self.drv is not None:
            try:  # a context this thread can use: the check costs one call, once
                self.drv.record(self.producer_done.cuda_event, cur.cuda_stream)
                self.drv.query(self.producer_done.cuda_event)
            except RuntimeError as exc:
                logger.warning("CUDA driver calls unusable here (%s); using torch's", exc)
                self.drv = None

    # -- rows -----------------------------------------------------------------------------
    def rows(self, a: int, n: int) -> torch.Tensor:
        """Rows [a, a + n). Indexing a prepared 2-D view: tensor indexing keeps the GIL, where
        a method such as ``as_strided`` hands it to the I/O threads and waits to get it back."""
        return self._grid[a : a + n]

    def set_pitch(self, pitch: int) -> None:
        self.pitch = pitch
        self._grid = self.flat.as_strided((self.capacity, self.nbytes), (pitch, 1))

    def adopt_pitch(self, slots: list[Any], idle: bool) -> None:
        """Space the rows like the slots' frames, if ``idle`` (no row held) and it fits."""
        if not idle or len(slots) < 2:
            return
        pitch = frame_pitch(slots[0])
        if pitch is None or pitch == self.pitch or not self.nbytes <= pitch <= self.room or pitch % 16:
            return
        self.set_pitch(pitch)

    # -- events and small copies ----------------------------------------------------------
    def record(self, ev: Any, stream: Any) -> None:
        if self.drv is not None:
            self.drv.record(ev.cuda_event, stream.cuda_stream)
        else:
            ev.record(stream)

    def wait_for(self, producer: Any) -> None:
        """Make the side stream wait (on the GPU) for the work queued on ``producer`` so far."""
        self.record(self.producer_done, producer)
        if self.drv is not None:
            self.drv.wait_event(self._stream_h, self.producer_done.cuda_event)
        else:
            self.stream.wait_event(self.producer_done)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)`` queued on the side stream (both contiguous, same size)."""
        if self.drv is not None:
            self.drv.memcpy_async(dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size(), self._stream_h)
        else:
            with torch.cuda.stream(self.stream):
                dst.copy_(src, non_blocking=True)

    # -- host copies ----------------------------------------------------------------------
    def host_info(self, t: torch.Tensor) -> tuple[int, int]:
        """(storage base, storage end) of a host buffer, looked up once per buffer: staging slots
        come back batch after batch, and torch calls on this thread are GIL hand-offs. The
        first time, also warn if the buffer is not pinned (``is_pinned`` asks the CUDA allocator)."""
        got = self._seen.get(id(t))
        if got is not None and got[0] is t:
            return got[1], got[2]
        if len(self._seen) >= _SEEN_MAX:
            self._seen.clear()
        if not self._warned_unpinned and not t.is_pinned():
            logger.warning(
                "staging slots are not pinned: host<->GPU copies will block the calling thread; "
                "create the IOEngine with pin=True")
            self._warned_unpinned = True
        storage = t.untyped_storage()
        base = storage.data_ptr()
        self._seen[id(t)] = (t, base, base + storage.nbytes())
        return base, base + storage.nbytes()

    def runs(self, tensors: list[torch.Tensor]) -> list[tuple[int, int]]:
        """[i, j) runs of the batch whose buffers lie exactly one row pitch apart in one host
        allocation, in batch order: each run is one contiguous copy."""
        runs = []
        i = 0
        n = len(tensors)
        ptrs = [t.data_ptr() for t in tensors]
        while i < n:
            base, end = self.host_info(tensors[i])
            j = i + 1
            while (j < n and ptrs[j] - ptrs[j - 1] == self.pitch and ptrs[j] + self.nbytes <= end
                   and self.host_info(tensors[j])[0] == base):
                j += 1
            runs.append((i, j))
            i = j
        return runs

    def copy_host(self, tensors: list[torch.Tensor], a: int, *, to_host: bool) -> None:
        """Rows [a, a + len(tensors)) <-> the host buffers, on the side stream, one copy per run."""
        drv = self.drv
        for i, j in self.runs(tensors):
            length = (j - i - 1) * self.pitch + self.nbytes
            off = (a + i) * self.pitch
            if drv is not None:  # addresses only: no tensor views, no GIL hand-off
                host_ptr, dev_ptr = tensors[i].data_ptr(), self._flat_ptr + off
                if to_host:
                    drv.memcpy_async(host_ptr, dev_ptr, length, self._stream_h)
                else:
                    drv.memcpy_async(dev_ptr, host_ptr, length, self._stream_h)
            else:
                host = tensors[i].as_strided((length,), (1,))
                dev = self.flat[off : off + length]
                with torch.cuda.stream(self.stream):
                    if to_host:
                        host.copy_(dev, non_blocking=True)
                    else:
                        dev.copy_(host, non_blocking=True)
            self.host_copies += 1
