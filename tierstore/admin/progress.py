"""Progress bars of the CLI's long walks (fsck, stats, ls, gc, doctor): ``progress_bar``, one
tqdm style for all of them, and ``Progress``, the directory walk's bar with its counts.

Contract: a bar draws on stderr (or the stream given) and only when enabled, by default when
that stream is a terminal; disabled, every call is a no-op. tqdm is imported only when a bar is
made, so a library import stays light.

Threading: ``Progress.advance`` may be called from any thread (a lock: tqdm itself is not
thread-safe for concurrent updates); a bar from ``progress_bar`` belongs to one thread.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, TextIO

from tierstore.admin.render import human_bytes

# tqdm's default with one decimal of percentage: "fsck:  42.5%|####      | 17/40 [00:03<00:04, 5.6dir/s, ...]".
KNOWN_TOTAL_FORMAT = "{desc}: {percentage:5.1f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}{postfix}]"


class Progress:
    """The walk's progress bar on stderr (tqdm): fan-out directories done of all, with the rate
    and the time left (ETA), and files, bytes and problems seen; silent unless enabled
    (default: only when the stream is a terminal). ``total_dirs`` may be set after creation
    (the walk knows it once it has listed the namespaces). Threading: ``advance`` from any
    thread (a lock; tqdm itself is not thread-safe for concurrent updates)."""

    def __init__(self, label: str, stream: TextIO | None = None, enabled: bool | None = None):
        self.stream = stream or sys.stderr
        self.enabled = _is_terminal(self.stream) if enabled is None else enabled
        self.label = label
        self.dirs = 0
        self.files = 0
        self.nbytes = 0
        self.problems = 0
        self._lock = threading.Lock()
        self._bar = progress_bar(label, unit="dir", stream=self.stream, enabled=self.enabled)

    @property
    def total_dirs(self) -> int:
        return int(self._bar.total or 0)

    @total_dirs.setter
    def total_dirs(self, n: int) -> None:
        with self._lock:
            self._bar.total = n
            self._bar.bar_format = KNOWN_TOTAL_FORMAT
            self._bar.refresh()

    def advance(self, *, files: int = 0, nbytes: int = 0, dirs: int = 0, problems: int = 0) -> None:
        with self._lock:
            self.files += files
            self.nbytes += nbytes
            self.dirs += dirs
            self.problems += problems
            if self.enabled:
                self._bar.set_postfix_str(f"{self.files} files, {human_bytes(self.nbytes)}, "
                                          f"{self.problems} problems", refresh=False)
                self._bar.update(dirs)

    def close(self) -> None:
        with self._lock:
            self._bar.close()


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or fake stream
        return False


def progress_bar(label: str, *, total: int | None = None, unit: str = "it", stream: TextIO | None = None,
                 enabled: bool | None = None) -> Any:
    """A tqdm bar on ``stream`` (stderr): rate and ETA when ``total`` is known, the rate alone
    otherwise; disabled (every call a no-op) unless ``enabled``, by default when the stream is
    a terminal. Every long walk of the CLI (fsck, stats, ls, gc) draws through this one style."""
    from tqdm import tqdm  # imported only where a command runs: a library import stays light

    out = stream or sys.stderr
    on = _is_terminal(out) if enabled is None else enabled
    return tqdm(total=total, desc=label, unit=unit, file=out, disable=not on, leave=True, dynamic_ncols=True,
                mininterval=0.2, smoothing=0.1, bar_format=KNOWN_TOTAL_FORMAT if total else None)
