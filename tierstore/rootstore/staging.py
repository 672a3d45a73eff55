"""StagingPool: the page buffers of one store, allocated once and reused.

Contract:
- One torch uint8 slab holds ``count`` frames (``directio.FrameGeometry``); each slot's page is
  ALIGN-aligned, pinned when asked and CUDA is available, else on transparent huge pages.
- Every slot is in exactly one of three states: free (in the pool), held by a caller (taken
  with ``take``/``acquire``, or handed over with a loaded page), or busy (owned by a queued or
  running job: ``claim`` for a caller's slot, ``take(busy=True)`` for one a load takes itself).
  ``release`` makes any held or busy slot free; ``hand_over`` turns a busy slot into a held
  one. Misuse (a slot of another pool, released twice, submitted while free or busy) is a
  ``ValueError``: a caller bug, never a page failure.
- Free slots are handed out most-recently-released first (their memory is still in the CPU
  cache).

Threading: every method may be called from any thread; one internal lock, a leaf (nothing is
called while holding it), so callers may hold their own locks around these calls. ``acquire``
with a timeout blocks on the pool's condition; every ``release`` wakes one such waiter.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from tierstore.fs.directio import ALIGN, FrameGeometry, advise_huge_pages


@dataclass(eq=False)
class StagingSlot:
    """A reusable page buffer owned by a ``StagingPool``."""

    index: int
    tensor: torch.Tensor  # 1-D uint8, layout.nbytes, ALIGN-aligned data pointer
    view: memoryview  # the same memory, writable bytes
    # [header room | page | pad to ALIGN] (``FrameGeometry``): a page file is one contiguous,
    # aligned I/O buffer (the header goes right before the page). Store-internal; callers use
    # ``view``/``tensor``.
    _frame: memoryview = field(repr=False)
    # The file a load read into this slot (rank_dir.FileIdentity), for removing it if damaged.
    source: tuple[int, int, int] | None = field(default=None, repr=False)

    @property
    def frame(self) -> memoryview:
        """The slot's whole frame, [header room | page | pad to ALIGN]: the one I/O buffer of
        its page file (the store's file operations and the transfer kernels' frame pitch)."""
        return self._frame


class StagingPool:
    """``count`` staging slots of one frame geometry; see the module docstring."""

    def __init__(self, geometry: FrameGeometry, count: int, pinned: bool) -> None:
        if count <= 0:
            raise ValueError(f"a staging pool needs at least one slot, got {count}")
        self.geometry = geometry
        self.pinned = pinned
        self.slots = self._allocate(count)
        self._lock = threading.Lock()
        self._released = threading.Condition(self._lock)
        self._free: deque[StagingSlot] = deque(self.slots)
        self._free_set = {s.index for s in self.slots}
        self._busy: set[int] = set()

    def _allocate(self, n: int) -> list[StagingSlot]:
        g = self.geometry
        base = torch.empty(n * g.stride + ALIGN, dtype=torch.uint8, pin_memory=self.pinned)
        if not self.pinned:  # pinned memory is the CUDA allocator's; leave it alone
            advise_huge_pages(base.data_ptr(), base.numel())
        skew = (-base.data_ptr()) % ALIGN
        self._slab = base  # keeps every slot's memory alive
        slab_view = memoryview(base.numpy()).cast("B")
        slots = []
        for i in range(n):
            start = skew + i * g.stride
            off = start + g.header_room
            tensor = base[off : off + g.nbytes]
            assert tensor.data_ptr() % ALIGN == 0
            slots.append(StagingSlot(i, tensor, slab_view[off : off + g.nbytes], slab_view[start : start + g.stride]))
        return slots

    def __len__(self) -> int:
        return len(self.slots)

    @property
    def free_count(self) -> int:
        with self._lock:
            return len(self._free)

    def owns(self, slot: StagingSlot) -> bool:
        return slot.index < len(self.slots) and self.slots[slot.index] is slot

    def acquire(self, timeout: float | None = 0) -> StagingSlot | None:
        """A free slot for the caller, or None if none frees within ``timeout`` (None: forever)."""
        with self._lock:
            if not self._free and timeout != 0:
                end = None if timeout is None else time.monotonic() + timeout
                while not self._free:
                    left = None if end is None else end - time.monotonic()
                    if left is not None and left <= 0:
                        break
                    self._released.wait(left)
            return self._take_locked(busy=False)

    def take(self, busy: bool) -> StagingSlot | None:
        """A free slot at once or None; ``busy``: owned by a job from here (see ``hand_over``)."""
        with self._lock:
            return self._take_locked(busy)

    def _take_locked(self, busy: bool) -> StagingSlot | None:
        if not self._free:
            return None
        slot = self._free.pop()  # LIFO: the most recently used buffer is the one still in cache
        self._free_set.discard(slot.index)
        if busy:
            self._busy.add(slot.index)
        return slot

    def claim(self, slot: StagingSlot, what: str) -> None:
        """A caller hands its held ``slot`` to a job; ValueError if it is not the caller's."""
        if not self.owns(slot):
            raise ValueError(f"{what}: the slot does not belong to this store")
        with self._lock:
            if slot.index in self._free_set or slot.index in self._busy:
                raise ValueError(f"{what}: slot {slot.index} is not held by the caller (free, or already submitted)")
            self._busy.add(slot.index)

    def hand_over(self, slot: StagingSlot) -> None:
        """A job's busy slot becomes the caller's (a loaded page); the caller releases it."""
        with self._lock:
            self._busy.discard(slot.index)

    def release(self, slot: StagingSlot) -> None:
        """Make a held or busy slot free and wake one ``acquire`` waiter."""
        if not self.owns(slot):
            raise ValueError("release_slot: this slot does not belong to this store")
        with self._lock:
            if slot.index in self._free_set:
                raise ValueError(f"release_slot: slot {slot.index} is already free (released twice)")
            self._free.append(slot)
            self._free_set.add(slot.index)
            self._busy.discard(slot.index)
            self._released.notify()
