"""Benchmark: prefill of a long prompt, cold vs restored from tierstore pages (vLLM on this host).

    tierstore bench restore [--tokens 4096] [--kind llama] [--size small] [--root DIR]

Runs fresh in-process engines one after another on the same root: (1) cold, with an empty
root (stores the pages), (2) restored with the pages in the OS page cache ("warm"), (3) restored
after the page files were dropped from the page cache (``page_cache.CacheDropper``, fadvise) ("cold
cache"). Each measures one request with max_tokens=1 (prefill + one token), best of
``--repeat`` prompts per engine; ratios are against the cold run of the same invocation.
Token identity is checked against vLLM's own prefix-cache hit in the cold engine (a full hit
recomputes only the last token, which may flip a near-tie of a random model's logits).
Checksums are verified on every load (tierstore always does).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from tierstore.bench.page_cache import CacheDropper


def _engine(model: Path, root: Path, max_len: int, blocks: int, extra: dict[str, Any], **engine_kw: Any) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    return LLM(
        model=str(model), dtype="bfloat16", enforce_eager=True, enable_prefix_caching=True, seed=0,
        gpu_memory_utilization=0.1, max_model_len=max_len, num_gpu_blocks_override=blocks,
        kv_transfer_config=KVTransferConfig(
            kv_connector="TierStoreConnector", kv_connector_module_path="tierstore.vllm", kv_role="kv_both",
            kv_connector_extra_config={"root": str(root), **extra}),
        **engine_kw,
    )


def _timed(llm: Any, prompts: list[list[int]]) -> tuple[float, list[int], list[int]]:
    from vllm import SamplingParams

    best, tokens, cached = float("inf"), [], []
    params = SamplingParams(temperature=0.0, max_tokens=1)
    for ids in prompts:
        t0 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        best = min(best, time.perf_counter() - t0)
        tokens.append(out.outputs[0].token_ids[0])
        cached.append(int(out.num_cached_tokens or 0))
    return best, tokens, cached


def _close(llm: Any) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--kind", default="llama", help="tiny model kind (tierstore.testing.tiny_models)")
    ap.add_argument("--size", default="small")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=2, help="distinct prompts per engine (best time counts)")
    ap.add_argument("--root", type=Path, default=None, help="an empty directory for the pages (default: a new temp dir)")


def run(args: argparse.Namespace) -> int:
    """Exit 0, or 8 when the cold run already had hits (a --root that was not empty)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from transformers import AutoTokenizer

    from tierstore.testing.tiny_models import cached_tiny_model, prompt_token_ids

    model = cached_tiny_model(args.kind, size=args.size)
    tok = AutoTokenizer.from_pretrained(str(model))
    prompts = [prompt_token_ids(tok, args.tokens, offset=7 * i) for i in range(args.repeat)]
    root = args.root or Path(tempfile.mkdtemp(prefix="tierstore-bench-"))
    max_len = args.tokens + 64
    # MLA (deepseekv2) on vLLM-CPU: 16-token blocks and the PyTorch rotary (test_vllm_mla.py says why)
    mla = args.kind == "deepseekv2"
    blocks = (max_len // (16 if mla else 128) + 2) * 2
    engine_kw: dict[str, Any] = {"compilation_config": {"custom_ops": ["-rotary_embedding"]}} if mla else {}
    results: dict[str, Any] = {"model": f"{args.kind}-{args.size}", "prompt_tokens": args.tokens, "root": str(root)}

    llm = _engine(model, root, max_len, blocks, {}, **engine_kw)
    cold, cold_tokens, cached = _timed(llm, prompts)
    # The same prompts again in the same engine: vLLM's own prefix-cache hit. A full hit
    # recomputes only the last token, which can flip a near-tie of a random model's logits
    # against the cold prefill; a correct restore must match this run exactly.
    local, ref, _ = _timed(llm, prompts)
    _close(llm)
    results["cold_s"] = cold
    results["local_prefix_hit_s"] = local
    results["cold_tokens"] = cold_tokens
    results["local_hit_tokens"] = ref
    if any(cached):
        print(f"tierstore bench restore: the cold run had prefix hits {cached}: give an empty --root")
        return 8

    for label, drop in (("restored_warm", False), ("restored_cold_cache", True)):
        if drop:
            pages = sorted(root.rglob("*.kvp"))
            CacheDropper("fadvise").drop(pages)
            results["pages_dropped_from_cache"] = len(pages)
        llm = _engine(model, root, max_len, blocks, {}, **engine_kw)
        t, toks, cached = _timed(llm, prompts)
        _close(llm)
        results[f"{label}_s"] = t
        results[f"{label}_ratio"] = t / cold
        results[f"{label}_cached_tokens"] = min(cached)
        results[f"{label}_same_tokens_as_local_hit"] = toks == ref
        results[f"{label}_same_tokens_as_cold"] = toks == cold_tokens
    print(json.dumps(results, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tierstore bench restore", description=(__doc__ or "").splitlines()[0])
    add_arguments(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
