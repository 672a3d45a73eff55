"""Tensor parallel 2 on vLLM-CPU (multiprocess executor, one core per rank), end to end.

The engines run in a subprocess (``tp_engine.py``, an ``if __name__ == "__main__"`` script:
vLLM's engine core and workers are forked from it). Checked: each rank writes its own page files (``r0``/``r1``,
same keys), a fresh engine restores the prefix with identical tokens, damaging rank 1's files
only makes that request recompute with identical tokens and rank 1 store its pages again (the
next engine: a full hit, issue 13 (a)), each header records its rank's KV heads (issue 13 (b)), and
fsck/stats report both ranks. 4 engine starts with 2 worker processes each, in one subprocess.
Reuse across a TP change (docs/DESIGN.md §9): ``test_vllm_tp_sliding.py`` (with a local tier in
front of the shared root), ``test_vllm_tp_gdn.py``, ``test_vllm_tp_mamba.py`` (TP=4).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

from vllm_helpers import namespace_dir, rank_dir, run_engine_script  # noqa: E402

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, str]:
    root = tmp_path_factory.mktemp("tp2")
    results, out = run_engine_script("tp_engine.py", [str(root)], 4)
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
    from tierstore.rootstore.page_read import inspect_page

    for rank in (0, 1):
        header = inspect_page(ns / "g0" / f"h{rank}-1" / r0[0])
        assert header.meta.rank == rank
        assert (header.meta.head_start, header.meta.head_count) == (rank, 1)  # KV head `rank` of 2
        assert {s.shape[0] for s in header.layout.sections} == {1}  # [H=1, T, 2, D]: this rank's head


def test_tp2_one_ranks_damaged_pages_recompute_with_identical_tokens(tp_run) -> None:
    _, res, out = tp_run
    assert "DAMAGED 2" in out
    damaged, cold = res["damaged_rank1"], res["store"]
    # Rank 1 found both of its pages damaged (a flipped payload byte fails a section checksum);
    # rank 0's pages were intact and loaded without a failure.
    failed = re.findall(r"load of page [0-9a-f]+\.\. \(group 0\) failed: checksum: .*\[(.+?)\]", out)
    assert len(failed) == 2 and all(f"/g0/{rank_dir(1)}/" in path for path in failed), failed
    # The hit was withdrawn and the whole prompt computed again: a served page would leave the
    # restore's 256 cached tokens (a damaged byte in the KV need not change greedy tokens).
    assert damaged["cached"] == 0 and res["restore"]["cached"] == 256
    # Computed again with the same batch shapes as the cold run (the prompt from token 0, in the
    # same chunks): the same tokens and bit-identical logprobs.
    assert damaged["tokens"] == cold["tokens"]
    assert damaged["logprobs"] == cold["logprobs"] and damaged["first_top"] == cold["first_top"]


def test_tp2_fsck_and_stats_report_ranks(tp_run, tmp_path: Path) -> None:
    import shutil

    from vllm_helpers import damage_rank

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
    # Rank 1's engine removed its damaged files (rank 0's stay), and the request that recomputed
    # stored them again at once (TierStoreConnectorScheduler.restart_stores; before it, they came
    # back only when a later engine missed the prefix) ...
    assert res["after_damage"]["files_before"] == {"0": 2, "1": 2}
    # ... so the next engine finds both ranks' files and hits.
    assert res["after_damage"]["cached"] == 256, res["after_damage"]
    assert res["after_damage"]["tokens"] == res["store"]["tokens"]


def slice_lines(out: str, phase: str) -> list[dict[str, int | str]]:
    """The ``tierstore-slices`` closing lines of one phase's engine (one per reading rank), by
    their ``phase=`` tag (tp_engine.py): a process of one engine may print after the next
    engine has started."""
    assert "PHASE " + phase in out, f"no engine ran phase {phase}"
    lines = [dict((k, int(v) if v.isdigit() else v) for k, v in (f.split("=") for f in ln.split()[1:]))
             for ln in out.splitlines() if ln.startswith("tierstore-slices ")]
    return [{k: v for k, v in ln.items() if k != "phase"} for ln in lines if ln.get("phase") == phase]
