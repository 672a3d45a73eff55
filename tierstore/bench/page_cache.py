"""The page cache for benchmarks and the demo: drop it (cold reads) or fill it (warm reads).

- ``CacheDropper(method)``: ``drop(paths)`` evicts the page cache. ``method="auto"`` uses
  ``/proc/sys/vm/drop_caches`` (the whole cache: needs root) when it can be written, else
  ``posix_fadvise(DONTNEED)`` of ``paths`` only (after an fsync: only clean pages drop);
  ``"fadvise"`` always uses the latter. ``drops_everything`` says which one is in use: a caller
  that needs the whole cache cold (a GPU pipeline without a file list) checks it.
- ``prime(paths, threads)``: read every file once, buffered, so its pages are cached.

Failure policy: an ``OSError`` of drop/prime (a file removed under us) propagates; only the
probe of ``drop_caches`` is silent (it decides the method). Threading: ``prime`` uses its own
threads; a dropper may be shared (it holds no state besides the method).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

_DROP_CACHES = "/proc/sys/vm/drop_caches"


class CacheDropper:
    """Drop the page cache of given files: drop_caches when permitted, else fadvise."""

    def __init__(self, method: str = "auto") -> None:
        self.method = "fadvise"
        if method == "fadvise":
            return
        try:
            with open(_DROP_CACHES, "w") as f:
                f.write("1\n")
            self.method = "drop_caches"
        except OSError:
            pass

    @property
    def drops_everything(self) -> bool:
        return self.method == "drop_caches"

    def drop(self, paths: Sequence[Path | str] = ()) -> None:
        if self.method == "drop_caches":
            os.sync()  # only clean pages drop
            with open(_DROP_CACHES, "w") as f:
                f.write("3\n")
            return
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def prime(paths: Sequence[Path | str], threads: int) -> None:
    """Read every file once, buffered, so that its pages are in the page cache."""

    def one(p: Path | str) -> None:
        with open(p, "rb", buffering=0) as f:
            while f.read(8 << 20):
                pass

    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(one, paths))
