"""``tierstore bench lookup`` on a small tree: it runs end to end on the local target and its
32k request finds every stored page through both prefix loops (the bench raises otherwise)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the bench drives vLLM's scheduler loop")

from tierstore.bench import lookup as bench  # noqa: E402


@pytest.mark.vllm
def test_bench_lookup_runs_and_reports_both_loops(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--work", str(tmp_path), "--pages", "5000", "--keys", "400", "--baseline-keys", "40",
                       "--targets", "local", "--no-memory", "--kv-heads", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    (local,) = out["results"]
    assert local["hits"] == 200 and local["shared_up"]
    q = local["request_32k"]
    for name in ("perkey", "batched"):
        assert q[f"{name}_first_ms"] > 0 and q[f"{name}_short_ms"] > 0
