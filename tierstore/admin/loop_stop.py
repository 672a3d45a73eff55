"""LoopStop: how a ``--loop`` command (``tierstore gc``, on a directory or a bucket) stops on
SIGINT or SIGTERM: between passes, never inside one.

A gc pass is a run of bounded calls (file-system calls, S3 requests under their deadline), some
in libraries that hold locks or have requests in flight. A ``KeyboardInterrupt`` raised at any
bytecode of a pass can land inside one of them; an object gc loop once failed to exit within
60 s of SIGINT on a loaded CI worker. In a loop the first SIGINT or SIGTERM therefore only asks
it to stop: the pass in progress ends, its report is printed, and the command exits (SIGTERM:
0, a requested stop, as a service manager expects; SIGINT: 32, "interrupted", as before). A
second signal interrupts at once (``KeyboardInterrupt``), for an operator who will not wait.

Threading: enter and ``wait`` on the main thread (Python runs signal handlers there); elsewhere
the handlers are not installed and the loop stops only by the process's default actions.
"""

from __future__ import annotations

import signal
import sys
import threading
from types import FrameType
from typing import Any

from tierstore.admin.cli import EXIT_CANCELLED


class LoopStop:
    """The stop request of a ``--loop`` command; see the module docstring."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, command: str) -> None:
        self.command = command
        self.received: int | None = None  # the signal that asked the loop to stop
        self._event = threading.Event()
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> LoopStop:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._event.is_set():
            raise KeyboardInterrupt  # the second signal: now
        self.received = signum
        self._event.set()

    @property
    def requested(self) -> bool:
        return self._event.is_set()

    def wait(self, seconds: float) -> bool:
        """Sleep between passes; True (at once) when a stop was asked for."""
        return self._event.wait(max(0.0, seconds))

    def exit_status(self) -> int:
        """The status of a loop that stopped: 0 for SIGTERM, ``EXIT_CANCELLED`` for SIGINT;
        the reason is said on stderr."""
        name = signal.Signals(self.received).name if self.received is not None else "a signal"
        print(f"tierstore {self.command}: stopped by {name} after the pass in progress", file=sys.stderr, flush=True)
        return 0 if self.received == signal.SIGTERM else EXIT_CANCELLED
