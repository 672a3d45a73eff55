"""JobQueue: the class order is data, and a store is never starved by a stream of loads."""

from __future__ import annotations

import threading

from tierstore.errors import PageError
from tierstore.ioqueue import Job, JobQueue, QueuePolicy


def _queue(policy: QueuePolicy, ran: list[str], gate: threading.Event, started: threading.Event) -> JobQueue:
    def run(job: Job) -> tuple[bool, int]:
        ran.append(f"{job.op}{job.key[0]}")
        if not started.is_set():  # the first job holds the only thread until the gate opens
            started.set()
            gate.wait(10)
        return False, 0

    def finish(job: Job, error: PageError | None, stored: bool, nbytes: int, seconds: float) -> tuple[int, bool]:
        return job.id, error is None

    return JobQueue(policy=policy, queue_depth=100, deadline_s=30.0, threads=1, name="test-io", run=run,
                    finish=finish, after_run=lambda job, accepted, error: None, where=lambda key: key.hex())


def _run_stream(policy: QueuePolicy, loads: int) -> list[str]:
    """One store running (blocked), then one store and ``loads`` loads queued behind it."""
    ran: list[str] = []
    gate, started = threading.Event(), threading.Event()
    q = _queue(policy, ran, gate, started)
    ids = [q.submit(q.new_job("store", bytes([0])))]
    assert started.wait(5)
    ids.append(q.submit(q.new_job("store", bytes([1]))))
    ids += [q.submit(q.new_job("load", bytes([i]))) for i in range(loads)]
    gate.set()
    assert all(ok for _, ok in q.wait(ids, timeout=10))
    q.close(5)
    return ran


def test_loads_go_first_but_a_store_is_taken_after_max_bypass_loads() -> None:
    ran = _run_stream(QueuePolicy(order=("load", "store"), max_bypass=4), loads=10)
    assert ran == ["store0", "load0", "load1", "load2", "load3", "store1", *[f"load{i}" for i in range(4, 10)]]


def test_a_short_burst_of_loads_all_go_before_the_store() -> None:
    ran = _run_stream(QueuePolicy(), loads=3)
    assert ran == ["store0", "load0", "load1", "load2", "store1"]


def test_the_order_is_data() -> None:
    ran = _run_stream(QueuePolicy(order=("store", "load"), max_bypass=100), loads=2)
    assert ran == ["store0", "store1", "load0", "load1"]
