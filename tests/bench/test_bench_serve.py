"""``tierstore bench serve`` without a server: the client command, result parsing, ratios, table."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from tierstore.bench import serve as bench

# The fields ``vllm bench serve --save-result`` wrote in a real run (vLLM 0.32, 4 prompts).
REAL_RESULT = {
    "backend": "vllm", "num_prompts": 4, "max_concurrency": 4, "duration": 2.003351961000135,
    "completed": 4, "failed": 0, "total_input_tokens": 2049, "total_output_tokens": 32,
    "request_throughput": 1.996653647421533, "output_throughput": 15.973229179372264,
    "total_token_throughput": 1038.7590600710525, "mean_ttft_ms": 1340.289855500032,
    "median_ttft_ms": 1660.4538689998662, "p50_ttft_ms": 1660.4538689998662,
    "p99_ttft_ms": 1660.8454746101643, "median_tpot_ms": 48.840394500010525,
}


def _args(**kw: object) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    bench.add_arguments(ap)
    return ap.parse_args(["--work", "/tmp/x", *[str(a) for kv in kw.items() for a in kv]])


def _run(name: str, ttft: float, p99: float, tput: float = 1000.0) -> bench.RunResult:
    return bench.parse_client_result(name, {**REAL_RESULT, "median_ttft_ms": ttft, "p99_ttft_ms": p99,
                                            "total_token_throughput": tput})


def test_parses_a_real_vllm_result() -> None:
    run = bench.parse_client_result("cold", REAL_RESULT, {"hit_tokens": 0.0}, 123)
    assert (run.completed, round(run.ttft_median_ms), round(run.ttft_p99_ms)) == (4, 1660, 1661)
    assert run.total_token_throughput == pytest.approx(1038.76, abs=0.01)
    assert run.counters == {"hit_tokens": 0.0} and run.bytes_on_disk == 123


def test_a_result_without_ttft_percentiles_names_the_flags() -> None:
    broken = {k: v for k, v in REAL_RESULT.items() if k != "p99_ttft_ms"}
    with pytest.raises(ValueError, match="p99_ttft_ms.*--metric-percentiles"):
        bench.parse_client_result("cold", broken)


def test_ratios_and_verdicts() -> None:
    runs = {"no-connector": _run("no-connector", 1000, 2000), "cold": _run("cold", 1040, 2100),
            "restored": _run("restored", 250, 400, tput=3000)}
    r = bench.ratios(runs)
    assert r["restored_over_cold_ttft_median"] == pytest.approx(250 / 1040)
    assert r["restored_over_cold_ttft_p99"] == pytest.approx(400 / 2100)
    assert r["restored_over_cold_throughput"] == pytest.approx(3.0)
    assert r["overhead_ttft_median"] == pytest.approx(0.04)
    assert all(bench.verdicts(r).values())
    slow = bench.ratios({**runs, "cold": _run("cold", 1100, 2100)})
    assert list(bench.verdicts(slow).values()) == [True, False]  # 250/1100 = 0.23; overhead 10%
    late = bench.ratios({**runs, "restored": _run("restored", 400, 800)})
    assert list(bench.verdicts(late).values()) == [False, True]  # 400/1040 = 0.38
    table = bench.format_table(runs, r)
    assert "restored" in table and "+4.0%" in table and "NOT met" not in table
    assert "NOT met" in bench.format_table(runs, slow)


def test_ratios_of_a_partial_invocation() -> None:
    assert bench.ratios({"cold": _run("cold", 1, 1)}) == {}
    assert set(bench.ratios({"cold": _run("cold", 1, 1), "no-connector": _run("no-connector", 1, 1)})) == {
        "overhead_ttft_median", "overhead_ttft_p99"}


def test_counter_deltas_sum_labels() -> None:
    before = {"vllm:external_prefix_cache_hits_total": 10.0, "tierstore_page_bytes_total{op=load}": 0.0}
    after = {"vllm:external_prefix_cache_hits_total": 4106.0, "tierstore_page_bytes_total{op=load}": 2.0**20,
             "tierstore_page_bytes_total{op=store}": 0.0, "tierstore_page_loads_total{result=failed}": 3.0,
             "tierstore_page_loads_total{result=ok}": 9.0}
    d = bench.counter_deltas(before, after)
    assert d["hit_tokens"] == 4096 and d["load_bytes"] == 2**20 and d["load_failed"] == 3 and d["store_bytes"] == 0


def test_client_command_is_accepted_by_vllm_bench_serve() -> None:
    pytest.importorskip("vllm")
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cmd = bench.client_command(_args(**{"--num-prompts": 16}), "http://127.0.0.1:1", "/m", Path("/r"), "cold")
    assert cmd[1:6] == ["-m", "tierstore.vllm.serve", "--vllm-cli", "bench", "serve"]
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    ns = parser.parse_args(cmd[6:])
    assert ns.dataset_name == "prefix_repetition" and ns.num_prompts == 16 and ns.max_concurrency == 8
    assert ns.prefix_repetition_prefix_len + ns.prefix_repetition_suffix_len == 4096
    assert ns.prefix_repetition_num_prefixes == 16  # default: every prompt its own prefix (cold misses all)
    assert ns.save_result and ns.result_filename == "cold.json" and ns.ready_check_timeout_sec == 0
