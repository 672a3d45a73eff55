"""A full root: after ENOSPC/EDQUOT a tier skips its stores (counted as ``failures["full"]``,
one warning per episode naming the root and what to do) but one trial store per probe
interval, loads go on, and the episode ends at the first store that goes through (space freed
by anyone) or at once when gc in this process frees space."""

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
from tierstore.native import page_calls as native_page
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


def _tier(root: Path) -> tuple[IOEngine, EngineTier, object]:
    eng = IOEngine(root, simple_namespace("float16", tokens_per_chunk=16), 0,
                   config=TierStoreConfig(root=str(root), io_threads=2, io_loop="python"))  # the lane's
    # compiled stores would not see the patched os.open
    metrics = MetricsRegistry().tier("root")
    return eng, EngineTier("root", eng, metrics, 16), metrics


def test_a_full_root_skips_stores_but_one_trial_per_probe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """After ENOSPC the tier skips its stores, one trial store per probe interval reaching the
    disk; when space comes back by someone else's hand (another node's gc, an operator: nothing
    in this process says so) the next trial goes through and stores resume, within one probe."""
    monkeypatch.setattr(deadline, "FULL_PROBE_S", 1.0)
    root = tmp_path / "root"
    eng, tier, metrics = _tier(root)
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
            assert "tierstore gc" in warnings[0] and "one trial store every 1 s" in warnings[0]
            for trial in range(2):  # a probe interval passed: one store tries the disk, still full
                time.sleep(1.1)
                assert store(tier, key(5 + 2 * trial)).error.kind == "enospc"
                assert eng.stats["stores_failed"] == {"enospc": 2 + trial}
                assert store(tier, key(6 + 2 * trial)).error.kind == "enospc"  # skipped: not a trial
                assert metrics.failures()["full"] == 4 + trial
            assert len([r for r in caplog.records if "is full" in r.getMessage()]) == 1  # one episode, one line
        # space is back (nothing in this process freed it): stores resume within one probe
        skipped_before = metrics.failures()["full"]
        t0 = time.monotonic()
        while not store(tier, key(9)).ok:
            assert time.monotonic() - t0 < 1.5, "stores did not resume within one probe"
            time.sleep(0.05)
        assert tier.space is not None and not tier.space.full
        assert store(tier, key(10)).ok and metrics.failures()["full"] >= skipped_before
        assert any("has room again" in r.getMessage() for r in caplog.records)
    finally:
        tier.close()


def test_gc_freeing_space_in_this_process_ends_the_skip_at_once(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(deadline, "FULL_PROBE_S", 60.0)  # no trial during the test
    root = tmp_path / "root"
    _eng, tier, _metrics = _tier(root)
    try:
        assert store(tier, key(0)).ok
        with monkeypatch.context() as full:
            _fill_up(full)
            assert store(tier, key(1)).error.kind == "enospc"
        assert store(tier, key(2)).error.kind == "enospc"  # skipped: space came back, no trial due
        rep = gc.collect(root, max_bytes=1)
        assert rep.evicted >= 1
        assert store(tier, key(3)).ok
        assert tier.space is not None and not tier.space.full
    finally:
        tier.close()
