"""TierStoreWorker on a CUDA device: real caches, real PageTransfer (side stream, pinned slots,
GPU checksums), real IOEngine in tmp_path.

- a store queued behind a long GPU sleep on the current stream returns from ``submit_store`` at
  once, is reported later by ``get_finished``, and the pages on disk equal the torch-reference
  gather of the KV the stream wrote after the sleep;
- vLLM's fence (``wait``) returns at once too, and KV overwritten on the current stream after it
  never reaches the pages;
- a load into a zeroed cache of another layout round-trips;
- a page corrupted on disk fails its load job (kind "checksum"), its blocks keep their old
  (poisoned) values, and the page file is removed.

The device machine has no vLLM: ``worker_import.import_worker`` imports the worker side on
stand-ins there.

Skipped without CUDA. Must not run with TRITON_INTERPRET=1 (the kernels would be interpreted).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (compiled Triton)"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="TRITON_INTERPRET=1 is set"),
]

from kernel_cases import AttentionCase, bits  # noqa: E402
from worker_import import import_worker  # noqa: E402

from tierstore.kernels import GroupCopier  # noqa: E402
from tierstore.kernels.transfer import PageTransfer  # noqa: E402
from tierstore.kernels.views import make_attention_caches  # noqa: E402

worker_mod, manager_mod, GPULoadStoreSpec = import_worker()

LAYERS, HEADS, HEAD, TOKENS, PAGES = 2, 2, 64, 16, 6


def _case(seed: int = 0) -> AttentionCase:
    return AttentionCase("bfloat16", layers=LAYERS, heads=HEADS, head_size=HEAD, tokens=TOKENS, n_pages=PAGES,
                         seed=seed)


def _worker(case: AttentionCase, views: list[torch.Tensor], bpp: int, root: Path, *, scratch: int = 4,
            slots: int = 8, engine: Any = None) -> tuple[Any, Any]:
    engine = engine if engine is not None else case.engine(root, slots, pin=True)
    copier = GroupCopier(views, case.layout, bpp, [1] * case.layers)
    group = worker_mod.WorkerGroup(
        index=0, vllm_group_id=0, copier=copier, store=engine, blocks_per_chunk=bpp, kernel_ratio=1,
        device=views[0].device, tokens_per_page=case.tokens,
        transfer=PageTransfer(copier, views[0].device, scratch_pages=scratch))
    group.transfer.warm_up()  # as spec.py does at startup
    return worker_mod.TierStoreWorker([group], flush_timeout_s=30.0, defer_limit_s=30.0), engine


def _keys(base: int, n: int = PAGES) -> list[bytes]:
    return [(base + i).to_bytes(4, "big") * 4 for i in range(n)]


def _specs(ids: torch.Tensor, keys: list[bytes], tokens: int) -> tuple[Any, Any]:
    flat = ids.reshape(-1).tolist()
    gpu = GPULoadStoreSpec(flat, group_sizes=[len(flat)], block_indices=[0])
    files = manager_mod.TierStoreFileSpec(groups=[0] * len(keys), keys=keys, token_counts=[tokens] * len(keys))
    return gpu, files


def _finish(worker: Any, job_id: int, timeout: float = 60.0) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for r in worker.get_finished():
            if r.job_id == job_id:
                return r
        time.sleep(0.002)
    raise AssertionError(f"job {job_id} not finished in {timeout} s")


def _stored_pages(engine: Any, keys: list[bytes]) -> torch.Tensor:
    """The pages on disk, read and verified by the engine."""
    out = []
    for res in engine.wait([engine.submit_load(k) for k in keys], timeout=30):
        assert res.ok, res.error
        out.append(res.slot.tensor.clone())
        engine.release_slot(res.slot)
    return torch.stack(out)


def _sleep_cycles(seconds: float) -> int:
    """``torch.cuda._sleep`` cycles for about ``seconds`` of GPU time on this device."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    torch.cuda._sleep(100_000_000)
    torch.cuda.synchronize()
    return int(100_000_000 * seconds / max(time.perf_counter() - t0, 1e-3))


def _warm_up(worker: Any, views: list[torch.Tensor], ids: torch.Tensor) -> None:
    """Compile the copy and checksum kernels (a store and a load) before anything is timed."""
    gpu, files = _specs(ids[:1], _keys(10_000, 1), TOKENS)
    worker.submit_store(90_000, gpu, files)
    assert _finish(worker, 90_000).success
    worker.submit_load(90_001, files, gpu)
    assert _finish(worker, 90_001).success


def _checksum_launches() -> dict[str, int]:
    """Launches of each checksum kernel in this process so far (through libcuda or Triton)."""
    from tierstore.kernels import checksum

    return {name: sum(launcher.counts().values()) for name, launcher in checksum._LAUNCH.items()}


def test_checksums_run_on_the_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                  caplog: pytest.LogCaptureFixture) -> None:
    """A store hashes its pages with the GPU kernels and hands the sums to the page store (the
    I/O threads hash nothing); a load has the page store read the pages unchecked and the GPU
    kernels check them after the copy: a damaged page is caught there, its blocks untouched."""
    from tierstore.rootstore.engine import IOEngine

    case = _case(seed=3)
    views, ids = case.build("LBHNC", 8, "cuda")
    worker, engine = _worker(case, views, ids.shape[1], tmp_path)
    transfer = worker.groups[0].transfer
    assert transfer.checksums_on_gpu, transfer.checksum_reason
    handed: list[Any] = []  # the sums each store handed to the page store (None: it hashes)
    checked_by_store: list[bool] = []  # each load's verify: whether the page store checks the sums
    real_store, real_load = IOEngine.submit_store, IOEngine.submit_load

    def submit_store(self: IOEngine, key: bytes, slot: Any, token_count: int, sums: Any = None) -> int:
        handed.append(sums)
        return real_store(self, key, slot, token_count, sums)

    def submit_load(self: IOEngine, key: bytes, verify: bool = True) -> int:
        checked_by_store.append(verify)
        return real_load(self, key, verify)

    monkeypatch.setattr(IOEngine, "submit_store", submit_store)
    monkeypatch.setattr(IOEngine, "submit_load", submit_load)
    keys = _keys(500)
    gpu, files = _specs(ids, keys, TOKENS)
    before = _checksum_launches()
    worker.submit_store(1, gpu, files)
    assert _finish(worker, 1).success
    after = _checksum_launches()
    assert after["hash_long"] > before["hash_long"]  # each section (2 x 16 x 2 x 64 bf16) is a long one
    assert len(handed) == PAGES and all(sums is not None for sums in handed), handed
    # The GPU's sums are the format's: the page store's own check (on the CPU) passes every page.
    assert torch.equal(_stored_pages(engine, keys), case.expected_pages())
    worker.shutdown()

    bad = 4
    path = engine.mapper.path_for(keys[bad])
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01  # a payload byte of the last section (the header is intact)
    path.write_bytes(bytes(data))
    nb = PAGES * 2 + 3
    _, views2 = make_attention_caches("LBHNC", LAYERS, nb, HEADS, 8, HEAD, case.dtype, "cuda")
    for v in views2:
        v.fill_(7.0)  # poison
    poisoned = [v.clone() for v in views2]
    ids2 = torch.randperm(nb, generator=torch.Generator().manual_seed(4))[: PAGES * 2].view(PAGES, 2)
    reader, _ = _worker(case, views2, 2, tmp_path)
    gpu2, files2 = _specs(ids2, keys, TOKENS)
    checked_by_store.clear()
    before = _checksum_launches()
    with caplog.at_level(logging.WARNING, logger="tierstore.vllm"):
        reader.submit_load(2, files2, gpu2)
        res = _finish(reader, 2)
    after = _checksum_launches()
    assert not res.success
    assert checked_by_store and not any(checked_by_store), checked_by_store  # read unchecked ...
    assert after["check_mask"] > before["check_mask"]  # ... and the GPU compared their sums
    assert after["hash_long"] > before["hash_long"]
    assert {(k, kind) for _job, _g, k, kind in reader.failed_loads} == {(keys[bad], "checksum")}
    assert any("after the copy to the device" in r.getMessage() for r in caplog.records), caplog.records
    blocks = ids2[bad].cuda()
    for v, p in zip(views2, poisoned, strict=True):
        assert torch.equal(bits(v[blocks]), bits(p[blocks])), "a damaged page's blocks were written"
    reader.shutdown()


def test_store_behind_gpu_work_never_blocks_and_stores_what_the_stream_wrote(tmp_path: Path) -> None:
    case = _case()
    views, ids = case.build("LBHNC", 8, "cuda")
    bpp = ids.shape[1]
    worker, engine = _worker(case, views, bpp, tmp_path, scratch=4)  # 6 pages: two transfers
    _warm_up(worker, views, ids)
    kv = [v.clone() for v in views]  # what the "forward pass" will write
    for v in views:
        v.zero_()
    cycles = _sleep_cycles(1.0)
    torch.cuda.synchronize()
    torch.cuda._sleep(cycles)  # the forward pass, still running ...
    for v, src in zip(views, kv, strict=True):
        v.copy_(src)  # ... then writing the KV, all queued on the current stream
    keys = _keys(0)
    gpu, files = _specs(ids, keys, TOKENS)
    t0 = time.perf_counter()
    worker.submit_store(1, gpu, files)
    took = time.perf_counter() - t0
    t1 = time.perf_counter()
    early = worker.get_finished()
    polled = time.perf_counter() - t1
    assert took < 0.1, f"submit_store took {took:.3f} s behind GPU work"
    assert polled < 0.1, f"get_finished took {polled:.3f} s behind GPU work"
    assert early == []  # the GPU is still sleeping: nothing can be stored yet
    res = _finish(worker, 1)
    assert res.success
    ref = torch.full((PAGES, case.layout.nbytes), 0xA5, dtype=torch.uint8, device="cuda")
    GroupCopier(views, case.layout, bpp, [1] * case.layers, backend="torch").gather(ids.cuda(), ref)
    stored = _stored_pages(engine, keys)
    assert torch.equal(stored, ref.cpu())
    assert torch.equal(stored, case.expected_pages())
    assert worker.counters["store_pages_ok"] >= PAGES
    worker.shutdown()
    assert engine.free_slots == 8


def test_fence_orders_block_reuse_after_the_gather_without_blocking(tmp_path: Path) -> None:
    case = _case(seed=3)
    views, ids = case.build("BLHNC", 8, "cuda")
    bpp = ids.shape[1]
    worker, engine = _worker(case, views, bpp, tmp_path, scratch=8)  # every page starts at once
    _warm_up(worker, views, ids)
    cycles = _sleep_cycles(1.0)
    torch.cuda.synchronize()
    torch.cuda._sleep(cycles)
    keys = _keys(100)
    gpu, files = _specs(ids, keys, TOKENS)
    t0 = time.perf_counter()
    worker.submit_store(2, gpu, files)
    worker.wait({2})  # vLLM is about to reuse the blocks
    took = time.perf_counter() - t0
    for v in views:
        v.zero_()  # the next forward overwrites the blocks (current stream, after the fence)
    assert took < 0.1, f"submit_store + wait took {took:.3f} s behind GPU work"
    assert _finish(worker, 2).success
    assert torch.equal(_stored_pages(engine, keys), case.expected_pages())
    worker.shutdown()


def _stored(tmp_path: Path, seed: int, layout: str, key_base: int) -> tuple[AttentionCase, Any, list[bytes]]:
    """A worker stores every page of a case, then shuts down: (case, its engine, page keys)."""
    case = _case(seed=seed)
    views, ids = case.build(layout, 8, "cuda")
    worker, engine = _worker(case, views, ids.shape[1], tmp_path)
    keys = _keys(key_base)
    gpu, files = _specs(ids, keys, TOKENS)
    worker.submit_store(1, gpu, files)
    assert _finish(worker, 1).success
    worker.shutdown()
    return case, engine, keys


def test_load_round_trips_into_another_layout(tmp_path: Path) -> None:
    case, _engine, keys = _stored(tmp_path, 5, "LBNHC", 200)
    # another engine on the same root, caches of another layout and kernel block size (zeroed)
    nb = PAGES * 4 + 5
    _, views2 = make_attention_caches("SPLIT_HND", LAYERS, nb, HEADS, 4, HEAD, case.dtype, "cuda")
    ids2 = torch.randperm(nb, generator=torch.Generator().manual_seed(9))[: PAGES * 4].view(PAGES, 4)
    reader, engine2 = _worker(case, views2, 4, tmp_path, scratch=4)
    gpu2, files2 = _specs(ids2, keys, TOKENS)
    t0 = time.perf_counter()
    reader.submit_load(3, files2, gpu2)
    assert time.perf_counter() - t0 < 0.1
    res = _finish(reader, 3)
    assert res.success and not reader.failed_loads
    assert torch.equal(bits(case.logical_from(views2, ids2)), bits(case.logical))
    reader.shutdown()
    assert engine2.free_slots == 8


def test_corrupt_page_fails_the_job_and_leaves_its_blocks(tmp_path: Path) -> None:
    case, engine, keys = _stored(tmp_path, 7, "LBHNC", 300)
    bad = 2
    path = engine.mapper.path_for(keys[bad])
    data = bytearray(path.read_bytes())
    data[-7] ^= 0x10  # a payload byte of the last section (the header is intact)
    path.write_bytes(bytes(data))
    nb = PAGES * 2 + 3
    _, views2 = make_attention_caches("LBHNC", LAYERS, nb, HEADS, 8, HEAD, case.dtype, "cuda")
    for v in views2:
        v.fill_(7.0)  # poison
    poisoned = [v.clone() for v in views2]
    ids2 = torch.randperm(nb, generator=torch.Generator().manual_seed(2))[: PAGES * 2].view(PAGES, 2)
    reader, engine2 = _worker(case, views2, 2, tmp_path)
    gpu2, files2 = _specs(ids2, keys, TOKENS)
    reader.submit_load(4, files2, gpu2)
    res = _finish(reader, 4)
    assert not res.success
    kinds = {(k, kind) for _job, _g, k, kind in reader.failed_loads}
    assert len(kinds) == 1 and next(iter(kinds))[0] == keys[bad], kinds
    assert next(iter(kinds))[1] in ("checksum", "corrupt"), kinds
    end = time.monotonic() + 5  # the worker removes it on a short-lived thread
    while path.exists() and time.monotonic() < end:
        time.sleep(0.01)
    assert not path.exists(), "the damaged page was not removed"
    blocks = ids2[bad].cuda()
    for v, p in zip(views2, poisoned, strict=True):
        assert torch.equal(bits(v[blocks]), bits(p[blocks])), "a failed page's blocks were written"
    reader.shutdown()
    assert engine2.free_slots == 8


def test_tier_chain_counts_a_hit_only_after_the_gpu_check(tmp_path: Path) -> None:
    """A TierChain reader (the shared tier alone: its loads reach the worker unverified): the
    GPU checks every page, the chain counts the good ones as hits once checked (settle)
    and the damaged one only as a checksum failure. The shared engine's slots are pinned, so
    the copies never block the thread."""
    from tierstore.config import TierStoreConfig
    from tierstore.metrics import MetricsRegistry
    from tierstore.tiers import TierChain, close_shared_state

    case, engine, keys = _stored(tmp_path, 11, "LBNHC", 400)
    bad = 1
    path = engine.mapper.path_for(keys[bad])
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01
    path.write_bytes(bytes(data))
    reg = MetricsRegistry()
    chain = TierChain(TierStoreConfig(root=str(tmp_path)), engine.namespace, 0, metrics=reg, staging_slots=8, pin=True)
    try:
        assert chain.local is None and chain.shared.engine().pinned
        _, views2 = make_attention_caches("LBNHC", LAYERS, PAGES * 4 + 3, HEADS, 4, HEAD, case.dtype, "cuda")
        ids2 = torch.arange(PAGES * 4).view(PAGES, 4)
        reader, _ = _worker(case, views2, 4, tmp_path, engine=chain)
        # One job per page: a failed job's later pages are not copied (the job is lost anyway),
        # so with one job for all pages how many were checked would depend on timing.
        for i, k in enumerate(keys):
            gpu_i, files_i = _specs(ids2[i:i + 1], [k], TOKENS)
            reader.submit_load(100 + i, files_i, gpu_i)
        finished: dict[int, Any] = {}
        end = time.monotonic() + 60
        while len(finished) < len(keys) and time.monotonic() < end:
            finished.update((r.job_id, r) for r in reader.get_finished())
            time.sleep(0.002)
        assert {j for j, r in finished.items() if not r.success} == {100 + bad}
        assert len(finished) == len(keys)
        assert {(k, kind) for _j, _g, k, kind in reader.failed_loads} == {(keys[bad], "checksum")}
        # The store that served the bad page removes it on a short-lived thread.
        reader.shutdown()
        end = time.monotonic() + 5
        while (not chain.m_shared.failures() or chain.m_shared.get("hits") < PAGES - 1) and time.monotonic() < end:
            time.sleep(0.01)
        assert chain.m_shared.failures() == {"checksum": 1}
        assert chain.m_shared.get("hits") == PAGES - 1
    finally:
        chain.close()
        close_shared_state()
