"""JobTracker: the one place that knows how far each vLLM transfer job is.

A job (one ``submit_store`` or ``submit_load`` of vLLM's ``OffloadingWorker``) is a set of
pages spread over the store and load pipelines. The tracker counts, per job, the pages handed
to a pipeline and not yet resolved; each such page is resolved exactly once, as done, failed,
dropped or skipped (its job was lost already). A job finishes when it is sealed (its submit
has handed over every page) and no page is open: then it is reported once, through
``take_finished``, with success only if no page failed. A failed load job also leaves its keys
in ``failed_loads`` for the scheduler, so the retried lookup misses them.

Contract for the pipelines: call ``expect`` before handing a page over, then exactly one of
``page_done``/``page_failed``/``page_dropped``/``page_skipped`` for it. ``record_failure``
marks a job failed for a page that was never handed over (a bad spec).

Threading: the vLLM worker thread only (no lock); imports nothing from vLLM, so the benchmarks
use it too.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field

logger = logging.getLogger("tierstore.vllm")


@dataclass(frozen=True)
class FinishedJob:
    """What vLLM's ``TransferResult`` needs of a finished job."""

    job_id: int
    success: bool
    nbytes: int
    seconds: float


@dataclass
class _Job:
    job_id: int
    is_load: bool
    started: float  # time.perf_counter() at submit
    keys: list[tuple[int, bytes]]  # load: every page (group index, key), for a failure not tied to one
    open_pages: int = 0  # handed to a pipeline, not yet resolved
    sealed: bool = False  # the submit has handed over every page
    failed: list[tuple[int, bytes | None, str]] = field(default_factory=list)  # (group, key, kind)
    nbytes: int = 0


class JobTracker:
    """Per-job page accounting; see the module docstring."""

    def __init__(self, counters: Counter[str], vllm_group_ids: list[int]) -> None:
        self.counters = counters  # shared with the worker: job and failure counts land here
        self._vllm_group_ids = vllm_group_ids  # tierstore group index -> vLLM group id
        self._jobs: dict[int, _Job] = {}
        self._finished: list[FinishedJob] = []
        self.failed_loads: list[tuple[int, int, bytes, str]] = []  # (job, vLLM group, key, kind)

    # ------------------------------------------------------------ lifecycle
    def open(self, job_id: int, *, is_load: bool, keys: list[tuple[int, bytes]] | None = None) -> None:
        """Start tracking a job; ``keys`` (loads): every (group index, key) of it."""
        self._jobs[job_id] = _Job(job_id, is_load, time.perf_counter(), list(keys or ()))

    def expect(self, job_id: int, pages: int = 1) -> None:
        """``pages`` more pages of the job are about to be handed to a pipeline."""
        self._jobs[job_id].open_pages += pages

    def seal(self, job_id: int) -> None:
        """The submit handed over every page: the job may finish once they resolve."""
        job = self._jobs[job_id]
        job.sealed = True
        self._maybe_finish(job)

    def take_finished(self) -> list[FinishedJob]:
        """Jobs finished since the last call, in finishing order."""
        out, self._finished = self._finished, []
        return out

    @property
    def open_jobs(self) -> int:
        return len(self._jobs)

    def is_lost(self, job_id: int) -> bool:
        """A page of this job failed already: its other pages need not be copied."""
        job = self._jobs.get(job_id)
        return job is not None and bool(job.failed)

    def is_load(self, job_id: int) -> bool:
        return self._jobs[job_id].is_load

    # ------------------------------------------------------------ page outcomes
    def page_done(self, job_id: int, nbytes: int) -> None:
        job = self._jobs[job_id]
        job.nbytes += nbytes
        self._resolve(job)

    def page_failed(self, job_id: int, group: int, key: bytes | None, kind: str, message: str) -> None:
        self.record_failure(job_id, group, key, kind, message)
        self._resolve(self._jobs[job_id])

    def page_dropped(self, job_id: int, group: int, key: bytes, reason: str) -> None:
        """A store page that never got a slot (not a failure of the disk): counted by reason."""
        job = self._jobs[job_id]
        job.failed.append((group, key, "store_dropped"))
        self.counters[f"store_dropped:{reason}"] += 1
        logger.debug("tierstore: store of page %s.. (group %d) dropped: %s", key.hex()[:16], group, reason)
        self._resolve(job)

    def page_skipped(self, job_id: int) -> None:
        """A page not copied because its job was lost already (the failure is recorded)."""
        self._resolve(self._jobs[job_id])

    def record_failure(self, job_id: int, group: int, key: bytes | None, kind: str, message: str) -> None:
        """Fail the job for ``key`` (None: not tied to one page) without resolving a page."""
        job = self._jobs[job_id]
        job.failed.append((group, key, kind))
        op = "load" if job.is_load else "store"
        self.counters[f"{op}_failed:{kind}"] += 1
        name = key.hex()[:16] if key else "?"
        logger.warning("tierstore: %s of page %s.. (group %d) failed: %s%s", op, name, group, message,
                       "; the request's tokens are recomputed" if job.is_load else "")

    # ------------------------------------------------------------ internals
    def _resolve(self, job: _Job) -> None:
        job.open_pages -= 1
        assert job.open_pages >= 0, f"job {job.job_id}: a page resolved twice"
        self._maybe_finish(job)

    def _maybe_finish(self, job: _Job) -> None:
        if not job.sealed or job.open_pages:
            return
        del self._jobs[job.job_id]
        ok = not job.failed
        if job.is_load:
            self.counters["load_jobs_ok" if ok else "load_jobs_failed"] += 1
            self._report_failed_keys(job)
        self._finished.append(FinishedJob(job.job_id, ok, job.nbytes, time.perf_counter() - job.started))

    def _report_failed_keys(self, job: _Job) -> None:
        failed = [(g, k, kind) for g, k, kind in job.failed if k is not None]
        if job.failed and not failed:
            # A failure not tied to one page: skip all of the job's pages on the retry, or the
            # same lookup would hit and fail again.
            kind = job.failed[0][2]
            failed = [(g, k, kind) for g, k in job.keys]
        for group, key, kind in failed:
            self.failed_loads.append((job.job_id, self._vllm_group_ids[group], key, kind))
