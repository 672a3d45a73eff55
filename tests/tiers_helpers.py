"""Shared helpers for the tier and engine tests: store/load through any IOEngine-like object,
disk usage."""

from __future__ import annotations

import os
from pathlib import Path

from tierstore.store import IOResult
from tierstore.testing.pages import page_bytes, page_key

INDEX_DIR = ".tierstore"


def key(i: int, seed: int = 0) -> bytes:
    return page_key(i, seed=seed)


def expected(store, k: bytes) -> bytes:
    return page_bytes(store.layout, k)


def store_data(st, k: bytes, data: bytes, tokens: int = 16, timeout: float = 10.0):
    """Store ``data`` as page ``k`` through a staging slot; the IOResult."""
    slot = st.acquire_slot(timeout)
    assert slot is not None, "no staging slot"
    slot.view[:] = data
    jid = st.submit_store(k, slot, tokens)
    (r,) = st.wait([jid], timeout)
    return r


def store(st, k: bytes, tokens: int = 16, timeout: float = 10.0):
    return store_data(st, k, expected(st, k), tokens, timeout)


def load_page(st, k: bytes, timeout: float = 10.0) -> tuple[IOResult, bytes | None]:
    """(IOResult, page bytes or None); releases the slot."""
    res = st.wait([st.submit_load(k)], timeout)
    assert res, f"load of {k.hex()[:8]} did not complete within {timeout} s"
    r = res[0]
    data = None
    if r.slot is not None:
        data = bytes(r.slot.view)
        st.release_slot(r.slot)
    return r, data


def load(st, k: bytes, timeout: float = 10.0) -> tuple[bool, str | None, bytes | None]:
    """(ok, error kind, page bytes); releases the slot."""
    r, data = load_page(st, k, timeout)
    if not r.ok:
        return False, r.error.kind if r.error else None, None
    return True, None, data


def _sizes(root: str | os.PathLike[str]) -> dict[str, int]:
    """Size of every file under ``root`` except the index and manifests."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        if Path(dirpath) == Path(root) and INDEX_DIR in dirnames:
            dirnames.remove(INDEX_DIR)
        for n in filenames:
            if n == "manifest.json":
                continue
            path = os.path.join(dirpath, n)
            try:
                out[path] = os.stat(path).st_size
            except FileNotFoundError:
                continue
    return out


class DiskUsage:
    """Bytes on disk under ``root`` (pages and temp files; the local cap covers both, while
    ``manifest.json``, about 1 KiB per namespace, and the index are outside it).

    One walk is not a snapshot: a file written into a directory the walk has not reached yet
    and one evicted from a directory it already passed would both count. ``sample`` therefore
    counts only the files seen by this walk and the one before: each of them existed from its
    visit in the first walk to its visit in the second, so all of them existed together at the
    moment between the walks. The figure never exceeds the real usage at that moment.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = root
        self.last: dict[str, int] = {}

    def sample(self) -> tuple[int, int]:
        """(bytes, largest file) of the files present in both of the last two walks."""
        now = _sizes(self.root)
        both = [size for path, size in now.items() if path in self.last]
        self.last = now
        return sum(both), max(both, default=0)


def page_files(root: str | os.PathLike[str]) -> dict[str, int]:
    """Size of every page file under ``root``, by path relative to it."""
    return {os.path.relpath(p, root): size for p, size in _sizes(root).items() if p.endswith(".kvp")}
