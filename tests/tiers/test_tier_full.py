"""A full root (issue 33, defect 4): after ENOSPC/EDQUOT a tier skips its stores for a back-off
(counted as ``failures["full"]``, one warning per episode naming the root and what to do),
loads go on, the back-off doubles while the root stays full, and gc freeing space ends it."""

from __future__ import annotations

import errno
import logging
import os
import time
from pathlib import Path

import pytest
from tiers_helpers import key, load, store

from tierstore.config import TierStoreConfig
from tierstore.fs import deadline
from tierstore.metrics import MetricsRegistry
from tierstore.native import loader as native
from tierstore.native import page as native_page
from tierstore.rootstore import engine as engine_mod
from tierstore.rootstore.engine import IOEngine
from tierstore.testing.pages import simple_namespace
from tierstore.tiers import gc
from tierstore.tiers.tier import EngineTier


def _fill_up(monkeypatch: pytest.MonkeyPatch, code: int = errno.ENOSPC) -> None:
    """Every new file fails ``code`` (os.open with O_CREAT; the native store hands back)."""
    real_open = os.open

    def fake_open(path: str, flags: int, *a: object, **kw: object) -> int:
        if flags & os.O_CREAT:
            raise OSError(code, os.strerror(code), path)
        return real_open(path, flags, *a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(engine_mod.os, "open", fake_open)
    monkeypatch.setattr(native_page, "store_page", lambda *a: native.STORE_FAILED)
    monkeypatch.setattr(native_page, "store_pages", lambda *a: None)


def test_stores_skipped_over_a_quota_say_edquot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A quota (EDQUOT) starts the same back-off; the stores it skips name EDQUOT, not ENOSPC
    (seen on a kernel NFS export with an ext4 quota: tests/nfs_kernel, scenario h)."""
    root = tmp_path / "root"
    eng = IOEngine(root, simple_namespace("float16", tokens_per_chunk=16), 0,
                   config=TierStoreConfig(root=str(root), io_threads=2, io_loop="python"))
    tier = EngineTier("root", eng, MetricsRegistry().tier("root"), 16)
    try:
        with monkeypatch.context() as full:
            _fill_up(full, errno.EDQUOT)
            results = [store(tier, key(i)) for i in range(3)]
        assert [r.error.kind for r in results] == ["enospc"] * 3  # type: ignore[union-attr]
        assert [r.error.errno for r in results] == [errno.EDQUOT] * 3  # type: ignore[union-attr]
    finally:
        tier.close()


def test_a_full_root_skips_stores_until_the_timer_or_gc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(deadline, "FULL_BACKOFF_S", 2.0)  # (doubles to 4 s)
    root = tmp_path / "root"
    eng = IOEngine(root, simple_namespace("float16", tokens_per_chunk=16), 0,
                   config=TierStoreConfig(root=str(root), io_threads=2, io_loop="python"))  # the lane's
    # compiled stores would not see the patched os.open below
    metrics = MetricsRegistry().tier("root")
    tier = EngineTier("root", eng, metrics, 16)
    try:
        assert store(tier, key(0)).ok
        with monkeypatch.context() as full:
            _fill_up(full)
            caplog.set_level(logging.WARNING, logger="tierstore.fs.deadline")
            first = store(tier, key(1))
            assert first.error is not None and first.error.kind == "enospc"
            skipped = [store(tier, key(i)) for i in range(2, 5)]
            assert all(r.error is not None and r.error.kind == "enospc" for r in skipped)
            assert metrics.failures().get("full") == 3
            assert eng.stats["stores_failed"] == {"enospc": 1}  # the skipped ones never reached the disk
            assert load(tier, key(0))[0]  # loads go on
            warnings = [r.getMessage() for r in caplog.records if "is full" in r.getMessage()]
            assert len(warnings) == 1 and str(root) in warnings[0] and "max_bytes" in warnings[0]
            assert "tierstore gc" in warnings[0]
            time.sleep(2.1)  # the timer passed: the next store tries the disk again, still full
            assert store(tier, key(5)).error.kind == "enospc"
            assert eng.stats["stores_failed"] == {"enospc": 2}
            assert store(tier, key(6)).error.kind == "enospc" and metrics.failures()["full"] == 4
            assert len([r for r in caplog.records if "is full" in r.getMessage()]) == 1  # one episode, one line
        # gc frees space under the root: stores resume at once (the doubled back-off not waited for)
        rep = gc.collect(root, max_bytes=1)
        assert rep.evicted >= 1
        assert store(tier, key(7)).ok
        assert tier.space is not None and not tier.space.full
    finally:
        tier.close()
