"""One rule counts a page result in a tier's metrics (``tiers.tier.count_result``), and a lone
root is counted by it like every tier: ``open_group_store`` with only ``root`` set builds a
chain of one tier named ``root`` (``tiers.factory``). Before, a lone root was a plain engine that
the vLLM adapter counted by a copy of the rule, which had drifted: it counted an ``unsafe`` load
(a symlink or FIFO under the page's name) as a failure only, a chain's tier as a miss and a
failure."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.tiers_helpers import key, load, store
from tierstore.config import TierStoreConfig
from tierstore.errors import PageCorrupt, PageError, PageMissing, PageTimeout, PageUnsafe
from tierstore.metrics import MetricsRegistry, TierMetrics
from tierstore.store import IOResult
from tierstore.testing.pages import simple_namespace
from tierstore.tiers import TierChain, close_shared_state, open_group_store
from tierstore.tiers.factory import root_tier_name, tier_specs
from tierstore.tiers.tier import count_result

COUNTERS = ("hits", "misses", "hit_tokens", "miss_tokens", "stores", "stored_bytes", "bytes_read")


def _result(op: str, error: PageError | None) -> IOResult:
    return IOResult(1, op, b"k" * 16, error is None, error, None, True, 4096, 0.001, verified=True)


@pytest.mark.parametrize("op, error, hits, misses, failure", [
    ("load", None, 1, 0, None),
    ("load", PageMissing("gone"), 0, 1, None),
    ("load", PageUnsafe("a symlink under the page's name"), 0, 1, "unsafe"),
    ("load", PageCorrupt("bad sum"), 0, 0, "checksum"),
    ("load", PageTimeout("slow"), 0, 0, "timeout"),
    ("store", None, 0, 0, None),
    ("store", PageTimeout("slow"), 0, 0, "timeout"),
])
def test_the_rule(op: str, error: PageError | None, hits: int, misses: int, failure: str | None) -> None:
    m = TierMetrics("root")
    count_result(m, _result(op, error), 16)
    assert (m.get("hits"), m.get("misses")) == (hits, misses)
    assert m.failures() == ({failure: 1} if failure else {})
    assert m.get("stores") == (1 if op == "store" and error is None else 0)


def test_specs_name_a_lone_root_root_and_a_root_behind_a_faster_tier_shared(tmp_path: Path) -> None:
    lone = TierStoreConfig(root=str(tmp_path / "r"))
    assert [s.kind for s in tier_specs(lone)] == ["root"] and root_tier_name(lone) == "root"
    assert tier_specs(lone)[0].deadline_s == lone.deadline_s
    full = lone.replace(local_root=str(tmp_path / "l"), host_bytes=1 << 20)
    assert [s.kind for s in tier_specs(full)] == ["host", "local", "shared"] and root_tier_name(full) == "shared"
    assert tier_specs(full)[-1].deadline_s == full.shared_deadline_s


def test_a_lone_root_is_a_chain_of_one_counted_by_the_rule(tmp_path: Path) -> None:
    reg = MetricsRegistry()
    st = open_group_store(TierStoreConfig(root=str(tmp_path / "r")), simple_namespace(), 0, metrics=reg)
    try:
        assert isinstance(st, TierChain) and [t.name for t in st.tiers] == ["root"]
        assert store(st, key(1)).ok
        assert load(st, key(1))[0]
        assert not load(st, key(2))[0]  # a clean miss
        page = next((tmp_path / "r").rglob(f"{key(1).hex()}*"))
        os.unlink(page)
        os.symlink("/etc/hostname", page)  # not what tierstore made: an unsafe miss
        assert not load(st, key(1))[0]
        m = reg.tier("root")
        assert (m.get("stores"), m.get("hits"), m.get("misses")) == (1, 1, 2)
        assert m.failures() == {"unsafe": 1}
        assert reg.names() == ["root"]  # nothing counted under another tier's name
    finally:
        st.close()
        close_shared_state()
