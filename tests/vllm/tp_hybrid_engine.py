"""Entry point of the hybrid-model TP-change tests: vLLM-CPU engines running a tiny hybrid at
tensor_parallel_size TP (2 or 4) and 1 on shared roots, run as a script because vLLM's worker
processes re-import it (see ``tp_engine.py``). TP=4 puts two ranks on each of this machine's
2 cores: slower (a TP=4 engine takes ~50 s), but it runs.

    python tests/vllm/tp_hybrid_engine.py ROOT FAMILY [TP]  # qwen3next (GDN), granitehybrid (Mamba2),
                                                            # lfm2 (short conv), gemma3 (sliding window)

A hybrid's states are stored as slices of the full (TP=1) state (docs/DESIGN.md §9): a rank's
file holds its units (GDN: its linear key heads' conv channels and value heads; Mamba2 with
one group: its heads' x channels and ssm heads, and all of B and C, which vLLM replicates)
under ``h<start>-<count>``, the TP=1 file the whole state (``r0``); one namespace for every TP.
Engines, one after another: (1) ``tp<TP>_store`` on ``ROOT`` (cold: the TP tokens), (2)
``tp1_store``: TP=1 on ``ROOT-tp1`` (cold: the TP=1 tokens), (3) ``tp1_from_tp<TP>``: TP=1 on
``ROOT`` hits the pages TP wrote (each state and attention page assembled from the rank
files), (4) ``tp<TP>_from_tp1`` on ``ROOT-tp1`` hits the pages TP=1 wrote (each rank reads the
``r0`` file and uses its slice), (5) ``tp1_swapped``: the negative control: on a copy of
``ROOT`` whose Mamba (gemma3: sliding-window) rank files ``h0-<c>`` and ``h<c>-<c>`` have their
payloads swapped (checksums recomputed: what a wrong split map would serve), TP=1 hits and its
tokens must differ from (2)'s.
Prints one ``RESULT {json}`` line per engine; the ``tierstore-slices`` log lines (stderr), each
tagged ``phase=<its engine's phase>``, give that engine's cost of serving across the TP change.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from tp_engine import PHASE_ENV, run_engine, tiny_model_and_prompt  # noqa: E402  (also installs the tierstore.slices log handler)


def cpu_mamba2_without_prefill_checkpoints() -> None:
    """Work around a vLLM-CPU 0.32 bug: in align mode ``MambaMixer2`` asks for mid-prefill state
    checkpoints (``num_prefill_checkpoint_blocks=1``), which the CPU chunk-scan kernel does not
    return (``_mamba_chunk_scan_combined_fwd_cpu`` gives final states only), so any Mamba2
    hybrid with prefix caching fails with ``IndexError`` in ``conv_ssm_forward`` (with or
    without tierstore). Without checkpoints the scheduler splits prefills at block boundaries
    instead. Applied at import: forked workers inherit it, spawned ones re-import this script."""
    from vllm.model_executor.layers.mamba.abstract import MambaBase
    from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2

    MambaMixer2.get_kv_cache_spec = MambaBase.get_kv_cache_spec  # type: ignore[method-assign]


cpu_mamba2_without_prefill_checkpoints()

# The prompt ends one token after the last stored state, so the loaded state decides the
# output. (GDN: with a longer tail, 2504 tokens, the tiny model's fast-decaying state was washed
# out: zeroed or swapped states gave the same tokens, so the check could not fail.)
# SSM states in float32 everywhere: vLLM-CPU picks float32 itself on CPUs with AVX-512 BF16 and
# keeps bf16 elsewhere, which changes the block size (Qwen3-Next: 1152 vs 640 tokens).
FAMILIES: dict[str, tuple[int, dict[str, Any]]] = {
    # two 1152-token blocks (vLLM's block size for the tiny Qwen3-Next) and one token
    "qwen3next": (2305, dict(max_model_len=4096, num_gpu_blocks_override=16, max_num_batched_tokens=2303,
                             prefix_cache_retention_interval=None, mamba_ssm_cache_dtype="float32")),
    # seven 128-token blocks and one token; max_num_batched_tokens in [N, 2N): one block a step.
    # lfm2 runs by hand only (not in CI): its TP=1 and TP=2 numerics differ enough (first-token
    # logprob 0.24 apart, tokens from the 4th) that a TP=1 reader of TP=2 pages gives TP=2's tokens.
    "granitehybrid": (897, dict(max_model_len=2048, num_gpu_blocks_override=64, max_num_batched_tokens=255,
                                prefix_cache_retention_interval=None, mamba_ssm_cache_dtype="float32")),
    "lfm2": (897, dict(max_model_len=2048, num_gpu_blocks_override=64, max_num_batched_tokens=255,
                       prefix_cache_retention_interval=None, mamba_ssm_cache_dtype="float32")),
    # sliding window (32 tokens) + full attention: phase 5 swaps the sliding-window rank files
    "gemma3": (897, dict(max_model_len=2048, num_gpu_blocks_override=64, max_num_batched_tokens=255)),
}


def swap_rank_files(root: Path, kind: str) -> int:
    """Swap the payloads of the first two rank files (``h0-<c>``, ``h<c>-<c>``) of every page of
    the groups of ``kind`` (a ``GroupKind`` name), checksums recomputed (headers keep their own
    rank and units); the number of files rewritten."""
    from vllm_helpers import rewrite_page

    from tierstore.format.header import GroupKind
    from tierstore.rootstore.page_read import inspect_page, read_page

    n = 0
    for a in sorted(root.glob("*/g*/h0-*/*/*.kvp")):
        count = a.parents[1].name.split("-")[1]
        b = a.parents[2] / f"h{count}-{count}" / a.parent.name / a.name
        if inspect_page(a).meta.group_kind != GroupKind[kind] or not b.exists():
            continue
        bufs = []
        for p in (a, b):
            buf = bytearray(inspect_page(p).layout.nbytes)
            read_page(p, None, memoryview(buf))
            bufs.append(bytes(buf))
        for p, other in ((a, bufs[1]), (b, bufs[0])):
            rewrite_page(p, lambda buf, other=other: buf.__setitem__(slice(None), other))
            n += 1
    return n


def main() -> None:
    root, family = sys.argv[1], sys.argv[2]
    tp = int(sys.argv[3]) if len(sys.argv) > 3 else 2  # the writer TP of phases 1, 3, 4 and the swap
    prompt_tokens, engine_kw = FAMILIES[family]
    model, ids = tiny_model_and_prompt(family, prompt_tokens)
    for phase, where, tp_now in ((f"tp{tp}_store", root, tp), ("tp1_store", root + "-tp1", 1),
                                 (f"tp1_from_tp{tp}", root, 1), (f"tp{tp}_from_tp1", root + "-tp1", tp),
                                 ("tp1_swapped", root + "-swapped", 1)):
        if phase == "tp1_swapped":
            # without the TP=1 reader's stored-back r0 pages: this reader must assemble again
            shutil.copytree(root, where, ignore=lambda d, names: ["r0"] if Path(d).name.startswith("g") else [])
            swapped = swap_rank_files(Path(where), "SLIDING_WINDOW" if family == "gemma3" else "MAMBA")
            print("SWAPPED " + str(swapped), flush=True)
        print("PHASE " + phase, file=sys.stderr, flush=True)
        os.environ[PHASE_ENV] = phase  # this engine's slice lines carry it (tp_engine.py)
        # gemma3 runs with a fresh local tier in front of the shared root in every engine (the
        # reader's node has none of the pages): a TierChain at TP>1 writes and assembles
        local = f"{root}-local-{phase}" if family == "gemma3" else None
        print("RESULT " + json.dumps({"phase": phase, "tp": tp_now,
                                      **run_engine(model, where, ids, tp_now, local, **engine_kw)}), flush=True)


if __name__ == "__main__":
    main()
