"""Shared helpers for the tier tests: store/load through any IOEngine-like object, disk usage."""

from __future__ import annotations

import os
from pathlib import Path

from tierstore.testing.pages import page_bytes, page_key

INDEX_DIR = ".tierstore"


def key(i: int, seed: int = 0) -> bytes:
    return page_key(i, seed=seed)


def expected(store, k: bytes) -> bytes:
    return page_bytes(store.layout, k)


def store(st, k: bytes, tokens: int = 16, timeout: float = 10.0):
    slot = st.acquire_slot(timeout)
    assert slot is not None, "no staging slot"
    slot.view[:] = expected(st, k)
    jid = st.submit_store(k, slot, tokens)
    (r,) = st.wait([jid], timeout)
    return r


def load(st, k: bytes, timeout: float = 10.0) -> tuple[bool, str | None, bytes | None]:
    """(ok, error kind, page bytes); releases the slot."""
    jid = st.submit_load(k)
    res = st.wait([jid], timeout)
    assert res, f"load of {k.hex()[:8]} did not complete within {timeout} s"
    r = res[0]
    if not r.ok:
        return False, r.error.kind if r.error else None, None
    data = bytes(r.slot.view)
    st.release_slot(r.slot)
    return True, None, data


def disk_usage(root: str | os.PathLike[str]) -> tuple[int, int]:
    """(bytes, largest file) of every file under ``root`` except the index and manifests.

    The local cap covers pages and temp files; ``manifest.json`` (about 1 KiB per namespace)
    and the index are outside it.
    """
    total = largest = 0
    for dirpath, dirnames, filenames in os.walk(root):
        if Path(dirpath) == Path(root) and INDEX_DIR in dirnames:
            dirnames.remove(INDEX_DIR)
        for n in filenames:
            if n == "manifest.json":
                continue
            try:
                s = os.stat(os.path.join(dirpath, n)).st_size
            except FileNotFoundError:
                continue
            total += s
            largest = max(largest, s)
    return total, largest


def page_files(root: str | os.PathLike[str]) -> dict[str, int]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        if Path(dirpath) == Path(root) and INDEX_DIR in dirnames:
            dirnames.remove(INDEX_DIR)
        for n in filenames:
            if n.endswith(".kvp"):
                p = os.path.join(dirpath, n)
                out[os.path.relpath(p, root)] = os.stat(p).st_size
    return out
