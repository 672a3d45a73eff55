"""Shared-tier gc on a plain directory: cap, LRU by touch stamp, lease, trash, temps, CLI."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import pytest

from tierstore.mapper import FileMapper
from tierstore.testing.pages import fill_pages, simple_namespace
from tierstore.tiers import gc
from tierstore.tiers.lease import LEASE_NAME, Lease

NS = simple_namespace()


def pages(root: Path) -> dict[str, int]:
    out = {}
    for dirpath, _, files in os.walk(root / NS.digest):
        for n in files:
            if n.endswith(".kvp"):
                out[n] = os.stat(os.path.join(dirpath, n)).st_mtime_ns
    return out


def fill(root: Path, n: int) -> list[Path]:
    stored = fill_pages(root, NS, n)
    paths = []
    base = time.time() - 1000
    for i, p in enumerate(stored):
        path = FileMapper(root, NS.digest, p.group_index, p.rank).path_for(p.key)
        os.utime(path, (base + i, base + i))  # page i used at base + i
        paths.append(path)
    return paths


def test_gc_evicts_least_recently_touched_down_to_watermark(tmp_path: Path) -> None:
    paths = fill(tmp_path, 20)
    size = paths[0].stat().st_size
    # a hit on the two oldest pages refreshes their stamp (what readers do on a shared hit)
    for p in paths[:2]:
        os.utime(p)
    cap = 10 * size
    rep = gc.collect(tmp_path, cap, low_watermark=0.8)
    assert not rep.busy and rep.pages == 20
    assert rep.total_after <= cap * 0.8
    left = {p.name for p in paths if p.exists()}
    # evicted: the oldest untouched pages 2.., kept: the two touched ones and the newest
    assert paths[0].name in left and paths[1].name in left
    evicted = [p for p in paths if not p.exists()]
    assert evicted == paths[2 : 2 + len(evicted)]
    assert rep.evicted == len(evicted) > 0
    assert list((tmp_path / gc.TRASH_DIR).iterdir()) == []  # grace 0: unlinked at once
    assert not (tmp_path / LEASE_NAME).exists()  # lease released


def test_gc_under_cap_does_nothing(tmp_path: Path) -> None:
    paths = fill(tmp_path, 5)
    rep = gc.collect(tmp_path, 1 << 30)
    assert rep.evicted == 0 and all(p.exists() for p in paths)


def test_gc_respects_a_live_lease_and_takes_an_expired_one(tmp_path: Path) -> None:
    fill(tmp_path, 5)
    other = Lease(tmp_path, ttl_s=30, settle_s=0)
    assert other.acquire()
    rep = gc.collect(tmp_path, 1, lease=Lease(tmp_path, settle_s=0))
    assert rep.busy and rep.evicted == 0
    # the other evictor died: its lease expires (ttl + skew) and we take over
    (tmp_path / LEASE_NAME).write_text(json.dumps({"owner": "dead:1:x", "expires": time.time() - 60}))
    rep = gc.collect(tmp_path, 1, lease=Lease(tmp_path, settle_s=0))
    assert not rep.busy and rep.evicted == 5


def test_lease_garbage_counts_as_absent_and_loser_detects_loss(tmp_path: Path) -> None:
    (tmp_path / LEASE_NAME).write_bytes(b"\x00garbage")
    a = Lease(tmp_path, settle_s=0, ttl_s=0.3)
    assert a.acquire()
    b = Lease(tmp_path, settle_s=0, ttl_s=0.3, skew_s=0)
    assert not b.acquire()
    time.sleep(0.35)
    assert b.acquire()  # a's lease expired
    assert not a.renew_if_due()  # a sees b's owner id and stops


def test_trash_grace_and_stale_temps(tmp_path: Path) -> None:
    paths = fill(tmp_path, 6)
    size = paths[0].stat().st_size
    tmp = paths[0].with_name(f".{'ab' * 16}.kvp.otherhost.4242.deadbeef.tmp")
    tmp.write_bytes(b"x" * 100)
    old = time.time() - 7200
    os.utime(tmp, (old, old))
    cap = 3 * size + 2000  # the manifest (about 1 KiB) counts too
    rep = gc.collect(tmp_path, cap, low_watermark=1.0, trash_grace_s=30)
    assert rep.temps_removed == 1 and not tmp.exists()
    assert rep.evicted == 3
    trash = list((tmp_path / gc.TRASH_DIR).iterdir())
    assert len(trash) == 3  # still there during the grace period
    rep2 = gc.collect(tmp_path, cap, low_watermark=1.0, trash_grace_s=0)
    assert rep2.trash_removed == 3 and rep2.evicted == 0
    assert list((tmp_path / gc.TRASH_DIR).iterdir()) == []


def test_open_reader_keeps_whole_page_while_evicted(tmp_path: Path) -> None:
    paths = fill(tmp_path, 2)
    data = paths[0].read_bytes()
    with open(paths[0], "rb") as f:
        head = f.read(100)
        rep = gc.collect(tmp_path, 1, low_watermark=0.0)
        assert rep.evicted == 2 and not paths[0].exists()
        assert head + f.read() == data


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    paths = fill(tmp_path, 8)
    size = paths[0].stat().st_size
    parser = argparse.ArgumentParser()
    gc.add_arguments(parser)
    args = parser.parse_args([str(tmp_path), "--max-bytes", str(4 * size), "--json"])
    assert gc.run(args) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["evicted"] >= 4 and rep["total_after"] <= 4 * size
    assert gc.parse_bytes("10G") == 10 << 30 and gc.parse_bytes("512MiB") == 512 << 20
    with pytest.raises(argparse.ArgumentTypeError):
        gc.parse_bytes("lots")
    assert gc.run(parser.parse_args([str(tmp_path / "nope"), "--max-bytes", "1"])) == 2
