"""TierStoreWorker's transfer state machine, with a fake PageTransfer and a fake page store.

The fake transfer behaves like the CUDA one seen from the host: a started transfer reads its
source ``free_after`` polls later (store: the KV blocks; load: the staging slots) and writes its
destination ``done_after`` polls later (store: the slots, plus section "sums"; load: the blocks,
except pages whose bytes do not match ``expect``). The fake engine poisons every slot it gets
back. So a worker that submits a store before ``done()``, releases a load slot before
``slots_free()`` or reports a load job before ``done()`` stores or loads wrong bytes, and the
checks below see it; slot ownership is also asserted directly on every release.
"""

from __future__ import annotations

import itertools
import time
import zlib
from collections import deque
from typing import Any

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

import torch  # noqa: E402
from vllm.v1.kv_offload.base import GPULoadStoreSpec  # noqa: E402

from tierstore.errors import PageCorrupt, PageMissing  # noqa: E402
from tierstore.kernels import GroupCopier  # noqa: E402
from tierstore.rootstore.engine import IOResult  # noqa: E402
from tierstore.testing.pages import page_key, simple_namespace  # noqa: E402
from tierstore.vllm.manager import TierStoreFileSpec  # noqa: E402
from tierstore.vllm.worker import TierStoreWorker, WorkerGroup  # noqa: E402

BLOCKS, HEADS, N, D = 32, 2, 16, 16
POISON = 0xEE


def fake_sums(page: bytes) -> tuple[int, ...]:
    return (zlib.crc32(page),)


class FakeSlot:
    def __init__(self, index: int, nbytes: int) -> None:
        self.index = index
        self.tensor = torch.full((nbytes,), POISON, dtype=torch.uint8)


class FakeEngine:
    """Page store: a result per submit at the next poll; slots poisoned when they come back."""

    def __init__(self, nbytes: int, slots: int) -> None:
        self.slots = [FakeSlot(i, nbytes) for i in range(slots)]
        self._free = list(self.slots)
        self.pages: dict[bytes, tuple[bytes, tuple[int, ...]]] = {}
        self._results: deque[IOResult] = deque()
        self._ids = itertools.count(1)
        self.held_by_transfer: set[int] = set()  # slot indexes a started transfer still reads
        self.load_verify: list[bool] = []
        self.store_sums: list[tuple[int, ...] | None] = []
        self.discarded: list[bytes] = []
        self.verdicts: list[tuple[bytes, bool]] = []

    def acquire_slot(self, timeout: float | None = 0) -> FakeSlot | None:
        return self._free.pop() if self._free else None

    def release_slot(self, slot: FakeSlot) -> None:
        assert slot not in self._free, "slot released twice"
        assert slot.index not in self.held_by_transfer, "slot released while a transfer still reads it"
        slot.tensor.fill_(POISON)
        self._free.append(slot)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def submit_store(self, key: bytes, slot: FakeSlot, token_count: int, sums: Any = None) -> int:
        assert slot not in self._free and slot.index not in self.held_by_transfer
        data = bytes(slot.tensor.numpy())
        self.store_sums.append(None if sums is None else tuple(sums))
        if sums is not None:
            assert tuple(sums) == fake_sums(data), "GPU sums do not match the slot's bytes"
        self.pages[key] = (data, fake_sums(data))
        self.release_slot(slot)
        jid = next(self._ids)
        self._results.append(IOResult(jid, "store", key, True, None, None, True, len(data), 0.0))
        return jid

    def submit_load(self, key: bytes, verify: bool = True) -> int:
        self.load_verify.append(verify)
        jid = next(self._ids)
        page = self.pages.get(key)
        if page is None:
            self._results.append(IOResult(jid, "load", key, False, PageMissing("no page", key=key), None,
                                          False, 0, 0.0))
            return jid
        data, sums = page
        if verify and fake_sums(data) != sums:
            self._results.append(IOResult(jid, "load", key, False, PageCorrupt("bad", key=key), None,
                                          False, 0, 0.0))
            return jid
        slot = self._free.pop()
        slot.tensor.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self._results.append(IOResult(jid, "load", key, True, None, slot, False, len(data), 0.0,
                                      verified=verify, sums=None if verify else sums))
        return jid

    def discard_page(self, key: bytes, reason: str) -> None:
        self.discarded.append(key)
        self.pages.pop(key, None)

    def settle(self, result: IOResult, ok: bool, reason: str = "") -> None:
        self.verdicts.append((result.key, ok))  # the store counts a settled page (a hit or a failure)
        if not ok:
            self.discard_page(result.key, reason)

    def poll(self) -> list[IOResult]:
        out = list(self._results)
        self._results.clear()
        return out

    def flush(self, timeout: float | None) -> bool:
        return True

    def close(self, timeout: float | None = None) -> None:
        pass

    @property
    def stats(self) -> dict[str, Any]:
        return {}


class FakeHandle:
    def __init__(self, op: str, slots: list[FakeSlot], rows: torch.Tensor, expect: Any) -> None:
        self.op, self.slots, self.rows, self.expect = op, slots, rows, expect
        self.age = 0
        self.read = False  # source read (store: blocks_free; load: slots_free)
        self.finished = False
        self.buf: list[torch.Tensor] = []  # the "device scratch"
        self.sums: list[tuple[int, ...]] | None = None
        self.failed: list[int] = []
        self.waited_on: list[Any] = []

    def done(self) -> bool:
        return self.finished

    def blocks_free(self) -> bool:
        return self.read

    def slots_free(self) -> bool:
        return self.read

    def blocks_wait_on(self, stream: Any) -> None:
        self.waited_on.append(stream)


class FakeTransfer:
    def __init__(self, copier: GroupCopier, engine: FakeEngine, *, free_after: int = 2, done_after: int = 3,
                 scratch: int = 4, checksums_on_gpu: bool = True) -> None:
        self.copier, self.engine = copier, engine
        self.free_after, self.done_after = free_after, done_after
        self.capacity = scratch
        self.checksums_on_gpu = checksums_on_gpu
        self.inflight: deque[FakeHandle] = deque()
        self.started: list[FakeHandle] = []
        self.fail_next_start = False

    def _used(self) -> int:
        return sum(len(h.slots) for h in self.inflight)

    def _start(self, op: str, slots: list[FakeSlot], rows: torch.Tensor, expect: Any) -> FakeHandle | None:
        assert rows.device.type == "cpu" and rows.shape[0] == len(slots)
        if len(slots) > self.capacity:
            raise ValueError("batch exceeds the scratch")
        if self.fail_next_start:
            self.fail_next_start = False
            raise RuntimeError("injected transfer failure")
        if self._used() + len(slots) > self.capacity:
            return None
        h = FakeHandle(op, list(slots), rows.clone(), expect)
        self.engine.held_by_transfer.update(s.index for s in slots)
        self.inflight.append(h)
        self.started.append(h)
        return h

    def start_store(self, block_ids: torch.Tensor, slots: list[FakeSlot]) -> FakeHandle | None:
        return self._start("store", slots, block_ids, None)

    def start_load(self, slots: list[FakeSlot], block_ids: torch.Tensor, expect: Any = None) -> FakeHandle | None:
        return self._start("load", slots, block_ids, expect)

    def _advance(self, h: FakeHandle, force: bool = False) -> None:
        h.age += 1
        if not h.read and (force or h.age >= self.free_after):
            if h.op == "store":  # gather the blocks into the scratch
                h.buf = [torch.empty_like(s.tensor) for s in h.slots]
                self.copier.gather(h.rows, h.buf)
            else:  # H2D: the slots into the scratch; the slots may go back now
                h.buf = [s.tensor.clone() for s in h.slots]
                self.engine.held_by_transfer.difference_update(s.index for s in h.slots)
            h.read = True
        if h.read and not h.finished and (force or h.age >= self.done_after):
            if h.op == "store":  # D2H: the scratch into the slots (+ the GPU's section sums)
                for s, b in zip(h.slots, h.buf, strict=True):
                    s.tensor.copy_(b)
                h.sums = [fake_sums(bytes(b.numpy())) for b in h.buf] if self.checksums_on_gpu else None
                self.engine.held_by_transfer.difference_update(s.index for s in h.slots)
            else:  # check, then scatter the pages that match
                for i, b in enumerate(h.buf):
                    e = None if h.expect is None else h.expect[i]
                    if e is not None and tuple(e) != fake_sums(bytes(b.numpy())):
                        h.failed.append(i)
                    else:
                        self.copier.scatter([b], h.rows[i : i + 1])
            h.finished = True

    def poll(self) -> list[FakeHandle]:
        for h in self.inflight:
            self._advance(h)
        out = []
        while self.inflight and self.inflight[0].done():
            out.append(self.inflight.popleft())
        return out

    def wait(self) -> list[FakeHandle]:
        for h in self.inflight:
            self._advance(h, force=True)
        return self.poll()


def _setup(*, slots: int = 8, scratch: int = 4, done_after: int = 3, checksums_on_gpu: bool = True):
    ns = simple_namespace("float16", tokens_per_chunk=N, num_layers=2, num_kv_heads=HEADS, head_size=D)
    layout = ns.groups[0].layout
    torch.manual_seed(0)
    caches = [torch.randn(BLOCKS, HEADS, N, 2, D, dtype=torch.float16) for _ in range(2)]
    copier = GroupCopier(caches, layout, 1, [1, 1], backend="torch")
    engine = FakeEngine(layout.nbytes, slots)
    transfer = FakeTransfer(copier, engine, done_after=done_after, scratch=scratch,
                            checksums_on_gpu=checksums_on_gpu)
    group = WorkerGroup(index=0, vllm_group_id=0, copier=copier, store=engine, blocks_per_chunk=1,
                        kernel_ratio=1, device=torch.device("cpu"), tokens_per_page=N, transfer=transfer)
    worker = TierStoreWorker([group], flush_timeout_s=5.0, defer_limit_s=30.0, fence_slot_wait_s=0.05)
    return worker, engine, transfer, copier, caches, layout


def _spec(blocks: list[int], key_base: int) -> tuple[GPULoadStoreSpec, TierStoreFileSpec]:
    keys = [page_key(key_base + i) for i in range(len(blocks))]
    gpu = GPULoadStoreSpec(blocks, group_sizes=[len(blocks)], block_indices=[0])
    return gpu, TierStoreFileSpec(groups=[0] * len(blocks), keys=keys, token_counts=[N] * len(blocks))


def _page(copier: GroupCopier, layout: Any, block: int) -> bytes:
    buf = torch.zeros(layout.nbytes, dtype=torch.uint8)
    copier.gather(torch.tensor([[block]]), [buf])
    return bytes(buf.numpy())


def _until(worker: TierStoreWorker, job_id: int, limit: int = 50) -> Any:
    for _ in range(limit):
        for r in worker.get_finished():
            if r.job_id == job_id:
                return r
    raise AssertionError(f"job {job_id} never finished")


def _no_leaks(worker: TierStoreWorker, engine: FakeEngine, transfer: FakeTransfer) -> None:
    assert engine.free_slots == len(engine.slots), "a staging slot leaked"
    assert not engine.held_by_transfer and not transfer.inflight
    assert not worker.jobs.open_jobs and all(p.idle() for p in worker.pipelines)


def test_store_submits_only_finished_gathers_with_gpu_sums() -> None:
    worker, engine, transfer, copier, _caches, layout = _setup(done_after=3)
    blocks = [3, 5, 7, 9, 11, 13]  # more than the scratch (4 pages): two transfers
    src, dst = _spec(blocks, 0)
    worker.submit_store(1, src, dst)
    assert not engine.pages, "submitted before the gather finished"
    assert worker.deferred_store_pages() == 2  # no scratch room for them yet
    seen_partial = False
    for _ in range(50):
        results = worker.get_finished()
        if results:
            break
        seen_partial = seen_partial or 0 < len(engine.pages) < len(blocks)
    else:
        raise AssertionError("store job never finished")
    assert [(r.job_id, r.success) for r in results] == [(1, True)]
    assert seen_partial  # the first transfer was submitted while the second was in flight
    for i, b in enumerate(blocks):
        assert engine.pages[page_key(i)][0] == _page(copier, layout, b)
    assert engine.store_sums and all(s is not None for s in engine.store_sums)  # the engine did not hash
    assert worker.counters["store_pages_ok"] == len(blocks)
    _no_leaks(worker, engine, transfer)


def test_load_releases_slots_after_slots_free_and_reports_after_done() -> None:
    worker, engine, transfer, copier, caches, layout = _setup(done_after=4)
    blocks = [1, 2, 3]
    worker.submit_store(1, *_spec(blocks, 0))
    _until(worker, 1)
    for c in caches:
        c.zero_()
    gpu, files = _spec([20, 21, 22], 0)
    worker.submit_load(2, files, gpu)
    for _ in range(50):
        results = worker.get_finished()
        if results:
            break
        assert engine.free_slots + len(engine.held_by_transfer) <= len(engine.slots)
    else:
        raise AssertionError("load job never finished")
    assert [(r.job_id, r.success) for r in results] == [(2, True)]
    assert engine.load_verify == [False, False, False]  # the transfer checks the sums
    # reported only after every page is in its blocks (the fake scatters at done)
    for i, dst in enumerate([20, 21, 22]):
        assert _page(copier, layout, dst) == engine.pages[page_key(i)][0]
    assert worker.counters["load_pages_ok"] == 3 and not worker.failed_loads
    _no_leaks(worker, engine, transfer)


def test_engine_verifies_when_checksums_are_not_on_the_gpu() -> None:
    worker, engine, transfer, _copier, _caches, _layout = _setup(checksums_on_gpu=False)
    worker.submit_store(1, *_spec([4], 0))
    _until(worker, 1)
    assert engine.store_sums == [None]  # no GPU sums: the engine hashes
    gpu, files = _spec([9], 0)
    worker.submit_load(2, files, gpu)
    assert _until(worker, 2).success
    assert engine.load_verify == [True]
    assert all(h.expect is None for h in transfer.started if h.op == "load")
    _no_leaks(worker, engine, transfer)


def test_page_failing_the_gpu_check_fails_the_job_and_leaves_its_blocks() -> None:
    worker, engine, transfer, copier, caches, layout = _setup()
    worker.submit_store(1, *_spec([1, 2], 0))
    _until(worker, 1)
    data, sums = engine.pages[page_key(1)]
    bad = bytearray(data)
    bad[100] ^= 0x01
    engine.pages[page_key(1)] = (bytes(bad), sums)  # flipped on disk, header sums intact
    for c in caches:
        c.fill_(7.0)  # poison: the failed page's blocks must keep it
    poisoned = _page(copier, layout, 11)
    gpu, files = _spec([10, 11], 0)
    worker.submit_load(2, files, gpu)
    res = _until(worker, 2)
    assert not res.success
    # the damaged page is settled as a failure, never also as a hit (the store counts verdicts)
    assert (page_key(1), False) in engine.verdicts and (page_key(1), True) not in engine.verdicts
    assert worker.counters["load_failed:checksum"] == 1 and worker.counters["load_jobs_failed"] == 1
    assert [(j, k, kind) for j, _g, k, kind in worker.failed_loads] == [(2, page_key(1), "checksum")]
    end = time.monotonic() + 5  # removed like a page the engine finds damaged (on its own thread)
    while not engine.discarded and time.monotonic() < end:
        time.sleep(0.01)
    assert engine.discarded == [page_key(1)]
    assert _page(copier, layout, 11) == poisoned  # never scattered
    # the good page was copied, or skipped because its job was lost already
    assert _page(copier, layout, 10) in (engine.pages[page_key(0)][0], _page(copier, layout, 12))
    _no_leaks(worker, engine, transfer)


def test_load_waits_for_scratch_and_missing_page_fails_without_leaks() -> None:
    worker, engine, transfer, _copier, _caches, _layout = _setup(slots=8, scratch=2)
    worker.submit_store(1, *_spec([1, 2, 3, 4, 5], 0))
    _until(worker, 1)
    gpu, files = _spec([10, 11, 12, 13, 14], 0)
    worker.submit_load(2, files, gpu)
    assert _until(worker, 2).success
    assert max(len(h.slots) for h in transfer.started if h.op == "load") <= 2
    gpu, files = _spec([15, 16], 100)  # not stored
    worker.submit_load(3, files, gpu)
    res = _until(worker, 3)
    assert not res.success and worker.counters["load_failed:missing"] == 2
    _no_leaks(worker, engine, transfer)


def _fence(worker: TierStoreWorker, job_ids: set[int]) -> None:
    """vLLM's fence returns promptly (bounded by fence_slot_wait_s), whatever the GPU does."""
    t0 = time.perf_counter()
    worker.wait(job_ids)
    assert time.perf_counter() - t0 < 1.0


def test_fence_starts_deferred_pages_and_waits_on_the_stream_for_running_gathers() -> None:
    worker, engine, transfer, copier, _caches, layout = _setup(slots=8, scratch=2, done_after=3)
    blocks = [1, 2, 3, 4]
    worker.submit_store(5, *_spec(blocks, 0))
    assert worker.deferred_store_pages() == 2  # scratch full
    _fence(worker, {5})
    assert worker.deferred_store_pages() == 0 and not worker.counters["store_dropped:fence"]
    # every gather of job 5 still reading blocks was made a dependency of the current stream
    for h in transfer.started:
        assert h.read or h.waited_on, "a running gather was not fenced"
    _until(worker, 5)
    for i, b in enumerate(blocks):
        assert engine.pages[page_key(i)][0] == _page(copier, layout, b)
    _no_leaks(worker, engine, transfer)


def test_fence_drops_what_gets_no_scratch_in_time() -> None:
    worker, engine, transfer, _copier, _caches, _layout = _setup(slots=8, scratch=2, done_after=10**9)
    transfer.free_after = 10**9  # a stuck GPU stream: the scratch never frees
    worker.submit_store(5, *_spec([1, 2, 3], 0))
    _fence(worker, {5})
    assert worker.counters["store_dropped:fence"] == 1
    assert all(h.waited_on for h in transfer.started)
    assert engine.free_slots == len(engine.slots) - 2  # only the running gather holds slots
    worker.shutdown()  # drains the transfer (wait), submits its pages, closes
    assert len(engine.pages) == 2
    res = worker.get_finished()
    assert [(r.job_id, r.success) for r in res] == [(5, False)]  # one page dropped
    _no_leaks(worker, engine, transfer)


def test_transfer_errors_fail_the_job_and_release_slots() -> None:
    worker, engine, transfer, _copier, _caches, _layout = _setup()
    transfer.fail_next_start = True
    worker.submit_store(1, *_spec([1, 2], 0))
    res = _until(worker, 1)
    assert not res.success and worker.counters["store_failed:transfer"] == 2
    worker.submit_store(2, *_spec([1, 2], 0))
    assert _until(worker, 2).success
    transfer.fail_next_start = True
    gpu, files = _spec([10, 11], 0)
    worker.submit_load(3, files, gpu)
    res = _until(worker, 3)
    assert not res.success and worker.counters["load_failed:transfer"] == 2
    _no_leaks(worker, engine, transfer)


def test_shutdown_drains_started_transfers_and_releases_every_slot() -> None:
    worker, engine, transfer, _copier, _caches, _layout = _setup(slots=8, scratch=2, done_after=3)
    worker.submit_store(1, *_spec([1, 2], 0))
    _until(worker, 1)
    transfer.free_after = transfer.done_after = 10**9  # a stuck stream: only wait() finishes
    worker.submit_store(2, *_spec([3, 4, 5], 10))  # 2 started, 1 deferred
    gpu, files = _spec([10, 11], 0)
    worker.submit_load(3, files, gpu)
    worker.get_finished()  # load results arrive; scratch full: they stay ready, holding slots
    worker.shutdown()
    assert {page_key(10), page_key(11), page_key(12)} <= set(engine.pages)
    assert engine.free_slots == len(engine.slots) and not engine.held_by_transfer and not transfer.inflight


def test_flush_resolves_the_jobs_whose_stores_it_waited_for() -> None:
    """After ``flush`` every store it waited for is resolved in the job tracker (not left in the
    page store's results until the next step), and the job is reported at the next call."""
    worker, engine, transfer, _copier, _caches, _layout = _setup(done_after=2)
    worker.submit_store(1, *_spec([3, 5, 7, 9, 11, 13], 0))
    assert worker.flush(5.0)
    assert len(engine.pages) == 6
    assert worker.jobs.open_jobs == 0, "flush returned with the store job still open"
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(1, True)]
    _no_leaks(worker, engine, transfer)
