"""HeadSliceStore's fallback under a hung shared root (issue 33, defect 1): a read of other head
slices that does not return yields a typed ``timeout`` at the shared deadline, at most the
pool's threads block, and later misses are not queued behind the hung reads."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from tierstore.config import TierStoreConfig
from tierstore.errors import PageMissing
from tierstore.format.head_slices import HeadRange, slice_layout, split_dir_name
from tierstore.rootstore.engine import IOEngine
from tierstore.testing.pages import layout_namespace, page_key, simple_namespace
from tierstore.tiers import head_slice_store
from tierstore.tiers.head_slice_store import DirectorySlices, HeadSliceStore

H = HeadRange
DEADLINE_S = 0.4


def _over_slices(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, assemble: object, deadline_s: float,
                 slots: int = 16) -> tuple[HeadSliceStore, DirectorySlices]:
    """A rank's store (head 0 of 2) over a group directory where every covering file "exists"
    (as a stat answered from the attribute cache says) and every read of one is ``assemble``;
    the fallback's deadline: the config's ``shared_deadline_s``."""
    ns = simple_namespace("bfloat16", num_kv_heads=2)
    full_layout = ns.groups[0].layout
    need = H(0, 1)
    group_dir = tmp_path / "shared" / ns.digest / "g0"
    (group_dir / split_dir_name(H(0, 2))).mkdir(parents=True)  # another TP's slice directory
    slices = DirectorySlices(group_dir, ns.digest_bytes, 0, full_layout, refresh_s=0)
    assert slices.listed.wait(5)
    monkeypatch.setattr(DirectorySlices, "locate", lambda self, h, key: (tmp_path / "README", None))
    (tmp_path / "README").write_bytes(b"")
    monkeypatch.setattr(head_slice_store, "assemble", assemble)
    layout = slice_layout(full_layout, need)
    own = IOEngine(tmp_path / "own", layout_namespace(layout, 16, model="own"), 0, staging_slots=slots,
                   config=TierStoreConfig.from_dict({"root": str(tmp_path / "own"), "shared_deadline_s": deadline_s}))
    return HeadSliceStore(own, need, full_layout, slices, store_back=False), slices


def test_a_hung_fallback_times_out_at_the_deadline_and_later_loads_do_not_queue(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hung = threading.Event()
    entered: list[bytes] = []

    def hung_assemble(*args: object, **kwargs: object) -> object:  # a hard NFS mount, its server stopped
        entered.append(b"")
        hung.wait(30)
        raise AssertionError("served after the hang")

    probed = threading.Event()

    def hung_probe(self: HeadSliceStore) -> None:  # the mount hangs for the health probe too
        probed.set()
        hung.wait(30)

    monkeypatch.setattr(HeadSliceStore, "_probe", hung_probe)
    store, slices = _over_slices(tmp_path, monkeypatch, hung_assemble, DEADLINE_S, slots=8)
    try:
        t0 = time.monotonic()
        first = [store.submit_load(page_key(i)) for i in range(2)]
        got = store.wait(first, 10)
        waited = time.monotonic() - t0
        assert sorted(r.job_id for r in got) == sorted(first)
        assert all(not r.ok and r.error is not None and r.error.kind == "timeout" for r in got), got
        assert DEADLINE_S * 0.9 <= waited < DEADLINE_S + 1.5, waited
        # The fallback is down now: the next misses are answered at once, nothing queued.
        t1 = time.monotonic()
        # (six of the eight slots are free: each hung read holds one)
        later = store.wait([store.submit_load(page_key(i)) for i in range(2, 8)], 10)
        assert time.monotonic() - t1 < DEADLINE_S
        assert [r.error.kind if r.error else "ok" for r in later] == ["missing"] * 6
        assert len(entered) == 2  # only the two hung threads ever read
        st = store.stats
        assert st["slice_timeouts"] == 2 and st["slice_skipped"] == 6
        # Down since the deadline, and still down: the health probe (the hung one above, not a
        # probe of the real directory, which would answer and mark it up) does not return.
        assert probed.wait(5) and not store.health.up
    finally:
        hung.set()
        store.close()
        slices.close()


def test_queued_fallbacks_are_bounded_while_threads_hang(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before any deadline passes: two reads hang on the pool's two threads; once both have
    been at it for STALL_S, every later miss is handed out as a miss at once instead of
    joining the queue."""
    hung = threading.Event()
    entered: list[int] = []
    store, slices = _over_slices(tmp_path, monkeypatch, lambda *a, **k: entered.append(1) or hung.wait(30), 30)
    try:
        first = [store.submit_load(page_key(i)) for i in range(2)]
        assert not store.wait(first, head_slice_store.STALL_S + 0.3)  # both hang on the pool's threads
        assert len(entered) == 2
        jobs = [store.submit_load(page_key(i)) for i in range(2, 10)]
        t0 = time.monotonic()
        got = store.wait(jobs, 1.0)
        assert time.monotonic() - t0 < 2.0
        assert len(got) == 8 and all(r.error is not None and r.error.kind == "missing" for r in got)
        assert store.stats["slice_skipped"] == 8 and len(entered) == 2
    finally:
        hung.set()
        store.close()
        slices.close()



def test_a_burst_of_misses_on_a_healthy_root_is_assembled_in_full(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A TP change misses every page of a prompt at once: none of them is given up as long as
    the pool's threads make progress (a bound of 2 x threads queued fallbacks recomputed 5 of 7
    pages of every cross-TP prompt in the vLLM tests)."""
    tried: list[int] = []

    def slow_assemble(*a: object, **k: object) -> None:  # a healthy root: 20 ms a read, then "gone"
        tried.append(1)
        time.sleep(0.02)
        raise PageMissing("not in any slice either")

    store, slices = _over_slices(tmp_path, monkeypatch, slow_assemble, 30)
    try:
        jobs = [store.submit_load(page_key(i)) for i in range(12)]
        got = store.wait(jobs, 10)
        assert len(got) == 12 and len(tried) == 12  # every miss was tried on the other slices
        assert store.stats["slice_skipped"] == 0
    finally:
        store.close()
        slices.close()
