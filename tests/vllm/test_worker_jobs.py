"""JobTracker (tierstore/vllm/jobs.py, no vLLM needed): each page resolves once, a job finishes
once, after its submit sealed it, and a failed load leaves its keys for the scheduler."""

from __future__ import annotations

from collections import Counter

import pytest

from tierstore.vllm.jobs import JobTracker


def test_job_finishes_once_sealed_and_every_page_resolved() -> None:
    jobs = JobTracker(Counter(), [7])
    jobs.open(1, is_load=False)
    jobs.expect(1, 2)
    jobs.page_done(1, 100)
    jobs.page_done(1, 50)
    assert jobs.take_finished() == []  # the submit may still hand over pages
    jobs.seal(1)
    (done,) = jobs.take_finished()
    assert (done.job_id, done.success, done.nbytes) == (1, True, 150)
    assert jobs.open_jobs == 0 and jobs.take_finished() == []


def test_failed_load_reports_its_keys_and_a_page_cannot_resolve_twice() -> None:
    counters: Counter[str] = Counter()
    jobs = JobTracker(counters, [3, 4])
    jobs.open(2, is_load=True, keys=[(0, b"a"), (1, b"b")])
    jobs.expect(2, 2)
    jobs.seal(2)
    jobs.page_failed(2, 1, b"b", "checksum", "bad")
    assert jobs.is_lost(2)
    jobs.page_skipped(2)  # its other page is not copied
    (done,) = jobs.take_finished()
    assert not done.success and counters["load_failed:checksum"] == 1 and counters["load_jobs_failed"] == 1
    assert jobs.failed_loads == [(2, 4, b"b", "checksum")]
    jobs.open(3, is_load=True, keys=[(0, b"c")])
    jobs.record_failure(3, 0, None, "partial_chunk", "window inside a page")  # not tied to a page
    jobs.seal(3)
    assert jobs.failed_loads[-1] == (3, 3, b"c", "partial_chunk")  # every key of the job
    jobs.open(4, is_load=False)
    jobs.expect(4)
    jobs.page_done(4, 1)
    with pytest.raises(AssertionError, match="resolved twice"):
        jobs.page_done(4, 1)
