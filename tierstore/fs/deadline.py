"""Deadlines for calls that may hang on a dead mount, and the shared tier's health state.

Contract:
- ``DeadlineRunner.call(fn, timeout)`` runs ``fn`` in a daemon thread and waits at most
  ``timeout`` seconds; on expiry it raises ``PageTimeout`` and leaves the thread to finish (or
  hang) on its own. At most ``max_inflight`` calls may be unfinished at once: when that many are
  stuck, further calls fail at once (no thread pile-up behind a hung NFS server, and process
  exit never waits for them).
- ``probe_root`` is the one health probe of a root on a file server: an exclusive create and
  unlink, which the server itself must answer (a ``stat`` is answered by the client's
  attribute cache while an NFS server is stopped). Both the worker's shared tier and the
  scheduler's index probe with it.
- ``Health`` is "up" or "down". ``mark_down`` (after a timeout) starts one probe thread that
  runs ``probe()`` every ``interval_s`` under the deadline until it succeeds, then marks the
  tier up again: a mount that comes back brings its tier back without a restart. ``changes``
  keeps the last 64 changes as (monotonic time, up) for whoever reports them (``transitions``
  counts them all). A ``Health`` made with ``root=`` is one of that root's healths in this
  process (the shared tier of each group and rank, the scheduler index's): when one goes down
  it marks the others down at once, so an outage costs one deadline per root and process, not
  one per group and rank, and the index stops promising hits from the root as soon as a worker
  in its process finds it down. Each comes back up by its own probe.
- ``SpaceBackoff`` is a tier's "full" state: after ENOSPC/EDQUOT (``note_full``) stores to the
  tier are skipped (``skip_store``) instead of each failing on the file system, except one
  trial store every ``probe_s`` (5 s): its success ends the episode, so stores resume within
  one probe of space coming back, whoever freed it (another node's gc, an operator, a grown
  quota); gc in this process ends it at once (``note_space_freed``). Loads are not its
  business. One warning per episode names the root and what to do.

Threading: all three classes are thread-safe; ``note_space_freed`` may be called from any thread.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import time
import uuid
import weakref
from collections import deque
from collections.abc import Callable
from pathlib import Path
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


# root (an absolute path, not resolved: a resolve would block on a hung mount) -> its healths here
_ROOT_HEALTHS: dict[str, weakref.WeakSet[Health]] = {}
_ROOT_HEALTHS_LOCK = threading.Lock()


class Health:
    """Up/down state of a tier with a self-healing probe (see the module docstring)."""

    def __init__(self, name: str, probe: Callable[[], object], deadline_s: float, interval_s: float = 1.0,
                 on_change: Callable[[bool], None] | None = None, root: str | os.PathLike[str] | None = None) -> None:
        self.name = name
        self._root = os.path.abspath(root) if root is not None else None
        if self._root is not None:
            with _ROOT_HEALTHS_LOCK:
                _ROOT_HEALTHS.setdefault(self._root, weakref.WeakSet()).add(self)
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

    def mark_down(self, reason: str, *, from_peer: bool = False) -> None:
        """Down (the probe thread brings it back); ``from_peer``: another health of this root
        went down (module docstring), which is not passed on again."""
        went_down = False
        with self._lock:
            if self._up:
                went_down = True
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
        if went_down and not from_peer and self._root is not None:
            with _ROOT_HEALTHS_LOCK:
                peers = [h for h in _ROOT_HEALTHS.get(self._root, ()) if h is not self]
            for peer in peers:  # outside our lock: a peer's hooks take their own tier's locks
                peer.mark_down(f"{reason} (found by {self.name} on the same root)", from_peer=True)

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


# errnos with which the server answered a probe's create (a missing directory, a read-only or full
# export, another owner's directory): it is up, whatever it refused
_PROBE_ANSWERED = frozenset({errno.ENOENT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EEXIST, errno.ENOSPC, errno.EDQUOT})


def probe_root(root: Path) -> None:
    """Raise unless the file server behind ``root`` answers now: create and remove a fresh name.

    A ``stat`` of a fresh name was answered while a kernel NFS server was stopped (the real-NFS
    test's outage: the tier came back 32 times in 30 s, each return costing another timeout);
    an exclusive create is a CREATE the server itself must answer, on every NFS version and any
    attribute or lookup caching. A refusal (``_PROBE_ANSWERED``) is an answer too."""
    name = root / f".tierstore-probe-{uuid.uuid4().hex}"
    try:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        if exc.errno in _PROBE_ANSWERED:
            return
        raise
    os.close(fd)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name)


FULL_PROBE_S = 5.0  # while a root is full, one trial store this often
_BACKOFFS: weakref.WeakSet[SpaceBackoff] = weakref.WeakSet()
_BACKOFFS_LOCK = threading.Lock()


class SpaceBackoff:
    """The "full" state of one tier's root (see the module docstring)."""

    def __init__(self, name: str, root: str | os.PathLike[str], probe_s: float | None = None) -> None:
        self.name, self.root = name, os.path.abspath(root)
        self.probe_s = probe_s if probe_s is not None else FULL_PROBE_S
        self._lock = threading.Lock()
        self._until = 0.0  # monotonic time of the episode's next trial store; 0.0: no episode
        self.episodes = 0
        self.trials = 0  # trial stores let through during episodes
        self.errno = errno.ENOSPC  # what the last refusal said: ENOSPC, or EDQUOT for a quota
        with _BACKOFFS_LOCK:
            _BACKOFFS.add(self)

    @property
    def full(self) -> bool:
        """An episode is on: the root refused a store for space and none has gone through since
        (lock-free read)."""
        return self._until > 0.0

    def skip_store(self) -> bool:
        """Whether to skip a store now: True during an episode, except for one trial store per
        ``probe_s`` (the caller that gets False is that trial)."""
        if self._until == 0.0:
            return False
        with self._lock:
            now = time.monotonic()
            if self._until == 0.0 or now < self._until:
                return self._until != 0.0
            self._until = now + self.probe_s  # this caller's store is the trial
            self.trials += 1
            return False

    def note_full(self, detail: str, code: int | None = None) -> None:
        """A store was refused for space (``code`` ENOSPC or EDQUOT, ``detail`` the error): an
        episode starts (one warning) unless one is on (a trial or an in-flight store failed)."""
        with self._lock:
            if code is not None:
                self.errno = code
            if self._until:
                return
            self._until = time.monotonic() + self.probe_s
            self.episodes += 1
        log.warning("tierstore %s tier: %s is full (%s); its stores are skipped, one trial store every %.0f s, "
                    "until one goes through; loads go on: lower max_bytes, run `tierstore gc %s --max-bytes N`, "
                    "or grow the export or its quota", self.name, self.root, detail, self.probe_s, self.root)

    def note_stored(self) -> None:
        """A store went through: the episode, if any, is over."""
        if self._until:
            self._clear()

    def _clear(self) -> None:
        with self._lock:
            ended = self._until != 0.0
            self._until = 0.0
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
