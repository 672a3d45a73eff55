"""An I/O thread takes a batch of queued jobs (``io_batch_pages``): loads of good, missing,
damaged and odd-sized pages in one batch each come back with their own result, exactly once;
the batch is really taken (the queue's counters), on the native path (one GIL-free call for the
batch) and on the Python path; with ``io_batch_pages`` 1 no batch is taken."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from test_crash_safety import crash_namespace, pattern

from tierstore.config import TierStoreConfig
from tierstore.native import loader as native
from tierstore.rootstore.engine import IOEngine
from tierstore.rootstore.page_files import settle_format_marker
from tierstore.testing.pages import page_key

GROUP = 0


def _submit_store(eng: IOEngine, key: bytes) -> int:
    """Submit a store of ``key``'s pattern page; its job id."""
    slot = eng.acquire_slot(timeout=5)
    assert slot is not None
    slot.view[:] = pattern(key, GROUP, eng.layout.nbytes)
    return eng.submit_store(key, slot, 128)


def _store_all(eng: IOEngine, keys: list[bytes]) -> None:
    ids = [_submit_store(eng, key) for key in keys]
    results = eng.wait(ids, timeout=60)
    assert len(results) == len(keys) and all(r.ok for r in results), [r.error for r in results if not r.ok]


def _hold_threads(eng: IOEngine, threads: int) -> threading.Event:
    """Occupy every I/O thread with a store that waits for the returned event, so the loads
    submitted next queue up and each thread then takes a batch of them."""
    gate = threading.Event()
    started = threading.Semaphore(0)
    real = eng.ops.store

    def held(*args: object) -> tuple[bool, int]:
        started.release()
        assert gate.wait(30)
        return real(*args)  # type: ignore[arg-type]

    eng.ops.store = held  # type: ignore[method-assign]
    for i in range(threads):
        slot = eng.acquire_slot(timeout=5)
        assert slot is not None
        key = page_key(10_000 + i)
        slot.view[:] = pattern(key, GROUP, eng.layout.nbytes)
        eng.submit_store(key, slot, 128)
    for _ in range(threads):
        assert started.acquire(timeout=30)
    eng.ops.store = real  # type: ignore[method-assign]
    return gate


def _batch_engine(tmp_path: Path, path: str, batch: int, monkeypatch: pytest.MonkeyPatch) -> IOEngine:
    """An engine of 2 I/O threads and 40 slots on the native or the Python path."""
    if path == "native" and not native.start(wait=True):
        pytest.skip(f"native path unavailable: {native.failure()}")
    if path == "python":
        monkeypatch.setattr(native, "_kernels", None)
    root = str(tmp_path / "root")
    return IOEngine(root, crash_namespace(), GROUP, staging_slots=40,
                    config=TierStoreConfig(root=root, io_threads=2, io_batch_pages=batch, io_loop="python"))


@pytest.mark.parametrize("path", ["native", "python"])
@pytest.mark.parametrize("batch", [8, 1])
def test_a_batch_of_loads_gives_each_page_its_own_result(tmp_path: Path, path: str, batch: int,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    eng = _batch_engine(tmp_path, path, batch, monkeypatch)
    threads = 2
    try:
        good = [page_key(i) for i in range(20)]
        _store_all(eng, good)
        damaged, short = good[3], good[11]  # a flipped payload byte; a file cut short
        p = Path(eng.mapper.final_path(damaged))
        data = bytearray(p.read_bytes())
        data[-100] ^= 0xFF
        p.write_bytes(bytes(data))
        q = Path(eng.mapper.final_path(short))
        with open(q, "r+b") as f:
            f.truncate(os.path.getsize(q) - 64)
        missing = [page_key(500 + i) for i in range(4)]
        order = good[:10] + missing[:2] + good[10:] + missing[2:]

        gate = _hold_threads(eng, threads)
        ids = {eng.submit_load(key): key for key in order}
        gate.set()
        results = eng.wait(list(ids), timeout=60)
        assert sorted(r.job_id for r in results) == sorted(ids), "a job was lost or came back twice"
        assert eng.flush(30)
        for r in results:
            key = ids[r.job_id]
            if key in missing:
                assert not r.ok and r.error.kind == "missing", (key.hex(), r.error)  # type: ignore[union-attr]
            elif key == damaged:
                assert not r.ok and r.error.kind == "checksum", r.error  # type: ignore[union-attr]
            elif key == short:
                assert not r.ok and r.error.kind in ("truncated", "corrupt"), r.error  # type: ignore[union-attr]
            else:
                assert r.ok, (key.hex(), r.error)
                assert bytes(r.slot.view) == pattern(key, GROUP, eng.layout.nbytes)  # type: ignore[union-attr]
            if r.slot is not None:
                eng.release_slot(r.slot)
        assert not p.exists(), "the damaged page is removed (so it can be stored again)"
        q_ = eng._queue
        if batch > 1:
            assert q_.batches >= 2 and q_.batched_jobs >= 16, (q_.batches, q_.batched_jobs)
        else:
            assert q_.batches == 0
        assert eng.free_slots == 40, "a staging slot was lost"
    finally:
        eng.close()


@pytest.mark.parametrize("op", ["load", "store"])
def test_a_failing_batch_call_falls_back_to_one_by_one(tmp_path: Path, op: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug in the batch path (here: the native batch call of loads or of stores raising)
    costs speed, not pages."""
    if not native.start(wait=True):
        pytest.skip(f"native path unavailable: {native.failure()}")
    from tierstore.native import page_calls as native_page

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("injected")

    monkeypatch.setattr(native_page, f"{op}_pages", broken)
    root = str(tmp_path / "root")
    eng = IOEngine(root, crash_namespace(), GROUP, staging_slots=24,
                   config=TierStoreConfig(root=root, io_threads=2, io_batch_pages=8, io_loop="python"))
    try:
        keys = [page_key(i) for i in range(12)]
        if op == "load":
            _store_all(eng, keys)
        gate = _hold_threads(eng, 2)
        ids = {}
        for key in keys:
            if op == "load":
                ids[eng.submit_load(key)] = key
                continue
            ids[_submit_store(eng, key)] = key
        gate.set()
        results = eng.wait(list(ids), timeout=60)
        assert len(results) == len(keys) and all(r.ok for r in results), [r.error for r in results if not r.ok]
        for r in results:
            if op == "store":
                assert r.stored and Path(eng.mapper.final_path(ids[r.job_id])).exists()
                continue
            assert bytes(r.slot.view) == pattern(ids[r.job_id], GROUP, eng.layout.nbytes)  # type: ignore[union-attr]
            eng.release_slot(r.slot)  # type: ignore[arg-type]
        assert eng._queue.batched_jobs >= 8
    finally:
        eng.close()


def test_batches_hold_at_most_16_mib_of_pages(tmp_path: Path) -> None:
    """io_batch_pages is cut to 16 MiB of pages (large pages go one by one: a thread holding
    several while others idle cost 16 MiB loads ~12%), and the engine runs with the cut value."""
    from tierstore.rootstore.engine import io_batch_for

    mib = 1 << 20
    assert [io_batch_for(8, p * mib) for p in (1, 2, 4, 8, 16, 64)] == [8, 8, 4, 2, 1, 1]
    assert io_batch_for(1, 2 * mib) == 1 and io_batch_for(32, 256 * 1024) == 32
    cfg = TierStoreConfig(root=str(tmp_path), io_threads=2, io_batch_pages=8)
    with IOEngine(tmp_path, crash_namespace(), 0, config=cfg) as engine:
        page = engine.layout.nbytes
        assert engine.stats["io_batch_pages"] == io_batch_for(8, page) == min(8, max(1, (16 * mib) // page))


@pytest.mark.parametrize("path", ["native", "python"])
@pytest.mark.parametrize("batch", [8, 1])
def test_a_batch_of_stores_gives_each_page_its_own_result(tmp_path: Path, path: str, batch: int,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Stores of new and already stored keys taken as batches: each its own result (stored or
    not), every page readable and verified after; on the native path one GIL-free call per batch."""
    from tierstore.native import page_calls as native_page

    sizes: list[int] = []
    real_many = native_page.store_pages

    def counted(shape, rank_fd, files, *rest):  # noqa: ANN001, ANN202
        sizes.append(len(files))
        return real_many(shape, rank_fd, files, *rest)

    monkeypatch.setattr(native_page, "store_pages", counted)
    eng = _batch_engine(tmp_path, path, batch, monkeypatch)
    root, threads = str(tmp_path / "root"), 2
    try:
        old = [page_key(i) for i in range(3)]
        _store_all(eng, old)
        keys = [page_key(i) for i in range(20)]  # the first three exist already
        gate = _hold_threads(eng, threads)
        ids = {}
        for key in keys:
            ids[_submit_store(eng, key)] = key
        gate.set()
        results = eng.wait(list(ids), timeout=60)
        assert sorted(r.job_id for r in results) == sorted(ids), "a job was lost or came back twice"
        for r in results:
            assert r.ok, (ids[r.job_id].hex(), r.error)
            assert r.stored == (ids[r.job_id] not in old)
        assert eng.flush(30)
        for key in keys:
            slot_id = eng.submit_load(key)
            [res] = eng.wait([slot_id], timeout=30)
            assert res.ok and bytes(res.slot.view) == pattern(key, GROUP, eng.layout.nbytes)  # type: ignore[union-attr]
            eng.release_slot(res.slot)  # type: ignore[arg-type]
        q_ = eng._queue
        if batch > 1:
            assert q_.batches >= 2 and q_.batched_jobs >= 16, (q_.batches, q_.batched_jobs)
            if path == "native":
                assert len(sizes) == q_.batches and sum(sizes) == q_.batched_jobs, (sizes, q_.batches)
        else:
            assert q_.batches == 0 and not sizes
        assert settle_format_marker(root)  # the root's marker is written on a thread of its own
        assert not list(Path(root).rglob("*.tmp")), "a temp file was left"
        assert eng.free_slots == 40, "a staging slot was lost"
    finally:
        eng.close()

