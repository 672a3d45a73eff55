"""Deadlines for calls that may hang on a dead mount, and the shared tier's health state.

Contract:
- ``DeadlineRunner.call(fn, timeout)`` runs ``fn`` in a daemon thread and waits at most
  ``timeout`` seconds; on expiry it raises ``PageTimeout`` and leaves the thread to finish (or
  hang) on its own. At most ``max_inflight`` calls may be unfinished at once: when that many are
  stuck, further calls fail at once (no thread pile-up behind a hung NFS server, and process
  exit never waits for them).
- ``Health`` is "up" or "down". ``mark_down`` (after a timeout) starts one probe thread that
  runs ``probe()`` every ``interval_s`` under the deadline until it succeeds, then marks the
  tier up again: a mount that comes back brings its tier back without a restart. ``changes``
  keeps the last 64 changes as (monotonic time, up) for whoever reports them (``transitions``
  counts them all).
- ``SpaceBackoff`` is a tier's "full" state: after ENOSPC/EDQUOT (``note_full``) the tier is
  ``full`` for ``first_s`` (30 s), doubling per further refusal up to ``max_s``, so stores to
  it are skipped instead of each failing on the file system; loads are not its business. One
  warning per episode (from the first refusal until a store goes through, ``note_stored``, or
  gc frees space under its root, ``note_space_freed``) names the root and what to do.

Threading: all three classes are thread-safe; ``note_space_freed`` may be called from any thread.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
import weakref
from collections import deque
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
        self.changes: deque[tuple[float, bool]] = deque(maxlen=64)
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
                self.changes.append((self.down_since, False))
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
                self.changes.append((time.monotonic(), True))
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


FULL_BACKOFF_S = 30.0  # the first skip after ENOSPC/EDQUOT; doubles per further refusal
FULL_BACKOFF_MAX_S = 480.0
_BACKOFFS: weakref.WeakSet[SpaceBackoff] = weakref.WeakSet()
_BACKOFFS_LOCK = threading.Lock()


class SpaceBackoff:
    """The "full" state of one tier's root (see the module docstring)."""

    def __init__(self, name: str, root: str | os.PathLike[str], first_s: float | None = None,
                 max_s: float | None = None) -> None:
        self.name, self.root = name, os.path.abspath(root)
        self.first_s = first_s if first_s is not None else FULL_BACKOFF_S
        self.max_s = max_s if max_s is not None else FULL_BACKOFF_MAX_S
        self._lock = threading.Lock()
        self._until = 0.0  # monotonic end of the current skip; 0.0: no episode
        self._next_s = self.first_s
        self.episodes = 0
        self.errno = errno.ENOSPC  # what the last refusal said: ENOSPC, or EDQUOT for a quota
        with _BACKOFFS_LOCK:
            _BACKOFFS.add(self)

    @property
    def full(self) -> bool:
        """Stores to this root are skipped now (lock-free read)."""
        until = self._until
        return until > 0.0 and time.monotonic() < until

    def note_full(self, detail: str, code: int | None = None) -> None:
        """A store was refused for space (``code`` ENOSPC or EDQUOT, ``detail`` the error): skip
        stores for the next back-off; the first refusal of an episode logs one warning."""
        with self._lock:
            if code is not None:
                self.errno = code
            now = time.monotonic()
            if self._until > now:
                return  # a store that was in flight when the episode began
            first = self._until == 0.0
            wait = self._next_s
            self._until = now + wait
            self._next_s = min(wait * 2, self.max_s)
            if first:
                self.episodes += 1
        if first:
            log.warning("tierstore %s tier: %s is full (%s); its stores are skipped for %.0f s at a time (doubling) "
                        "until space is freed, loads go on: lower max_bytes, run `tierstore gc %s --max-bytes N`, "
                        "or grow the export or its quota", self.name, self.root, detail, wait, self.root)

    def note_stored(self) -> None:
        """A store went through: the episode, if any, is over."""
        if self._until:
            self._clear()

    def _clear(self) -> None:
        with self._lock:
            ended = self._until != 0.0
            self._until, self._next_s = 0.0, self.first_s
        if ended:
            log.warning("tierstore %s tier: %s has room again; stores resume", self.name, self.root)


def note_space_freed(root: str | os.PathLike[str]) -> None:
    """gc freed space under ``root``: every tier of this process on it stores again at once."""
    where = os.path.abspath(root)
    with _BACKOFFS_LOCK:
        backoffs = [b for b in _BACKOFFS if b.root == where]
    for b in backoffs:
        if b._until:
            b._clear()
