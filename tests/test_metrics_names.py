"""tierstore's metrics: Prometheus naming, labels, exact histogram sums, residency, read time, tier up,
gc's exporter.

Every exported name follows Prometheus' conventions and is documented in docs/METRICS.md;
histogram ``_sum`` equals the true total after the registry -> connector stats -> exporter
path; residency gauges come from one owner per tier; the up gauge is the minimum over ranks;
gc's exporter writes what a pass did.
"""

from __future__ import annotations

import math
import random
import re
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

import prometheus_client as prom  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats  # noqa: E402

from tierstore.admin.metrics_export import GC_METRICS  # noqa: E402
from tierstore.metrics import LATENCY_BUCKETS, MetricsRegistry  # noqa: E402
from tierstore.vllm import stats as ts_stats  # noqa: E402
from tierstore.vllm.stats import (  # noqa: E402
    TierDeltas,
    TierStorePromMetrics,
    add_adapter_counters,
    add_index_residency,
    metric_definitions,
)

REPO = Path(__file__).resolve().parents[1]
UNITS = ("seconds", "bytes", "pages", "tokens", "timestamp_seconds")


def _exporter() -> tuple[TierStorePromMetrics, prom.CollectorRegistry]:
    registry = prom.CollectorRegistry()
    types = {cls: partial(cls, registry=registry) for cls in (prom.Gauge, prom.Counter, prom.Histogram)}
    vllm_config = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config={"root": "/x"}))
    return TierStorePromMetrics(vllm_config, types, ["engine"], {0: ["0"]}), registry


def _all_exported() -> dict[str, str]:
    """Exported family name -> type, tierstore's engine metrics and gc's."""
    out = {name: type(m).__name__.replace("Offloading", "").replace("Metadata", "").lower()
           for name, m in metric_definitions().items()}
    out.update({name: spec[0] for name, spec in GC_METRICS.items()})
    return out


@pytest.mark.parametrize("name", sorted(_all_exported()))
def test_names_follow_prometheus_conventions(name: str) -> None:
    kind = _all_exported()[name]
    assert re.fullmatch(r"tierstore_[a-z][a-z0-9_]*", name), name
    assert "_total_" not in name and not name.endswith("_total_total")
    if kind == "counter":
        assert name.endswith("_total"), name
    else:
        assert not name.endswith("_total"), name
    if kind == "histogram":
        assert name.endswith("_seconds"), name  # every histogram is a duration in base units
    stem = name.removesuffix("_total")
    for unit in ("bytes", "seconds", "ms", "milliseconds", "kib", "mib"):  # a unit only as the last word
        assert f"_{unit}_" not in stem + "_" or stem.endswith(f"_{unit}"), name
    assert not re.search(r"_(ms|milliseconds|kib|mib|kb|mb)(_|$)", name), name  # base units only


def test_tier_families_label_tier_first_and_adapter_families_have_no_tier() -> None:
    for name, meta in metric_definitions().items():
        if name.startswith("tierstore_tier_"):
            assert meta.labelnames[0] == "tier", name
        else:
            assert "tier" not in meta.labelnames, name


def test_exposition_has_total_once_and_labels() -> None:
    metrics, registry = _exporter()
    reg = MetricsRegistry()
    deltas = TierDeltas({})
    reg.tier("local").hit(16, 4096, 0.003, 0.001)
    reg.tier("local").stored(4096, 0.01)
    reg.tier("local").failure("enospc")
    stats = OffloadingConnectorStats()
    deltas.add_to(stats, reg.snapshot())
    add_adapter_counters(stats, {"lookups": 10, "lookup_hits": 6, "lookup_retries": 1, "skipped_failed": 1,
                                 "store_dropped:fence": 2, "store_pages_ok": 3, "store_bytes": 99})
    metrics.observe(stats.data, 0)
    text = prom.generate_latest(registry).decode()
    assert "_total_total" not in text
    assert 'tierstore_lookups_total{engine="0",result="miss"} 2.0' in text  # 10 - 6 - 1 - 1
    assert 'tierstore_lookups_total{engine="0",result="hit"} 6.0' in text
    assert 'tierstore_tier_loads_total{engine="0",result="hit",tier="local"} 1.0' in text
    assert 'tierstore_tier_errors_total{engine="0",kind="enospc",tier="local"} 1.0' in text
    assert 'tierstore_page_stores_total{engine="0",result="dropped"} 2.0' in text
    assert 'tierstore_page_stores_dropped_total{engine="0",reason="fence"} 2.0' in text
    assert 'tierstore_page_bytes_total{engine="0",op="store"} 99.0' in text
    assert 'tierstore_tier_page_bytes_total{engine="0",op="write",tier="local"} 4096.0' in text
    assert 'tierstore_tier_load_read_seconds_count{engine="0",tier="local"} 1.0' in text
    families = {f.name: f.type for f in text_string_to_metric_families(text) if f.name.startswith("tierstore_")}
    for name, kind in _all_exported().items():
        if name in families or name.removesuffix("_total") in families:
            assert families.get(name.removesuffix("_total"), families.get(name)) == kind, name


def test_histogram_sum_is_exact_through_the_exporter() -> None:
    """Registry samples -> TierDeltas (two exports) -> exporter: ``_sum`` is the true total and
    every bucket holds what a prometheus_client histogram fed the same samples holds."""
    rng = random.Random(7)
    samples = [rng.lognormvariate(-6, 2) for _ in range(3000)] + [LATENCY_BUCKETS[3]] * 5 + [120.0]
    reg = MetricsRegistry()
    deltas = TierDeltas({})
    metrics, registry = _exporter()
    direct = prom.Histogram("direct_seconds", "x", buckets=LATENCY_BUCKETS, registry=prom.CollectorRegistry())
    for part in (samples[:1000], samples[1000:]):
        for s in part:
            reg.tier("shared").hit(1, 1, s)
            direct.observe(s)
        stats = OffloadingConnectorStats()
        deltas.add_to(stats, reg.snapshot())
        metrics.observe(stats.data, 0)
    got = partial(registry.get_sample_value, labels={"engine": "0", "tier": "shared"})
    exported = registry.get_sample_value("tierstore_tier_load_seconds_sum", {"engine": "0", "tier": "shared"})
    assert exported is not None and math.isclose(exported, math.fsum(samples), rel_tol=1e-9), (exported, sum(samples))
    assert got("tierstore_tier_load_seconds_count") == len(samples)
    for b in [*LATENCY_BUCKETS, math.inf]:
        le = prom.utils.floatToGoString(b)
        want = direct._samples()  # noqa: SLF001 - the reference histogram's own buckets
        ref = next(s.value for s in want if s.name == "_bucket" and s.labels["le"] == le)
        assert registry.get_sample_value("tierstore_tier_load_seconds_bucket",
                                         {"engine": "0", "tier": "shared", "le": le}) == ref, le


def test_residency_has_one_owner_per_tier() -> None:
    """The worker reports host/local residency (and every cap); root/shared residency comes
    from the scheduler's page index only, so an in-process engine never reports it twice."""
    reg = MetricsRegistry()
    reg.tier("local").set_capacity(5000, 10000, pages=5)
    reg.tier("root").set_capacity(7777, 20000)  # the in-process gc daemon's whole-root figure
    worker = OffloadingConnectorStats()
    TierDeltas({}).add_to(worker, reg.snapshot())
    gauges = worker.data["data"]
    assert gauges["tierstore_tier_resident_bytes"] == {("local",): 5000}
    assert gauges["tierstore_tier_resident_pages"] == {("local",): 5}
    assert gauges["tierstore_tier_capacity_bytes"] == {("local",): 10000, ("root",): 20000}
    sched = OffloadingConnectorStats()
    assert add_index_residency(sched, {"local": [9, 9], "shared": [3, 4]}, [100, 1000], {"shared": "root"})
    assert sched.data["data"]["tierstore_tier_resident_pages"] == {("root",): 7}
    assert sched.data["data"]["tierstore_tier_resident_bytes"] == {("root",): 3 * 100 + 4 * 1000}


def test_tier_up_is_reported_per_process_and_exported_as_the_minimum_over_ranks() -> None:
    """Each rank's ``TierDeltas`` reports its registry's ``up`` (first report, then changes) under
    its own reporter; vLLM's merge of the ranks' stats (``aggregate``, last value per label
    tuple) keeps them apart; the exporter remembers each rank's last value and exports the
    minimum under ``tier`` alone: one rank's down tier reads 0 until that rank reads 1 again."""
    metrics, registry = _exporter()
    regs = [MetricsRegistry(), MetricsRegistry()]
    tokens = [object(), object()]
    for reg, token in zip(regs, tokens, strict=True):
        reg.tier("shared").set_up(token, True)
        reg.tier("local").set_capacity(1, 2)  # a tier without a health check: no up series
    ranks = [TierDeltas(r.snapshot(), reporter=f"rank{i}") for i, r in enumerate(regs)]  # a baseline up: sent anyway

    def step() -> float | None:
        merged = OffloadingConnectorStats()  # rank 0's stats, then the others' (KVOutputAggregator)
        for deltas, reg in zip(ranks, regs, strict=True):
            one = OffloadingConnectorStats()
            deltas.add_to(one, reg.snapshot())
            merged = merged.aggregate(one) if not merged.is_empty() else one
        metrics.observe(merged.data, 0)
        return registry.get_sample_value("tierstore_tier_up", {"engine": "0", "tier": "shared"})

    assert step() == 1
    first = OffloadingConnectorStats()
    assert not ranks[0].add_to(first, regs[0].snapshot()) and first.is_empty()  # unchanged: nothing sent
    regs[1].tier("shared").set_up(tokens[1], False)  # rank 1's shared tier goes down
    assert step() == 0
    assert step() == 0  # neither rank reports (no change): the exporter keeps the minimum
    regs[0].tier("shared").set_up(tokens[0], False)  # rank 0 goes down and back: it reports 1
    step()
    regs[0].tier("shared").set_up(tokens[0], True)
    assert step() == 0  # rank 1 is still down
    regs[1].tier("shared").set_up(tokens[1], True)
    assert step() == 1
    assert registry.get_sample_value("tierstore_tier_up", {"engine": "0", "tier": "local"}) is None
    text = prom.generate_latest(registry).decode()
    assert 'tierstore_tier_up{engine="0",tier="shared"} 1.0' in text  # no reporter label exported
    assert "# TYPE tierstore_tier_up gauge" in text


def test_tier_up_payload_and_exposition_of_one_worker() -> None:
    """One worker: the payload carries (tier, reporter); the exposition ``tier`` only; a tier
    that starts down is exported as 0 at the first report."""
    reg = MetricsRegistry()
    reg.tier("root").set_up(object(), False)
    stats = OffloadingConnectorStats()
    assert TierDeltas({}).add_to(stats, reg.snapshot())
    assert stats.data["data"]["tierstore_tier_up"] == {("root", ts_stats.process_reporter()): 0}
    metrics, registry = _exporter()
    metrics.observe(stats.data, 0)
    assert registry.get_sample_value("tierstore_tier_up", {"engine": "0", "tier": "root"}) == 0
    plain = OffloadingConnectorStats()  # a payload without a reporter (one label) is exported too
    plain.set_gauge("tierstore_tier_up", 1, ("shared",))
    metrics.observe(plain.data, 0)
    assert registry.get_sample_value("tierstore_tier_up", {"engine": "0", "tier": "shared"}) == 1


def test_page_index_counts_resident_pages(tmp_path: Path) -> None:
    from tierstore.fs.mapper import FileMapper
    from tierstore.index.indexed_lookup import IndexedLookup
    from tierstore.testing.pages import fill_pages, simple_namespace

    ns = simple_namespace()
    fill_pages(tmp_path / "root", ns, pages_per_group=6)
    fill_pages(tmp_path / "local", ns, pages_per_group=2)
    mappers = [FileMapper(tmp_path / "root", ns.digest, g, 0) for g in range(len(ns.groups))]
    local = [FileMapper(tmp_path / "local", ns.digest, g, 0) for g in range(len(ns.groups))]
    lookup = IndexedLookup(mappers, local, refresh_s=0).start()
    try:
        end = time.monotonic() + 30
        while not lookup.resident and time.monotonic() < end:
            time.sleep(0.02)
        assert lookup.resident == {"local": [2] * len(ns.groups), "shared": [6] * len(ns.groups)}
    finally:
        lookup.close()


def test_host_and_local_tiers_publish_resident_pages(tmp_path: Path) -> None:
    from tierstore.tiers.host import HostTier

    reg = MetricsRegistry()
    host = HostTier(1 << 20, reg.tier("host"))
    host.put("s", b"k1", b"x" * 100)
    host.put("s", b"k2", b"y" * 50)
    snap = reg.snapshot()["host"]
    assert snap["resident_pages"] == 2 and snap["used_bytes"] == 150 and snap["cap_bytes"] == 1 << 20
    host.discard("s", b"k1")  # a damaged page dropped: the gauges follow
    snap = reg.snapshot()["host"]
    assert snap["resident_pages"] == 1 and snap["used_bytes"] == 50


def test_load_read_time_is_part_of_the_load_time(tmp_path: Path) -> None:
    """A real engine's verified loads carry the I/O thread's time; the tier counts it in
    ``load_read_seconds`` beside ``load_seconds`` (never more than the whole load)."""
    from tiers_helpers import key, load, store

    from tierstore.config import TierStoreConfig
    from tierstore.testing.pages import simple_namespace
    from tierstore.tiers import TierChain, close_shared_state

    reg = MetricsRegistry()
    conf = TierStoreConfig.from_dict({"root": str(tmp_path / "shared"), "local_root": str(tmp_path / "local"),
                                      "local_max_bytes": 1 << 20})
    st = TierChain(conf, simple_namespace(), 0, metrics=reg)
    try:
        for i in range(8):
            assert store(st, key(i)).ok
        assert st.flush(10)
        for i in range(8):
            assert load(st, key(i))[0]
    finally:
        st.close()
        close_shared_state()
    local = reg.snapshot()["local"]
    whole, read = local["load_seconds"], local["load_read_seconds"]
    assert whole["count"] == 8 and read["count"] == 8, local
    assert 0 < read["sum"] <= whole["sum"], (read["sum"], whole["sum"])


def test_docs_list_every_metric_and_the_old_names() -> None:
    doc = (REPO / "docs" / "METRICS.md").read_text()
    for name in _all_exported():
        assert f"`{name}`" in doc, name
    reference = doc.split("## Before and after", 1)[0]
    documented = set(re.findall(r"^\| `(tierstore_[a-z0-9_]+)`", reference, re.M))
    assert documented <= set(_all_exported()), documented - set(_all_exported())
    for old in ("tierstore_lookup_hits_total", "tierstore_tier_hits_total", "tierstore_load_pages_ok_total",
                "tierstore_tier_failures_total", "tierstore_tier_used_bytes", "tierstore_tier_stored_bytes_total"):
        assert f"`{old}`" in doc, old  # the before/after table


def _promql_names(expr: str) -> set[str]:
    names = set(re.findall(r"\b(tierstore_[a-z0-9_]+)", expr))
    out = set()
    for n in names:
        for suffix in ("_bucket", "_sum", "_count"):
            if n.endswith(suffix) and n.removesuffix(suffix) in _all_exported():
                n = n.removesuffix(suffix)
        out.add(n)
    return out


def promql_expressions() -> dict[str, str]:
    """Every PromQL expression shipped (alert and recording rules, dashboard targets), by where."""
    import json

    import yaml

    out: dict[str, str] = {}
    rules = yaml.safe_load((REPO / "deploy/prometheus/tierstore-alerts.yml").read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            out[f"rule {rule.get('alert') or rule.get('record')}"] = rule["expr"]
    dash = json.loads((REPO / "deploy/grafana/tierstore-dashboard.json").read_text())
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            out[f"panel {panel['title']!r} {target['refId']}"] = target["expr"]
    return out


def test_promql_uses_only_exported_names() -> None:
    exported = set(_all_exported())
    exprs = promql_expressions()
    assert len(exprs) >= 20
    recorded = {k.split(" ", 1)[1] for k in exprs if k.startswith("rule tierstore:")}
    for where, expr in exprs.items():
        unknown = _promql_names(expr) - exported
        assert not unknown, (where, unknown)
        for rec in re.findall(r"\b(tierstore:[a-z0-9_:]+)", expr):
            assert rec in recorded, (where, rec)


def test_gc_exports_its_pass_to_a_textfile(tmp_path: Path) -> None:
    from tierstore.testing.pages import fill_pages, simple_namespace

    root, prom_file = tmp_path / "root", tmp_path / "textfile" / "tierstore_gc.prom"
    prom_file.parent.mkdir()
    fill_pages(root, simple_namespace(), pages_per_group=40)
    out = subprocess.run([sys.executable, "-m", "tierstore", "gc", str(root), "--max-bytes", "20K", "--json",
                          "--metrics-textfile", str(prom_file)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    import json

    rep = json.loads(out.stdout.splitlines()[-1])
    samples: dict[str, Any] = {}
    for fam in text_string_to_metric_families(prom_file.read_text()):
        for s in fam.samples:
            samples[(s.name, s.labels.get("result", ""))] = s.value
            assert s.labels["root"] == str(root)
    assert samples[("tierstore_gc_runs_total", "ok")] == 1
    assert samples[("tierstore_gc_evicted_pages_total", "")] == rep["evicted"] > 0
    assert samples[("tierstore_gc_evicted_bytes_total", "")] == rep["evicted_bytes"]
    assert samples[("tierstore_gc_cap_bytes", "")] == 20 * 1024
    assert samples[("tierstore_gc_held_bytes", "")] == rep["total_after"] <= 20 * 1024
    assert samples[("tierstore_gc_last_success_timestamp_seconds", "")] > time.time() - 120
    assert samples[("tierstore_gc_duration_seconds_count", "")] == 1
    assert not list(prom_file.parent.glob("*.tmp*")), "the textfile is written through a rename"


def test_stats_module_names_its_reference() -> None:
    assert "docs/METRICS.md" in (ts_stats.__doc__ or "")
