"""AdaptiveGate: the limit climbs to the top when more holders finish more work (a slow
mount), falls to a few when they do not (GIL-bound work), and never lets more in than it says."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from tierstore.admin.adaptive_gate import AdaptiveGate


def drive(gate: AdaptiveGate, rate_at: Callable[[int], float], seconds: float) -> list[int]:
    """Release the gate as a workload whose completion rate depends on the limit would, on a
    fake clock (deterministic), with more threads than the limit; the limit sampled every 0.2
    simulated seconds."""
    now = [0.0]
    gate._clock = lambda: now[0]  # type: ignore[method-assign]
    gate._since = 0.0
    samples: list[int] = []
    while now[0] < seconds:
        gate._contended = True  # a pool with more threads than the limit: someone always waits
        gate.acquire()
        now[0] += 1.0 / rate_at(gate.limit)
        gate.release()
        if now[0] >= 0.2 * len(samples):
            samples.append(gate.limit)
    return samples


def test_a_latency_bound_walk_climbs_to_the_top_and_stays() -> None:
    gate = AdaptiveGate(64, start=4)
    seen = drive(gate, lambda n: 100.0 * n, seconds=6)  # 10 ms a page: rate grows with n
    assert seen[-10:] == [64] * 10
    assert gate.limits_seen[:5] == [4, 8, 16, 32, 64]


def test_a_gil_bound_walk_settles_low() -> None:
    gate = AdaptiveGate(64, start=4)
    seen = drive(gate, lambda n: 30_000.0 / (1 + 0.15 * (n - 1)), seconds=8)  # contention: more is slower
    assert max(seen[-20:]) <= 4 and min(seen[-20:]) == 1


def test_from_the_top_a_latency_bound_walk_stays() -> None:
    top = AdaptiveGate(64, start=64)
    assert set(drive(top, lambda n: 100.0 * n, seconds=6)) == {64} and top.limits_seen == [64]


def test_the_best_in_the_middle_is_found() -> None:
    gate = AdaptiveGate(64, start=1)
    seen = drive(gate, lambda n: {1: 10.0, 2: 18.0, 4: 30.0, 8: 31.0, 16: 20.0, 32: 10.0, 64: 5.0}[n], seconds=30)
    assert all(2 <= n <= 16 for n in seen[-60:])
    assert sum(n in (4, 8) for n in seen[-60:]) >= 30


def test_a_fixed_gate_keeps_its_limit_and_never_lets_more_in() -> None:
    gate = AdaptiveGate(3, adaptive=False)
    inside, most = [0], [0]
    lock = threading.Lock()

    def work() -> None:
        for _ in range(50):
            with gate:
                with lock:
                    inside[0] += 1
                    most[0] = max(most[0], inside[0])
                time.sleep(0.0005)
                with lock:
                    inside[0] -= 1

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert most[0] == gate.peak == 3 and gate.limits_seen == [3]


def test_windows_where_nobody_waited_do_not_move_the_limit() -> None:
    """A walk's tail (fewer directories left than the limit) runs slower, but not because of
    the limit: with no acquire waiting, the gate keeps its limit."""
    gate = AdaptiveGate(64, start=64)
    now = [0.0]
    gate._clock = lambda: now[0]  # type: ignore[method-assign]
    gate._since = 0.0
    for rate in (6400.0, 100.0):  # the full walk, then its tail
        for _ in range(2000):
            gate.acquire()
            now[0] += 1.0 / rate
            gate.release()
    assert gate.limits_seen == [64]


def test_a_gate_needs_a_holder() -> None:
    with pytest.raises(ValueError, match="at least one"):
        AdaptiveGate(0)
