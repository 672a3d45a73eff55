"""Full and read-only file systems: store failures come back per key, the engine goes on.

A 2 MiB tmpfs fills up after a few pages: later stores fail with kind ``enospc`` (no temp
file left behind), earlier pages still load, and freeing space lets stores succeed again.
Remounted read-only, stores fail with kind ``readonly`` while loads keep working; an engine
started on a read-only root still serves loads. Needs root (mount); without the permission
the same checks run against a simulated errno (os.open monkeypatched) and say so.
"""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tierstore.config import TierStoreConfig
from tierstore.format.identity import Namespace
from tierstore.native import loader as native
from tierstore.native import page_calls as native_page
from tierstore.rootstore import engine as engine_mod
from tierstore.rootstore.engine import IOEngine, IOResult
from tierstore.testing.pages import page_bytes, page_key, simple_namespace


def _ns() -> Namespace:
    # 2 layers x [4, 64, 2, 64] fp16 = 128 KiB per page: a 2 MiB tmpfs holds about 14.
    return simple_namespace("float16", tokens_per_chunk=64, num_kv_heads=4, head_size=64)


def _mount(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["mount", *args], capture_output=True, text=True, timeout=30)


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path | None]:
    """A mounted 2 MiB tmpfs, or None when mounting is not permitted."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    proc = _mount("-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt))
    if proc.returncode != 0:
        yield None
        return
    try:
        yield mnt
    finally:
        _mount("-o", "remount,rw", str(mnt))
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)


def _store(eng: IOEngine, i: int) -> IOResult:
    slot = eng.acquire_slot(timeout=5)
    assert slot is not None
    slot.view[:] = page_bytes(eng.layout, page_key(i))
    [res] = eng.wait([eng.submit_store(page_key(i), slot, 64)], timeout=10)
    return res


def _load_ok(eng: IOEngine, i: int) -> bool:
    [res] = eng.wait([eng.submit_load(page_key(i))], timeout=10)
    if res.slot is None:
        return False
    good = bytes(res.slot.view) == page_bytes(eng.layout, page_key(i))
    eng.release_slot(res.slot)
    return res.ok and good


def _simulate(monkeypatch: pytest.MonkeyPatch, err: int) -> None:
    real_open = os.open

    def fake_open(path: str, flags: int, *a: object, **kw: object) -> int:
        if flags & os.O_CREAT:
            raise OSError(err, os.strerror(err), path)
        return real_open(path, flags, *a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(engine_mod.os, "open", fake_open)
    # The native store (native.py) creates its temp without os.open: it fails as it would on
    # that errno (temp removed, code < 0) and hands the store to the patched Python path.
    monkeypatch.setattr(native_page, "store_page", lambda *a: native.STORE_FAILED)
    monkeypatch.setattr(native_page, "store_pages", lambda *a: None)  # batches: one by one, as above


def _temps(root: Path) -> list[Path]:
    return [p for p in root.rglob("*.tmp")]


def test_full_file_system(small_fs: Path | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = small_fs if small_fs is not None else tmp_path / "root"
    eng = IOEngine(root, _ns(), 0, config=TierStoreConfig(root=str(root), io_threads=2))
    results = []
    for i in range(24):
        if small_fs is None and i == 8:  # no tmpfs: the disk "fills up" here
            _simulate(monkeypatch, errno.ENOSPC)
        results.append(_store(eng, i))
    ok = [i for i, r in enumerate(results) if r.ok]
    failed = [r for r in results if not r.ok]
    assert 4 <= len(ok) < 24 and failed, [r.error for r in results]
    assert {r.error.kind for r in failed if r.error} == {"enospc"}
    assert all(r.error is not None and r.error.key == r.key for r in failed)
    assert _temps(root) == []  # a failed store removes its temp file
    assert all(_load_ok(eng, i) for i in ok)  # earlier pages still load
    assert eng.stats["stores_failed"] == {"enospc": len(failed)}
    # Space comes back (gc, an operator): the same engine stores again.
    monkeypatch.undo()
    for i in ok[:3]:
        eng.mapper.path_for(page_key(i)).unlink()
    first_failed = next(i for i, r in enumerate(results) if not r.ok)
    assert _store(eng, first_failed).ok
    assert _load_ok(eng, first_failed)
    eng.close()
    if small_fs is None:
        pytest.skip("mount not permitted: ENOSPC was simulated (os.open patched), not real")


def test_read_only_file_system(small_fs: Path | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = small_fs if small_fs is not None else tmp_path / "root"
    cfg = TierStoreConfig(root=str(root), io_threads=2)
    eng = IOEngine(root, _ns(), 0, config=cfg)
    assert all(_store(eng, i).ok for i in range(3))
    if small_fs is not None:
        proc = _mount("-o", "remount,ro", str(root))
        assert proc.returncode == 0, proc.stderr
    else:
        _simulate(monkeypatch, errno.EROFS)
    res = [_store(eng, i) for i in range(3, 6)]
    assert [r.error.kind if r.error else None for r in res] == ["readonly"] * 3
    assert all(_load_ok(eng, i) for i in range(3))
    assert _store(eng, 0).ok  # already there: counts as stored, nothing written
    eng.close()
    # An engine started on a read-only root still serves loads.
    ro = IOEngine(root, _ns(), 0, config=cfg)
    assert ro.stats["io_mode"] == "buffered" or small_fs is None
    assert all(_load_ok(ro, i) for i in range(3))
    [r] = [_store(ro, 9)]
    assert r.error is not None and r.error.kind == "readonly"
    ro.close()
    if small_fs is None:
        pytest.skip("mount not permitted: EROFS was simulated (os.open patched), not real")
