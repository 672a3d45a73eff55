"""One rule counts a page result in a tier's metrics (``tiers.tier.count_result``), for the
tiers of a chain and for a lone root alike (``vllm.group.count_result`` delegates): a lone
root counted an ``unsafe`` load (a symlink or FIFO under the page's name) as a failure only,
a chain's tier as a miss and a failure."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tierstore.errors import PageCorrupt, PageError, PageMissing, PageTimeout, PageUnsafe
from tierstore.metrics import TierMetrics
from tierstore.store import IOResult
from tierstore.tiers.tier import count_result

COUNTERS = ("hits", "misses", "hit_tokens", "miss_tokens", "stores", "stored_bytes", "bytes_read")


def _result(op: str, error: PageError | None) -> IOResult:
    return IOResult(1, op, b"k" * 16, error is None, error, None, True, 4096, 0.001, verified=True)


def _counts(m: TierMetrics) -> dict[str, int]:
    return {name: m.get(name) for name in COUNTERS}


@pytest.mark.parametrize("op, error, misses, failure", [
    ("load", None, 0, None),
    ("load", PageMissing("gone"), 1, None),
    ("load", PageUnsafe("a symlink under the page's name"), 1, "unsafe"),
    ("load", PageCorrupt("bad sum"), 0, "checksum"),
    ("load", PageTimeout("slow"), 0, "timeout"),
    ("store", None, 0, None),
    ("store", PageTimeout("slow"), 0, "timeout"),
])
def test_a_result_counts_the_same_on_a_chain_and_on_a_lone_root(op: str, error: PageError | None, misses: int,
                                                                  failure: str | None) -> None:
    from tierstore.vllm import group  # imports torch, not vLLM

    chain, lone = TierMetrics("shared"), TierMetrics("root")
    count_result(chain, _result(op, error), 16)
    group.count_result(SimpleNamespace(root_metrics=lone, tokens_per_page=16), _result(op, error))  # type: ignore[arg-type]
    assert _counts(chain) == _counts(lone)
    assert chain.failures() == lone.failures() == ({failure: 1} if failure else {})
    assert chain.get("misses") == misses
