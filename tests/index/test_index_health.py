"""The scheduler's index probes a down shared root with the worker's probe (a create the file
server must answer), so a client cache that still answers ``stat`` cannot bring it back up: no
hits are promised from a tier that is down."""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import pytest

from tierstore.fs import deadline
from tierstore.fs.mapper import FileMapper
from tierstore.index.indexed_lookup import IndexedLookup
from tierstore.testing.pages import fill_pages, simple_namespace


def test_a_down_root_that_still_answers_stat_stays_down_until_creates_work(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    ns = simple_namespace()
    root = tmp_path / "root"
    fill_pages(root, ns, pages_per_group=2)
    lookup = IndexedLookup([FileMapper(root, ns.digest, g, 0) for g in range(len(ns.groups))], refresh_s=0).start()
    real_open = os.open

    def server_gone(path: object, flags: int, mode: int = 0o777, **kw: object) -> int:
        if flags & os.O_CREAT and str(path).startswith(str(root)):
            raise OSError(errno.EIO, "server not responding", str(path))  # what a stopped server gives
        return real_open(path, flags, mode, **kw)  # type: ignore[arg-type]

    try:
        health = lookup.shared.health
        assert health is not None and lookup.shared_up
        with monkeypatch.context() as outage:
            outage.setattr(deadline.os, "open", server_gone)  # os.stat(root) still answers, as a cache does
            health.mark_down("a listing took longer than the deadline (test)")
            time.sleep(3 * health.interval_s + 0.5)  # three probes
            assert not lookup.shared_up and not health.up, health.changes
            assert health.transitions == 1  # down once, never back up on a cached stat
        end = time.monotonic() + 3 * health.interval_s + 2
        while not lookup.shared_up and time.monotonic() < end:
            time.sleep(0.05)
        assert lookup.shared_up and health.transitions == 2  # the server answers creates: up again
        assert [p.name for p in root.iterdir() if p.name.startswith(".tierstore-probe")] == []
    finally:
        lookup.close()
