"""Deadlines for calls that may hang on a dead mount, and the shared tier's health state.

Contract:
- ``DeadlineRunner.call(fn, timeout)`` runs ``fn`` in a daemon thread and waits at most
  ``timeout`` seconds; on expiry it raises ``PageTimeout`` and leaves the thread to finish (or
  hang) on its own. At most ``max_inflight`` calls may be unfinished at once: when that many are
  stuck, further calls fail at once (no thread pile-up behind a hung NFS server, and process
  exit never waits for them).
- ``Health`` is "up" or "down". ``mark_down`` (after a timeout) starts one probe thread that
  runs ``probe()`` every ``interval_s`` under the deadline until it succeeds, then marks the
  tier up again: a mount that comes back brings its tier back without a restart.

Threading: both classes are thread-safe.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from tierstore.errors import PageTimeout

log = logging.getLogger(__name__)
T = TypeVar("T")


class DeadlineRunner:
    def __init__(self, name: str, max_inflight: int = 4) -> None:
        self.name = name
        self._slots = threading.BoundedSemaphore(max_inflight)

    def call(self, fn: Callable[[], T], timeout: float) -> T:
        if not self._slots.acquire(blocking=False):
            raise PageTimeout(f"{self.name}: {self._slots._initial_value} earlier calls are still blocked "  # type: ignore[attr-defined]
                              "(the file system is not answering)")
        done = threading.Event()
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["value"] = fn()
            except BaseException as exc:  # handed to the caller below
                box["error"] = exc
            finally:
                self._slots.release()
                done.set()

        threading.Thread(target=run, name=f"tierstore-deadline:{self.name}", daemon=True).start()
        if not done.wait(timeout):
            raise PageTimeout(f"{self.name}: no answer within {timeout:.3f} s")
        if "error" in box:
            raise box["error"]
        return box["value"]  # type: ignore[no-any-return]

    def fire(self, fn: Callable[[], object]) -> bool:
        """Run ``fn`` in the background without waiting; False if too many calls are stuck."""
        if not self._slots.acquire(blocking=False):
            return False

        def run() -> None:
            try:
                fn()
            except Exception:  # best effort (e.g. a touch-on-hit)
                pass
            finally:
                self._slots.release()

        threading.Thread(target=run, name=f"tierstore-bg:{self.name}", daemon=True).start()
        return True


class Health:
    """Up/down state of a tier with a self-healing probe (see the module docstring)."""

    def __init__(self, name: str, probe: Callable[[], object], deadline_s: float, interval_s: float = 1.0,
                 on_change: Callable[[bool], None] | None = None) -> None:
        self.name = name
        self._probe = probe
        self.deadline_s = deadline_s
        self.interval_s = interval_s
        self._on_change = on_change
        self._up = True
        self._lock = threading.Lock()
        self._prober: threading.Thread | None = None
        self._runner = DeadlineRunner(f"{name}-probe", max_inflight=1)
        self.down_since: float | None = None
        self.transitions = 0
        self.reason = ""

    @property
    def up(self) -> bool:
        return self._up

    def mark_down(self, reason: str) -> None:
        with self._lock:
            if self._up:
                self._up = False
                self.down_since = time.monotonic()
                self.transitions += 1
                self.reason = reason
                log.warning("tierstore %s tier is down (%s); treating it as a miss until it answers again", self.name, reason)
                if self._on_change:
                    self._on_change(False)
            if self._prober is None or not self._prober.is_alive():
                self._prober = threading.Thread(target=self._probe_loop, name=f"tierstore-health:{self.name}", daemon=True)
                self._prober.start()

    def mark_up(self) -> None:
        with self._lock:
            if not self._up:
                self._up = True
                self.transitions += 1
                log.warning("tierstore %s tier answers again after %.1f s; back in use", self.name,
                            time.monotonic() - (self.down_since or time.monotonic()))
                self.down_since = None
                if self._on_change:
                    self._on_change(True)

    def _probe_loop(self) -> None:
        while not self._up:
            try:
                self._runner.call(self._probe, self.deadline_s)
                self.mark_up()
                return
            except Exception:
                time.sleep(self.interval_s)
