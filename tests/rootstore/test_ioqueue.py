"""JobQueue: the class order is data, and a store is never starved by a stream of loads."""

from __future__ import annotations

import threading

from tierstore.errors import PageError
from tierstore.rootstore.ioqueue import Job, JobQueue, QueuePolicy, new_job
from tierstore.store import JobTicket


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
    ids = [q.submit(new_job("store", bytes([0]), JobTicket.new(), q.deadline_s))]
    assert started.wait(5)
    ids.append(q.submit(new_job("store", bytes([1]), JobTicket.new(), q.deadline_s)))
    ids += [q.submit(new_job("load", bytes([i]), JobTicket.new(), q.deadline_s)) for i in range(loads)]
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


def test_batches_keep_the_policy_and_give_each_job_its_result() -> None:
    """One thread, batches of at most 3: the queued loads go in batches of one class, the
    store is still taken after max_bypass loads, and a job the batch hook fails alone fails."""
    ran: list[str] = []
    batches: list[list[str]] = []
    gate, started = threading.Event(), threading.Event()

    def run(job: Job) -> tuple[bool, int]:
        ran.append(f"{job.op}{job.key[0]}")
        if not started.is_set():
            started.set()
            gate.wait(10)
        return False, 0

    def run_batch(jobs: list[Job]) -> list[tuple[bool, int] | PageError]:
        batches.append([f"{j.op}{j.key[0]}" for j in jobs])
        return [PageError("bad page", key=j.key) if j.key[0] == 5 and j.op == "load" else (False, 0) for j in jobs]

    def finish(job: Job, error: PageError | None, stored: bool, nbytes: int, seconds: float) -> tuple[int, bool]:
        return job.id, error is None

    q = JobQueue(policy=QueuePolicy(order=("load", "store"), max_bypass=4), queue_depth=100, deadline_s=30.0,
                 threads=1, name="test-io", run=run, finish=finish, after_run=lambda job, accepted, error: None,
                 where=lambda key: key.hex(), run_batch=run_batch, max_batch=3)
    ids = [q.submit(new_job("store", bytes([0]), JobTicket.new(), q.deadline_s))]
    assert started.wait(5)
    ids.append(q.submit(new_job("store", bytes([1]), JobTicket.new(), q.deadline_s)))
    ids += [q.submit(new_job("load", bytes([i]), JobTicket.new(), q.deadline_s)) for i in range(10)]
    gate.set()
    results = dict(q.wait(ids, timeout=10))
    q.close(5)
    assert len(results) == len(ids) and [ok for i, ok in results.items()].count(False) == 1
    # 10 loads and a store queued behind the blocked store, one thread: batches of
    # ceil(queued / 1) capped at 3, one class each; the store goes after 4 loads (max_bypass),
    # so the 4th load is a batch of one (run alone, by ``run``) and the store follows it.
    assert ran == ["store0", "load3", "store1"]
    assert batches == [["load0", "load1", "load2"], ["load4", "load5", "load6"], ["load7", "load8", "load9"]], batches
    assert q.batches == 3 and q.batched_jobs == 9 and q.jobs_run == 12, (q.batches, q.batched_jobs, q.jobs_run)
