"""The head-slice fallback (tiers/head_slice_store.py, tiers/assembly.py) trusts no more than an
engine's own loads: with a fleet key, a covering slice file written without it is never served
and never stored back under the reader's slice with a valid tag; covering files are opened
through directory fds, so a symlinked fan-out directory is not followed out of the root."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tierstore.config import TierStoreConfig
from tierstore.format.head_slices import HeadRange, copy_heads, slice_layout, split_dir_name
from tierstore.format.header import Codec, PageExpectation, PageMeta
from tierstore.format.mac import PageMac
from tierstore.format.page import encode_page
from tierstore.fs.mapper import fanout
from tierstore.rootstore.engine import IOEngine
from tierstore.rootstore.page_read import read_page
from tierstore.rootstore.publish import publish_page
from tierstore.testing.pages import page_bytes, page_key, simple_namespace
from tierstore.tiers.head_slice_store import DirectorySlices, HeadSliceStore

H = HeadRange
NS = simple_namespace("bfloat16", num_kv_heads=2)
FULL = NS.groups[0].layout
pytestmark = pytest.mark.timeout(60)


def key_file(tmp_path: Path) -> Path:
    path = tmp_path / "fleet.key"
    path.write_text(os.urandom(32).hex())
    path.chmod(0o600)
    return path


def config(root: Path, key: Path | None) -> TierStoreConfig:
    return TierStoreConfig.from_dict({"root": str(root), "io_threads": 2,
                                      **({"mac_key_file": str(key)} if key is not None else {})})


def plant_slices(root: Path, slices: DirectorySlices, key: bytes, data: bytes, at: Path | None = None) -> None:
    """A writer without the key: slices h0-1 and h1-1 of ``data`` with valid checksums and no
    MAC, published at their names (or, with ``at``, in that directory outside the root)."""
    for h in (H(0, 1), H(1, 1)):
        lay = slice_layout(FULL, h)
        part = bytearray(lay.nbytes)
        copy_heads(FULL, memoryview(data), H(0, 2), memoryview(part), h)
        meta = PageMeta(NS.digest_bytes, key, 0, NS.groups[0].kind, 16, h.start // h.count, h.start, h.count)
        header, pieces = encode_page(meta, lay, bytes(part), Codec.NONE, None)
        path, _ = slices.locate(h, key)
        if at is not None:
            path = at / split_dir_name(h) / path.name
        path.parent.mkdir(parents=True, exist_ok=True)
        publish_page(path, path.with_name(path.name + ".tmp"), header, pieces, key=key)


def own_and_slices(tmp_path: Path, key: Path | None) -> tuple[Path, IOEngine, DirectorySlices]:
    """A TP=1 engine (its own pages in r0) and the slice directories of its group."""
    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    own = IOEngine(root, NS, 0, config=config(root, key), staging_slots=4)
    slices = DirectorySlices(root / NS.digest / "g0", NS.digest_bytes, 0, FULL, refresh_s=0)
    return root, own, slices


def load(store: HeadSliceStore, key: bytes) -> tuple[bool, str | None, bytes | None]:
    (res,) = store.wait([store.submit_load(key)], 10)
    data = None
    if res.slot is not None:
        data = bytes(res.slot.view[:FULL.nbytes])
        store.release_slot(res.slot)
    return res.ok, res.error.kind if res.error is not None else None, data


def test_slices_written_without_the_key_are_never_served_or_stored_back(tmp_path: Path) -> None:
    """The review's reproduction: a TP=1 engine with ``mac_key_file``, an attacker without the
    key plants h0-1 and h1-1 (valid xxh3, no MAC) filled with 0x41. Before: served, then
    stored back in r0 with a valid fleet MAC. Now: a ``mac`` failure, nothing stored back,
    the planted files left in place (not verifiable is not damage)."""
    k = key_file(tmp_path)
    root, own, slices = own_and_slices(tmp_path, k)
    key = page_key(7)
    forged = bytes([0x41]) * FULL.nbytes
    plant_slices(root, slices, key, forged)
    slices.list_now()
    store = HeadSliceStore(own, H(0, 2), FULL, slices)
    try:
        ok, kind, data = load(store, key)
        assert data != forged and not ok and kind == "mac" and data is None, kind
        assert store.mac is own.mac is not None
        assert store.flush(10)
        time.sleep(0.2)
        assert not own.mapper.path_for(key).exists()  # nothing laundered into r0
        st = store.stats
        assert st["slice_loads"] == 0 and st["slice_stored_back"] == 0 and st["slice_failures"] == 1
        assert st["slice_damaged_removed"] == 0
        assert all(slices.locate(h, key)[0].exists() for h in (H(0, 1), H(1, 1)))
    finally:
        store.close()
        slices.close()


def test_slices_written_with_the_key_are_served_and_stored_back_with_a_valid_tag(tmp_path: Path) -> None:
    """The control: slices written by keyed writer ranks (TP=2 engines) are assembled, served
    and stored back under r0 with the fleet MAC."""
    k = key_file(tmp_path)
    root, own, slices = own_and_slices(tmp_path, k)
    key = page_key(8)
    full = page_bytes(FULL, key)
    for h in (H(0, 1), H(1, 1)):
        lay = slice_layout(FULL, h)
        writer = IOEngine(root, NS, 0, rank=h.start, head_start=h.start, head_count=h.count, config=config(root, k),
                          rank_dir=split_dir_name(h), layout=lay, staging_slots=2)
        slot = writer.acquire_slot(5)
        copy_heads(FULL, memoryview(full), H(0, 2), slot.view, h)
        (res,) = writer.wait([writer.submit_store(key, slot, 16)], 10)
        assert res.ok, res.error
        writer.close()
    slices.list_now()
    store = HeadSliceStore(own, H(0, 2), FULL, slices)
    try:
        ok, kind, data = load(store, key)
        assert ok and data == full, kind
        assert store.flush(10)
        out = memoryview(bytearray(FULL.nbytes))
        header = read_page(own.mapper.path_for(key), PageExpectation(NS.digest_bytes, key, 0, 0, FULL), out,
                           mac=PageMac.from_key_file(k))
        assert header.has_mac and bytes(out) == full
    finally:
        store.close()
        slices.close()


def test_a_symlinked_fan_out_directory_of_a_slice_is_not_followed(tmp_path: Path) -> None:
    """No key configured: a slice's fan-out directory swapped for a symlink to a directory
    outside the root holding valid slice files. Before: followed and served. Now: ``unsafe``,
    nothing read through it, the target left alone."""
    root, own, slices = own_and_slices(tmp_path, None)
    key = page_key(9)
    outside = tmp_path / "outside"
    plant_slices(root, slices, key, page_bytes(FULL, key), at=outside)
    for h in (H(0, 1), H(1, 1)):
        sdir = slices.group_dir / split_dir_name(h)
        sdir.mkdir(parents=True, exist_ok=True)
        os.symlink(outside / split_dir_name(h), sdir / fanout(key))
    slices.list_now()
    before = sorted((p, p.read_bytes()) for p in outside.rglob("*.kvp"))
    store = HeadSliceStore(own, H(0, 2), FULL, slices)
    try:
        ok, kind, data = load(store, key)
        assert not ok and kind == "unsafe" and data is None, kind
        assert store.flush(10)
        assert not own.mapper.path_for(key).exists()
        assert sorted((p, p.read_bytes()) for p in outside.rglob("*.kvp")) == before
    finally:
        store.close()
        slices.close()
