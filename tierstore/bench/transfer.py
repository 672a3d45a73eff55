"""The transfer half of ``tierstore bench kernels``: the vLLM worker's store and load pipelines
on a CUDA device against raw PCIe and raw files, measured in the same run.

- ``transfer_pipeline``: store = GPU cache -> gather -> pinned staging slot -> IOEngine page
  file, load = page file -> IOEngine slot -> GPU scratch -> scatter into the cache, driven by
  the worker's own pipelines (``tierstore.vllm.pipelines.GroupPipelines`` with a
  ``JobTracker``: one job of every page per direction), so the benchmark measures the code
  vLLM runs and a protocol change is made once. ``batch`` caps the pages per transfer; the
  transfer scratch holds two batches (one copying while the next fills); the engine gets
  ``default_slots`` staging slots (the worker's floor at that thread count). Each row also
  reports the driver thread's busy share (time inside ``GroupPipelines.step``) and the
  host<->device copies per transfer (adjacent staging slots move in one).
- ``raw_pcie``: one large pinned<->device copy; ``raw_files``: plain ``os.write`` /
  ``os.preadv`` of the same bytes, one file per page, the same threads and cache state.
- ``engine_only``: the same IOEngine without the GPU (how much of the gap is the engine's).

Loads are measured warm (page cache) and, when the whole page cache can be dropped (root),
cold. GB/s counts page payload bytes once (10^9 bytes/s), wall clock with a final synchronize.
Threading: the benchmark drives its own threads; nothing here is used by the library.
"""

from __future__ import annotations

import itertools
import os
import shutil
import statistics
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from tierstore.bench.page_cache import CacheDropper

GB = 1e9
STALL_S = 60.0  # a pipeline with no progress for this long is a bug: raise, with its state


def drop_page_cache() -> bool:
    """Drop the whole page cache if permitted (root); False if not (cold loads are skipped)."""
    dropper = CacheDropper()
    if not dropper.drops_everything:
        return False
    dropper.drop()
    return True


# ---------------------------------------------------------------------------- raw baselines
def raw_pcie(nbytes: int, device: str, reps: int = 5) -> dict[str, float]:
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    res = {}
    for name, dst, src in (("d2h", host, dev), ("h2d", dev, host)):
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src, non_blocking=True)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        res[f"{name}_gbps"] = round(nbytes / statistics.median(times) / GB, 2)
    return res


def raw_files(root: Path, bufs: list[memoryview], threads: int, cold: bool) -> dict[str, float]:
    """Plain write (no header, no checksum, no rename) then read of one file per buffer."""
    d = root / "raw"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    paths = [d / f"p{i}" for i in range(len(bufs))]
    total = sum(len(b) for b in bufs)

    def write(i: int) -> None:
        fd = os.open(paths[i], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = bufs[i]
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)

    def read(i: int) -> None:
        fd = os.open(paths[i], os.O_RDONLY)
        try:
            pos = 0
            while pos < len(bufs[i]):
                n = os.preadv(fd, [bufs[i][pos:]], pos)
                if n <= 0:
                    raise OSError("short read")
                pos += n
        finally:
            os.close(fd)

    with ThreadPoolExecutor(threads) as ex:
        os.sync()  # no earlier writeback running under the measurement
        t0 = time.perf_counter()
        list(ex.map(write, range(len(bufs))))
        w = time.perf_counter() - t0
        t0 = time.perf_counter()
        list(ex.map(read, range(len(bufs))))
        r_warm = time.perf_counter() - t0
        r_cold = None
        if cold and drop_page_cache():
            t0 = time.perf_counter()
            list(ex.map(read, range(len(bufs))))
            r_cold = time.perf_counter() - t0
    shutil.rmtree(d, ignore_errors=True)
    out = {"write_gbps": round(total / w / GB, 2), "read_warm_gbps": round(total / r_warm / GB, 2)}
    if r_cold is not None:
        out["read_cold_gbps"] = round(total / r_cold / GB, 2)
    return out


def _idle(progressed: bool, last: float) -> tuple[float, bool]:
    """A pipeline loop's bookkeeping: (time of the last progress, stalled). Without progress it
    sleeps briefly; ``STALL_S`` without any is a stall (a hang is a bug: the caller raises)."""
    now = time.perf_counter()
    if progressed:
        return now, False
    if now - last > STALL_S:
        return last, True
    time.sleep(0.0005)
    return last, False


# ---------------------------------------------------------------------------- the worker's pipelines
class WorkerPipelines:
    """One group's ``GroupPipelines`` over ``engine`` and ``transfer``, run a job at a time."""

    def __init__(self, case: Any, engine: Any, transfer: Any, batch: int, tokens: int) -> None:
        from tierstore.vllm.group import WorkerGroup
        from tierstore.vllm.jobs import JobTracker
        from tierstore.vllm.pipelines import GroupPipelines

        views, _lay, bpp, _cds = case.copier_args
        group = WorkerGroup(index=0, vllm_group_id=0, copier=transfer.copier, store=engine, blocks_per_chunk=bpp,
                            kernel_ratio=1, device=views[0].device, tokens_per_page=tokens, transfer=transfer)
        self.counters: Counter[str] = Counter()
        self.jobs = JobTracker(self.counters, [0])
        self.pipes = GroupPipelines(group, self.jobs, self.counters, defer_limit_s=float("inf"), batch_limit=batch)
        self.tokens = tokens
        self._job_ids = itertools.count(1)
        self.busy_s = 0.0  # time inside GroupPipelines.step (the driver thread's own work)
        self.wall_s = 0.0  # time inside run
        # Where the staging slots were, time-weighted over the last run (pages): free, in the
        # engine (queued or in an I/O thread), read and waiting for scratch, in a transfer.
        self.slot_census: dict[str, float] = {}

    def run(self, op: str, keys: list[bytes], rows: torch.Tensor) -> None:
        """Store (``op="store"``) or load every page of ``keys`` to/from its ``rows`` (kernel
        block ids [pages, blocks per page], CPU) as one job; raises if a page failed."""
        job = next(self._job_ids)
        is_load = op == "load"
        self.jobs.open(job, is_load=is_load, keys=[(0, k) for k in keys])
        self.jobs.expect(job, len(keys))
        for key, row in zip(keys, rows, strict=True):
            if is_load:
                self.pipes.loads.add(job, key, row[None, :])
            else:
                self.pipes.stores.add(job, key, self.tokens, row[None, :])
        self.jobs.seal(job)
        last, state = time.perf_counter(), None
        t_run = last
        pipes, engine = self.pipes, self.pipes.g.store
        side = pipes.loads if is_load else pipes.stores
        census = dict.fromkeys(("free", "in_engine", "waiting_scratch", "in_transfer"), 0.0)
        t_prev = t_run
        while True:
            t0 = time.perf_counter()
            self.pipes.step()
            t1 = time.perf_counter()
            self.busy_s += t1 - t0
            dt, t_prev = t1 - t_prev, t1
            census["free"] += dt * engine.free_slots
            census["in_engine"] += dt * side.pending()
            census["waiting_scratch"] += dt * (len(pipes.loads.ready) if is_load else 0)
            census["in_transfer"] += dt * sum(len(x.slots) for x in pipes.poller.started(side)
                                              if not x.slots_released)
            finished = self.jobs.take_finished()
            if finished:
                break
            now = (sum(self.counters.values()), self.pipes.stores.pending(), self.pipes.loads.pending(),
                   len(self.pipes.loads.ready), len(self.pipes.poller))
            last, stalled = _idle(now != state, last)
            state = now
            if stalled:
                raise RuntimeError(f"{op} pipeline stalled: {dict(self.counters)}, state {now}, "
                                   f"engine {self.pipes.g.store.stats}")
        if is_load and self.pipes.g.device.type == "cuda":
            torch.cuda.synchronize()
        run_s = time.perf_counter() - t_run
        self.wall_s += run_s
        self.slot_census = {k: round(v / max(1e-9, run_s), 1) for k, v in census.items()}
        if not finished[0].success:
            raise RuntimeError(f"{op} job failed: {dict(self.counters)}")


def _warm_up(transfer: Any, engine: Any, ids_cpu: torch.Tensor, batch: int, key: bytes) -> None:
    """Compile (untimed) the gather/scatter/checksum kernels of this shape for the batch sizes
    Triton specializes differently (1, other, multiples of 16); then store and load one page
    under ``key`` (not one of the timed keys), which starts the engine's I/O lane: a
    once-per-engine cost (its threads and arrays, made at the first job), which a vLLM worker
    pays once in its life and a 2 GiB timed transfer of ~0.1 s would otherwise count."""
    engine.wait([engine.submit_store(key, engine.acquire_slot(), 1)], 30)  # the engine releases the slot
    for res in engine.wait([engine.submit_load(key)], 30):
        if not res.ok:
            raise RuntimeError(f"bench warm-up: the engine's load failed: {res.error}")
        engine.release_slot(res.slot)
    n = ids_cpu.shape[0]
    for k in sorted({1, 2, min(batch, n), min(16, batch, n)}):
        slots = [engine.acquire_slot() for _ in range(k)]
        h = transfer.start_store(ids_cpu[:k], slots)
        transfer.wait()
        transfer.start_load(slots, ids_cpu[:k], expect=h.sums if h is not None else None)
        transfer.wait()
        for s in slots:
            engine.release_slot(s)


class IoBusy:
    """The share of a phase's wall time the engine's I/O threads spent running jobs (1.0: every
    thread busy throughout; lower: they waited for work), and the mean thread time per job."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        st = engine.stats
        self.busy0, self.jobs0, self.t0 = st["io_busy_s"], st["jobs_run"], time.perf_counter()

    def done(self, prefix: str) -> dict[str, float]:
        wall = time.perf_counter() - self.t0
        st = self.engine.stats
        busy, jobs = st["io_busy_s"] - self.busy0, st["jobs_run"] - self.jobs0
        return {f"{prefix}_io_busy": round(busy / max(1e-9, wall * self.engine.config.io_threads), 3),
                f"{prefix}_ms_per_job": round(1000 * busy / max(1, jobs), 3)}


def _store_timed(pipes: WorkerPipelines, keys: list[bytes], ids_cpu: torch.Tensor, total: int) -> dict[str, Any]:
    os.sync()
    torch.cuda.synchronize()
    io = IoBusy(pipes.pipes.g.store)
    t0 = time.perf_counter()
    busy0, wall0 = pipes.busy_s, pipes.wall_s
    pipes.run("store", keys, ids_cpu)
    store_s = time.perf_counter() - t0
    batches = max(1, pipes.counters["store_batches"])
    return {"store_s": store_s, "store_gbps": round(total / store_s / GB, 2), **io.done("store"),
            **{f"store_slots_{k}": v for k, v in pipes.slot_census.items()},
            "store_driver_busy": round((pipes.busy_s - busy0) / max(1e-9, pipes.wall_s - wall0), 3),
            "store_failed": sum(v for k, v in pipes.counters.items() if k.startswith("store_failed:")),
            "store_pages_per_transfer": round(len(keys) / batches, 2)}


def _load_checked(case: Any, pipes: WorkerPipelines, keys: list[bytes], ids_cpu: torch.Tensor, total: int,
                  cold: bool) -> dict[str, Any]:
    """Poison the blocks, load every page (warm, then cold if the cache can be dropped) and
    compare the blocks with the pages gathered before."""
    from tierstore.kernels import GroupCopier

    views, lay, bpp, cds = case.copier_args
    n = case.ids.shape[0]
    ref = GroupCopier(views, lay, bpp, cds, backend="torch")
    want = torch.zeros(n, lay.nbytes, dtype=torch.uint8, device=views[0].device)
    got = torch.zeros_like(want)
    ref.gather(case.ids, want)
    out: dict[str, Any] = {"verified": True}

    def load_once(name: str) -> None:
        for v in views:
            v[case.block_ids_flat] = 0  # poison
        torch.cuda.synchronize()
        io = IoBusy(pipes.pipes.g.store)
        t0 = time.perf_counter()
        busy0, wall0 = pipes.busy_s, pipes.wall_s
        pipes.run("load", keys, ids_cpu)
        out[f"load_{name}_gbps"] = round(total / (time.perf_counter() - t0) / GB, 2)
        out.update(io.done(f"load_{name}"))
        out.update({f"load_{name}_slots_{k}": v for k, v in pipes.slot_census.items()})
        # share of the load's wall time the driver thread spent inside step() (not sleeping idle)
        out[f"load_{name}_driver_busy"] = round((pipes.busy_s - busy0) / max(1e-9, pipes.wall_s - wall0), 3)
        got.zero_()
        ref.gather(case.ids, got)
        out["verified"] = out["verified"] and bool(torch.equal(got, want))

    load_once("warm")
    if cold and drop_page_cache():
        load_once("cold")
    return out


def default_slots(batch: int, threads: int) -> int:
    """Staging slots the benchmark gives the engine: three batches, and never fewer than the
    vLLM worker's own floor (``tierstore.vllm.spec.staging_slots_for``: 4 x io_threads + 8, not
    imported here because that module needs vLLM), so that the pipeline is measured with the
    staging depth the worker runs it with (with 3 x batch alone, 24 slots of 8 MiB at 16
    threads, the slots' round trip, not the code, set the rate: docs/measurements/scaling.md)."""
    return max(3 * batch, 4 * threads + 8)


def transfer_pipeline(case: Any, root: Path, batch: int, threads: int, cold: bool, slots: int = 0,
                      io_batch_pages: int | None = None, scratch_pages: int = 0,
                      io_loop: str | None = None, encryption_key_file: str | None = None) -> dict[str, Any]:
    """Store then load every page of ``case`` through the worker's pipelines (see the module
    docstring); the engine alone after them. ``slots``: staging slots (default ``default_slots``);
    ``scratch_pages``: the transfer's device scratch (default two batches); ``io_loop``: the
    engine's setting (default the setting's default); ``encryption_key_file``: sealed pages."""
    from tierstore.config import TierStoreConfig
    from tierstore.format.header import GroupKind
    from tierstore.kernels import GroupCopier
    from tierstore.kernels.launch import refusals as launch_refusals
    from tierstore.kernels.launch import totals as launch_totals
    from tierstore.kernels.transfer import PageTransfer
    from tierstore.rootstore.engine import IOEngine
    from tierstore.testing.pages import layout_namespace

    views, lay, bpp, cds = case.copier_args
    n = case.ids.shape[0]
    ids_cpu = case.ids.cpu()
    if case.layout_name == "mamba":
        tokens, kind = 1, GroupKind.MAMBA
    elif case.layout_name == "mla":  # [T, C] per layer
        tokens, kind = lay.sections[0].shape[0], GroupKind.MLA
    else:  # [H, T, 2, D] per layer
        tokens, kind = lay.sections[0].shape[1], GroupKind.ATTENTION
    ns = layout_namespace(lay, tokens, kind=kind, model=f"bench/{case.label}")
    shutil.rmtree(root / "ts", ignore_errors=True)
    config = TierStoreConfig(root=str(root / "ts"), io_threads=threads, odirect="off",
                             **({} if io_batch_pages is None else {"io_batch_pages": io_batch_pages}),
                             **({} if io_loop is None else {"io_loop": io_loop}),
                             encryption_key_file=encryption_key_file)
    n_slots = slots or default_slots(batch, threads)
    transfer = PageTransfer(GroupCopier(views, lay, bpp, cds), scratch_pages=scratch_pages or 2 * batch)
    transfer.warm_up()
    keys = [i.to_bytes(4, "little") * 4 for i in range(n)]
    total = lay.nbytes * n
    out: dict[str, Any] = {"case": case.label, "pages": n, "page_bytes": lay.nbytes, "batch": batch,
                           "io_threads": threads, "staging_slots": n_slots, "scratch_pages": transfer.capacity,
                           "checksums_on_gpu": transfer.checksums_on_gpu}
    with IOEngine(root / "ts", ns, 0, config=config, staging_slots=n_slots, pin=True) as engine:
        out["slots_pinned"] = engine.pinned
        _warm_up(transfer, engine, ids_cpu, batch, b"W" + keys[0][1:])
        pipes = WorkerPipelines(case, engine, transfer, batch, tokens)
        c0, b0 = transfer.host_copies, transfer.batches
        l0 = launch_totals()
        out.update(_store_timed(pipes, keys, ids_cpu, total))
        c1, b1 = transfer.host_copies, transfer.batches
        out.update(_load_checked(case, pipes, keys, ids_cpu, total, cold))
        c2, b2 = transfer.host_copies, transfer.batches
        # host<->device copies per transfer (adjacent staging slots move in one copy)
        out["store_copies_per_transfer"] = round((c1 - c0) / max(1, b1 - b0), 2)
        out["load_copies_per_transfer"] = round((c2 - c1) / max(1, b2 - b1), 2)
        l1 = launch_totals()  # Triton kernels launched through libcuda (kernels.launch), of all
        direct, via = l1["direct"] - l0["direct"], l1["via_triton"] - l0["via_triton"]
        out["direct_launch_share"] = round(direct / max(1, direct + via), 3)
        out["launch_refusals"] = launch_refusals()
        st = engine.stats
        out["engine_io_mode"] = st["io_mode"]
        out["io_batch_pages"] = st["io_batch_pages"]
        # of the jobs the I/O threads ran (the pipeline's), those taken in batches
        out["batched_job_share"] = round(st["jobs_in_batches"] / max(1, st["jobs_run"]), 3)
        out["native_loop_share"] = round(st["jobs_native_loop"] / max(1, st["jobs_run"]), 3)
        # the same engine without the GPU: how much of the gap to raw files is the engine's own
        out.update(engine_only(engine, [b"E" + k[1:] for k in keys], tokens, cold,
                               hash_on_cpu=not transfer.checksums_on_gpu))
    shutil.rmtree(root / "ts", ignore_errors=True)
    return out


def engine_only(engine: Any, keys: list[bytes], tokens: int, cold: bool, hash_on_cpu: bool = True) -> dict[str, float]:
    """IOEngine store then load of the same number of pages from/to its slots, no GPU.

    ``hash_on_cpu=False``: the engine's work in the GPU-checksum pipeline (sums handed in,
    loads not verified by the engine), i.e. the engine's I/O alone."""
    n = len(keys)
    fake_sums = None if hash_on_cpu else [0] * len(engine.layout.sections)
    total = engine.layout.nbytes * n
    os.sync()
    io = IoBusy(engine)
    t0 = time.perf_counter()
    submitted = done = 0
    while done < n:
        while submitted < n and engine.free_slots > 0:
            slot = engine.acquire_slot()  # holds the bytes of an earlier page: content does not matter
            engine.submit_store(keys[submitted], slot, tokens, sums=fake_sums)
            submitted += 1
        res = engine.poll()
        done += len(res)
        if not res:
            time.sleep(0.0005)
    store_s = time.perf_counter() - t0
    busy = io.done("engine_only_store")

    def load(name: str) -> dict[str, float]:
        """One load of every page: its GB/s and the I/O threads' busy share, keyed by ``name``."""
        io = IoBusy(engine)
        t0 = time.perf_counter()
        submitted = done = 0
        while done < n:
            while submitted < n and engine.free_slots > 0:
                engine.submit_load(keys[submitted], verify=hash_on_cpu)
                submitted += 1
            res = engine.poll()
            for r in res:
                if not r.ok:
                    raise RuntimeError(f"engine-only load failed: {r.error}")
                engine.release_slot(r.slot)
            done += len(res)
            if not res:
                time.sleep(0.0005)
        return {f"{name}_gbps": round(total / (time.perf_counter() - t0) / GB, 2), **io.done(name)}

    out = {"engine_only_store_gbps": round(total / store_s / GB, 2), **busy, **load("engine_only_load_warm")}
    if cold and drop_page_cache():
        out.update(load("engine_only_load_cold"))
    return out


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One row for a case: every number is the median over the repeats (each ratio paired
    with the raw figures of its own repeat), with the per-repeat ratios kept for the spread."""
    out = dict(runs[-1])
    for key, val in runs[-1].items():
        if isinstance(val, float | int) and not isinstance(val, bool):
            out[key] = round(statistics.median(r[key] for r in runs if key in r), 3)
    out["raw_files"] = {k: round(statistics.median(r["raw_files"][k] for r in runs), 2) for k in runs[-1]["raw_files"]}
    out["verified"] = all(r.get("verified") for r in runs)
    out["repeats"] = len(runs)
    out["per_repeat"] = [{k: r[k] for k in ("store_ratio", "load_warm_ratio", "load_cold_ratio", "store_gbps",
                                            "load_warm_gbps", "engine_only_store_gbps", "engine_only_load_warm_gbps")
                          if k in r} | {"raw_files": r["raw_files"]} for r in runs]
    return out
