"""CPU-side pieces of ``tierstore bench kernels`` (the benchmark itself needs a CUDA device)."""

from __future__ import annotations

import time

import pytest

from tierstore.bench import kernels as bk


def test_idle_tracks_progress_and_reports_a_stall(monkeypatch: pytest.MonkeyPatch) -> None:
    before = time.perf_counter()
    last, stalled = bk._idle(True, 0.0)
    assert last >= before and not stalled  # progress: now
    assert bk._idle(False, last) == (last, False)  # no progress yet: unchanged
    monkeypatch.setattr(bk, "STALL_S", 0.0)
    assert bk._idle(False, 0.0) == (0.0, True)


def test_median_run_pairs_ratios_and_keeps_the_spread() -> None:
    runs = [{"store_gbps": g, "store_ratio": r, "verified": v, "case": "c", "raw_files": {"write_gbps": w}}
            for g, r, v, w in ((1.0, 0.5, True, 2.0), (3.0, 0.9, True, 4.0), (2.0, 0.7, False, 3.0))]
    out = bk._median_run(runs)
    assert out["store_gbps"] == 2.0 and out["store_ratio"] == 0.7 and out["raw_files"] == {"write_gbps": 3.0}
    assert out["verified"] is False  # every repeat must verify
    assert out["repeats"] == 3 and [r["store_ratio"] for r in out["per_repeat"]] == [0.5, 0.9, 0.7]
