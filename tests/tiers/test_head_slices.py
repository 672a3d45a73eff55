"""Head slices (tierstore/format/head_slices.py, head_slice_store.py): covering plans and
verified assembly of one rank's KV heads from pages written at another tensor-parallel size
(issue 13 item 2, the building blocks): TP=2 files -> a TP=1 page, a TP=1 file -> each TP=2
rank's page, byte for byte; a damaged piece is a typed error, never served; the PageStore
wrapper serves a missing own page from the other slices with the same job id."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tierstore.errors import PageError
from tierstore.format.head_slices import (
    HeadRange,
    copy_heads,
    cover,
    parse_split_dir,
    rank_heads,
    slice_layout,
    split_dir_name,
)
from tierstore.format.header import Codec, PageExpectation, PageMeta
from tierstore.format.page import encode_page
from tierstore.rootstore.publish import publish_page
from tierstore.testing.pages import corrupt_flip_bit, page_bytes, page_key, simple_namespace
from tierstore.tiers.assembly import assemble

H = HeadRange


def test_split_dir_names_round_trip_and_refuse_other_spellings() -> None:
    assert split_dir_name(H(2, 4)) == "h2-4" and parse_split_dir("h2-4") == H(2, 4)
    for bad in ("h02-4", "h1-0", "r0", "h-1", "h1-", "h1-01"):
        assert parse_split_dir(bad) is None, bad


def test_rank_heads_follow_vllm_sharding_and_gqa_replication() -> None:
    assert [rank_heads(8, 2, r) for r in (0, 1)] == [H(0, 4), H(4, 4)]
    assert rank_heads(2, 1, 0) == H(0, 2)
    # TP=4 over 2 KV heads: ranks 0,1 hold head 0 and ranks 2,3 head 1 (they share a file)
    assert [rank_heads(2, 4, r) for r in range(4)] == [H(0, 1), H(0, 1), H(1, 1), H(1, 1)]


def test_cover_prefers_exact_then_one_wider_then_fewest_narrower() -> None:
    assert cover(H(0, 1), [H(0, 2), H(0, 1)]) == [H(0, 1)]
    assert cover(H(1, 1), [H(0, 2), H(0, 4)]) == [H(0, 2)]
    assert cover(H(0, 4), [H(0, 1), H(1, 1), H(2, 2), H(0, 2)]) == [H(0, 2), H(2, 2)]
    assert cover(H(0, 2), [H(0, 1)]) is None  # head 1 missing: not a hit


def write_slice(root: Path, ns, full: bytes, heads: HeadRange, key: bytes) -> tuple[Path, PageExpectation]:
    """A TP rank's file of ``heads``: the slice of the full page, as that rank would write it."""
    full_layout = ns.groups[0].layout
    layout = slice_layout(full_layout, heads)
    data = bytearray(layout.nbytes)
    copy_heads(full_layout, memoryview(full), H(0, full_layout.sections[0].shape[0]), memoryview(data), heads)
    meta = PageMeta(ns.digest_bytes, key, 0, ns.groups[0].kind, 16, heads.start // heads.count, heads.start, heads.count)
    header, pieces = encode_page(meta, layout, bytes(data), Codec.NONE, None)
    path = root / split_dir_name(heads) / f"{key.hex()}.kvp"
    path.parent.mkdir(parents=True, exist_ok=True)
    publish_page(path, path.with_name(path.name + ".tmp"), header, pieces, key=key)
    return path, PageExpectation(ns.digest_bytes, key, 0, meta.rank, layout)


@pytest.mark.parametrize(("written", "need"), [
    ([H(0, 1), H(1, 1)], H(0, 2)),  # TP=2 -> TP=1: two half files, nothing wasted
    ([H(0, 2)], H(1, 1)),  # TP=1 -> TP=2 rank 1: half of one file
    ([H(0, 2)], H(0, 1)),  # TP=1 -> TP=2 rank 0
    ([H(0, 4)], H(2, 1)),  # TP=1 -> TP=4 rank 2 of 4 heads
])
def test_assemble_gives_the_readers_heads_byte_for_byte(tmp_path: Path, written, need) -> None:
    ns = simple_namespace("bfloat16", num_kv_heads=max(h.end for h in written))
    full_layout, key = ns.groups[0].layout, page_key(1)
    full = page_bytes(full_layout, key)
    files = {h: write_slice(tmp_path, ns, full, h, key) for h in written}
    want = bytearray(slice_layout(full_layout, need).nbytes)
    copy_heads(full_layout, memoryview(full), H(0, full_layout.sections[0].shape[0]), memoryview(want), need)
    out = memoryview(bytearray(len(want)))
    plan = cover(need, written)
    assert plan is not None
    cost = assemble(need, plan, full_layout, out, files.__getitem__)
    assert bytes(out) == bytes(want)
    assert cost.files == len(plan) and cost.bytes_scattered == len(want)
    assert cost.amplification == sum(h.count for h in plan) / need.count


def test_a_damaged_piece_is_a_typed_error(tmp_path: Path) -> None:
    ns = simple_namespace("bfloat16", num_kv_heads=2)
    full_layout, key = ns.groups[0].layout, page_key(2)
    files = {h: write_slice(tmp_path, ns, page_bytes(full_layout, key), h, key) for h in (H(0, 1), H(1, 1))}
    corrupt_flip_bit(files[H(1, 1)][0], -60)
    out = memoryview(bytearray(full_layout.nbytes))
    with pytest.raises(PageError) as err:
        assemble(H(0, 2), [H(0, 1), H(1, 1)], full_layout, out, files.__getitem__)
    assert err.value.kind == "checksum"


# ---------------------------------------------------------------- HeadSliceStore (a wrapper)
def slice_engine(root: Path, full_ns, heads: HeadRange):
    """The rank's own store: an IOEngine whose pages are ``heads`` of the group (its own tree)."""
    from tierstore.rootstore.engine import IOEngine
    from tierstore.testing.pages import layout_namespace

    layout = slice_layout(full_ns.groups[0].layout, heads)
    return IOEngine(root / "own", layout_namespace(layout, 16, model=f"own-{split_dir_name(heads)}"), 0,
                    staging_slots=4)


@pytest.mark.parametrize(("written", "need"), [([H(0, 1), H(1, 1)], H(0, 2)), ([H(0, 2)], H(1, 1))])
def test_head_slice_store_serves_a_missing_own_page_from_other_slices(tmp_path: Path, written, need) -> None:
    from tierstore.tiers.head_slice_store import DirectorySlices, HeadSliceStore

    ns = simple_namespace("bfloat16", num_kv_heads=2)
    full_layout, key = ns.groups[0].layout, page_key(3)
    full = page_bytes(full_layout, key)
    group_dir = tmp_path / "shared" / ns.digest / "g0"
    slices = DirectorySlices(group_dir, ns.digest_bytes, 0, full_layout, refresh_s=0)
    for h in written:  # as their writer ranks would (the full range lives in r0)
        path, _ = slices.locate(h, key)
        src, _ = write_slice(tmp_path / "tmp", ns, full, h, key)
        path.parent.mkdir(parents=True, exist_ok=True)
        src.rename(path)
    assert slices.listed.wait(5) and sorted(slices.list_now()) == sorted(written)
    # store_back off: the damaged-slice case below needs the key to stay missing from the own slice
    store = HeadSliceStore(slice_engine(tmp_path, ns, need), need, full_layout, slices, store_back=False)
    try:
        want = bytearray(slice_layout(full_layout, need).nbytes)
        copy_heads(full_layout, memoryview(full), H(0, 2), memoryview(want), need)
        job = store.submit_load(key, verify=False)
        (res,) = store.wait([job], 10)
        assert res.ok and res.verified and res.job_id == job, res.error
        assert bytes(res.slot.view[: len(want)]) == bytes(want)
        store.release_slot(res.slot)
        st = store.stats
        assert st["slice_loads"] == 1 and st["slice_files"] == len(written)
        assert st["slice_bytes_scattered"] == len(want)
        # a key no slice holds stays a plain miss; a damaged slice is a checksum failure
        (miss,) = store.wait([store.submit_load(page_key(99))], 10)
        assert not miss.ok and miss.error.kind == "missing"
        damaged = slices.locate(written[-1], key)[0]
        corrupt_flip_bit(damaged, -60)
        job = store.submit_load(key)
        got: list = []
        deadline = time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            got = store.poll()
        assert len(got) == 1 and not got[0].ok and got[0].error.kind == "checksum" and got[0].slot is None
        assert store.free_slots == 4
        # the damaged covering file is removed (that file only): the next reader does not pay for it
        assert not damaged.exists() and store.stats["slice_damaged_removed"] == 1
        assert all(slices.locate(h, key)[0].exists() for h in written[:-1])
    finally:
        store.close()
        slices.close()


@pytest.mark.parametrize(("written", "need"), [([H(0, 1), H(1, 1)], H(0, 2)), ([H(0, 2)], H(1, 1))])
def test_an_assembled_page_is_stored_back_under_the_readers_slice(tmp_path: Path, written, need) -> None:
    """After a TP change the first hit reads the covering files and stores the rank's page
    under its own slice: the next hit reads that one file (amplification paid once)."""
    from tierstore.tiers.head_slice_store import DirectorySlices, HeadSliceStore

    ns = simple_namespace("bfloat16", num_kv_heads=2)
    full_layout, key = ns.groups[0].layout, page_key(4)
    full = page_bytes(full_layout, key)
    slices = DirectorySlices(tmp_path / "shared" / ns.digest / "g0", ns.digest_bytes, 0, full_layout, refresh_s=0)
    for h in written:
        path, _ = slices.locate(h, key)
        src, _ = write_slice(tmp_path / "tmp", ns, full, h, key)
        path.parent.mkdir(parents=True, exist_ok=True)
        src.rename(path)
    assert slices.listed.wait(5) and sorted(slices.list_now()) == sorted(written)
    own = slice_engine(tmp_path, ns, need)
    store = HeadSliceStore(own, need, full_layout, slices)
    try:
        want = bytearray(slice_layout(full_layout, need).nbytes)
        copy_heads(full_layout, memoryview(full), H(0, 2), memoryview(want), need)
        (first,) = store.wait([store.submit_load(key)], 10)
        assert first.ok and bytes(first.slot.view[: len(want)]) == bytes(want)
        store.release_slot(first.slot)
        assert store.flush(10)
        assert store.poll() == []  # the store-back's result is not the caller's
        assert own.mapper.path_for(key).exists() and store.stats["slice_stored_back"] == 1
        (second,) = store.wait([store.submit_load(key)], 10)
        assert second.ok and bytes(second.slot.view[: len(want)]) == bytes(want)
        store.release_slot(second.slot)
        st = store.stats
        assert st["slice_loads"] == 1 and st["loads_ok"] == 1  # the second hit: the own file only
        assert st["slice_store_back_failures"] == 0 and store.free_slots == 4
    finally:
        store.close()
        slices.close()


# ---------------------------------------------------------------- the engine, fsck and gc on slice directories
def test_an_engine_writes_a_head_slice_directory_that_fsck_verifies_and_gc_evicts(tmp_path: Path) -> None:
    from tierstore.admin.fsck import FsckOptions, run_fsck
    from tierstore.format.identity import write_manifest
    from tierstore.fs.mapper import locate
    from tierstore.rootstore.engine import IOEngine
    from tierstore.tiers.gc import collect

    ns = simple_namespace("bfloat16", num_kv_heads=2)
    write_manifest(tmp_path, ns)
    heads = H(1, 1)
    layout = slice_layout(ns.groups[0].layout, heads)
    eng = IOEngine(tmp_path, ns, 0, rank=1, head_start=1, head_count=1, rank_dir="h1-1", layout=layout,
                   staging_slots=4)
    try:
        key = page_key(7)
        slot = eng.acquire_slot(1)
        slot.view[: layout.nbytes] = page_bytes(layout, key)
        (res,) = eng.wait([eng.submit_store(key, slot, 16)], 10)
        assert res.ok
        path = eng.mapper.path_for(key)
        assert path.parent.parent.name == "h1-1"
        loc = locate(tmp_path, path)
        assert loc is not None and (loc.rank, loc.rank_dir) == (1, "h1-1")
        (back,) = eng.wait([eng.submit_load(key)], 10)
        assert back.ok and bytes(back.slot.view[: layout.nbytes]) == page_bytes(layout, key)
        eng.release_slot(back.slot)
    finally:
        eng.close()
    from tierstore.native import loader as native

    native.start(wait=True)
    report = run_fsck(FsckOptions(root=str(tmp_path)))
    assert report.pages_ok == 1 and not report.problems, report.problems
    if native.page_kernels() is not None:  # fsck's batch knows a slice page's exact header
        assert report.reads["native_pages"] == 1
    gone = collect(tmp_path, max_bytes=0)
    assert not path.exists(), gone
