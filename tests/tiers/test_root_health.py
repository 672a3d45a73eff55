"""One truth about a shared root's health in a process (fs/deadline.py ``Health(root=)``).

Each group and rank has its own shared tier, and the scheduler's index its own view of the
root. When one of them finds the root down (a timeout), the others are down at once: they
skip the root instead of each paying a deadline to find out, and the index stops promising
hits from it. Each comes back up by its own probe once the root answers.
"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path
from typing import Any

import pytest
from tiers_helpers import key, load, store

from tierstore.config import TierStoreConfig
from tierstore.fs import deadline
from tierstore.fs.mapper import FileMapper
from tierstore.index.indexed_lookup import IndexedLookup
from tierstore.metrics import MetricsRegistry
from tierstore.testing.faults import Fault, FaultInjectingStore
from tierstore.testing.pages import simple_namespace
from tierstore.tiers import TierChain

NS = simple_namespace()


def _wait_until(cond: Any, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while not cond() and time.monotonic() < end:
        time.sleep(0.02)
    return bool(cond())


@pytest.fixture
def two_ranks(tmp_path: Path) -> Any:
    """Two chains (ranks 0 and 1) on one shared root, each with a local tier in front."""
    chains = []
    for rank in (0, 1):
        config = TierStoreConfig.from_dict({"root": str(tmp_path / "shared"), "local_root": str(tmp_path / f"local{rank}"),
                                            "local_max_bytes": 1 << 20, "shared_deadline_s": 1.0})
        chain = TierChain(config, NS, 0, rank=rank, metrics=MetricsRegistry())
        assert _wait_until(lambda c=chain: c.shared.available, 10)
        chains.append(chain)
    yield chains
    for chain in chains:
        chain.close()


def test_a_rank_that_finds_the_root_down_takes_the_other_ranks_with_it(two_ranks: Any, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    first, second = two_ranks
    shared = tmp_path / "shared"
    lookup = IndexedLookup([FileMapper(shared, NS.digest, 0, 0)], refresh_s=0).start()
    real_open = os.open

    def server_gone(path: object, flags: int, mode: int = 0o777, **kw: object) -> int:
        if flags & os.O_CREAT and str(path).startswith(str(shared)):
            raise OSError(errno.EIO, "server not responding", str(path))  # the probes' creates
        return real_open(path, flags, mode, **kw)  # type: ignore[arg-type]

    try:
        assert lookup.shared_up
        with monkeypatch.context() as outage:
            outage.setattr(deadline.os, "open", server_gone)
            first.shared.wrap_engine(lambda eng: FaultInjectingStore(eng, [Fault("load", kind="timeout", times=1)]))
            assert load(first, key(1))[1] is not None  # the shared tier's load timed out: it is down
            assert not first.shared.available
            # at once: the other rank skips the root without a deadline of its own; the index promises nothing
            assert not second.shared.available and not lookup.shared_up
            t0 = time.monotonic()
            ok, kind, _ = load(second, key(2))
            assert not ok and time.monotonic() - t0 < 0.5
            assert not second.m_shared.failures().get("timeout")  # skipped, not tried
        # the root answers: each comes back by its own probe, the index too
        assert _wait_until(lambda: first.shared.available and second.shared.available and lookup.shared_up, 10)
        assert store(second, key(3)).ok and first.shared.health.transitions == second.shared.health.transitions == 2
    finally:
        lookup.close()


def test_another_roots_health_is_not_touched(tmp_path: Path) -> None:
    chains = [TierChain(TierStoreConfig.from_dict({"root": str(tmp_path / f"shared{n}"), "local_root":
                                                   str(tmp_path / f"local{n}"), "local_max_bytes": 1 << 20}),
                        NS, 0, metrics=MetricsRegistry()) for n in (0, 1)]
    try:
        assert all(_wait_until(lambda c=c: c.shared.available, 10) for c in chains)
        chains[0].shared.health.mark_down("a test's timeout")
        assert not chains[0].shared.available and chains[1].shared.available
    finally:
        for c in chains:
            c.close()
