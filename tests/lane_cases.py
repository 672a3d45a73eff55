"""Single-engine cases of the native lane that need a fresh process (a fault build of the
kernels, ``TIERSTORE_LANE_FAULTS``, or a fork); run by ``tests/native/test_native_lane_races.py``.
Each prints one JSON object.

    python tests/lane_cases.py withdrawn ROOT         # a thread stalled between claim and RUNNING at close
    python tests/lane_cases.py running-at-close ROOT  # a thread stalled after RUNNING, its job timed out, at close
    python tests/lane_cases.py fork ROOT              # a child forked after the lane started
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from tierstore.config import TierStoreConfig
from tierstore.native import loader as native
from tierstore.native.abi import (
    FAULT_BEFORE_IO,
    FAULT_BEFORE_RUNNING,
    FAULT_EVERY,
    FAULT_FIELDS,
    FAULT_PAUSE_NS,
)
from tierstore.rootstore.engine import IOEngine
from tierstore.testing.pages import hybrid_namespace, page_bytes, page_key

GROUP = 2


def _engine(root: Path, **cfg: object) -> IOEngine:
    return IOEngine(root, hybrid_namespace(), GROUP, staging_slots=4,
                    config=TierStoreConfig.from_dict({"root": str(root), "odirect": "off", "io_threads": 1, **cfg}))


def _store(eng: IOEngine, key: bytes) -> bytes:
    data = page_bytes(eng.layout, key, GROUP)
    slot = eng.acquire_slot(10)
    assert slot is not None
    slot.view[:] = data
    (res,) = eng.wait([eng.submit_store(key, slot, 16)], 30)
    assert res.ok, res
    return data


def _pause(eng: IOEngine, point: int, ms: int) -> None:
    lane = eng._queue._lane
    assert lane is not None and lane.started
    lane.faults[point * FAULT_FIELDS + FAULT_PAUSE_NS] = ms * 1_000_000
    lane.faults[point * FAULT_FIELDS + FAULT_EVERY] = 1


def withdrawn(root: Path) -> dict[str, object]:
    """A load claimed by a thread that stalls 800 ms before marking it RUNNING; the engine is
    closed with a 0.1 s timeout meanwhile, so stop withdraws the job and gives its slot back.
    The caller takes every slot and fills it; when the thread wakes it must not run the job
    (the slot would then hold the page, read through a closed directory fd)."""
    eng = _engine(root)
    key = page_key(1)
    _store(eng, key)  # starts the lane
    _pause(eng, FAULT_BEFORE_RUNNING, 800)
    jid = eng.submit_load(key)
    time.sleep(0.1)  # claimed and stalled
    eng.close(0.1)
    (res,) = eng.wait([jid], 5)
    slots = [eng.acquire_slot(0) for _ in range(len(eng.slots))]
    for s in slots:
        assert s is not None
        s.view[:] = b"\xa5" * len(s.view)
    time.sleep(1.2)  # the thread wakes and decides
    changed = sum(bytes(s.view) != b"\xa5" * len(s.view) for s in slots if s is not None)
    return {"result": "ok" if res.ok else res.error.kind, "slots_back": len([s for s in slots if s is not None]),
            "slots_changed": changed, "lane_ended": eng._queue._lane.ended()}


def running_at_close(root: Path) -> dict[str, object]:
    """A store whose thread stalls 800 ms after marking it RUNNING, before its first system
    call; its 100 ms deadline passes (the caller gets a timeout) and the engine is closed with a
    0.2 s timeout. The engine must keep its directory fds open for that thread: a second
    engine opened meanwhile (on another root, likely given the closed fd's number) must get no
    page, and the late store lands under the first root."""
    eng = _engine(root / "a", deadline_s=0.1)
    _store(eng, page_key(1))
    _pause(eng, FAULT_BEFORE_IO, 800)
    key = page_key(2)
    slot = eng.acquire_slot(10)
    assert slot is not None
    data = page_bytes(eng.layout, key, GROUP)
    slot.view[:] = data
    jid = eng.submit_store(key, slot, 16)
    (res,) = eng.wait([jid], 5)
    eng.close(0.2)
    ended_at_close = eng._queue._lane.ended()
    other = _engine(root / "b")
    _store(other, page_key(3))  # opens its rank directory
    time.sleep(1.2)
    strays = sorted(p.name for p in (root / "b").rglob("*.kvp") if p.name != other.mapper.path_for(page_key(3)).name)
    landed = eng.mapper.path_for(key)
    other.close()
    return {"result": "ok" if res.ok else res.error.kind, "ended_at_close": ended_at_close,
            "lane_ended_later": eng._queue._lane.ended(), "strays_in_other_root": strays,
            "landed_in_own_root": landed.exists() and landed.read_bytes().endswith(data),
            "slot_kept": eng.free_slots < len(eng.slots)}


def fork(root: Path) -> dict[str, object]:
    """A child forked after the lane started: its engine refuses jobs at once, naming the fork,
    instead of taking them into a lane with no threads (each would time out, its slot lost)."""
    eng = _engine(root, deadline_s=3.0)
    key = page_key(1)
    _store(eng, key)
    assert eng._queue._lane.started
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        t0 = time.monotonic()
        (res,) = eng.wait([eng.submit_load(key)], 10)
        out = {"result": "ok" if res.ok else res.error.kind, "message": "" if res.ok else str(res.error),
               "seconds": round(time.monotonic() - t0, 3), "lane_stopped": eng._queue._lane.stopped}
        os.write(w, json.dumps(out).encode())
        os._exit(0)
    os.close(w)
    child = json.loads(os.read(r, 65536).decode() or "{}")
    os.waitpid(pid, 0)
    (res,) = eng.wait([eng.submit_load(key)], 10)  # the parent's engine still works
    child["parent_result"] = "ok" if res.ok else res.error.kind
    if res.slot is not None:
        eng.release_slot(res.slot)
    eng.close()
    return child


def main() -> int:
    case, root = sys.argv[1], Path(sys.argv[2])
    native.start(wait=True)
    if native.lane_kernels() is None:
        print(json.dumps({"error": f"native lane unavailable: {native.failure()}"}))
        return 2
    print(json.dumps({"withdrawn": withdrawn, "running-at-close": running_at_close, "fork": fork}[case](root)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
