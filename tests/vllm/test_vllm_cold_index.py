"""A real vLLM-CPU engine whose page index has not loaded: lookups answer RETRY, the request
waits a step or two while others run, then restores with the tokens of a cold run."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from vllm_helpers import failures, prompt_ids, run_engine  # noqa: E402

from tierstore.index.indexed_lookup import IndexedLookup  # noqa: E402


def test_retry_then_hit_with_a_cold_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ids = prompt_ids("llama")
    first = run_engine("llama", tmp_path, [{"prompt_token_ids": ids}])
    assert first.outputs[0].cached == 0 and first.worker.get("store_pages_ok", 0) > 0

    real_start = IndexedLookup.start
    monkeypatch.setattr(IndexedLookup, "start", lambda self, load=True: real_start(self, load=False))
    second = run_engine("llama", tmp_path, [{"prompt_token_ids": ids}])
    out = second.outputs[0]
    assert out.tokens == first.outputs[0].tokens
    assert out.cached > 0
    assert second.scheduler["lookup_retries"] > 0 and second.scheduler["lookup_probes"] > 0
    assert second.scheduler["lookup_hits"] > 0
    assert second.worker.get("load_jobs_ok", 0) == 1 and not failures(second.worker), second.worker
