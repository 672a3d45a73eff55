"""Import the vLLM worker side of tierstore with or without vLLM (the device has none).

When ``import vllm.v1.kv_offload.base`` fails, minimal stand-ins for the few vLLM names
``tierstore/vllm/worker.py`` and ``manager.py`` import (``vllm.v1.kv_offload.base``) are put
into ``sys.modules``, and ``tierstore.vllm`` is bound to a bare package object so that its
``__init__`` (the connector, which needs all of vLLM) does not run; both are removed from
``sys.modules`` again right after the import, so other test files still see no vLLM and skip.
With vLLM installed the real modules are used.
"""

from __future__ import annotations

import enum
import functools
import sys
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import tierstore


def _vllm_standins() -> dict[str, types.ModuleType]:
    """Modules standing in for ``vllm.v1.kv_offload.base`` (only what the worker side imports)."""

    class LoadStoreSpec:
        pass

    class GPULoadStoreSpec(LoadStoreSpec):
        def __init__(self, block_ids: list[int], group_sizes: list[int], block_indices: list[int]) -> None:
            assert sum(group_sizes) == len(block_ids) and len(block_indices) == len(group_sizes)
            self.block_ids = torch.tensor(block_ids, dtype=torch.int64)
            self.group_sizes = group_sizes
            self.block_indices = block_indices

    @dataclass
    class TransferResult:
        job_id: int
        success: bool
        transfer_size: int | None = None
        transfer_time: float | None = None

    class _Placeholder:
        pass

    base = types.ModuleType("vllm.v1.kv_offload.base")
    base.LoadStoreSpec = LoadStoreSpec
    base.GPULoadStoreSpec = GPULoadStoreSpec
    base.TransferResult = TransferResult
    for name in ("OffloadingWorker", "OffloadingManager", "OffloadKey", "PrepareStoreOutput",
                 "ReqContext", "RequestOffloadingContext"):
        setattr(base, name, type(name, (_Placeholder,), {}))
    # The manager reads its members at import (vLLM 0.32's values).
    base.LookupResult = enum.Enum("LookupResult", {"MISS": 1, "HIT": 2, "HIT_PENDING": 3, "RETRY": 4})
    base.get_offload_block_hash = lambda key: key
    base.get_offload_group_idx = lambda key: 0
    mods = {name: types.ModuleType(name) for name in ("vllm", "vllm.v1", "vllm.v1.kv_offload")}
    mods["vllm.v1.kv_offload.base"] = base
    mods["vllm"].v1 = mods["vllm.v1"]
    mods["vllm.v1"].kv_offload = mods["vllm.v1.kv_offload"]
    mods["vllm.v1.kv_offload"].base = base
    return mods


@functools.cache
def import_worker() -> tuple[Any, Any, Any]:
    """(worker module, manager module, GPULoadStoreSpec): the real ones, or on stand-ins (once
    per process: every caller gets the same modules)."""
    try:
        import vllm.v1.kv_offload.base  # noqa: F401  (a bare `vllm` may exist without the v1 API)
    except ImportError:
        before = set(sys.modules)
        sys.modules.update(_vllm_standins())
        pkg = types.ModuleType("tierstore.vllm")
        pkg.__path__ = [str(Path(tierstore.__file__).parent / "vllm")]
        sys.modules["tierstore.vllm"] = pkg
        try:
            import tierstore.vllm.manager as manager
            import tierstore.vllm.worker as worker
            spec_cls = sys.modules["vllm.v1.kv_offload.base"].GPULoadStoreSpec
        finally:
            for name in set(sys.modules) - before:
                if name == "vllm" or name.startswith(("vllm.", "tierstore.vllm")):
                    del sys.modules[name]
        return worker, manager, spec_cls
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    import tierstore.vllm.manager as manager
    import tierstore.vllm.worker as worker

    return worker, manager, GPULoadStoreSpec


def run_job(worker: Any, job_id: int, store: bool, blocks: list[int], keys: list[bytes], tokens: int,
            timeout_s: float = 120.0) -> None:
    """One store (``store``) or load job of group 0 through ``worker`` (a TierStoreWorker):
    ``keys``' pages from or into ``blocks``, one block a page; fails unless it succeeds in time."""
    _, manager, gpu_spec = import_worker()
    gpu = gpu_spec(blocks, group_sizes=[len(blocks)], block_indices=[0])
    files = manager.TierStoreFileSpec(groups=[0] * len(keys), keys=keys, token_counts=[tokens] * len(keys))
    if store:
        worker.submit_store(job_id, gpu, files)
    else:
        worker.submit_load(job_id, files, gpu)
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        for r in worker.get_finished():
            if r.job_id == job_id:
                assert r.success, f"job {job_id} failed"
                return
        time.sleep(0.002)
    raise AssertionError(f"job {job_id} did not finish")
