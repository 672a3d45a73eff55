"""AdaptiveGate: how many threads may work at once, found by measuring, not guessed.

Why: ``tierstore fsck`` verifies pages on a pool of threads. On a mount with 1-10 ms per
operation, reads in flight set the pace and 64 threads pay off; with the tree in the page
cache each page is ~30 us of Python under the GIL, and 64 threads fighting for it are 2-3x
slower than one (the lock hand-offs show up as system time; docs/measurements/fsck.md). The
right number depends on the mount and the machine, so the gate measures it.

Contract:
- ``acquire()`` blocks while ``limit`` holders are inside; ``release(done)`` lets the next one
  in, counting ``done`` units of work finished inside (``with gate:`` counts one);
  ``progress(done)`` counts units while staying in. Waiting threads sleep on a condition (they
  do not compete for the GIL). Every pass through the gate may be a thread switch: hold it for
  a large piece of work and report progress on the way (fsck's walk holds it for a fan-out
  directory and reports every 32 entries). A lower limit takes effect as holders leave.
- With ``adaptive=True`` the limit moves between 1 and ``most`` by hill climbing on the rate
  of units done: after each window (at least ``window_s`` and ``max(8, 2 x limit)`` reports) it
  doubles or halves in the current direction (at 1 or ``most`` it stays).
  A window more than 5% slower than the one before turns the direction around; one within 5%
  keeps the limit; a window in which no thread had to wait says nothing about the limit (a
  walk's tail, with fewer directories left than the limit) and is skipped. It starts at
  ``start`` (fsck: ``most`` on a slow mount, 1 elsewhere). So a walk whose rate grows with the
  limit (a slow mount) climbs to ``most``, or stays there; a GIL-bound one settles at 1-4; one
  that saturates stays at the first limit that does as well as twice as many. Without
  ``adaptive`` the limit stays ``most`` (an operator's explicit setting).
- ``limits_seen`` records each limit used (for reports and tests); ``peak`` the most holders
  at once.

Threading: every method may be called from any thread; the state is guarded by one condition.
``clock`` is injectable so the controller can be tested without timing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from types import TracebackType

_NOISE = 0.05  # rate changes within this fraction count as "the same"


class AdaptiveGate:
    def __init__(self, most: int, *, adaptive: bool = True, start: int = 4, window_s: float = 0.5,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if most < 1:
            raise ValueError(f"the gate needs at least one holder, got {most}")
        self.most = most
        self.adaptive = adaptive
        self.limit = min(max(1, start), most) if adaptive else most
        self.limits_seen = [self.limit]
        self.peak = 0
        self._window_s = window_s
        self._clock = clock
        self._cond = threading.Condition()
        self._inside = 0
        self._done = 0  # units of work finished in this window
        self._reports = 0
        self._contended = False  # some acquire waited in this window (the limit was binding)
        self._since = clock()
        self._last_rate: float | None = None
        self._growing = True

    def __enter__(self) -> AdaptiveGate:
        self.acquire()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()

    def acquire(self) -> None:
        with self._cond:
            while self._inside >= self.limit:
                self._contended = True
                self._cond.wait()
            self._inside += 1
            self.peak = max(self.peak, self._inside)

    def progress(self, done: int) -> None:
        """A holder finished ``done`` more units of work (the rate counts units) and stays in."""
        with self._cond:
            self._count(done)

    def release(self, done: int = 1) -> None:
        """Leave the gate, having finished ``done`` units of work since the last ``progress``."""
        with self._cond:
            self._inside -= 1
            self._count(done)
            self._cond.notify()

    def _count(self, done: int) -> None:
        self._done += done
        self._reports += 1
        before = self.limit
        if self.adaptive:
            self._maybe_adapt()
        if self.limit > before:
            self._cond.notify_all()

    def _maybe_adapt(self) -> None:
        now = self._clock()
        elapsed = now - self._since
        if elapsed < self._window_s or self._reports < max(8, 2 * self.limit):
            return
        rate = self._done / elapsed
        if not self._contended:  # nobody waited: the limit did not set this rate (a walk's tail)
            self._done, self._reports, self._since = 0, 0, now
            return
        last = self._last_rate
        self._done, self._reports, self._since, self._last_rate = 0, 0, now, rate
        self._contended = False
        if last is not None:
            if rate < last * (1 - _NOISE):
                self._growing = not self._growing  # the last step hurt: go back the other way
            elif rate <= last * (1 + _NOISE):
                return  # no better, no worse: stay
        self._step()

    def _step(self) -> None:
        if (self.limit == self.most) if self._growing else (self.limit == 1):
            return  # at an end and no worse for it: stay (a worse window turns it around)
        new = min(self.most, self.limit * 2) if self._growing else max(1, self.limit // 2)
        if new != self.limit:
            self.limit = new
            self.limits_seen.append(new)
