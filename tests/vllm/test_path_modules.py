"""How many of the package's modules one store and one load run through, worker to file.

A profiler on every thread records the module of each Python function (and of each compiled
function called from Python) that runs between ``submit_store``/``submit_load`` of vLLM's
worker interface and the job's result, for one job of 6 pages through a lone root (a chain of
one) on the CPU transfer path, and on a CUDA device where there is one (Triton copies, GPU
checksums). The figures are a ratchet: the path may get shorter, never
longer, without this test being changed on purpose. The floor plan asks for at most 10 modules
each; today's counts are higher (the lists are printed with ``-s``; the count at the floor
plan's start, docs/measurements/floor-plan.md). Counted by package, the layers a reader
goes through, they are 10 and 9.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch
from kernel_cases import AttentionCase
from worker_import import import_worker

from tierstore.config import TierStoreConfig
from tierstore.kernels import GroupCopier
from tierstore.kernels.transfer import PageTransfer
from tierstore.native import loader as native
from tierstore.tiers import TierChain

worker_mod, manager_mod, GPULoadStoreSpec = import_worker()

# (store, load) modules at most, per device, with the compiled I/O path: 2026-11-27's counts
# (H200 host; CPU the same on the 2-core CI kind) plus one for timing (which poll finds a
# result first can add a module). CPU 29 and 30: worker, pipelines, jobs, group, transfer,
# kernels (torch), chain, tier, shared, engine, queue, lane, staging, page files, native page
# calls, mapper, metrics...; CUDA 32 and 33: the Triton copies, checksums and driver besides.
# 2026-11-29: a CPU load is 31 since the raw page I/O left pageops for rootstore/page_io (the
# split into files under 600 lines; a store stays 29), and a CI run on the saturated 2-core
# machine stored through 31 (the rank directory's 2 s staleness check fell inside the measured
# job: fs.safefs, fs.directio): two for timing on the CPU.
MODULES_MAX = {"cpu": (31, 33), "cuda": (33, 34)}
# (store, load) packages at most (a top-level module counts as one): format, fs, index, kernels,
# native, rootstore, tiers, vllm and the modules metrics and store for a store; no index for a
# load; no format on CUDA (the GPU computes the checksums). H200 and CI kind, 2026-11-28.
PACKAGES_MAX = {"cpu": (10, 9), "cuda": (9, 8)}
DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (compiled Triton)"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="TRITON_INTERPRET=1 is set")])]


class _ModuleRecorder:
    """{tierstore module: functions of it that ran} inside ``record``, on every Python thread.

    ``threading.setprofile`` hooks only threads started after it (Python 3.11 has no
    ``setprofile_all_threads``), so the hook goes in before the chain and the worker start
    their threads and records only inside ``record``: the I/O threads started by the warm-up
    job are traced too."""

    def __init__(self) -> None:
        self._seen: dict[str, set[str]] | None = None

    def _profile(self, frame: FrameType, event: str, arg: Any) -> None:
        seen = self._seen
        if seen is None:
            return
        if event == "call":
            module, name = frame.f_globals.get("__name__", ""), frame.f_code.co_name
        elif event == "c_call":  # a compiled kernel (numba) called from Python counts too
            module, name = getattr(arg, "__module__", None) or "", getattr(arg, "__name__", "?")
        else:
            return
        if module.startswith("tierstore"):
            seen.setdefault(module, set()).add(name)

    def install(self) -> None:
        threading.setprofile(self._profile)
        sys.setprofile(self._profile)

    def uninstall(self) -> None:
        sys.setprofile(None)
        threading.setprofile(None)  # threads started meanwhile keep the hook, which records nothing now

    def record(self, call: Any) -> dict[str, list[str]]:
        self._seen = seen = {}
        try:
            call()
        finally:
            self._seen = None
        return {m: sorted(f) for m, f in sorted(seen.items())}


def _packages(modules: dict[str, list[str]]) -> set[str]:
    """``tierstore.rootstore.engine`` -> ``rootstore``; a top-level module is its own package."""
    return {m.split(".")[1] if "." in m else m for m in modules}


@pytest.mark.parametrize("io_loop", ["native", "python"])
@pytest.mark.parametrize("device", DEVICES)
def test_a_store_and_a_load_run_through_no_more_modules_than_today(tmp_path: Path, device: str, io_loop: str) -> None:
    if not native.start(wait=True):  # the counts are the compiled path's (the Python one differs)
        pytest.skip(f"the native I/O path is off here: {native.failure()}")
    case = AttentionCase("bfloat16", layers=2, heads=2, head_size=64, tokens=16, n_pages=6)
    views, ids = case.build("LBHNC", 8, device)
    probe = case.engine(tmp_path, 8)  # only asked for its namespace
    namespace = probe.namespace
    probe.close()
    recorder = _ModuleRecorder()
    recorder.install()  # before any of the chain's or the worker's threads start
    chain = TierChain(TierStoreConfig(root=str(tmp_path), io_loop=io_loop), namespace, 0, staging_slots=8, pin=device == "cuda")
    copier = GroupCopier(views, case.layout, ids.shape[1], [1] * case.layers)
    group = worker_mod.WorkerGroup(
        index=0, vllm_group_id=0, copier=copier, store=chain, blocks_per_chunk=ids.shape[1], kernel_ratio=1,
        device=views[0].device, tokens_per_page=case.tokens,
        transfer=PageTransfer(copier, views[0].device, scratch_pages=4))
    worker = worker_mod.TierStoreWorker([group], flush_timeout_s=30.0, defer_limit_s=30.0)

    def specs(rows: Any, keys: list[bytes]) -> tuple[Any, Any]:
        flat = rows.reshape(-1).tolist()
        return (GPULoadStoreSpec(flat, group_sizes=[len(flat)], block_indices=[0]),
                manager_mod.TierStoreFileSpec(groups=[0] * len(keys), keys=keys, token_counts=[16] * len(keys)))

    def finish(job_id: int) -> None:
        end = time.monotonic() + 60
        while time.monotonic() < end:
            if any(r.job_id == job_id and r.success for r in worker.get_finished()):
                return
            time.sleep(0.002)
        raise AssertionError(f"job {job_id} did not succeed within 60 s")

    try:
        gpu, files = specs(ids[:1], [b"warm" * 4])  # first calls: compile, start threads
        worker.submit_store(1, gpu, files)
        finish(1)
        worker.submit_load(2, files, gpu)
        finish(2)
        gpu, files = specs(ids, [(500 + i).to_bytes(4, "big") * 4 for i in range(case.n_pages)])
        stored = recorder.record(lambda: (worker.submit_store(10, gpu, files), finish(10)))
        loaded = recorder.record(lambda: (worker.submit_load(11, files, gpu), finish(11)))
    finally:
        recorder.uninstall()
        worker.shutdown()
        chain.close()
    for what, mods in (("store", stored), ("load", loaded)):
        print(f"{device} {io_loop} {what}: {len(mods)} modules in {len(_packages(mods))} packages {sorted(_packages(mods))}")
        for module, functions in mods.items():
            print(f"  {module}: {', '.join(functions)}")
    assert "tierstore.rootstore.engine" in stored and "tierstore.kernels.transfer" in loaded  # the tracer saw the path
    store_max, load_max = MODULES_MAX[device]
    assert len(stored) <= store_max, sorted(stored)
    assert len(loaded) <= load_max, sorted(loaded)
    store_max, load_max = PACKAGES_MAX[device]
    assert len(_packages(stored)) <= store_max, sorted(_packages(stored))
    assert len(_packages(loaded)) <= load_max, sorted(_packages(loaded))
