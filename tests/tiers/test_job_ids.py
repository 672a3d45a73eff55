"""One job id from the caller to the file (store.py, "One job id for a page").

A chain of a host, a local and a shared tier, each tier's engine wrapped in a recorder of the
tickets it was given and the results it made. The id the caller gets back is the id every tier
and engine filed the page's job under, and the result the caller gets is the very object the
engine that did the work made (not a copy rebuilt per layer).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import pytest
from tiers_helpers import expected, key

from tierstore.config import TierStoreConfig
from tierstore.metrics import MetricsRegistry
from tierstore.rootstore.engine import IOEngine
from tierstore.store import IOResult, JobTicket
from tierstore.testing.pages import simple_namespace
from tierstore.tiers import TierChain
from tierstore.tiers.host import HostTier

NS = simple_namespace()


class RecordingEngine:
    """An engine that notes the (op, ticket id) of each submit and keeps each result it made."""

    def __init__(self, inner: IOEngine) -> None:
        self.inner = inner
        self.tickets: list[tuple[str, int | None]] = []
        self.results: list[IOResult] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def submit_load(self, key: bytes, verify: bool = True, *, ticket: JobTicket | None = None) -> int:
        self.tickets.append(("load", ticket.id if ticket else None))
        return self.inner.submit_load(key, verify, ticket=ticket)

    def submit_store(self, key: bytes, slot: Any, token_count: int, sums: Sequence[int] | None = None, *,
                     ticket: JobTicket | None = None) -> int:
        self.tickets.append(("store", ticket.id if ticket else None))
        return self.inner.submit_store(key, slot, token_count, sums, ticket=ticket)

    def poll(self) -> list[IOResult]:
        out = self.inner.poll()
        self.results += out
        return out

    def wait(self, job_ids: Iterable[int], timeout: float | None) -> list[IOResult]:
        out = self.inner.wait(job_ids, timeout)
        self.results += out
        return out


@pytest.fixture
def chain(tmp_path: Path) -> Any:
    config = TierStoreConfig.from_dict({"root": str(tmp_path / "shared"), "local_root": str(tmp_path / "local"),
                                        "local_max_bytes": 1 << 20, "host_bytes": 1 << 20})
    st = TierChain(config, NS, 0, host=HostTier(1 << 20), metrics=MetricsRegistry())
    end = time.monotonic() + 10
    while not st.shared.available and time.monotonic() < end:  # the shared engine opens in the background
        time.sleep(0.02)
    recorders = {"local": st.local.wrap_engine(RecordingEngine), "shared": st.shared.wrap_engine(RecordingEngine)}
    yield st, recorders
    st.close()


def _store(st: TierChain, k: bytes) -> tuple[int, IOResult]:
    slot = st.acquire_slot(5)
    slot.view[:] = expected(st, k)
    jid = st.submit_store(k, slot, 16)
    (r,) = st.wait([jid], 10)
    return jid, r


def test_a_store_is_one_job_id_in_every_tier_and_the_result_is_the_front_engines(chain: Any) -> None:
    st, rec = chain
    jid, r = _store(st, key(1))
    assert r.ok and r.job_id == jid and r.tier == "local"
    assert st.flush(10)
    assert rec["local"].tickets == [("store", jid)]
    assert rec["shared"].tickets == [("store", jid)]  # the write-behind copy: the same job
    assert any(r is made for made in rec["local"].results)  # handed up, not rebuilt


def test_a_load_walks_the_tiers_under_one_id_and_promotes_under_it(chain: Any) -> None:
    """A page only the shared root has: the local tier misses it, the shared tier serves it and
    the local tier takes the promotion, all under the id the caller got."""
    st, rec = chain
    k = key(2)
    slot = st.shared.acquire_slot(5)
    slot.view[:] = expected(st, k)
    st.shared.wait([st.shared.submit_store(k, slot, 16)], 10)  # the shared tier alone
    rec["local"].tickets.clear()
    rec["shared"].tickets.clear()
    jid = st.submit_load(k)
    (r,) = st.wait([jid], 10)
    assert r.ok and r.job_id == jid and r.tier == "shared" and bytes(r.slot.view) == expected(st, k)
    assert any(r is made for made in rec["shared"].results)
    st.release_slot(r.slot)
    assert st.flush(10)
    st.poll()
    assert rec["shared"].tickets == [("load", jid)]
    assert rec["local"].tickets == [("load", jid), ("store", jid)]  # the miss, then the promotion
    # the next load is a local hit (the promotion landed), under a new id
    jid2 = st.submit_load(k)
    (r2,) = st.wait([jid2], 10)
    assert r2.ok and r2.tier in ("host", "local") and jid2 != jid
    st.release_slot(r2.slot)


def test_a_miss_in_every_tier_hands_up_the_last_tiers_result(chain: Any) -> None:
    st, rec = chain
    jid = st.submit_load(key(3))
    (r,) = st.wait([jid], 10)
    assert not r.ok and r.error.kind == "missing" and r.job_id == jid
    assert r.tier == "shared" and any(r is made for made in rec["shared"].results)


def test_a_ticket_given_by_the_caller_is_the_id_throughout(chain: Any) -> None:
    st, rec = chain
    ticket = JobTicket.new()
    slot = st.acquire_slot(5)
    slot.view[:] = expected(st, key(4))
    assert st.submit_store(key(4), slot, 16, ticket=ticket) == ticket.id
    (r,) = st.wait([ticket.id], 10)
    assert r.ok and r.job_id == ticket.id and r.seconds >= 0
    assert st.flush(10)
    assert ("store", ticket.id) in rec["local"].tickets and ("store", ticket.id) in rec["shared"].tickets


def test_one_ticket_for_two_jobs_at_once_is_refused(tmp_path: Path) -> None:
    """An id is taken from submit until its result is handed out (in flight, or finished and
    not yet polled): a second job under it would overwrite the first's result."""
    eng = IOEngine(tmp_path / "root", NS, 0)
    try:
        ticket = JobTicket.new()
        slot = eng.acquire_slot(5)
        slot.view[:] = expected(eng, key(5))
        eng.submit_store(key(5), slot, 16, ticket=ticket)
        with pytest.raises(ValueError, match="a ticket is for one job"):
            eng.submit_load(key(5), ticket=ticket)
        (r,) = eng.wait([ticket.id], 10)
        assert r.ok and r.op == "store"
        r2 = eng.wait([eng.submit_load(key(5), ticket=ticket)], 10)[0]  # handed out: the id is free again
        assert r2.ok and r2.job_id == ticket.id
        eng.release_slot(r2.slot)
    finally:
        eng.close()
