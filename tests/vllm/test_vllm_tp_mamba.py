"""Reuse across a TP change for a Mamba2 hybrid (tiny Granite 4.0-H shape) on vLLM-CPU, end to end.

The engines run in a subprocess (``tp_hybrid_engine.py ROOT granitehybrid``). The model: 3
Mamba2 layers (8 heads of 32, ONE group, state 16) and 1 attention layer (2 KV heads). vLLM
replicates a one-group model's B and C on every rank, so a TP=2 rank's conv state is half the x
channels plus all of B and C (``head_slices``: units = 8 head blocks, B and C one block every
slice holds). Checked (issue 13): pages written at TP=2 are hits at TP=1 and pages written at
TP=1 are hits at TP=2, with the tokens of a no-cache run at the reader's TP; every group is
served from the other TP's files, each verified whole; going down a TP a reader reads B and C
twice and uses them once, going up it reads the whole state and uses its half plus B and C;
one namespace serves both TPs. The check can fail: the prompt ends one token after the last
stored state, and Mamba rank files whose payloads are swapped (valid checksums, what a wrong
split map would serve) change the tokens. vLLM-CPU 0.32 cannot run a Mamba2 hybrid with prefix
caching as shipped (``tp_hybrid_engine.cpu_mamba2_without_prefill_checkpoints``).
5 engine starts (2 with 2 worker processes) in one subprocess.
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
    results, out = run_engine_script("tp_hybrid_engine.py", [str(root), "granitehybrid"], 5)
    return root, results, out


def group_kinds(ns: Path) -> dict[int, str]:
    from tierstore.pagefile import inspect_page

    return {int(g.name[1:]): inspect_page(next(g.rglob("*.kvp"))).meta.group_kind.name for g in ns.glob("g*")}


def test_mamba_ranks_write_slices_in_one_namespace_for_every_tp(mamba_run) -> None:
    root, res, _ = mamba_run
    assert res["tp2_store"]["cached"] == res["tp1_store"]["cached"] == 0
    ns = namespace_dir(root)
    assert ns.name == namespace_dir(root.with_name(root.name + "-tp1")).name  # TP is not in the digest
    from tierstore.pagefile import inspect_page

    kinds = group_kinds(ns)
    assert sorted(kinds.values()) == ["ATTENTION", "MAMBA", "MAMBA", "MAMBA"], kinds
    for g, kind in kinds.items():
        count = 4 if kind == "MAMBA" else 1  # 8 Mamba2 head blocks, 2 KV heads
        for rank in (0, 1):
            files = sorted((ns / f"g{g}" / f"h{rank * count}-{count}").rglob("*.kvp"))
            assert len(files) == 7, (g, rank)
            meta = inspect_page(files[0]).meta
            assert (meta.rank, meta.head_start, meta.head_count) == (rank, rank * count, count)
        assert not list(ns.glob(f"g{g}/r[1-9]*/*/*.kvp"))


def test_mamba_pages_written_at_tp2_hit_at_tp1_with_the_tp1_tokens(mamba_run) -> None:
    _, res, out = mamba_run
    assert res["tp1_from_tp2"]["cached"] == CACHED
    assert res["tp1_from_tp2"]["tokens"] == res["tp1_store"]["tokens"]
    lines = slice_lines(out, "tp1_from_tp2")  # one per group: each page assembled from both ranks' files
    states = [ln for ln in lines if ln["heads"] == "h0-8"]
    assert len(states) == 3 and all(ln["files"] == 2 and ln["loads"] == 1 for ln in states), lines
    # both rank files hold B and C: read twice, used once
    assert all(int(ln["bytes_read"]) - int(ln["bytes_scattered"]) == BC_BYTES for ln in states), lines
    (attention,) = [ln for ln in lines if ln["heads"] == "h0-2"]
    assert attention["bytes_read"] == attention["bytes_scattered"] and attention["files"] == 14, attention
    print(f"Mamba2 TP 2->1: {lines}")


def test_mamba_pages_written_at_tp1_hit_at_tp2_with_the_tp2_tokens(mamba_run) -> None:
    _, res, out = mamba_run
    assert res["tp2_from_tp1"]["cached"] == CACHED
    assert res["tp2_from_tp1"]["tokens"] == res["tp2_store"]["tokens"]
    lines = slice_lines(out, "tp2_from_tp1")  # per rank and group: the r0 file read whole
    assert sorted(str(ln["heads"]) for ln in lines) == ["h0-1", "h0-4", "h0-4", "h0-4", "h1-1", "h4-4", "h4-4",
                                                        "h4-4"], lines
    for ln in lines:
        assert ln["files"] == ln["loads"] and ln["stored_back"] == ln["loads"], ln
        # a rank uses its half of x and of the ssm heads, and all of B and C
        extra = BC_BYTES if str(ln["heads"]).endswith("-4") else 0
        assert 2 * int(ln["bytes_scattered"]) - extra == ln["bytes_read"], ln
    print(f"Mamba2 TP 1->2: {lines}")


def test_mamba_states_in_the_wrong_place_change_the_tokens(mamba_run) -> None:
    _, res, out = mamba_run
    assert "SWAPPED 42" in out  # 3 Mamba groups x 7 pages x 2 rank files, checksums recomputed
    assert res["tp1_swapped"]["cached"] == CACHED  # valid files: served
    assert res["tp1_swapped"]["tokens"] != res["tp1_store"]["tokens"]
