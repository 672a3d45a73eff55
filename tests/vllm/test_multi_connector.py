"""tierstore as a child of vLLM's MultiConnector, without an engine: its name in vLLM's connector
registry (MultiConnector's statistics in the API server look children up by class name), its
Prometheus families beside vLLM's OffloadingConnector (the same ``vllm:kv_offload_*`` names
registered twice stopped the API server), and the outer failure policy it reads from the
enclosing MultiConnector.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

import prometheus_client  # noqa: E402
from prometheus_client import Counter, Gauge, Histogram  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (  # noqa: E402
    MultiConnector,
    MultiKVConnectorStats,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (  # noqa: E402
    OffloadingConnectorStats,
)

TIERSTORE = {"kv_connector": "TierStoreConnector", "kv_connector_module_path": "tierstore.vllm",
             "kv_role": "kv_both", "kv_connector_extra_config": {"root": "/nonexistent/cache"}}
OFFLOADING = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 30}}
EXAMPLE = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
           "kv_connector_extra_config": {"shared_storage_path": "/nonexistent/example"}}
LABELS = ["model_name", "engine"]
TYPES = {Gauge: Gauge, Counter: Counter, Histogram: Histogram}


def multi_config(children: list[dict[str, Any]], **outer: Any) -> SimpleNamespace:
    """What MultiConnector's class methods read of an engine config: its kv_transfer_config."""
    return SimpleNamespace(kv_transfer_config=KVTransferConfig(
        kv_connector="MultiConnector", kv_role="kv_both", kv_connector_extra_config={"connectors": children}, **outer))


@pytest.fixture
def registry() -> Iterator[prometheus_client.CollectorRegistry]:
    """The default registry, left as it was found (vLLM's exporter and metric classes use it)."""
    reg = prometheus_client.REGISTRY
    before = set(reg._collector_to_names)
    yield reg
    for collector in set(reg._collector_to_names) - before:
        reg.unregister(collector)


def family_counts(reg: prometheus_client.CollectorRegistry) -> dict[str, int]:
    counts: dict[str, int] = {}
    for family in reg.collect():
        counts[family.name] = counts.get(family.name, 0) + 1
    return counts


def sample(reg: prometheus_client.CollectorRegistry, name: str, **labels: str) -> float:
    return sum(s.value for f in reg.collect() for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


# ------------------------------------------------------------------ registration
def test_connector_is_found_by_name_after_import_and_its_stats_rebuild() -> None:
    from tierstore.vllm.connector import TierStoreConnector
    from tierstore.vllm.multi import register_with_factory
    from tierstore.vllm.stats import PAGE_LOADS, add_adapter_counters

    assert KVConnectorFactory.get_connector_class_by_name("TierStoreConnector") is TierStoreConnector
    # MultiConnector's statistics in the API server: a child's stats arrive as a dict keyed by
    # the child's class name and are rebuilt through the registry (this raised "not registered")
    stats = OffloadingConnectorStats()
    add_adapter_counters(stats, {"load_pages_ok": 3})
    rebuilt = MultiConnector.build_kv_connector_stats({"TierStoreConnector": stats.to_dict()})
    assert isinstance(rebuilt, MultiKVConnectorStats)
    child = rebuilt["TierStoreConnector"]
    assert isinstance(child, OffloadingConnectorStats)
    assert child.reduce() == stats.reduce() and any(k.startswith(PAGE_LOADS) for k in child.reduce())
    # vLLM's factory refuses a name twice (ValueError): a second registration is a quiet no-op
    assert register_with_factory() is False
    assert KVConnectorFactory.get_connector_class_by_name("TierStoreConnector") is TierStoreConnector


# ------------------------------------------------------------------ Prometheus families
@pytest.mark.parametrize("children", [[TIERSTORE, OFFLOADING], [OFFLOADING, TIERSTORE]],
                         ids=["tierstore-first", "offloading-first"])
def test_beside_offloading_connector_each_family_is_registered_once(registry, children) -> None:
    from tierstore.vllm.stats import PAGE_LOADS, add_adapter_counters

    prom = MultiConnector.build_prom_metrics(multi_config(children), TYPES, LABELS, {0: ["m", "0"]})
    # vLLM's OffloadingConnector owns vllm:kv_offload_* (registered when it was built); tierstore
    # registers its own families at once and leaves vLLM's to it at its first report
    ours = OffloadingConnectorStats()
    add_adapter_counters(ours, {"load_pages_ok": 3})
    ours.increase_counter("vllm:kv_offload_load_bytes", 1000)
    theirs = OffloadingConnectorStats()
    theirs.increase_counter("vllm:kv_offload_load_bytes", 7)
    prom.observe({"TierStoreConnector": ours.to_dict(), "OffloadingConnector": theirs.to_dict()})
    prom.observe({"TierStoreConnector": ours.to_dict()})
    counts = family_counts(registry)
    assert counts.get(PAGE_LOADS.removesuffix("_total")) == 1
    assert counts.get("vllm:kv_offload_load_bytes") == 1
    assert sample(registry, PAGE_LOADS, result="ok", engine="0") == 6
    # vLLM's series are the OffloadingConnector's alone: tierstore's 1000 bytes are not in them
    assert sample(registry, "vllm:kv_offload_load_bytes_total", engine="0") == 7
    assert prom._prom_metrics["TierStoreConnector"].exports_vllm_families is False


def test_alone_tierstore_exports_vllms_offload_families_from_its_first_report(registry) -> None:
    from tierstore.vllm.connector import TierStoreConnector

    prom = TierStoreConnector.build_prom_metrics(SimpleNamespace(kv_transfer_config=KVTransferConfig(**TIERSTORE)),
                                                 TYPES, LABELS, {0: ["m", "0"]})
    assert "vllm:kv_offload_load_bytes" not in family_counts(registry)  # held until the first report
    stats = OffloadingConnectorStats()
    stats.increase_counter("vllm:kv_offload_load_bytes", 1000)
    prom.observe(stats.to_dict())
    assert prom.exports_vllm_families is True
    assert sample(registry, "vllm:kv_offload_load_bytes_total", engine="0") == 1000
    # the deprecated family vLLM still fills for the CPU spec came along with the rest
    assert sample(registry, "vllm:kv_offload_total_bytes_total", engine="0", transfer_type="GPU_to_CPU") \
        + sample(registry, "vllm:kv_offload_total_bytes_total", engine="0", transfer_type="CPU_to_GPU") == 1000


# ------------------------------------------------------------------ the outer failure policy
def _inside(parent: MultiConnector, then: Any) -> Any:
    """``then()`` called from a frame whose ``self`` is ``parent``, as in MultiConnector's methods."""
    self = parent  # noqa: F841 - what the walk looks for
    return then()


def _multi(policy: str | None) -> MultiConnector:
    multi = object.__new__(MultiConnector)  # only the attribute the walk reads
    kw = {} if policy is None else {"kv_load_failure_policy": policy}
    multi._kv_transfer_config = multi_config([TIERSTORE], **kw).kv_transfer_config
    return multi


def test_the_outer_config_is_the_outermost_multiconnectors() -> None:
    from tierstore.vllm.multi import enclosing_transfer_config

    assert enclosing_transfer_config() is None  # alone
    outer, inner = _multi("recompute"), _multi(None)
    assert _inside(inner, enclosing_transfer_config) is inner._kv_transfer_config
    # nested MultiConnectors: the outermost one's, the one the scheduler reads
    assert _inside(outer, lambda: _inside(inner, enclosing_transfer_config)) is outer._kv_transfer_config


@pytest.mark.parametrize("policy", [None, "fail"])  # vLLM's default is "fail"
def test_multiconnector_without_outer_recompute_refuses_to_build_tierstore(policy: str | None) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    kw = {} if policy is None else {"kv_load_failure_policy": policy}
    # what a scheduler does with --kv-transfer-config: MultiConnector builds its children; the
    # refusal comes before tierstore needs anything else of the engine's config
    with pytest.raises(ValueError, match="kv_load_failure_policy") as err:
        MultiConnector(multi_config([TIERSTORE, EXAMPLE], **kw), KVConnectorRole.SCHEDULER, None)
    assert "outer kv_transfer_config" in str(err.value) and "ExampleConnector" in str(err.value)


def test_outer_policy_other_than_recompute_is_refused_naming_the_setting() -> None:
    from tierstore.vllm.multi import check_failure_policy

    check_failure_policy(_multi("recompute")._kv_transfer_config)
    for policy in (None, "fail"):  # vLLM's default is "fail"
        with pytest.raises(ValueError, match="kv_load_failure_policy") as err:
            check_failure_policy(_multi(policy)._kv_transfer_config)
        assert "outer kv_transfer_config" in str(err.value) and '"recompute"' in str(err.value)
        assert "TierStoreConnector" in str(err.value)
