"""The tiers in a real vLLM engine: local disk in front of the shared root, per-tier metrics.

Engine 1 (local tier A + shared root) stores; a fresh engine on local tier B (same shared root)
restores from the shared tier with identical tokens; with the shared root renamed away, a fresh
engine on local tier A still restores from its local tier. vLLM's connector stats hook carries
the per-tier loads/stores (``tierstore_tier_*_total{tier}``) next to the adapter counters.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from vllm_helpers import failures, prompt_ids, run_engine  # noqa: E402


def _tier(reported: dict, family: str, tier: str, *labels: str) -> float:
    return reported.get(f"tierstore_tier_{family}_total:{(tier, *labels)}", 0)


def test_local_tier_in_front_of_shared_root(tmp_path: Path) -> None:
    shared, local_a, local_b = tmp_path / "shared", tmp_path / "local_a", tmp_path / "local_b"
    ids = prompt_ids("llama")
    cfg = {"local_max_bytes": 256 << 20}

    first = run_engine("llama", shared, [{"prompt_token_ids": ids}], extra={"local_root": str(local_a), **cfg})
    assert first.outputs[0].cached == 0
    r = first.reported
    assert _tier(r, "stores", "local") > 0 and _tier(r, "stores", "shared") > 0, r
    assert r.get("tierstore_page_stores_total:('written',)", 0) > 0, r
    assert any(local_a.rglob("*.kvp")) and any(shared.rglob("*.kvp"))

    # another node's local tier, same shared root: served by the shared tier
    second = run_engine("llama", shared, [{"prompt_token_ids": ids}], extra={"local_root": str(local_b), **cfg})
    assert second.outputs[0].tokens == first.outputs[0].tokens
    assert second.outputs[0].cached > 0 and not failures(second.worker), second.worker
    r = second.reported
    assert _tier(r, "loads", "shared", "hit") > 0 and _tier(r, "load_tokens", "shared", "hit") > 0, r
    assert _tier(r, "loads", "local", "hit") == 0, r
    assert r.get("tierstore_page_loads_total:('ok',)", 0) == _tier(r, "loads", "shared", "hit"), r

    # shared root gone: the first node's local tier still serves the prefix
    shared.rename(tmp_path / "shared-away")
    third = run_engine("llama", shared, [{"prompt_token_ids": ids}], extra={"local_root": str(local_a), **cfg})
    assert third.outputs[0].tokens == first.outputs[0].tokens
    assert third.outputs[0].cached == second.outputs[0].cached, (third.outputs[0].cached, second.outputs[0].cached)
    r = third.reported
    assert _tier(r, "loads", "local", "hit") > 0 and _tier(r, "loads", "shared", "hit") == 0, r
    assert third.worker.get("load_jobs_ok", 0) == 1 and not failures(third.worker), third.worker


def test_tier_metrics_reach_prometheus() -> None:
    """Registry increments -> OffloadingConnectorStats -> (IPC dict) -> TierStorePromMetrics."""
    from functools import partial
    from types import SimpleNamespace

    import prometheus_client as prom
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadingConnectorStats,
    )

    from tierstore.metrics import MetricsRegistry
    from tierstore.vllm.stats import (
        TierDeltas,
        TierStorePromMetrics,
        accumulate,
        add_adapter_counters,
    )

    reg = MetricsRegistry()
    reg.tier("local").hit(128, 4096, 0.002)
    deltas = TierDeltas(reg.snapshot())  # what happened before reporting started is not reported
    reg.tier("local").hit(128, 4096, 0.002)
    reg.tier("shared").miss(128)
    reg.tier("shared").failure("timeout")
    reg.tier("local").set_capacity(1000, 2000, pages=3)
    stats = OffloadingConnectorStats()
    assert deltas.add_to(stats, reg.snapshot())
    add_adapter_counters(stats, {"load_pages_ok": 1, "load_failed:checksum": 2, "not_declared": 5})
    assert not deltas.add_to(OffloadingConnectorStats(), reg.snapshot())  # nothing new

    totals: dict = {}
    accumulate(totals, stats)
    accumulate(totals, stats)
    assert totals["tierstore_tier_loads_total:('local', 'hit')"] == 2  # counters add up
    assert totals["tierstore_tier_resident_bytes:('local',)"] == 1000  # gauges keep the latest
    assert totals["tierstore_tier_load_seconds:('local',)_count"] == 2

    registry = prom.CollectorRegistry()
    types = {cls: partial(cls, registry=registry) for cls in (prom.Gauge, prom.Counter, prom.Histogram)}
    vllm_config = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config={"root": "/x"}))
    metrics = TierStorePromMetrics(vllm_config, types, ["engine"], {0: ["0"]})
    metrics.observe(stats.data, 0)

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"engine": "0", **labels})

    assert value("tierstore_tier_loads_total", tier="local", result="hit") == 1
    assert value("tierstore_tier_load_tokens_total", tier="local", result="hit") == 128
    assert value("tierstore_tier_loads_total", tier="shared", result="miss") == 1
    assert value("tierstore_tier_errors_total", tier="shared", kind="timeout") == 1
    assert value("tierstore_tier_resident_bytes", tier="local") == 1000
    assert value("tierstore_tier_resident_pages", tier="local") == 3
    assert value("tierstore_tier_capacity_bytes", tier="local") == 2000
    assert value("tierstore_tier_load_seconds_count", tier="local") == 1
    assert value("tierstore_tier_load_seconds_bucket", tier="local", le="0.001") == 0
    assert value("tierstore_tier_load_seconds_bucket", tier="local", le="0.0025") == 1
    assert value("tierstore_page_loads_total", result="ok") == 1
    assert value("tierstore_page_loads_total", result="failed") == 2
    assert value("tierstore_page_failures_total", op="load", kind="checksum") == 2
