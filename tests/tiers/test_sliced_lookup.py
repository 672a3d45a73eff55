"""Scheduler lookups of head-sliced groups (the default layout of attention models): the fast
paths of ``IndexedLookup.answer`` give exactly ``SliceGroup.covered``'s verdict, and a slice
directory that was empty at one listing is looked at again after the next."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import pytest

from tierstore.format.head_slices import HeadRange, slice_mappers, tp_slices
from tierstore.fs.mapper import FileMapper
from tierstore.index.indexed_lookup import IndexedLookup, SliceGroup

HEADS = 8
HAVE = tuple(tp_slices(HEADS))


def _mappers(root: Path) -> list[FileMapper]:
    out = slice_mappers(root, "ns", 0, HEADS)
    for m in out:
        m.make_fanout_dirs()
    return out


def _write(mapper: FileMapper, key: bytes) -> None:
    os.close(os.open(mapper.path_for(key), os.O_WRONLY | os.O_CREAT, 0o644))


def _need(tp: int) -> tuple[HeadRange, ...]:
    return tuple(HeadRange(r * HEADS // tp, HEADS // tp) for r in range(tp))


def _loaded(lookup: IndexedLookup) -> IndexedLookup:
    end = time.monotonic() + 30
    while not lookup.loaded:
        assert time.monotonic() < end, "index did not load"
        time.sleep(0.01)
    return lookup


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_answers_equal_the_covered_rule_for_random_slice_contents(tmp_path: Path, tp: int) -> None:
    """Pages spread over random slice directories (some empty): every answer is what
    ``SliceGroup.covered`` says from the files alone."""
    rng = random.Random(tp)
    mappers = _mappers(tmp_path)
    own = {HAVE.index(n) for n in _need(tp)}
    used = own | set(rng.sample(range(len(HAVE)), 5))  # the other slice directories stay empty
    keys = [rng.randbytes(32) for _ in range(300)]
    where: dict[bytes, set[int]] = {}
    for k in keys:
        where[k] = {i for i in used if rng.random() < 0.5}
        for i in where[k]:
            _write(mappers[i], k)
    sg = SliceGroup(HAVE, _need(tp))
    lookup = _loaded(IndexedLookup([mappers], slices=[sg], refresh_s=0).start())
    try:
        for k in keys:
            present = [i in where[k] for i in range(len(HAVE))]
            assert lookup.answer(0, k) is sg.covered(present, present), (tp, sorted(where[k]))
        assert sum(lookup.answer(0, k) for k in keys) > 0  # the draw covers some keys
        # The vectorized prefix: the leading keys every current rank finds under its own slice
        # (the shortcut ``answer`` takes first), all of them hits.
        for start in range(0, len(keys), 7):
            run = keys[start:]
            n = lookup.known_prefix(0, run)
            own_all = [own <= where[k] for k in run] + [False]
            assert n == own_all.index(False), (tp, start)
            assert all(lookup.answer(0, k) for k in run[:n])
    finally:
        lookup.close()


def test_a_slice_directory_empty_at_one_listing_is_seen_after_the_next(tmp_path: Path) -> None:
    """The miss shortcut skips slice directories found empty; another node's pages there are
    hits after the next refresh, as anywhere else."""
    mappers = _mappers(tmp_path)
    key = b"k" * 32
    halves = [HAVE.index(HeadRange(0, 4)), HAVE.index(HeadRange(4, 4))]
    lookup = _loaded(IndexedLookup([mappers], slices=[SliceGroup(HAVE, _need(1))], refresh_s=0.2).start())
    try:
        assert lookup.answer(0, key) is False
        refreshes = lookup.counters["refreshes"]
        for i in halves:  # a TP=2 writer elsewhere: both halves cover the TP=1 reader
            _write(mappers[i], key)
        end = time.monotonic() + 30
        while lookup.counters["refreshes"] < refreshes + 2:
            assert time.monotonic() < end, "no refresh"
            time.sleep(0.05)
        assert lookup.answer(0, key) is True
    finally:
        lookup.close()
