"""Entry point of the MLA TP=2 test: vLLM-CPU engines running the tiny DeepSeek-V2-shaped model
(``cached_tiny_model("deepseekv2")``) with the multiprocess executor, run as a script (forked
from a forkserver, ``engine_start.py``, like ``tp_engine.py``).

    python tests/vllm/tp_mla_engine.py ROOT

Three fresh engines on ROOT: (1) TP=2 stores a 200-token prompt, (2) TP=2 restores it, (3) TP=1
restores it (the replicated latent's pages are TP-independent). Each engine's workers report
their pages stored and loaded (``collective_rpc``), so the test sees that only rank 0 writes.
Prints one ``RESULT {json}`` line per engine.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

VLLM_DEFAULTS = os.environ.get("TIERSTORE_TEST_VLLM_DEFAULTS") == "1"
if not VLLM_DEFAULTS:
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # before torch is imported (tp_engine.py says why)

sys.path.insert(0, str(Path(__file__).parent))
import engine_start  # noqa: E402

engine_start.install(VLLM_DEFAULTS)

PROMPT_TOKENS = 200


def worker_pages(worker: Any) -> tuple[int, int]:
    """(pages stored, pages loaded) by this worker's connector (runs in each TP worker; vLLM passes
    the worker)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    conn = get_kv_transfer_group()
    conn.flush()
    stats = conn.tierstore_stats()
    return int(stats.get("store_pages_ok", 0)), int(stats.get("load_pages_ok", 0))


def run_engine(model: str, root: str, ids: list[int], tp: int) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    t0 = time.perf_counter()
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join("01"[r % 2] for r in range(tp))
    gc.freeze()
    try:
        llm = LLM(model=model, dtype="bfloat16", enforce_eager=True, seed=0, max_model_len=512,
                  num_gpu_blocks_override=64, tensor_parallel_size=tp, distributed_executor_backend="mp",
                  kv_transfer_config=KVTransferConfig(
                      kv_connector="TierStoreConnector", kv_connector_module_path="tierstore.vllm",
                      kv_role="kv_both", kv_connector_extra_config={"root": root}),
                  compilation_config={"custom_ops": ["-rotary_embedding"]})  # test_vllm_mla.py NATIVE_ROPE says why
    finally:
        gc.unfreeze()
    try:
        out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0.0, max_tokens=8, logprobs=5),
                           use_tqdm=False)[0]
        per_rank = llm.collective_rpc(worker_pages)
    finally:
        llm.llm_engine.engine_core.shutdown(timeout=60)
    done = out.outputs[0]
    return {"tokens": list(done.token_ids), "cached": int(out.num_cached_tokens or 0),
            "top": {str(t): lp.logprob for t, lp in done.logprobs[0].items()},
            "stores_by_rank": [s for s, _ in per_rank], "loads_by_rank": [n for _, n in per_rank],
            "seconds": round(time.perf_counter() - t0, 1)}


def main() -> None:
    from transformers import AutoTokenizer

    from tierstore.testing.tiny_models import cached_tiny_model, prompt_token_ids

    root = sys.argv[1]
    model = str(cached_tiny_model("deepseekv2"))
    ids = prompt_token_ids(AutoTokenizer.from_pretrained(model), PROMPT_TOKENS)
    for phase, tp in (("store", 2), ("restore_tp2", 2), ("restore_tp1", 1)):
        print("RESULT " + json.dumps({"phase": phase, **run_engine(model, root, ids, tp)}), flush=True)


if __name__ == "__main__":
    main()
