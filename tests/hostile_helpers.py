"""Shared pieces of the hostile-root tests (issue 17, tests/test_hostile_*.py): a sentinel
directory outside the root that no operation may touch, its snapshot, a hang guard, a directory
swapped for a link, a deep directory chain, a peak-allocation probe and a zstd bomb.

The ``sentinel`` fixture reaches the tests through tests/conftest.py, which imports it.
Threading: ``within`` runs its function in one daemon
thread; everything else runs in the caller's thread.
"""

from __future__ import annotations

import contextlib
import os
import stat
import threading
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
import zstandard

T = TypeVar("T")

SENTINEL_FILES = 3


@pytest.fixture
def sentinel(tmp_path: Path) -> Path:
    """A directory outside the root holding ``precious{i}.kvp`` files with old, known mtimes."""
    d = tmp_path / "outside"
    d.mkdir()
    for i in range(SENTINEL_FILES):
        (d / f"precious{i}.kvp").write_bytes(b"do not touch %d" % i)
        os.utime(d / f"precious{i}.kvp", (1_000_000 + i, 1_000_000 + i))
    return d


def snapshot(d: Path) -> dict[str, tuple[bytes | None, int]]:
    """Name -> (content, mtime) of every entry directly in ``d`` (content None for anything but
    a regular file; links are not followed): a write, a new entry or a touch there changes it."""
    out: dict[str, tuple[bytes | None, int]] = {}
    for p in sorted(d.iterdir()):
        st = p.lstat()
        out[p.name] = (p.read_bytes() if stat.S_ISREG(st.st_mode) else None, st.st_mtime_ns)
    return out


def within(seconds: float, fn: Callable[[], T]) -> T:
    """Run ``fn`` in a thread; fail (a hang) if it does not return in time."""
    box: dict[str, object] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
            box["error"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"hung for more than {seconds} s"
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box.get("value")  # type: ignore[return-value]


def traced_peak(fn: Callable[[], T]) -> tuple[T, int]:
    """``fn``'s result and the peak of Python allocations while it ran."""
    tracemalloc.start()
    try:
        value = fn()
        return value, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@contextlib.contextmanager
def nested_dirs(top: Path, depth: int) -> Iterator[None]:
    """``depth`` nested directories named ``d`` under ``top``, removed on exit (made and removed
    relative to directory fds: their paths exceed PATH_MAX, and pytest's own cleanup of
    tmp_path would recurse too deep)."""
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir("d", dir_fd=fd)
            nfd = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nfd
    finally:
        os.close(fd)
    try:
        yield
    finally:
        fds = [os.open(top, os.O_RDONLY | os.O_DIRECTORY)]
        for _ in range(depth - 1):
            fds.append(os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fds[-1]))
        for fd in reversed(fds):
            os.rmdir("d", dir_fd=fd)
            os.close(fd)


def zstd_bomb(declared: int) -> bytes:
    """A zstd frame of a few KiB that declares (and decodes to) ``declared`` zero bytes."""
    co = zstandard.ZstdCompressor(level=1, write_content_size=True).compressobj(size=declared)
    zeros = bytes(1 << 20)
    return b"".join([*(co.compress(zeros) for _ in range(declared >> 20)), co.flush()])


def swap_for_link(d: Path, target: Path, aside: str = "moved") -> Path:
    """Move ``d`` aside to its sibling ``aside`` and put a symlink to ``target`` in its place
    (a directory swapped under a walker); the moved directory's new path."""
    moved = d.with_name(aside)
    os.rename(d, moved)
    d.symlink_to(target)
    return moved


def fsck_per_page(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep fsck on its per-page path, for a test that instruments its per-page steps
    (``open_page``, ``PageVerifier._verify_fd``) which the batched native path does not take."""
    from tierstore.admin.fsck_batch import NativeBatch

    monkeypatch.setattr(NativeBatch, "ready", staticmethod(lambda: False))
