"""The README's `vllm serve` recipes, one per model family, run on tiny models.

Each recipe (the flags of one README line) starts one real ``vllm serve`` process (through
``python -m tierstore.vllm.serve``, the CPU wheel's launcher) with the tierstore connector. One
prompt is sent, vLLM's own prefix cache is emptied (``POST /reset_prefix_cache``, a dev-mode
endpoint; retried while the prompt's blocks are still being offloaded), and the prompt is sent
again: its full blocks must now come from tierstore (vLLM's ``external_prefix_cache_hits``,
tierstore's ``load_pages_ok`` on ``/metrics``, no failed load) and the first generated token's
top-5 logprobs must match the first answer's. One server start per family keeps the cost at
~30-60 s each; a restart between the two requests is what tests/vllm/test_vllm_serve.py does
(dense). A cheap test checks that every recipe's flags are on the README's CPU line.

Gemma 4 and gpt-oss recipes are the same line as dense; they are exercised by the offline
engine tests, not here (their tiny models' CPU kernels are slower to start).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm_helpers import reset_prefix_cache  # noqa: E402

README = Path(__file__).resolve().parents[2] / "README.md"
STOP_FLAGS = ["--shutdown-timeout", "45"]
BASE_FLAGS = ["--dtype", "bfloat16", "--enforce-eager"]
# family -> tiny model kind, README flags, extra environment, prompt tokens.
# Qwen3-Next: vLLM's CPU build picks unified blocks of N=1152 tokens for the tiny model (GDN
# state page size); align mode needs --enable-prefix-caching, and the budget 2N-1 = 2303 tokens.
RECIPES: dict[str, dict[str, Any]] = {
    "dense": {"kind": "llama", "flags": ["--max-model-len", "1024"], "env": {}, "prompt": 600},
    "gemma3": {"kind": "gemma3", "flags": ["--max-model-len", "1024"], "env": {}, "prompt": 600},
    "qwen3next": {"kind": "qwen3next", "flags": ["--max-model-len", "4096", "--enable-prefix-caching",
                                                 "--max-num-batched-tokens", "2303",
                                                 "--mamba-ssm-cache-dtype", "float32"], "env": {}, "prompt": 2504},
    "tp2": {"kind": "llama", "flags": ["--max-model-len", "1024", "--tensor-parallel-size", "2"],
            "env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}, "prompt": 600},
}
LOGPROB_TOL = 0.05  # bf16 rounding of a logit near 4 is 0.03 (see test_vllm_serve.py)


def readme_cpu_lines() -> list[str]:
    """The README's `python -m tierstore.vllm.serve` command lines (continuations joined)."""
    text = README.read_text().replace("\\\n", " ")
    return [re.sub(r"\s+", " ", line) for line in text.splitlines() if "-m tierstore.vllm.serve $" in line]


def test_every_recipe_is_a_readme_line() -> None:
    lines = readme_cpu_lines()
    for family, recipe in RECIPES.items():
        want = " ".join(BASE_FLAGS + recipe["flags"] + STOP_FLAGS)
        env = " ".join(f'{var}="{value}"' for var, value in recipe["env"].items())
        found = [ln for ln in lines if want in ln and ln.strip().startswith(env)]
        assert found, f"README has no CPU recipe line for {family} with `{env} ... {want}`"


def _first_top(resp: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in resp["choices"][0]["logprobs"]["top_logprobs"][0].items()}


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("family", list(RECIPES))
def test_recipe_serves_and_hits_tierstore(family: str, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from tierstore.testing.tiny_models import cached_tiny_model, prompt_token_ids
    from tierstore.vllm.server_process import VllmServer, metric

    recipe = RECIPES[family]
    model = cached_tiny_model(recipe["kind"])
    prompt = prompt_token_ids(AutoTokenizer.from_pretrained(str(model)), recipe["prompt"], 5)
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_SERVER_DEV_MODE": "1",
           "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": "40", **recipe["env"]}
    server = VllmServer(model, root=tmp_path / "cache", log_path=tmp_path / "server.log",
                        args=BASE_FLAGS + recipe["flags"] + STOP_FLAGS + ["--seed", "0"], env=env)
    server.start()
    try:
        first = server.complete(prompt, max_tokens=2, logprobs=5)
        reset_prefix_cache(server.url)
        before = server.metrics()
        second = server.complete(prompt, max_tokens=2, logprobs=5)
        after = server.metrics()
        assert server.stop() == 0, server.log_tail()
    finally:
        server.kill()

    def delta(name: str) -> float:
        return metric(after, name) - metric(before, name)

    assert delta("vllm:external_prefix_cache_hits_total") > 0, server.log_tail()
    assert delta("tierstore_page_loads_total{result=ok}") > 0
    assert delta("tierstore_page_loads_total{result=failed}") == 0
    a, b = _first_top(first), _first_top(second)
    common = a.keys() & b.keys()
    assert len(common) >= 3 and max(abs(a[t] - b[t]) for t in common) <= LOGPROB_TOL, (a, b)
