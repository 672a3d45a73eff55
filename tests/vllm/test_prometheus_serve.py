"""A real Prometheus scraping a real ``vllm serve`` with tierstore and a real ``tierstore gc --loop``.

What runs (about 2 minutes on a 2-core CPU host, most of it two vLLM starts): server 1 (tiny
llama, CPU, a local tier in front of the root, a root cap with the in-process gc daemon) answers
a prompt cold and stops with the documented stop flags (its stores flushed); server 2 starts on
the same root and local root; ``tierstore gc ROOT --loop 1 --metrics-port P`` runs beside it;
Prometheus 2.x (Debian's package: tools/prometheus-setup.sh) starts on 127.0.0.1 with a temp
config scraping both every second. Server 2 answers a new prompt and the cold prompt (a restart
hit from tierstore), twice with vLLM's prefix cache reset between, so every counter moves between
scrapes. Then every PromQL expression of deploy/grafana/tierstore-dashboard.json and
deploy/prometheus/tierstore-alerts.yml is evaluated through Prometheus' HTTP API
(``/api/v1/query``; Grafana's ``$__rate_interval`` as ``1m``): each must evaluate without
error; each over families that a restart hit moves must return series carrying its
``by (...)`` labels (``tier``, ``result``, ``op``, ``root``); expressions over event-only
families (errors, failures, drops, evictions) may be empty. The alert rules are also loaded by
the server itself (``rule_files``), which must report them healthy.

Skips with the reason when the prometheus binary or vLLM is missing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from vllm_helpers import reset_prefix_cache  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
PROMETHEUS = shutil.which("prometheus")
SERVER_ARGS = ["--dtype", "bfloat16", "--enforce-eager", "--max-model-len", "1024", "--seed", "0",
               "--shutdown-timeout", "45"]
# Families that only get series when something goes wrong (or a cap is passed): may be empty.
EVENT_FAMILIES = ("tierstore_tier_errors_total", "tierstore_page_failures_total",
                  "tierstore_page_stores_dropped_total", "tierstore_tier_evicted_bytes_total")


def _get(url: str, timeout: float = 10.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def _query(prom_url: str, expr: str) -> dict[str, Any]:
    return _get(f"{prom_url}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))


def _expressions() -> dict[str, str]:
    sys.path.insert(0, str(REPO / "tests"))
    from test_metrics_names import promql_expressions

    return {where: expr.replace("$__rate_interval", "1m") for where, expr in promql_expressions().items()}


def _by_labels(expr: str) -> set[str]:
    """Labels the result must carry: the outermost aggregation's ``by (...)`` (all of them, for
    a binary expression of aggregations, is the intersection: every ``by`` here lists the same)."""
    groups = [set(x.replace(" ", "").split(",")) for x in re.findall(r"\bby \(([^)]*)\)", expr)]
    labels = set.intersection(*groups) if groups else set()
    return labels - {"le"}


def _wait(what: str, check: Any, timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.5)
    raise TimeoutError(what)


@pytest.mark.skipif(PROMETHEUS is None, reason="the prometheus binary is missing: run tools/prometheus-setup.sh "
                    "(Debian's prometheus package)")
def test_real_prometheus_evaluates_every_dashboard_and_alert_expression(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from tierstore.testing.tiny_models import cached_tiny_model, prompt_token_ids
    from tierstore.vllm.server_process import VllmServer, free_port, metric

    t_start = time.monotonic()
    exprs = _expressions()  # before the servers: a broken file fails at once
    assert len(exprs) >= 30
    root, local = tmp_path / "cache", tmp_path / "local"
    model = cached_tiny_model("llama")
    tok = AutoTokenizer.from_pretrained(str(model))
    cold_prompt = prompt_token_ids(tok, 600, 5)
    new_prompts = [prompt_token_ids(tok, 600, 40 + i) for i in range(2)]
    extra = {"local_root": str(local), "local_max_bytes": "64M", "max_bytes": "1G", "gc_interval_s": 5}
    env = {"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
           "VLLM_SERVER_DEV_MODE": "1", "TOKENIZERS_PARALLELISM": "false",
           "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": "40"}

    cold = VllmServer(model, root=root, log_path=tmp_path / "cold.log", extra_config=extra, args=SERVER_ARGS,
                      env=env)
    cold.start()
    try:
        cold.complete(cold_prompt, max_tokens=2)
        assert cold.stop() == 0, cold.log_tail()
    finally:
        cold.kill()

    gc_port, prom_port = free_port(), free_port()
    gc_log = open(tmp_path / "gc.log", "wb")  # noqa: SIM115 - closed in finally
    gc = subprocess.Popen([sys.executable, "-m", "tierstore", "gc", str(root), "--max-bytes", "1G", "--loop", "1",
                           "--metrics-port", str(gc_port), "--metrics-addr", "127.0.0.1"],
                          stdout=gc_log, stderr=subprocess.STDOUT)
    warm = VllmServer(model, root=root, log_path=tmp_path / "warm.log", extra_config=extra, args=SERVER_ARGS,
                      env=env)
    prom_proc = None
    try:
        warm.start()
        rules = tmp_path / "tierstore-alerts.yml"
        shutil.copy(REPO / "deploy" / "prometheus" / "tierstore-alerts.yml", rules)
        config = tmp_path / "prometheus.yml"
        config.write_text(json.dumps({  # JSON is YAML
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(rules)],
            "scrape_configs": [
                {"job_name": "vllm", "static_configs": [{"targets": [f"127.0.0.1:{warm.port}"]}]},
                {"job_name": "tierstore-gc", "static_configs": [{"targets": [f"127.0.0.1:{gc_port}"]}]},
            ]}))
        prom_log = open(tmp_path / "prometheus.log", "wb")  # noqa: SIM115 - closed with the process
        prom_proc = subprocess.Popen([PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                      f"--web.listen-address=127.0.0.1:{prom_port}"],
                                     stdout=prom_log, stderr=subprocess.STDOUT)
        prom_url = f"http://127.0.0.1:{prom_port}"

        def targets_up() -> bool:
            try:
                res = _query(prom_url, "up == 1")["data"]["result"]
            except OSError:
                return False
            return {r["metric"]["job"] for r in res} == {"vllm", "tierstore-gc"}

        _wait("Prometheus did not scrape both targets", targets_up, 60)
        before = warm.metrics()
        for new in new_prompts:  # a new prompt (misses, stores), then the cold one (a restart hit)
            warm.complete(new, max_tokens=2)
            warm.complete(cold_prompt, max_tokens=2)
            time.sleep(3)  # scrapes between the rounds: rate() sees the counters move
            reset_prefix_cache(warm.url)
        after = warm.metrics()
        hits = metric(after, "tierstore_page_loads_total{result=ok}") - metric(before, "tierstore_page_loads_total{result=ok}")
        assert hits > 0, warm.log_tail()  # the restart hit came from tierstore
        time.sleep(4)

        evaluated: dict[str, int] = {}
        for where, expr in exprs.items():
            doc = _query(prom_url, expr)
            assert doc["status"] == "success", (where, doc)
            series = doc["data"]["result"]
            evaluated[where] = len(series)
            is_alert = where.startswith("rule Tierstore")
            event_only = any(f in expr for f in EVENT_FAMILIES)
            if is_alert or event_only:
                continue  # evaluates without error; fires only on trouble
            assert series, (where, expr)
            want = _by_labels(expr)
            for s in series:
                assert want <= set(s["metric"]), (where, want, s["metric"])
        hit_ratio = _query(prom_url, "tierstore:lookup_hit_ratio:rate5m")["data"]["result"]
        assert hit_ratio and 0 < float(hit_ratio[0]["value"][1]) <= 1, hit_ratio
        tiers = {s["metric"]["tier"] for s in _query(prom_url, "tierstore_tier_resident_bytes")["data"]["result"]}
        assert {"local", "shared"} <= tiers, tiers  # the worker's local tier, the scheduler's root
        groups = _get(f"{prom_url}/api/v1/rules")["data"]["groups"]
        rules_seen = [r for g in groups for r in g["rules"]]
        assert len(rules_seen) == 14 and all(r["health"] == "ok" for r in rules_seen), rules_seen
        print(f"\nPrometheus evaluated {len(evaluated)} expressions in {time.monotonic() - t_start:.0f} s "
              "(series per expression):")
        for where, n in evaluated.items():
            print(f"  {n:3d}  {where}")
        assert warm.stop() == 0, warm.log_tail()
    finally:
        warm.kill()
        if prom_proc is not None:
            prom_proc.terminate()
            prom_proc.wait(30)
        gc.terminate()
        gc.wait(30)
        gc_log.close()
        os.sync()
