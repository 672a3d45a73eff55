"""The one eviction policy of tierstore's capped tiers: least recently used first.

A page's recency is one number, its *stamp*: nanoseconds of the wall clock at its last store or
hit. The local tier's index keeps it per page (``LocalIndex``: set when a store commits,
refreshed by a touch on a hit; a page found by the reconciling scan gets its file's mtime). The
shared root keeps it in each file's mtime (set by the write, refreshed on a hit by the shared
tier's touch, at most every ``shared_touch_interval_s``), since the nodes share nothing else.
Every evictor takes its victims oldest stamp first and stops as soon as the bytes left are at
most its target: the local tier's cap, at each reservation (``LocalIndex``); the low watermark of
``max_bytes``, at each gc pass (``tiers/gc_evict.py``).

- ``lru_order(stamps)``: the indexes of packed stamps in that order (stable: equal stamps keep
  their scan order);
- ``victims_until(order, sizes, live, target)``: the victims an order gives for a target;
- ``SQL_ORDER``: the same order in the local index's sqlite (its ``pages_by_stamp`` index).

Pure functions and a constant: no I/O, no state, any thread.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

SQL_ORDER = "ORDER BY stamp"


def lru_order(stamps: Any) -> Iterator[int]:
    """Indexes of ``stamps`` (a buffer of int64 nanoseconds, e.g. ``array("q")``), least
    recently used first; equal stamps in index order."""
    import numpy as np  # 8 bytes a page for the order, where a list of ints costs ~70

    yield from (int(i) for i in np.argsort(np.frombuffer(stamps, dtype=np.int64), kind="stable"))


def victims_until(order: Iterable[int], sizes: Sequence[int], live: int, target: int) -> Iterator[int]:
    """The pages of ``order`` to evict, in order, until the ``live`` bytes left are at most
    ``target`` (``sizes[i]``: what evicting page ``i`` frees)."""
    pages = iter(order)
    while live > target:  # checked before the next page is taken: ``order`` is never read past a victim
        i = next(pages, None)
        if i is None:
            return
        yield i
        live -= sizes[i]
