"""PageIndex: answers from one listing per fan-out directory, keeps this process's changes
across a racing listing, never counts temp or misplaced files, about 8-16 bytes per page."""

from __future__ import annotations

import os
import tracemalloc
from pathlib import Path

from tierstore import page_index
from tierstore.mapper import FileMapper
from tierstore.page_index import PageIndex, fingerprint


def key_of(i: int) -> bytes:
    return i.to_bytes(8, "big") * 4


def make_pages(mapper: FileMapper, keys: list[bytes]) -> None:
    mapper.make_fanout_dirs()
    for k in keys:
        os.close(os.open(mapper.path_for(k), os.O_WRONLY | os.O_CREAT, 0o644))


def test_listing_answers_and_unlisted_directories_are_unknown(tmp_path: Path) -> None:
    mapper = FileMapper(tmp_path, "ns", 0)
    keys = [key_of(i) for i in range(500)]
    make_pages(mapper, keys)
    temp = mapper.temp_path_for(key_of(9999))
    temp.write_bytes(b"")  # a store in progress: not a page
    misplaced = mapper.path_for(key_of(7777))
    wrong_dir = mapper.base / f"{(fingerprint(key_of(7777)) >> 56 ^ 1):02x}" / misplaced.name
    wrong_dir.write_bytes(b"")
    index = PageIndex(mapper.base)
    assert index.contains(keys[0]) is None and not index.loaded
    index.load_all()
    assert index.loaded and len(index) == 500
    assert all(index.contains(k) for k in keys)
    assert not index.contains(key_of(9999)) and not index.contains(key_of(7777))


def test_changes_after_a_listing_started_survive_it(tmp_path: Path, monkeypatch) -> None:
    mapper = FileMapper(tmp_path, "ns", 0)
    old, new = key_of(1), key_of(2)
    make_pages(mapper, [old])
    index = PageIndex(mapper.base)
    index.load_all()
    d_new = fingerprint(new) >> 56
    real = page_index.list_fingerprints

    def racing_listing(directory, fanout_index):  # the store completes while we list
        listed = real(directory, fanout_index)
        if fanout_index == d_new:
            index.add(new)
        return listed

    monkeypatch.setattr(page_index, "list_fingerprints", racing_listing)
    index.load_dir(d_new)
    assert index.contains(new)  # no stale negative for our own page
    index.discard(old)
    assert not index.contains(old)
    index.load_dir(fingerprint(old) >> 56)  # listed after the removal: the file is still there
    assert index.contains(old)  # (someone else's copy: the listing is the truth)


def test_hooks_reach_every_index_of_the_directory(tmp_path: Path) -> None:
    mapper = FileMapper(tmp_path, "ns", 0)
    a, b = PageIndex(mapper.base), PageIndex(mapper.base)
    page_index.note_stored(mapper.base, key_of(5))
    assert a.contains(key_of(5)) and b.contains(key_of(5))
    page_index.note_removed(mapper.base, key_of(5))
    assert a.contains(key_of(5)) is False
    page_index.note_stored(tmp_path / "elsewhere", key_of(6))  # no index there: a no-op


def test_memory_per_page_is_small(tmp_path: Path) -> None:
    mapper = FileMapper(tmp_path, "ns", 0)
    n = 20_000
    make_pages(mapper, [key_of(i) for i in range(n)])
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    index = PageIndex(mapper.base)
    index.load_all()
    held = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(before, "filename"))
    tracemalloc.stop()
    assert len(index) == n
    assert held / n <= 64, held / n


def test_the_engine_and_local_evictions_feed_the_index(tmp_path) -> None:
    """The store path adds this process's own pages at once (never a stale miss), and the
    removal of a damaged page and a local eviction drop them (no stale hit)."""
    from tierstore.engine import IOEngine
    from tierstore.mapper import FileMapper
    from tierstore.testing.pages import page_bytes, page_key, simple_namespace

    ns = simple_namespace()
    base = FileMapper(tmp_path, ns.digest, 0, 0).base
    index = PageIndex(base)
    eng = IOEngine(tmp_path, ns, 0)
    try:
        key = page_key(1)
        slot = eng.acquire_slot(5)
        assert slot is not None
        slot.view[:] = page_bytes(eng.layout, key, 1)
        [res] = eng.wait([eng.submit_store(key, slot, 16)], timeout=10)
        assert res.ok and index.contains(key) is True
        page_index.note_removed_file(tmp_path, str(eng.mapper.path_for(key).relative_to(tmp_path)))
        assert index.contains(key) is False
        page_index.note_removed_file(tmp_path, "not/a/page")  # ignored
    finally:
        eng.close()


def test_removal_hook_runs_when_a_page_may_have_left_and_only_then(tmp_path: Path) -> None:
    """``on_removal`` (what a cache of HIT answers listens to): a discard, a listing that lacks
    a listed page or one this process had added; never an addition or an unchanged listing."""
    mapper = FileMapper(tmp_path, "ns", 0)
    keys = [key_of(i) for i in range(300)]
    make_pages(mapper, keys)
    index = PageIndex(mapper.base)
    index.load_all()
    calls: list[bytes | None] = []
    index.on_removal = calls.append
    d = fingerprint(keys[0]) >> 56
    make_pages(mapper, [key_of(7000)])
    index.add(key_of(7000))  # our own store
    index.load_all()  # nothing gone, a page more
    assert calls == [] and index.contains(key_of(7000)) is True
    os.unlink(mapper.path_for(keys[0]))
    index.load_dir(d)  # the listing lacks a page it answered True for
    assert calls == [None] and index.contains(keys[0]) is False  # which page: unknown
    index.add(key_of(5000))
    index.load_dir(fingerprint(key_of(5000)) >> 56)  # our add, older than the listing; no file
    assert calls == [None, None]
    index.discard(keys[1])
    assert calls == [None, None, keys[1]]


def test_bucket_lookup_agrees_with_the_listing(tmp_path: Path) -> None:
    """Every listed page is found and absent keys are not, for directory sizes around the
    bucket-count steps (0, 1, 2, 3, 5 ... pages in a directory)."""
    mapper = FileMapper(tmp_path, "ns", 0)
    keys = [key_of(i) for i in range(3000)]  # about 12 per directory, some with 0..5
    make_pages(mapper, keys)
    index = PageIndex(mapper.base)
    index.load_all()
    assert all(index.contains(k) is True for k in keys)
    assert not any(index.contains(key_of(i)) for i in range(10_000, 20_000))
