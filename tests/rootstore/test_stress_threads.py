"""Stress: many caller threads against one engine with more I/O threads than staging slots.

Callers store and load the same small set of keys at the same moments, so stores of one key
race each other (temp + rename onto one name) and loads race the stores. Every load must be a
miss (``missing``: not stored yet) or exactly the bytes of its key: nothing torn, no other
error. A store may fail only for lack of a slot (``acquire_slot`` timing out is the caller's
business, not a failure); no job is lost (every submitted job comes back exactly once), and
every slot is back in the pool at the end. Checksums are on (the default).
"""

from __future__ import annotations

import random
import threading
from collections import Counter

import pytest
from test_crash_safety import crash_namespace, pattern

from tierstore.config import TierStoreConfig
from tierstore.native import loader as native
from tierstore.rootstore.engine import IOEngine
from tierstore.testing.pages import page_key

GROUP = 0  # attention page
KEYS = [page_key(i) for i in range(12)]


def _caller(eng: IOEngine, seed: int, rounds: int, errors: list[str], seen: Counter[str]) -> None:
    rng = random.Random(seed)
    expected = {k: pattern(k, GROUP, eng.layout.nbytes) for k in KEYS}
    for _ in range(rounds):
        key = rng.choice(KEYS)
        if rng.random() < 0.5:
            slot = eng.acquire_slot(timeout=5)
            if slot is None:
                seen["no_slot"] += 1
                continue
            slot.view[:] = expected[key]
            job = eng.submit_store(key, slot, 128)
        else:
            job = eng.submit_load(key)
        results = eng.wait([job], timeout=60)
        if len(results) != 1:
            errors.append(f"job {job} lost: {len(results)} results")
            continue
        r = results[0]
        seen[f"{r.op}:{'ok' if r.ok else r.error.kind}"] += 1  # type: ignore[union-attr]
        if r.op == "load" and r.ok:
            if bytes(r.slot.view) != expected[key]:  # type: ignore[union-attr]
                errors.append(f"torn or foreign page for key {key.hex()[:12]}")
            eng.release_slot(r.slot)  # type: ignore[arg-type]
        elif not r.ok and r.error.kind not in ("missing", "queue_full"):  # type: ignore[union-attr]
            errors.append(f"{r.op} of {key.hex()[:12]} failed: {r.error}")


@pytest.mark.parametrize("path", ["lane", "native", "python"])
@pytest.mark.parametrize("io_threads,slots,callers", [(8, 4, 12), (3, 2, 6), (2, 12, 16)])
def test_many_threads_same_keys_nothing_lost_or_torn(tmp_path, io_threads: int, slots: int, callers: int, path: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Every page path: the native lane (compiled I/O threads, ``native_lane``), the GIL-free
    calls of native.py on the Python I/O threads (racing temp + rename in C) and the Python
    path. (2, 12, 16): more slots than threads and 8 callers per thread, so the queue
    runs deeper than the threads and the threads take batches (``io_batch_pages``)."""
    if path != "python" and not native.start(wait=True):
        pytest.skip(f"native path unavailable: {native.failure()}")
    if path == "python":
        monkeypatch.setattr(native, "_kernels", None)
    root = str(tmp_path / "root")
    ns = crash_namespace()
    errors: list[str] = []
    seen: Counter[str] = Counter()
    eng = IOEngine(root, ns, GROUP, config=TierStoreConfig(root=root, io_threads=io_threads,
                                                           io_loop="native" if path == "lane" else "python"),
                   staging_slots=slots)
    try:
        threads = [threading.Thread(target=_caller, args=(eng, i, 40, errors, seen)) for i in range(callers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), "a caller is stuck"
        assert eng.flush(30)
        assert errors == [], errors[:5]
        assert eng.free_slots == slots, "a staging slot was lost"
        assert seen["load:ok"] > 0 and seen["store:ok"] > 0, seen
        if slots > 2 * io_threads and path != "lane":  # the case that exists to run batches
            assert eng._queue.batched_jobs > 0, (eng._queue.jobs_run, seen)
        if path == "lane":
            assert eng.stats["jobs_native_loop"] > 0, (eng._queue.jobs_run, seen)
        # After the storm every key that was stored loads with exactly its bytes.
        stored = eng.stats["stores_ok"]
        assert stored >= 1
        for key in KEYS:
            r = eng.wait([eng.submit_load(key)], timeout=30)[0]
            assert r.ok or r.error.kind == "missing", r.error  # type: ignore[union-attr]
            if r.ok:
                assert bytes(r.slot.view) == pattern(key, GROUP, eng.layout.nbytes)  # type: ignore[union-attr]
                eng.release_slot(r.slot)  # type: ignore[arg-type]
    finally:
        eng.close()
