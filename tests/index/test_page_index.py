"""PageIndex: answers from one listing per fan-out directory, keeps this process's changes
across a racing listing, never counts temp or misplaced files, about 8-16 bytes per page."""

from __future__ import annotations

import os
import tracemalloc
from pathlib import Path

import pytest

from tierstore.fs.mapper import FileMapper
from tierstore.index import page_index
from tierstore.index.page_index import PageIndex, fingerprint


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
    from tierstore.fs.mapper import FileMapper
    from tierstore.rootstore.engine import IOEngine
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


def test_found_many_agrees_with_contains_any(tmp_path: Path) -> None:
    """The vectorized answer is True exactly where ``contains_any`` is True (listings, this
    process's additions and removals on top of them, two indexes), False where it is False or
    undecided (a shard with an unlisted directory)."""
    import random

    import numpy as np

    rng = random.Random(7)
    keys = [rng.randbytes(32) for _ in range(3000)]
    a_map, b_map = FileMapper(tmp_path / "a", "ns", 0), FileMapper(tmp_path / "b", "ns", 0)
    make_pages(a_map, keys[:1000])
    make_pages(b_map, keys[800:1500])
    a, b = PageIndex(a_map.base), PageIndex(b_map.base)
    unlisted = {fingerprint(keys[2000]) >> 56, fingerprint(keys[5]) >> 56}
    for d in range(256):
        a.load_dir(d)
        if d not in unlisted:
            b.load_dir(d)
    for k in keys[1500:1700]:
        a.add(k)  # stored after the listing
    for k in keys[:100] + keys[1600:1650]:
        a.discard(k)  # removed after the listing (or after being added)
    fps = np.array([fingerprint(k) for k in keys], dtype=np.uint64)
    got = page_index.found_many([a, b], fps).tolist()
    want = [page_index.contains_any([a, b], int(fp)) is True for fp in fps]
    partial = {d >> 4 for d in unlisted}  # b's shards with an unlisted directory
    assert all(w for g, w in zip(got, want, strict=True) if g)  # never a True contains_any lacks
    assert [g for g, fp in zip(got, fps, strict=True) if int(fp) >> 60 not in partial] == \
        [w for w, fp in zip(want, fps, strict=True) if int(fp) >> 60 not in partial]
    assert sum(got) > 1000 and not all(got)
    undecided = [page_index.contains_any([b], int(fp)) is None for fp in fps]
    assert any(undecided) and not any(page_index.found_many([b], fps)[undecided])
    assert page_index.found_many([a], fps[:0]).tolist() == []


@pytest.mark.parametrize("compiled", [True, False])
def test_fingerprints_of_offload_keys_leave_the_suffix_out(compiled: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """``fingerprints`` (one compiled call, or one hash per key when the native path is not
    ready) equals ``fingerprint`` of each key without its 4-byte group suffix; keys of mixed
    lengths take the per-key path and are still right."""
    import random

    from tierstore.native import loader as native

    if compiled:
        pytest.importorskip("numba", reason="the compiled path needs numba (a vLLM dependency)")
        assert native.start(wait=True), native.failure()
    else:
        monkeypatch.setattr(native, "_kernels", None)
    compiled_calls: list[int] = []
    real = native.record_sums
    monkeypatch.setattr(native, "record_sums", lambda *a: compiled_calls.append(1) or real(*a))
    rng = random.Random(3)
    keys = [rng.randbytes(32) + b"\x00\x00\x00\x01" for _ in range(500)]
    assert page_index.fingerprints(keys, 4).tolist() == [fingerprint(k[:32]) for k in keys]
    assert compiled_calls == ([1] if compiled else [])  # one compiled call, or none at all
    mixed = keys[:10] + [rng.randbytes(20) + b"\x00\x00\x00\x02"]
    assert page_index.fingerprints(mixed, 4).tolist() == [fingerprint(k[:-4]) for k in mixed]
    assert page_index.fingerprints(keys[:3]).tolist() == [fingerprint(k) for k in keys[:3]]
    assert page_index.fingerprints([], 4).tolist() == []


def _age(directory: Path, seconds: float = 10.0) -> None:
    """Make a directory's mtime ``seconds`` old (as if nothing changed in it since)."""
    t = os.stat(directory).st_mtime - seconds
    os.utime(directory, (t, t))


def test_an_unchanged_directory_is_answered_by_a_stat_until_it_changes(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A refresh stats each fan-out directory and lists only those whose (inode, mtime, ctime)
    moved since a listing made when the mtime was already settled; every FULL_RELIST_EVERY-th
    refresh lists anyway. A page another node creates changes the mtime: it is seen."""
    monkeypatch.setattr(page_index, "FULL_RELIST_EVERY", 3)
    mapper = FileMapper(tmp_path, "ns", 0)
    first = key_of(1)
    make_pages(mapper, [first])
    d = fingerprint(first) >> 56
    directory = mapper.base / f"{d:02x}"
    _age(directory)
    index = PageIndex(mapper.base)
    index.load_dir(d)
    assert index.contains(first) and (index.listings, index.listings_skipped) == (1, 0)
    index.load_dir(d)
    index.load_dir(d)
    assert (index.listings, index.listings_skipped) == (1, 2)  # two stats, no readdir
    index.load_dir(d)  # the third refresh lists anyway
    assert (index.listings, index.listings_skipped) == (2, 2)
    # another node's page: a new name in the directory changes its mtime and ctime
    later = next(key_of(i) for i in range(3, 10_000) if fingerprint(key_of(i)) >> 56 == d)
    os.close(os.open(mapper.path_for(later), os.O_WRONLY | os.O_CREAT, 0o644))
    index.load_dir(d)
    assert index.contains(later) and index.listings == 3


def test_a_fresh_mtime_is_never_trusted(tmp_path: Path) -> None:
    """A directory listed within SETTLED_S of its last change is listed again at every refresh:
    a change in the same clock tick as the listing could leave its mtime as it was."""
    mapper = FileMapper(tmp_path, "ns", 0)
    make_pages(mapper, [key_of(1)])
    d = fingerprint(key_of(1)) >> 56
    index = PageIndex(mapper.base)
    for _ in range(3):
        index.load_dir(d)
    assert (index.listings, index.listings_skipped) == (3, 0)


def test_refresh_of_an_unchanged_tree_reads_a_tenth_of_the_entries(tmp_path: Path) -> None:
    """``tierstore bench lookup``'s refresh figure: an unchanged tree costs one stat per fan-out
    directory per refresh plus a full listing every FULL_RELIST_EVERY-th refresh, against a
    readdir of every directory each time."""
    from tierstore.bench.lookup import NS, make_tree, refresh_cost

    mapper = make_tree(tmp_path / "export", 3000)
    for d in mapper.base.iterdir():
        _age(d)
    f = refresh_cost(FileMapper(tmp_path / "export", NS, 0).base)
    every = page_index.FULL_RELIST_EVERY
    assert f["list_all_readdir"] == 256 and f["list_all_entries"] == 3000
    assert f["changed_only_stat"] == 256 and f["changed_only_readdir"] == 256 / every
    assert f["changed_only_entries"] == 3000 / every


def test_the_refresh_sees_another_nodes_page_past_a_cached_directory_stat(tmp_path: Path, monkeypatch) -> None:
    """An NFS client answers ``stat`` of a directory from its attribute cache (30-60 s); the
    refresh reads the directory's change through an open (close-to-open revalidates), so
    another node's new page is listed at the next refresh, not once the cache expires. The
    cache is played by an ``os.stat`` that returns the directory's attributes from before."""
    import time

    mapper = FileMapper(tmp_path, "ns", 0)
    first = key_of(1)
    d = fingerprint(first) >> 56
    second = next(key_of(i) for i in range(2, 10_000) if fingerprint(key_of(i)) >> 56 == d)
    make_pages(mapper, [first])
    directory = mapper.path_for(first).parent
    old = time.time() - 3600
    os.utime(directory, (old, old))  # settled: its signature is remembered
    index = PageIndex(mapper.base)
    index.load_all()
    assert index.contains(first) and index.contains(second) is False
    cached = os.stat(directory)
    make_pages(mapper, [second])  # another node's store: the directory changed on the server
    real_stat = os.stat
    monkeypatch.setattr(page_index.os, "stat",
                        lambda p, *a, **k: cached if str(p) == str(directory) else real_stat(p, *a, **k))
    index.load_dir(d)
    assert index.contains(second), "the refresh trusted the cached directory attributes"
