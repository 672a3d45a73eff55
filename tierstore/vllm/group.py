"""One offloaded KV-cache group as the worker's pipelines see it, and its started transfers.

- ``WorkerGroup``: the group's copier (vLLM's per-layer tensors to canonical pages:
  ``tierstore.kernels``), its ``PageTransfer`` (the copier driven without blocking the forward
  pass: ``tierstore.kernels.transfer``) and its page store (any ``tierstore.store.PageStore``:
  an ``IOEngine``, a ``TierChain``, a test double).
- ``TransferPoller``: the one place that polls the group's ``PageTransfer``. Both pipelines
  register the transfers they start with it; it hands load slots back to the store as soon as
  a transfer no longer reads them (``slots_free``) and calls the owner's completion with each
  finished transfer. Started transfers complete in start order, so a pipeline sees its own
  completions in order too.
- ``kernel_rows``/``max_batch``: block ids of pages as the transfer wants them.

The page store counts its own results in the per-tier metrics (every store is a ``TierChain``,
a lone root a chain of one): the worker counts only its adapter counters.

Threading: the vLLM worker thread (or a benchmark's driving thread) only. Imports nothing
from vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from tierstore.kernels import GroupCopier
from tierstore.kernels.transfer import PageTransfer
from tierstore.store import PageStore


@dataclass
class WorkerGroup:
    """One offloaded KV-cache group as the worker sees it."""

    index: int  # tierstore group index (position among offloaded groups)
    vllm_group_id: int
    copier: GroupCopier
    store: PageStore  # the group's page store (a TierChain, a HeadSliceStore around one, a test double)
    blocks_per_chunk: int  # scheduler blocks per page (1 for Mamba)
    kernel_ratio: int  # kernel blocks per scheduler block
    device: torch.device
    fixup: Any = None  # in-place page fix-up (after_gather / before_scatter), see spec.KTransposeFixup
    tokens_per_page: int = 0
    # Cache <-> staging slot copies; None: the worker builds a PageTransfer with default scratch.
    transfer: PageTransfer | Any = None
    stores_pages: bool = True  # False: another rank writes this group's files (a replicated MLA latent)

    def release(self, slots: list[Any]) -> None:
        for slot in slots:
            self.store.release_slot(slot)


def kernel_rows(g: WorkerGroup, block_ids: list[int], pages: int) -> torch.Tensor:
    """Kernel block ids [pages, blocks_per_page] of ``pages`` pages, in token order, on the CPU
    (the transfer moves them to the device asynchronously: a plain ``.to("cuda")`` of a
    pageable tensor would wait for the forward pass)."""
    ids = torch.tensor(block_ids, dtype=torch.int64)
    if g.kernel_ratio > 1:
        ids = (ids[:, None] * g.kernel_ratio + torch.arange(g.kernel_ratio)).reshape(-1)
    return ids.reshape(pages, -1)


def max_batch(g: WorkerGroup, n: int, limit: int | None = None) -> int:
    """Pages per transfer start: at most the scratch (GPU; no limit on CPU: capacity 0) and
    ``limit`` (a benchmark's batch size)."""
    cap = int(getattr(g.transfer, "capacity", 0) or 0)
    n = min(n, cap) if cap > 0 else n
    return min(n, limit) if limit else n


@dataclass
class StartedTransfer:
    """A started ``PageTransfer`` and the pages it carries (in slot order)."""

    handle: Any
    slots: list[Any]
    pages: list[Any]  # the owner's page records
    owner: object
    on_done: Callable[[StartedTransfer], None]
    release_slots_early: bool  # load: the slots go back once the transfer no longer reads them
    slots_released: bool = field(default=False)


class TransferPoller:
    """Polls one group's ``PageTransfer`` for both pipelines; see the module docstring."""

    def __init__(self, g: WorkerGroup) -> None:
        self.g = g
        self._started: dict[int, StartedTransfer] = {}  # by id(handle), in start order

    def track(self, handle: Any, slots: list[Any], pages: list[Any], owner: object,
              on_done: Callable[[StartedTransfer], None], *, release_slots_early: bool = False) -> None:
        self._started[id(handle)] = StartedTransfer(handle, list(slots), list(pages), owner, on_done,
                                                    release_slots_early)

    def started(self, owner: object) -> Iterator[StartedTransfer]:
        return (x for x in self._started.values() if x.owner is owner)

    def __len__(self) -> int:
        return len(self._started)

    def poll(self, *, block: bool = False) -> None:
        """Hand back load slots the transfers no longer read and finish completed transfers.
        ``block``: wait for every started transfer first (flush/shutdown only)."""
        if not self._started:
            return
        finished = self.g.transfer.wait() if block else self.g.transfer.poll()
        for x in self._started.values():
            if x.release_slots_early and not x.slots_released and x.handle.slots_free():
                self.release_slots(x)
        for h in finished:
            x = self._started.pop(id(h), None)
            if x is None:
                continue
            if x.release_slots_early:
                self.release_slots(x)
            x.on_done(x)

    def release_slots(self, x: StartedTransfer) -> None:
        if not x.slots_released:
            x.slots_released = True
            self.g.release(x.slots)
