"""One "node" of the two-mount vLLM test: an in-process vLLM engine (CPU) with the tierstore
connector whose root is this node's mount; prints token ids and cached-token counts as JSON.

    python nfs_vllm_node.py MODEL_DIR EXTRA_CONFIG_JSON
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def main() -> int:
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    from tierstore.testing.tiny_models import prompt_token_ids

    model, extra = sys.argv[1], json.loads(sys.argv[2])
    tok = AutoTokenizer.from_pretrained(model)
    prompts = [prompt_token_ids(tok, 300, offset=o) for o in (0, 40)]
    llm = LLM(model=model, dtype="bfloat16", max_model_len=1024, max_num_seqs=2, enforce_eager=True,
              enable_prefix_caching=True, seed=0, num_gpu_blocks_override=64,
              kv_transfer_config=KVTransferConfig(kv_connector="TierStoreConnector",
                                                  kv_connector_module_path="tierstore.vllm",
                                                  kv_role="kv_both", kv_connector_extra_config=extra))
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=8))
    from tierstore.metrics import default_registry

    tiers = {t: {k: m[k] for k in ("hits", "misses", "stores", "failures")} for t, m in default_registry().snapshot().items()}
    print(json.dumps({"tokens": [list(o.outputs[0].token_ids) for o in outs],
                      "cached": [o.num_cached_tokens or 0 for o in outs], "tiers": tiers}), flush=True)
    del llm
    return 0


if __name__ == "__main__":
    sys.exit(main())
