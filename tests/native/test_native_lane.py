"""The native I/O lane (``native_lane.NativeLane``, setting ``io_loop``): jobs run on compiled
threads that never return to Python, and come back with the results, bytes and failures of
the Python I/O threads (``io_loop`` "python", the reference here)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from tiers_helpers import load_page, store_data

from tierstore.config import TierStoreConfig
from tierstore.format.checksums import section_checksums
from tierstore.native import loader as native
from tierstore.rootstore.engine import IOEngine
from tierstore.testing.pages import corrupt_flip_bit, hybrid_namespace, page_bytes, page_key


@pytest.fixture(autouse=True)
def _compiled() -> None:
    if not native.start(wait=True) or native.lane_kernels() is None:
        pytest.skip(f"native path unavailable: {native.failure()}")


def _engine(root: Path, group: int = 2, **cfg: object) -> IOEngine:
    extra = {k: cfg.pop(k) for k in ("staging_slots", "deadline_s") if k in cfg}
    config = TierStoreConfig.from_dict({"root": str(root), "odirect": "off", **cfg})
    return IOEngine(root, hybrid_namespace(), group, config=config, **extra)  # type: ignore[arg-type]


def _lane_jobs(eng: IOEngine) -> int:
    return int(eng.stats["jobs_native_loop"])


@pytest.mark.parametrize("odirect", ["off", "auto"])
@pytest.mark.parametrize("group", [0, 2])
def test_the_lane_writes_the_python_threads_bytes_and_reads_them_back(tmp_path: Path, group: int, odirect: str) -> None:
    files = {}
    for loop in ("native", "python"):
        root = tmp_path / loop
        eng = _engine(root, group, io_loop=loop, odirect=odirect)
        pages = {page_key(i): page_bytes(eng.layout, page_key(i), group) for i in range(6)}
        for key, data in pages.items():
            res = store_data(eng, key, data)
            assert res.ok and res.stored, res
        again = store_data(eng, page_key(0), pages[page_key(0)])
        assert again.ok and not again.stored  # the name exists: stored, nothing written
        for key, data in pages.items():
            res, got = load_page(eng, key)
            assert res.ok and res.verified and got == data, res
        # every store and load of a new page runs in the lane; the store onto an existing name
        # is answered where its file type is checked (a FIFO or directory there is not "stored")
        assert _lane_jobs(eng) == (2 * len(pages) if loop == "native" else 0)
        files[loop] = {k: eng.mapper.path_for(k).read_bytes() for k in pages}
        eng.close()
    assert files["native"] == files["python"]  # canonical bytes whichever loop wrote them


def test_unverified_loads_hand_back_the_header_sums_and_given_sums_are_written(tmp_path: Path) -> None:
    eng = _engine(tmp_path)
    key = page_key(1)
    data = page_bytes(eng.layout, key, 2)
    sums = section_checksums(eng.layout, memoryview(data))
    slot = eng.acquire_slot(5)
    assert slot is not None
    slot.view[:] = data
    (res,) = eng.wait([eng.submit_store(key, slot, 16, sums=sums)], 10)
    assert res.ok and res.stored
    (res,) = eng.wait([eng.submit_load(key, verify=False)], 10)
    assert res.ok and not res.verified and list(res.sums) == list(sums)
    assert bytes(res.slot.view) == data
    eng.settle(res, True)
    eng.release_slot(res.slot)
    assert _lane_jobs(eng) == 2 and eng.stats["loads_ok"] == 1
    eng.close()


def test_damage_and_misses_are_named_by_the_python_path_and_the_damaged_file_removed(tmp_path: Path) -> None:
    eng = _engine(tmp_path)
    key = page_key(2)
    assert store_data(eng, key, page_bytes(eng.layout, key, 2)).ok
    path = eng.mapper.path_for(key)
    corrupt_flip_bit(path, path.stat().st_size - 100)
    res, got = load_page(eng, key)
    assert not res.ok and res.error.kind == "checksum" and got is None, res
    assert not path.exists() and eng.stats["bad_pages_discarded"] == 1
    res, _ = load_page(eng, page_key(3))
    assert not res.ok and res.error.kind == "missing", res
    assert _lane_jobs(eng) == 1  # the store; both loads were handed back and redone in Python
    eng.close()


def test_the_python_threads_start_at_the_first_job_handed_to_them(tmp_path: Path) -> None:
    """With a lane, the engine's Python I/O threads start only when a job needs them (here a
    load of a missing page, which the lane hands back to be named), not with the engine; on
    the Python loop they start with it."""
    before = set(threading.enumerate())

    def python_threads() -> list[str]:
        return sorted(t.name for t in set(threading.enumerate()) - before
                      if t.name.startswith("tierstore-io-g2-") and t.name[len("tierstore-io-g2-"):].isdigit())

    eng = _engine(tmp_path / "lane", io_threads=2)
    key = page_key(4)
    assert store_data(eng, key, page_bytes(eng.layout, key, 2)).ok
    res, _ = load_page(eng, key)
    assert res.ok and _lane_jobs(eng) == 2 and python_threads() == []
    res, _ = load_page(eng, page_key(5))
    assert not res.ok and res.error.kind == "missing", res
    assert python_threads() == ["tierstore-io-g2-0", "tierstore-io-g2-1"]
    eng.close()
    assert python_threads() == []
    eng = _engine(tmp_path / "python", io_threads=2, io_loop="python")
    assert python_threads() == ["tierstore-io-g2-0", "tierstore-io-g2-1"]
    eng.close()


def test_a_store_into_a_removed_fanout_directory_is_redone_and_lands(tmp_path: Path) -> None:
    eng = _engine(tmp_path)
    key = page_key(4)
    fan = eng.mapper.path_for(key).parent
    os.rmdir(fan)
    res = store_data(eng, key, page_bytes(eng.layout, key, 2))
    assert res.ok and res.stored, res
    assert load_page(eng, key)[0].ok
    eng.close()


def test_a_job_past_its_deadline_is_not_started_late(tmp_path: Path) -> None:
    eng = _engine(tmp_path, deadline_s=1e-6)
    key = page_key(5)
    slot = eng.acquire_slot(5)
    assert slot is not None
    slot.view[:] = page_bytes(eng.layout, key, 2)
    job = eng.submit_store(key, slot, 16)
    time.sleep(0.2)
    (res,) = eng.wait([job], 5)
    assert not res.ok and res.error.kind == "timeout", res
    assert eng.flush(5)
    time.sleep(0.1)
    assert not eng.mapper.path_for(key).exists()
    assert eng.free_slots == len(eng.slots)  # the lane gave the slot back
    eng.close()


def test_finished_stores_give_their_slots_back_without_a_poll(tmp_path: Path) -> None:
    """The harvest thread completes the lane's jobs when nobody polls: a caller blocked on the
    pool alone (no engine call) gets a slot back."""
    eng = _engine(tmp_path, staging_slots=2)
    for i in range(2):
        slot = eng.acquire_slot(5)
        assert slot is not None
        slot.view[:] = page_bytes(eng.layout, page_key(10 + i), 2)
        eng.submit_store(page_key(10 + i), slot, 16)
    assert eng._pool.acquire(5) is not None
    eng.close()


def test_close_finishes_queued_stores_and_stops_the_lane_threads(tmp_path: Path) -> None:
    before = set(threading.enumerate())  # other tests' engines in this process may still run
    eng = _engine(tmp_path, staging_slots=16, io_threads=2)
    keys = [page_key(20 + i) for i in range(16)]
    for key in keys:
        slot = eng.acquire_slot(5)
        assert slot is not None
        slot.view[:] = page_bytes(eng.layout, key, 2)
        eng.submit_store(key, slot, 16)
    eng.close(30)
    assert all(eng.mapper.path_for(k).exists() for k in keys)
    assert eng._queue._lane.started
    assert not [t for t in set(threading.enumerate()) - before if t.name.startswith("tierstore-io-g2-n")]
    assert eng.stats["stores_ok"] == len(keys)


def test_a_process_that_exits_with_pages_in_flight_exits_cleanly(tmp_path: Path) -> None:
    """The lane's threads hold no GIL, so interpreter shutdown would not pause them: at an exit
    with stores in flight and no close, ``_stop_at_exit`` stops the lane before shutdown (an
    exit handler registered first runs last and sees it stopped), and the status is 0."""
    script = (
        "import atexit, sys\n"
        "lanes = []\n"
        "atexit.register(lambda: print('lane stopped at exit:', lanes[0].stopped, flush=True))\n"
        "from tierstore.native import loader as native\n"
        "native.start(wait=True)\n"
        "from tierstore.config import TierStoreConfig\n"
        "from tierstore.rootstore.engine import IOEngine\n"
        "from tierstore.testing.pages import hybrid_namespace, page_bytes, page_key\n"
        f"root = {str(tmp_path / 'root')!r}\n"
        "eng = IOEngine(root, hybrid_namespace(), 2, config=TierStoreConfig(root=root, odirect='off'),"
        " staging_slots=32)\n"
        "for i in range(32):\n"
        "    slot = eng.acquire_slot(5)\n"
        "    slot.view[:] = page_bytes(eng.layout, page_key(i), 2)\n"
        "    eng.submit_store(page_key(i), slot, 16)\n"
        "assert eng._queue._lane.started\n"
        "lanes.append(eng._queue._lane)\n"
        "sys.exit(0)\n"
    )
    got = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stderr[-2000:]
    assert "lane stopped at exit: True" in got.stdout, got.stdout[-2000:]


@pytest.mark.parametrize("loop", ["native", "python"])
def test_a_load_goes_before_queued_stores(tmp_path: Path, loop: str) -> None:
    """One I/O thread, 40 stores of 2 MiB queued, then a load: the load is taken next
    (``QueuePolicy``, the lane's MAX_BYPASS rule), so most stores are still to do when it
    returns."""
    from tierstore.bench.io import bench_namespace

    root = tmp_path / loop
    eng = IOEngine(root, bench_namespace(2 << 20), 0, staging_slots=48,
                   config=TierStoreConfig(root=str(root), io_threads=1, odirect="off", io_loop=loop))
    slot = eng.acquire_slot(5)
    assert slot is not None
    (res,) = eng.wait([eng.submit_store(b"L" * 16, slot, 16)], 10)
    assert res.ok
    keys = [f"s{i:015d}".encode() for i in range(40)]
    for key in keys:  # slot contents do not matter here
        eng.submit_store(key, eng.acquire_slot(5), 16)  # type: ignore[arg-type]
    (res,) = eng.wait([eng.submit_load(b"L" * 16)], 10)
    done_before = sum(eng.mapper.path_for(k).exists() for k in keys)
    assert res.ok and done_before <= 20, done_before
    assert (_lane_jobs(eng) > 0) == (loop == "native")
    eng.close()
