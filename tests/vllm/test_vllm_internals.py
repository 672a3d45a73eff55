"""vLLM internals the TierStoreConnector subclass relies on (beyond public signatures).

tools/vllm_conformance.py checks signatures and abstract methods; these tests pin the private
behaviour the adapter builds on, so an upstream change fails here with a clear name instead of
as wrong behaviour. Run under another vLLM with ``<venv>/bin/python -m pytest
tests/vllm/test_vllm_internals.py`` (no engine, no GPU).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm


def assigned_attrs(fn: object) -> set[str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))  # type: ignore[arg-type]
    out = set()
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                out.add(t.attr)
    return out


def test_connector_init_sets_nothing_we_do_not_set() -> None:
    """TierStoreConnector.__init__ replaces OffloadingConnector.__init__ without calling it."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )

    from tierstore.vllm.connector import TierStoreConnector

    missing = assigned_attrs(OffloadingConnector.__init__) - assigned_attrs(TierStoreConnector.__init__)
    assert not missing, f"upstream OffloadingConnector.__init__ now also sets {sorted(missing)}"


def test_connector_worker_internals() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (
        OffloadingConnectorWorker,
    )

    attrs = assigned_attrs(OffloadingConnectorWorker.__init__)
    assert {"_load_jobs", "_connector_worker_meta", "_is_store_writer", "worker", "spec"} <= attrs
    # Stores reach the worker through prepare_store_kv (we submit there instead of deferring),
    # loads through start_kv_transfers -> worker.submit_load.
    assert "submit_load" in inspect.getsource(OffloadingConnectorWorker.start_kv_transfers)
    assert "prepare_store_kv" in inspect.getsource(
        __import__("vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector",
                   fromlist=["OffloadingConnector"]).OffloadingConnector.wait_for_save)


def test_failed_recving_recompute_path() -> None:
    """Request-level load failures: failed_recving + policy "recompute" resets the request."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
    from vllm.v1.core.sched.scheduler import Scheduler

    assert "failed_recving" in {f.name for f in dataclasses.fields(KVConnectorTransferResults)}
    cfg = KVTransferConfig(kv_connector="X", kv_role="kv_both")
    cfg.kv_load_failure_policy = "recompute"  # the connector sets it on the scheduler side
    src = inspect.getsource(Scheduler._handle_failed_recving)
    assert "num_computed_tokens = 0" in src and "recompute_kv_load_failures" in src
    init = inspect.getsource(Scheduler.__init__)
    # The scheduler must read the policy after it created the connector.
    assert init.index("create_connector") < init.index("kv_load_failure_policy")


def test_store_progress_moves_past_a_load_and_failed_loads_reach_the_connector() -> None:
    """What TierStoreConnectorScheduler.restart_stores builds on: per-request offload state in
    ``_req_status`` with a ``next_stored_chunk_idx`` per group, moved past the loaded chunks by
    ``update_state_after_alloc`` (chunk-level policy) and reset by ``reset_cache``; the failed
    requests reach ``update_connector_output`` in ``KVConnectorOutput.failed_recving``."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
        OffloadingConnectorScheduler,
        RequestGroupState,
        RequestOffloadState,
    )
    from vllm.v1.outputs import KVConnectorOutput

    assert "next_stored_chunk_idx" in {f.name for f in dataclasses.fields(RequestGroupState)}
    assert "group_states" in RequestOffloadState.__slots__ or "group_states" in {
        f.name for f in dataclasses.fields(RequestOffloadState)}
    assert "failed_recving" in {f.name for f in dataclasses.fields(KVConnectorOutput)}
    assert "_req_status" in assigned_attrs(OffloadingConnectorScheduler.__init__)
    alloc = inspect.getsource(OffloadingConnectorScheduler.update_state_after_alloc)
    assert "group_state.next_stored_chunk_idx = num_chunks" in alloc
    reset = inspect.getsource(OffloadingConnectorScheduler.reset_cache)
    assert "group_state.next_stored_chunk_idx = 0" in reset


def test_offloading_config_and_keys() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
        build_offloading_config,
    )
    from vllm.v1.kv_offload.base import (
        GPULoadStoreSpec,
        ReqContext,
        get_offload_block_hash,
        make_offload_key,
    )
    from vllm.v1.kv_offload.config import OffloadingConfig

    src = inspect.getsource(build_offloading_config)
    assert 'extra_config.get("blocks_per_chunk")' in src
    assert {"cache", "groups", "parallel", "model", "extra_config"} <= {f.name for f in dataclasses.fields(OffloadingConfig)}
    assert get_offload_block_hash(make_offload_key(b"h" * 32, 3)) == b"h" * 32
    spec = GPULoadStoreSpec([4, 5], group_sizes=[2], block_indices=[0])
    assert list(spec.block_ids) == [4, 5]
    assert hasattr(ReqContext, "get_offload_key_position")


def test_mamba_states_packed_back_to_back() -> None:
    from vllm.model_executor.layers.mamba.abstract import MambaBase

    src = inspect.getsource(MambaBase.bind_kv_cache)
    assert "offset += nbytes" in src


def test_cpu_attention_reads_kv_planes() -> None:
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl
    except ImportError:
        pytest.skip("no CPU attention backend in this vLLM build")
    assert CPUAttentionBackend.get_name() == "CPU_ATTN"
    src = inspect.getsource(CPUAttentionBackendImpl.forward)
    assert "block_size * 2" in src and "chunk(2, dim=2)" in src


def test_offload_keys_end_with_the_group_index_in_four_big_endian_bytes() -> None:
    """``TierStoreManager`` splits a key by slicing (``key[-4:]`` routes the group,
    ``key[:-4]`` is the block hash) instead of calling vLLM's helpers once per lookup; this
    pins that encoding to vLLM's own ``make_offload_key`` / ``get_offload_*``."""
    from vllm.v1.kv_offload.base import (
        get_offload_block_hash,
        get_offload_group_idx,
        make_offload_key,
    )

    for block_hash in (bytes(range(32)), b"\xff" * 8, b"x"):
        for gid in (0, 1, 7, 300, 2**31 + 5):
            key = make_offload_key(block_hash, gid)
            assert key[-4:] == gid.to_bytes(4, "big") and get_offload_group_idx(key) == gid
            assert key[:-4] == get_offload_block_hash(key) == block_hash


def test_the_prefix_loop_lookup_prefix_stands_in_for() -> None:
    """``TierStoreConnectorScheduler`` replaces ``_maximal_prefix_lookup`` by one
    ``lookup_prefix`` call that must answer as it does: HITs counted until the first MISS, any
    RETRY before it makes the answer None (later keys still asked), and the scheduler calls it
    for non-sliding groups. It keeps vLLM's loop while ``self_describing_enabled`` (KV events
    record each hit)."""
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (
        OffloadingEventsTracker,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
        OffloadingConnectorScheduler,
    )
    from vllm.v1.kv_offload.base import LookupResult, OffloadingKVEventsConfig

    H, R, M = LookupResult.HIT, LookupResult.RETRY, LookupResult.MISS
    events = OffloadingEventsTracker(OffloadingKVEventsConfig(False, False))
    assert events.self_describing_enabled is False
    for answers, want, asked in (([H, H, M, H], 2, 3), ([H, R, H, M, H], None, 4), ([H, H, H], 3, 3), ([M, H], 0, 1)):
        seen: list[bytes] = []
        manager = SimpleNamespace(lookup=lambda key, ctx, a=answers, s=seen: s.append(key) or a[len(s) - 1])
        loop = SimpleNamespace(manager=manager, _events_tracker=events)
        keys = [bytes([i]) for i in range(len(answers))]
        assert OffloadingConnectorScheduler._maximal_prefix_lookup(loop, keys, None, None, None, 0) == want
        assert len(seen) == asked
    assert "self._maximal_prefix_lookup(" in inspect.getsource(OffloadingConnectorScheduler._lookup_complete_chunks)
