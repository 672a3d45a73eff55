"""End to end across two "nodes": vLLM engine A stores through node A's mount, engine B (another
process, the other mount) gets the prefix hit and the same greedy tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
from nfs_standin import TwoNodeMount, unavailable_reason  # noqa: E402

from tierstore.testing.tiny_models import cached_tiny_model  # noqa: E402

HERE = Path(__file__).resolve().parents[1]  # tests/: the node scripts and stand-ins
pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture
def two_nodes(tmp_path: Path):
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"NFS stand-in unavailable: {reason}")
    with TwoNodeMount(tmp_path, "nfs", "nfs") as fs:
        yield fs


def _run_node(model: Path, extra: dict) -> dict:
    env = dict(os.environ, PYTHONPATH=str(HERE.parent), VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1")
    p = subprocess.run([sys.executable, str(HERE / "nfs_vllm_node.py"), str(model), json.dumps(extra)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_engine_b_on_other_mount_gets_engine_a_pages(two_nodes: TwoNodeMount, tmp_path: Path) -> None:
    model = cached_tiny_model("llama")
    a = _run_node(model, {"root": str(two_nodes.a)})
    b = _run_node(model, {"root": str(two_nodes.b)})
    print(json.dumps({"node_a": a, "node_b": b}))
    assert a["cached"] == [0, 0]  # cold export
    assert all(c > 0 for c in b["cached"]), b  # prefix hits from the other node's pages
    assert b["tokens"] == a["tokens"]  # identical greedy output


def test_tier_chain_in_vllm_across_two_mounts(two_nodes: TwoNodeMount, tmp_path: Path) -> None:
    """Each node with its own local tier in front of its mount: B's first run is served by the
    shared tier (and promoted), its second run by its local tier; tokens identical throughout."""
    model = cached_tiny_model("llama")
    cfg = {"local_max_bytes": 64 << 20}
    a = _run_node(model, {"root": str(two_nodes.a), "local_root": str(tmp_path / "local_a"), **cfg})
    b1 = _run_node(model, {"root": str(two_nodes.b), "local_root": str(tmp_path / "local_b"), **cfg})
    b2 = _run_node(model, {"root": str(two_nodes.b), "local_root": str(tmp_path / "local_b"), **cfg})
    print(json.dumps({"node_a": a, "node_b_first": b1, "node_b_again": b2}))
    assert a["cached"] == [0, 0] and a["tiers"]["local"]["stores"] > 0 and a["tiers"]["shared"]["stores"] > 0
    assert all(c > 0 for c in b1["cached"]) and b1["tokens"] == a["tokens"]
    assert b1["tiers"]["shared"]["hits"] > 0 and b1["tiers"]["local"]["hits"] == 0
    assert all(c > 0 for c in b2["cached"]) and b2["tokens"] == a["tokens"]
    assert b2["tiers"]["local"]["hits"] > 0 and b2["tiers"]["shared"]["hits"] == 0
    for run in (a, b1, b2):
        assert all(not m["failures"] for m in run["tiers"].values()), run["tiers"]
