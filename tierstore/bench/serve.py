"""``tierstore bench serve``: TTFT of a real ``vllm serve`` cold, restored from tierstore, and without it.

One invocation starts ``vllm serve`` three times on the same model and drives each with vLLM's
own client, ``vllm bench serve`` (``prefix_repetition`` dataset, same seed, so the same
prompts), run through ``python -m tierstore.vllm.serve --vllm-cli bench serve`` (the launcher
that makes the ``vllm`` CLI work on the CPU wheel):

1. ``no-connector``: no ``--kv-transfer-config`` (the reference);
2. ``cold``: the tierstore connector on an empty cache directory: a 0%-hit workload for
   tierstore (by default every prompt has its own prefix, so vLLM's own prefix cache misses
   too); the pages it writes are flushed by a normal stop with the documented stop flags;
3. ``restored``: restarted on the same cache directory: every full block of every prompt is
   loaded from tierstore instead of computed.

Per run: TTFT median / p99, request and token throughput (vLLM's client), and from the live
``/metrics`` before and after: vLLM's ``external_prefix_cache_hits`` (tokens restored by the
connector), tierstore's page bytes stored and loaded. Ratios: ``restored / cold`` TTFT (target
<= 0.3 at concurrency 8) and ``cold / no-connector`` TTFT - 1 (the connector's overhead on a
cache-miss workload, target <= 5%).

Default model: the local tiny Llama of ``tierstore.testing.tiny_models`` at ``size="small"``
(hidden 1024 x 8 layers), built on first use; ``--model`` takes any other model folder.
Run: ``tierstore bench serve --work DIR [--num-prompts 16 --max-concurrency 8] [--json]``.

Threading: runs on the main thread; the servers and clients are child processes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

RUNS = ("no-connector", "cold", "restored")
TTFT_RATIO_TARGET = 0.3
OVERHEAD_TARGET = 0.05
# A normal stop of the cold server must flush every queued page store (see tierstore.vllm.stop).
STOP_FLAGS = ["--shutdown-timeout", "120"]
STOP_ENV = {"VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": "100"}
# Counters read from /metrics: name in this report -> Prometheus sample name.
SCRAPED = {
    "hit_tokens": "vllm:external_prefix_cache_hits_total",
    "prompt_tokens": "vllm:prompt_tokens_total",
    "load_bytes": "tierstore_page_bytes_total{op=load}",
    "store_bytes": "tierstore_page_bytes_total{op=store}",
    "load_failed": "tierstore_page_loads_total{result=failed}",
}


@dataclass
class RunResult:
    """One server run: vLLM's client figures plus counter deltas from ``/metrics``."""

    name: str
    completed: int
    ttft_median_ms: float
    ttft_p99_ms: float
    ttft_mean_ms: float
    request_throughput: float
    total_token_throughput: float
    duration_s: float
    counters: dict[str, float] = field(default_factory=dict)
    bytes_on_disk: int = 0


def parse_client_result(name: str, result: dict[str, Any], counters: dict[str, float] | None = None,
                        bytes_on_disk: int = 0) -> RunResult:
    """A ``RunResult`` from the JSON that ``vllm bench serve --save-result`` writes."""
    missing = [k for k in ("completed", "median_ttft_ms", "p99_ttft_ms", "mean_ttft_ms",
                           "request_throughput", "total_token_throughput", "duration") if k not in result]
    if missing:
        raise ValueError(f"vllm bench serve result has no {missing}: run it with "
                         "--percentile-metrics ttft --metric-percentiles 50,99")
    return RunResult(name=name, completed=int(result["completed"]),
                     ttft_median_ms=float(result["median_ttft_ms"]), ttft_p99_ms=float(result["p99_ttft_ms"]),
                     ttft_mean_ms=float(result["mean_ttft_ms"]),
                     request_throughput=float(result["request_throughput"]),
                     total_token_throughput=float(result["total_token_throughput"]),
                     duration_s=float(result["duration"]), counters=dict(counters or {}),
                     bytes_on_disk=bytes_on_disk)


def counter_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """``SCRAPED`` counters' increments between two ``VllmServer.metrics()`` scrapes."""
    from tierstore.vllm.server_process import metric

    return {k: metric(after, name) - metric(before, name) for k, name in SCRAPED.items()}


def ratios(runs: dict[str, RunResult]) -> dict[str, float]:
    """restored/cold TTFT (median, p99) and the connector's overhead cold/no-connector - 1."""
    out: dict[str, float] = {}
    cold, warm, ref = runs.get("cold"), runs.get("restored"), runs.get("no-connector")
    if cold and warm:
        out["restored_over_cold_ttft_median"] = warm.ttft_median_ms / cold.ttft_median_ms
        out["restored_over_cold_ttft_p99"] = warm.ttft_p99_ms / cold.ttft_p99_ms
        out["restored_over_cold_throughput"] = warm.total_token_throughput / cold.total_token_throughput
    if cold and ref:
        out["overhead_ttft_median"] = cold.ttft_median_ms / ref.ttft_median_ms - 1.0
        out["overhead_ttft_p99"] = cold.ttft_p99_ms / ref.ttft_p99_ms - 1.0
    return out


def verdicts(r: dict[str, float]) -> dict[str, bool]:
    out = {}
    if "restored_over_cold_ttft_median" in r:
        out[f"restored TTFT <= {TTFT_RATIO_TARGET}x cold"] = r["restored_over_cold_ttft_median"] <= TTFT_RATIO_TARGET
    if "overhead_ttft_median" in r:
        out[f"connector overhead <= {OVERHEAD_TARGET:.0%}"] = r["overhead_ttft_median"] <= OVERHEAD_TARGET
    return out


def format_table(runs: dict[str, RunResult], r: dict[str, float]) -> str:
    head = (f"{'run':<13} {'done':>4} {'TTFT p50 ms':>11} {'TTFT p99 ms':>11} {'req/s':>6} {'tok/s':>7} "
            f"{'hit tokens':>10} {'stored MiB':>10} {'loaded MiB':>10}")
    lines = [head, "-" * len(head)]
    for run in runs.values():
        c = run.counters
        lines.append(f"{run.name:<13} {run.completed:>4} {run.ttft_median_ms:>11.0f} {run.ttft_p99_ms:>11.0f} "
                     f"{run.request_throughput:>6.2f} {run.total_token_throughput:>7.0f} "
                     f"{c.get('hit_tokens', 0):>10.0f} {c.get('store_bytes', 0) / 2**20:>10.1f} "
                     f"{c.get('load_bytes', 0) / 2**20:>10.1f}")
    lines.append("")
    for k, v in r.items():
        lines.append(f"{k:<32} {v:+.1%}" if k.startswith("overhead") else f"{k:<32} {v:.3f}")
    for k, ok in verdicts(r).items():
        lines.append(f"target {k}: {'met' if ok else 'NOT met'}")
    return "\n".join(lines)


# ------------------------------------------------------------------ running
def client_command(args: argparse.Namespace, url: str, model: str, result_dir: Path, name: str) -> list[str]:
    """``vllm bench serve`` (through tierstore's launcher) against the server at ``url``."""
    return [sys.executable, "-m", "tierstore.vllm.serve", "--vllm-cli", "bench", "serve",
            "--backend", "vllm", "--base-url", url, "--model", model, "--tokenizer", model,
            "--dataset-name", "prefix_repetition",
            "--prefix-repetition-prefix-len", str(args.prefix_len),
            "--prefix-repetition-suffix-len", str(args.suffix_len),
            "--prefix-repetition-num-prefixes", str(args.num_prefixes or args.num_prompts),
            "--prefix-repetition-output-len", str(args.output_len),
            "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.max_concurrency),
            "--request-rate", "inf", "--ignore-eos", "--seed", str(args.seed),
            "--ready-check-timeout-sec", "0",  # the server is up; its test prompt would warm the cache
            "--percentile-metrics", "ttft,tpot,e2el", "--metric-percentiles", "50,99",
            "--disable-tqdm", "--save-result", "--result-dir", str(result_dir),
            "--result-filename", f"{name}.json"]


def _dir_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*.kvp")) if root.exists() else 0


def _warm_up(server: Any) -> None:
    """One short prompt unlike the dataset's (first-request costs out of the timed run)."""
    server.complete([3 + (i * 7) % 200 for i in range(64)], max_tokens=2)


def run_one(args: argparse.Namespace, name: str, model: str, root: Path | None) -> RunResult:
    from tierstore.vllm.server_process import VllmServer

    work: Path = args.work
    server_args = ["--dtype", "bfloat16", "--max-model-len", str(args.prefix_len + args.suffix_len + args.output_len + 64),
                   "--seed", "0", *args.server_args.split()]
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if root is not None:
        server_args += STOP_FLAGS
        env.update(STOP_ENV)
    server = VllmServer(model, root=root, log_path=work / f"{name}.server.log", args=server_args, env=env)
    t0 = time.monotonic()
    server.start()
    try:
        print(f"[{name}] server up in {time.monotonic() - t0:.0f} s; running vllm bench serve", file=sys.stderr)
        _warm_up(server)
        before = server.metrics()
        with open(work / f"{name}.client.log", "wb") as log:
            rc = subprocess.run(client_command(args, server.url, model, work, name), stdout=log,
                                stderr=subprocess.STDOUT, env={**os.environ, **env}).returncode
        if rc != 0:
            raise RuntimeError(f"vllm bench serve failed with {rc}; see {work / f'{name}.client.log'}")
        deltas = counter_deltas(before, server.metrics())
    finally:
        server.stop(timeout_s=180)
    result = json.loads((work / f"{name}.json").read_text())
    run = parse_client_result(name, result, deltas, _dir_bytes(root) if root is not None else 0)
    print(f"[{name}] done: TTFT p50 {run.ttft_median_ms:.0f} ms", file=sys.stderr)
    return run


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--work", type=Path, required=True, help="scratch directory (cache, logs, results); emptied first")
    ap.add_argument("--model", help="model folder (default: the local small tiny Llama, hidden 1024 x 8 layers)")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-concurrency", type=int, default=8)
    ap.add_argument("--prefix-len", type=int, default=3840, help="tokens of each prompt's prefix (default 3840)")
    ap.add_argument("--suffix-len", type=int, default=256, help="tokens after the prefix (default 256: 4k prompts)")
    ap.add_argument("--num-prefixes", type=int, default=0,
                    help="distinct prefixes (default: one per prompt, so the cold run misses every prefix)")
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--server-args", default="--enforce-eager",
                    help="more `vllm serve` flags for every run (default: --enforce-eager)")
    ap.add_argument("--runs", default=",".join(RUNS), help=f"subset of {','.join(RUNS)} (restored needs cold)")
    ap.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    names = [n for n in args.runs.split(",") if n]
    unknown = set(names) - set(RUNS)
    if unknown or ("restored" in names and "cold" not in names):
        raise SystemExit(f"--runs: choose from {RUNS}; 'restored' needs 'cold' (got {args.runs})")
    if args.model is None:
        from tierstore.testing.tiny_models import cached_tiny_model

        args.model = str(cached_tiny_model("llama", size="small"))
    if args.work.exists():
        shutil.rmtree(args.work)
    args.work.mkdir(parents=True)
    root = args.work / "cache"
    runs: dict[str, RunResult] = {}
    for name in RUNS:  # fixed order: restored follows cold
        if name in names:
            runs[name] = run_one(args, name, args.model, None if name == "no-connector" else root)
    r = ratios(runs)
    if args.json:
        print(json.dumps({"tierstore_bench_serve": 1, "runs": {k: asdict(v) for k, v in runs.items()}, "ratios": r,
                          "targets": verdicts(r)}, indent=2))
    else:
        print(format_table(runs, r))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tierstore bench serve", description=(__doc__ or "").splitlines()[0])
    add_arguments(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
