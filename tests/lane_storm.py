"""A storm of page loads and stores on the native I/O lane, with pauses injected into its
threads (``native_abi.FAULT_*``), and a checker of what callers get. Run in a fresh process
with ``TIERSTORE_LANE_FAULTS`` set (``1``: today's kernels; ``unfixed``: the claim and RUNNING
mark that had the races) and ``TIERSTORE_LANE_FAULTS_TESTS_ONLY=1`` by
``tests/native/test_native_lane_races.py``; prints one JSON object.

What is checked, per job (every anomaly is listed in the output):
- an OK load's slot holds exactly the stored page, and an unverified one's sums are the page's;
- a slot the caller holds does not change while held (checked again after a short hold);
- every job gets exactly one result from ``wait`` (none missing, no engine call raising);
- after the engine is closed mid-storm and the callers are done, every slot is free again;
- every page a store reported stored reads back, verified, with its bytes.

    python tests/lane_storm.py ROOT --seed 3 --seconds 6 --pause 0:32:2000 --close-at 0.8
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from pathlib import Path

from tierstore.config import TierStoreConfig
from tierstore.format.checksums import section_checksums
from tierstore.native import loader as native
from tierstore.native.abi import (
    FAULT_COUNT,
    FAULT_EVERY,
    FAULT_FIELDS,
    FAULT_PAUSE_NS,
    FAULT_POINTS,
)
from tierstore.rootstore.engine import IOEngine
from tierstore.testing.pages import hybrid_namespace, page_bytes, page_key

GROUP = 2  # the hybrid test namespace's small group: many jobs per second


class Checker:
    """Anomalies and counts, shared by the caller threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.anomalies: list[str] = []
        self.counts: dict[str, int] = {}

    def bad(self, what: str) -> None:
        with self.lock:
            self.anomalies.append(what)

    def count(self, what: str) -> None:
        with self.lock:
            self.counts[what] = self.counts.get(what, 0) + 1


def _caller(eng: IOEngine, pages: dict[bytes, bytes], sums: dict[bytes, list[int]], stored: dict[bytes, bytes],
            rng: random.Random, end: float, chk: Checker, ident: int) -> None:
    layout = eng.layout
    made = 0
    keys = list(pages)
    while time.monotonic() < end:
        jobs: dict[int, tuple[str, bytes]] = {}
        try:
            for _ in range(rng.randint(1, 4)):
                if rng.random() < 0.25:
                    slot = eng.acquire_slot(0.02)
                    if slot is None:
                        continue
                    key = page_key(100_000 * (ident + 1) + made, seed=7)
                    made += 1
                    data = page_bytes(layout, key, GROUP)
                    slot.view[:] = data
                    jobs[eng.submit_store(key, slot, 16)] = ("store", key)
                    with chk.lock:
                        stored.setdefault(key, data)
                else:
                    key = rng.choice(keys)
                    verify = rng.random() < 0.7
                    jobs[eng.submit_load(key, verify=verify)] = ("load", key)
            results = eng.wait(list(jobs), 60)
        except Exception as exc:  # an engine call must never raise here
            chk.bad(f"engine call raised {type(exc).__name__}: {exc}")
            continue
        got = {r.job_id: r for r in results}
        for jid in jobs:
            if jid not in got:
                chk.bad(f"job {jid} ({jobs[jid][0]}) got no result within 60 s")
        for res in results:
            op, key = jobs[res.job_id]
            chk.count(f"{op}_{'ok' if res.ok else res.error.kind}")
            if op == "store" and not (res.ok and res.stored):
                with chk.lock:
                    stored.pop(key, None)  # not known to be written: not checked afterwards
            if op != "load" or res.slot is None:
                continue
            data = bytes(res.slot.view)
            right = data == pages[key]
            if not right:
                chk.bad(f"load ok (verified={res.verified}) with bytes that are not the page's")
            if not res.verified:
                if list(res.sums) != sums[key]:
                    chk.bad("unverified load ok with sums that are not the page's")
                eng.settle(res, right)
            time.sleep(rng.random() * 0.002)
            if bytes(res.slot.view) != data:
                chk.bad("a held slot changed under its holder")
            eng.release_slot(res.slot)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--callers", type=int, default=6)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--deadline-ms", type=int, default=300)
    ap.add_argument("--pages", type=int, default=12)
    ap.add_argument("--pause", action="append", default=[],
                    help="POINT:EVERY:MICROSECONDS, a native_abi.FAULT_* point (repeatable)")
    ap.add_argument("--close-at", type=float, default=1.0,
                    help="close the engine at this fraction of the run, callers still submitting (1: after)")
    a = ap.parse_args()
    native.start(wait=True)
    if native.lane_kernels() is None:
        print(json.dumps({"error": f"native lane unavailable: {native.failure()}"}))
        return 2
    from tierstore.native import lane_kernels as native_kernels

    root = Path(a.root)
    ns = hybrid_namespace()
    seed_cfg = TierStoreConfig(root=str(root), odirect="off", io_loop="python")
    with IOEngine(root, ns, GROUP, config=seed_cfg) as seeder:
        pages = {page_key(i, seed=a.seed): page_bytes(seeder.layout, page_key(i, seed=a.seed), GROUP)
                 for i in range(a.pages)}
        for key, data in pages.items():
            slot = seeder.acquire_slot(10)
            assert slot is not None
            slot.view[:] = data
            (res,) = seeder.wait([seeder.submit_store(key, slot, 16)], 30)
            assert res.ok, res
    sums = {k: list(section_checksums(seeder.layout, memoryview(d))) for k, d in pages.items()}

    cfg = TierStoreConfig(root=str(root), odirect="off", io_threads=a.threads, deadline_s=a.deadline_ms / 1000)
    eng = IOEngine(root, ns, GROUP, config=cfg, staging_slots=a.slots)
    first = eng.wait([eng.submit_load(next(iter(pages)))], 30)  # starts the lane
    eng.release_slot(first[0].slot)
    lane = eng._queue._lane
    assert lane is not None and lane.started, "the lane did not start"
    for spec in a.pause:
        point, every, us = (int(x) for x in spec.split(":"))
        assert 0 <= point < FAULT_POINTS
        lane.faults[point * FAULT_FIELDS + FAULT_PAUSE_NS] = us * 1000
        lane.faults[point * FAULT_FIELDS + FAULT_EVERY] = every

    chk = Checker()
    stored: dict[bytes, bytes] = {}
    rng = random.Random(a.seed)
    start = time.monotonic()
    end = start + a.seconds
    callers = [threading.Thread(target=_caller, args=(eng, pages, sums, stored, random.Random(rng.random()), end, chk, i),
                                name=f"caller-{i}") for i in range(a.callers)]
    for th in callers:
        th.start()
    if a.close_at < 1:
        time.sleep(a.seconds * a.close_at)
        eng.close(2.0)
    for th in callers:
        th.join(120)
    if any(th.is_alive() for th in callers):
        chk.bad("a caller thread is still blocked 120 s after the storm")
    stats = eng.stats
    try:
        eng.close(5.0)
    except Exception as exc:
        chk.bad(f"close raised {type(exc).__name__}: {exc}")
    lane_ended = lane.ended()
    if not lane_ended:
        chk.bad("the lane's threads did not end at close")
    if eng.free_slots != len(eng.slots):
        chk.bad(f"{len(eng.slots) - eng.free_slots} of {len(eng.slots)} slots not back after close")
    with IOEngine(root, ns, GROUP, config=seed_cfg) as reader:
        for key, data in stored.items():
            (res,) = reader.wait([reader.submit_load(key)], 30)
            if not (res.ok and bytes(res.slot.view) == data):
                chk.bad(f"a page stored during the storm reads back wrong ({res.error})")
            if res.slot is not None:
                reader.release_slot(res.slot)
    print(json.dumps({
        "faults_build": native_kernels.LANE_FAULTS, "seed": a.seed, "seconds": round(time.monotonic() - start, 2),
        "jobs": sum(chk.counts.values()), "lane_jobs": stats["jobs_native_loop"],
        "passes": [int(lane.faults[p * FAULT_FIELDS + FAULT_COUNT]) for p in range(FAULT_POINTS)],
        "results": chk.counts, "stored_checked": len(stored), "late_results_dropped": stats["late_results_dropped"],
        "anomalies": len(chk.anomalies), "anomaly_kinds": sorted(set(chk.anomalies))[:12],
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
