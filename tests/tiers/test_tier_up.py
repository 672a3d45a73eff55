"""The up gauge of the shared tier (``TierMetrics.up``, exported as ``tierstore_tier_up``): 1 while
the tier serves, 0 while it is down or still opening, the minimum over the tier objects that
share a name, withdrawn when a tier closes; host and local tiers report none."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from test_tiers_chain import _down_until, cfg  # a stopped shared root: probe fails until released
from tiers_helpers import key, load, store

from tierstore.config import TierStoreConfig
from tierstore.metrics import MetricsRegistry, TierMetrics
from tierstore.testing.pages import simple_namespace
from tierstore.tiers import TierChain, close_shared_state, open_group_store

NS = simple_namespace()


def _wait_for(check, timeout_s: float = 10.0) -> bool:  # noqa: ANN001 - a zero-argument predicate
    end = time.monotonic() + timeout_s
    while not check() and time.monotonic() < end:
        time.sleep(0.02)
    return bool(check())


def test_up_is_the_minimum_over_tier_objects_and_none_without_any() -> None:
    m = TierMetrics("shared")
    assert m.up is None and m.to_dict()["up"] is None  # nothing reports: no value (not exported)
    a, b = object(), object()
    m.set_up(a, True)
    m.set_up(b, True)
    assert m.up == 1
    m.set_up(b, False)  # one group's tier is down: the name reads 0
    assert m.up == 0 and m.to_dict()["up"] == 0
    m.drop_up(b)  # that tier closed
    assert m.up == 1
    m.drop_up(a)
    m.drop_up(a)  # twice is harmless
    assert m.up is None


def test_shared_tier_up_goes_1_0_1_across_a_down_and_up(tmp_path: Path) -> None:
    reg = MetricsRegistry()
    st = TierChain(cfg(tmp_path), NS, 0, metrics=reg)
    try:
        assert st.shared.available and reg.tier("shared").up == 1  # set before the constructor returns
        assert reg.tier("local").up is None and "host" not in reg.names()  # only tiers with a health check
        assert store(st, key(0)).ok and st.flush(10)
        back = _down_until(st)  # the probe fails: the root does not answer
        assert reg.tier("shared").up == 0 and reg.snapshot()["shared"]["up"] == 0  # at the transition
        assert store(st, key(1)).ok  # the local tier takes it meanwhile
        time.sleep(0.1)  # failed probes leave it down
        assert not st.shared.health.up and reg.tier("shared").up == 0
        back.set()
        assert _wait_for(lambda: st.shared.health.up)
        assert reg.tier("shared").up == 1 and reg.snapshot()["shared"]["up"] == 1
        assert load(st, key(0))[0]
    finally:
        st.close()
        close_shared_state()
    assert reg.tier("shared").up is None  # closed: withdrawn, not left at its last value


def test_a_lone_root_hung_at_open_reads_0_until_it_serves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The export hangs at open: the gauge reads 0 already while the open is under way (before
    the constructor's deadline), stays 0 after the tier starts down, and reads 1 once the probe
    brings it up."""
    from tierstore.tiers import shared

    answers = threading.Event()
    seen_while_opening: list[int | None] = []
    reg = MetricsRegistry()
    real_engine = shared.IOEngine

    def hung_engine(*a: object, **k: object) -> object:
        seen_while_opening.append(reg.tier("root").up)  # the open thread, before the engine exists
        answers.wait(30)  # the export does not answer until released
        return real_engine(*a, **k)

    monkeypatch.setattr(shared, "IOEngine", hung_engine)
    st = open_group_store(TierStoreConfig.from_dict({"root": str(tmp_path / "r"), "deadline_s": 0.3}), NS, 0,
                          metrics=reg)
    try:
        assert [t.name for t in st.tiers] == ["root"]
        assert seen_while_opening == [0]
        assert not st.tiers[-1].available and reg.tier("root").up == 0  # started down
        assert store(st, key(0)).error.kind == "timeout"  # refused as down
        assert reg.tier("root").up == 0
        answers.set()
        assert _wait_for(lambda: st.tiers[-1].available)
        assert _wait_for(lambda: reg.tier("root").up == 1, 2.0)
        assert store(st, key(1)).ok
    finally:
        answers.set()
        st.close()
    assert reg.tier("root").up is None


def test_a_root_whose_open_fails_leaves_no_up_value(tmp_path: Path) -> None:
    """An open that fails within the deadline raises; the closed tier withdraws its gauge."""
    from tierstore.errors import ConfigError
    from tierstore.fs.mapper import FileMapper

    group_dir = FileMapper(tmp_path / "r", NS.digest, 0, 0).base.parent
    group_dir.parent.mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    group_dir.symlink_to(tmp_path / "elsewhere")
    reg = MetricsRegistry()
    with pytest.raises(ConfigError):
        open_group_store(TierStoreConfig(root=str(tmp_path / "r")), NS, 0, metrics=reg)
    assert reg.tier("root").up is None
