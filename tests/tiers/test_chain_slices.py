"""Head slices through a ``TierChain`` (a local tier in front of the shared root): at TP > 1
every tier keeps the rank's slice directory, so pages survive a TP change with a local tier
configured (issue 13): TP=2 ranks store their halves locally and on the shared root, a TP=1
reader with its own local tier assembles the page from the shared halves and stores it back
under ``r0`` in both of its tiers."""

from __future__ import annotations

import os
import time
from pathlib import Path

from tierstore.config import TierStoreConfig
from tierstore.format.head_slices import HeadRange, copy_heads, slice_layout, split_dir_name
from tierstore.rootstore.page_read import inspect_page
from tierstore.testing.pages import page_bytes, page_key, simple_namespace
from tierstore.tiers import close_shared_state, open_group_store, open_rank_store
from tierstore.tiers.head_slice_store import DirectorySlices, HeadSliceStore

H = HeadRange
NS = simple_namespace("bfloat16", num_kv_heads=2)
FULL = NS.groups[0].layout


def _rank_store(tmp_path: Path, node: str, heads: HeadRange) -> tuple[HeadSliceStore, DirectorySlices]:
    """One rank's store as the engine's spec opens it (``tiers.open_rank_store``): its own local
    root, the shared root, its slice directory and layout in every tier, wrapped for assembly."""
    config = TierStoreConfig(root=str(tmp_path / "shared"), local_root=str(tmp_path / node), odirect="off",
                             index_refresh_s=0)
    tp = FULL.sections[0].shape[0] // heads.count
    full = heads.count == FULL.sections[0].shape[0]
    store = open_rank_store(config, NS, 0, rank=heads.start // heads.count, tp_size=tp,
                            layout=FULL if full else slice_layout(FULL, heads), heads=(0, 0), staging_slots=6)
    assert isinstance(store, HeadSliceStore) and store.heads == heads
    assert isinstance(store.slices, DirectorySlices)
    return store, store.slices


def _slice(full: bytes, heads: HeadRange) -> bytes:
    layout = slice_layout(FULL, heads)
    out = bytearray(layout.nbytes)
    copy_heads(FULL, memoryview(full), H(0, 2), memoryview(out), heads)
    return bytes(out)


def _store(store: HeadSliceStore, key: bytes, data: bytes) -> None:
    slot = store.acquire_slot(10)
    assert slot is not None
    slot.view[: len(data)] = data
    (res,) = store.wait([store.submit_store(key, slot, 16)], 10)
    assert res.ok and res.stored, res.error
    assert store.flush(10)


def test_tp2_halves_in_both_tiers_assemble_for_a_tp1_reader_with_its_own_local_tier(tmp_path: Path) -> None:
    key = page_key(5)
    full = page_bytes(FULL, key)
    try:
        for heads in (H(0, 1), H(1, 1)):  # the two TP=2 ranks of node a
            store, source = _rank_store(tmp_path, "local-a", heads)
            _store(store, key, _slice(full, heads))
            for tier in ("local-a", "shared"):  # the slice directory on both tiers, never r<rank>
                assert (tmp_path / tier / NS.digest / "g0" / split_dir_name(heads)).is_dir(), tier
                assert not (tmp_path / tier / NS.digest / "g0" / f"r{heads.start}").exists(), tier
            store.close()
            source.close()
        reader, source = _rank_store(tmp_path, "local-b", H(0, 2))  # TP=1, another node's local tier
        assert source.listed.wait(5)
        (res,) = reader.wait([reader.submit_load(key)], 10)
        assert res.ok and res.verified, res.error
        assert bytes(res.slot.view[: len(full)]) == full
        reader.release_slot(res.slot)
        assert reader.flush(10)
        st = reader.stats
        assert st["slice_loads"] == 1 and st["slice_files"] == 2 and st["slice_stored_back"] == 1
        for tier in ("local-b", "shared"):  # stored back under the reader's own r0, in both tiers
            assert any((tmp_path / tier / NS.digest / "g0" / "r0").rglob(f"{key.hex()}.kvp")), tier
        (again,) = reader.wait([reader.submit_load(key)], 10)
        assert again.ok and bytes(again.slot.view[: len(full)]) == full
        reader.release_slot(again.slot)
        assert reader.stats["slice_loads"] == 1  # the second hit: its own file
        reader.close()
        source.close()
    finally:
        close_shared_state()


def test_a_slice_the_shared_tier_missed_is_uploaded_under_its_slice_directory(tmp_path: Path) -> None:
    """TP=2 rank 1's shared store fails (injected ENOSPC): the page is stored locally and the
    backlog uploads it later from the local ``h1-1`` directory to the shared ``h1-1`` directory
    (the header keeps the slice), where a TP=1 reader on another node assembles the page."""
    from tierstore.testing.faults import Fault, FaultInjectingStore

    key = page_key(6)
    full = page_bytes(FULL, key)
    try:
        store, source = _rank_store(tmp_path, "local-a", H(0, 1))
        _store(store, key, _slice(full, H(0, 1)))
        store.close()
        source.close()
        store, source = _rank_store(tmp_path, "local-a", H(1, 1))
        chain = store.inner
        shared = chain.wrap_tier("shared", lambda t: FaultInjectingStore(t, [Fault("store", kind="enospc", times=1)]))
        _store(store, key, _slice(full, H(1, 1)))
        assert shared.injected[("store", "enospc")] == 1
        uploaded = tmp_path / "shared" / NS.digest / "g0" / "h1-1"
        end = time.monotonic() + 10
        while not any(uploaded.rglob(f"{key.hex()}.kvp")) and time.monotonic() < end:
            time.sleep(0.02)
            chain.poll()
        assert chain.flush(10) and len(chain.backlog) == 0
        (path,) = uploaded.rglob(f"{key.hex()}.kvp")
        meta = inspect_page(path).meta
        assert (meta.rank, meta.head_start, meta.head_count) == (1, 1, 1)
        assert not (tmp_path / "shared" / NS.digest / "g0" / "r1").exists()
        store.close()
        source.close()
        reader, source = _rank_store(tmp_path, "local-b", H(0, 2))  # TP=1, another node
        assert source.listed.wait(5)
        (res,) = reader.wait([reader.submit_load(key)], 10)
        assert res.ok and res.verified and bytes(res.slot.view[: len(full)]) == full, res.error
        reader.release_slot(res.slot)
        assert reader.stats["slice_files"] == 2
        reader.close()
        source.close()
    finally:
        close_shared_state()


def test_a_hit_on_a_shared_head_slice_stamps_that_slice_file(tmp_path: Path) -> None:
    """Touch-on-hit (gc's LRU stamp) reaches the file the hit came from, in the rank's slice
    directory: it stamped ``r<rank>`` instead (nothing there), so gc evicted hot sliced pages
    as if never read."""
    key = page_key(9)
    heads = H(1, 1)
    full = page_bytes(FULL, key)
    config = {"root": str(tmp_path / "shared"), "odirect": "off", "shared_touch_interval_s": 0}
    try:
        writer, source = _rank_store(tmp_path, "local-a", heads)
        _store(writer, key, _slice(full, heads))
        writer.close()
        source.close()
        shared_file = next((tmp_path / "shared" / NS.digest / "g0" / split_dir_name(heads)).rglob(f"{key.hex()}.kvp"))
        old = time.time() - 3600
        os.utime(shared_file, (old, old))
        layout = slice_layout(FULL, heads)
        reader = open_group_store(TierStoreConfig.from_dict({**config, "local_root": str(tmp_path / "local-b")}), NS, 0,
                                  rank=1, head_start=1, head_count=1, staging_slots=6, rank_dir=split_dir_name(heads),
                                  layout=layout)
        (res,) = reader.wait([reader.submit_load(key)], 10)
        assert res.ok and bytes(res.slot.view[: layout.nbytes]) == _slice(full, heads), res.error
        reader.release_slot(res.slot)
        end = time.monotonic() + 10
        while shared_file.stat().st_mtime < old + 60 and time.monotonic() < end:
            time.sleep(0.05)
        assert shared_file.stat().st_mtime > old + 60, "the shared slice file was not stamped"
        reader.close()
    finally:
        close_shared_state()


def test_the_fallback_reads_the_root_under_its_tiers_deadline(tmp_path: Path) -> None:
    """``open_rank_store`` gives the head-slice fallback the deadline of the tier the covering
    files are on: ``shared_deadline_s`` behind a local tier, ``deadline_s`` on a lone root."""
    try:
        for extra, want in (({"local_root": str(tmp_path / "local")}, 2.5), ({}, 7.0)):
            config = TierStoreConfig(root=str(tmp_path / "shared"), odirect="off", deadline_s=7.0,
                                     shared_deadline_s=2.5, **extra)
            store = open_rank_store(config, NS, 0, rank=0, tp_size=2, layout=slice_layout(FULL, H(0, 1)),
                                    heads=(0, 0), staging_slots=4)
            try:
                assert isinstance(store, HeadSliceStore) and store.deadline_s == want
            finally:
                store.close(5)
    finally:
        close_shared_state()
