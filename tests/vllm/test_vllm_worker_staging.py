"""TierStoreWorker store path without an engine: a step never waits for a staging slot.

A group with 2 staging slots and a slowed disk gets 6 chunks per "step": ``submit_store``
returns without waiting (pages beyond the free slots are deferred), deferred pages are written
in later steps, vLLM's fence (``wait``) gathers or drops what is still deferred, and in the end
every page is on disk with the blocks' bytes, or counted as dropped.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

import torch  # noqa: E402
from vllm.v1.kv_offload.base import GPULoadStoreSpec  # noqa: E402

from tierstore.config import TierStoreConfig  # noqa: E402
from tierstore.kernels import GroupCopier  # noqa: E402
from tierstore.rootstore.engine import IOEngine  # noqa: E402
from tierstore.testing.pages import page_key, simple_namespace  # noqa: E402
from tierstore.vllm.manager import TierStoreFileSpec  # noqa: E402
from tierstore.vllm.spec import staging_slots_for  # noqa: E402
from tierstore.vllm.worker import TierStoreWorker, WorkerGroup  # noqa: E402

BLOCKS, HEADS, N, D = 64, 2, 16, 16


def _setup(root: Path, slots: int, store_delay_s: float, monkeypatch: pytest.MonkeyPatch):
    ns = simple_namespace("float16", tokens_per_chunk=N, num_layers=2, num_kv_heads=HEADS, head_size=D)
    layout = ns.groups[0].layout
    torch.manual_seed(0)
    caches = [torch.randn(BLOCKS, HEADS, N, 2, D, dtype=torch.float16) for _ in range(2)]
    copier = GroupCopier(caches, layout, 1, [1, 1], backend="torch")
    # a slow disk wraps the Python I/O threads' file operations (a native lane would bypass them)
    loop = "python" if store_delay_s else "native"
    engine = IOEngine(root, ns, 0, config=TierStoreConfig.from_dict({"root": str(root), "io_loop": loop}),
                      staging_slots=slots)
    if store_delay_s:
        real = engine.ops.store  # a slow disk: every page write takes store_delay_s

        def slow(*a, **kw):  # noqa: ANN002, ANN003, ANN202
            time.sleep(store_delay_s)
            return real(*a, **kw)

        real_many = engine.ops.store_many

        def slow_many(items):  # noqa: ANN001, ANN202 - a batch: each page takes store_delay_s
            time.sleep(store_delay_s * len(items))
            return real_many(items)

        monkeypatch.setattr(engine.ops, "store", slow)
        monkeypatch.setattr(engine.ops, "store_many", slow_many)
    group = WorkerGroup(index=0, vllm_group_id=0, copier=copier, store=engine, blocks_per_chunk=1,
                        kernel_ratio=1, device=torch.device("cpu"), tokens_per_page=N)
    return TierStoreWorker([group], flush_timeout_s=30.0, defer_limit_s=30.0), copier, engine, layout


def _job(blocks: list[int], key_base: int) -> tuple[GPULoadStoreSpec, TierStoreFileSpec]:
    keys = [page_key(key_base + i) for i in range(len(blocks))]
    src = GPULoadStoreSpec(blocks, group_sizes=[len(blocks)], block_indices=[0])
    return src, TierStoreFileSpec(groups=[0] * len(blocks), keys=keys, token_counts=[N] * len(blocks))


def _page_of(copier: GroupCopier, layout, block: int) -> bytes:
    buf = torch.zeros(layout.nbytes, dtype=torch.uint8)
    copier.gather(torch.tensor([[block]]), [buf])
    return bytes(buf.numpy())


@pytest.mark.slow
def test_more_chunks_per_step_than_slots_never_waits_and_all_are_stored(tmp_path: Path, monkeypatch) -> None:
    worker, copier, engine, layout = _setup(tmp_path / "root", slots=2, store_delay_s=0.1, monkeypatch=monkeypatch)
    steps, per_step = 8, 6
    longest = 0.0
    results = []
    for step in range(steps):
        blocks = [(step * per_step + i) % BLOCKS for i in range(per_step)]
        src, dst = _job(blocks, step * per_step)
        t0 = time.perf_counter()
        worker.submit_store(step, src, dst)
        results += worker.get_finished()
        longest = max(longest, time.perf_counter() - t0)
        time.sleep(0.01)  # the step's forward
    assert worker.counters["store_deferrals"] > 0  # the pool really was too small
    # A page write takes 100 ms: waiting for a slot would take at least that per batch.
    assert longest < 0.08, longest
    assert worker.flush(30.0)
    results += worker.get_finished()
    assert sorted(r.job_id for r in results) == list(range(steps))
    stored = worker.counters["store_pages_ok"]
    dropped = sum(v for k, v in worker.counters.items() if k.startswith("store_dropped:"))
    assert stored + dropped == steps * per_step and dropped == 0, worker.counters
    # every page holds the bytes of its blocks
    for step in range(steps):
        for i in range(per_step):
            k = page_key(step * per_step + i)
            jid = engine.submit_load(k)
            (res,) = engine.wait([jid], 10.0)
            assert res.ok, res.error
            assert bytes(res.slot.view) == _page_of(copier, layout, (step * per_step + i) % BLOCKS)
            engine.release_slot(res.slot)
    worker.shutdown()


def test_fence_gathers_deferred_pages_or_drops_them_counted(tmp_path: Path, monkeypatch) -> None:
    worker, copier, engine, layout = _setup(tmp_path / "root", slots=2, store_delay_s=0.0, monkeypatch=monkeypatch)
    held = [engine.acquire_slot(0), engine.acquire_slot(0)]  # every slot busy (e.g. a stalled disk)
    src, dst = _job([1, 2, 3], 100)
    t0 = time.perf_counter()
    worker.submit_store(7, src, dst)
    assert time.perf_counter() - t0 < 0.5
    assert worker.deferred_store_pages() == 3 and worker.get_finished() == []
    # vLLM is about to reuse the blocks (jobs_to_flush): still no slot -> dropped, counted
    t0 = time.perf_counter()
    worker.wait({7})
    assert time.perf_counter() - t0 < 1.0
    assert worker.counters["store_dropped:fence"] == 3 and worker.deferred_store_pages() == 0
    (res,) = worker.get_finished()
    assert res.job_id == 7 and not res.success
    # with slots back, a fenced job is gathered before the blocks change
    for s in held:
        engine.release_slot(s)
    held = [engine.acquire_slot(0)]  # one slot left: one page now, one at the fence
    src, dst = _job([4, 5], 200)
    worker.submit_store(8, src, dst)
    engine.release_slot(held[0])
    worker.wait({8})
    assert worker.flush(10.0)
    (res,) = worker.get_finished()
    assert res.success and worker.counters["store_pages_ok"] == 2
    assert engine.contains(page_key(200)) and engine.contains(page_key(201))
    worker.shutdown()


def test_staging_pool_is_sized_from_the_scheduler_budget() -> None:
    # two steps of 8192 tokens in 16-token chunks (+1 per step), within the byte cap
    assert staging_slots_for(8192, 16, 64 << 10, 4) == 2 * (8192 // 16 + 1)
    assert staging_slots_for(255, 128, 1 << 20, 4) == 24  # small budgets keep the old floor
    assert staging_slots_for(8192, 16, 64 << 20, 4) == 24  # 1 GiB cap of 64 MiB pages -> floor
    assert staging_slots_for(8192, 16, 1 << 20, 4) == 1024  # capped at 1 GiB of 1 MiB pages
    assert staging_slots_for(8192, 16, 1 << 20, 4, override=7) == 7
