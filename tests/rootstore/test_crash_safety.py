"""Crash safety: writers killed with SIGKILL at random moments never leave a torn page.

A helper process imports tierstore once, then forks writer children that store pages in a
loop through IOEngine (two groups: a 1 MiB attention page, aligned, and a Mamba page whose
payload is not a multiple of 4096, so O_DIRECT padding + truncate is exercised) and kills
each one with SIGKILL after a random delay. Afterwards every file under a final name must
verify completely and hold exactly the bytes its key stands for; everything else must be a
temp file that fsck recognizes, reports as stale and removes. Page temps named after a killed
writer's pid show that kills landed while a store was in progress (a kill between stores
leaves none), so the check above covered interrupted stores, not only finished ones.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tierstore.admin.fsck import FsckOptions, run_fsck
from tierstore.format.header import PageExpectation
from tierstore.format.identity import MANIFEST_NAME
from tierstore.format.page_layout import zero_gaps
from tierstore.fs.mapper import FORMAT_MARKER_TEMP_RE, locate, parse_temp_name
from tierstore.rootstore.page_read import inspect_page, read_page
from tierstore.testing.pages import hybrid_namespace

KILLS = 24
GROUPS = (0, 2)


def crash_namespace():  # noqa: ANN201 - also imported by the writer script
    return hybrid_namespace(tokens_per_chunk=128, num_kv_heads=4, head_size=64, conv_dim=1001)


def pattern(key: bytes, group: int, n: int) -> bytes:
    """The bytes a page of ``key`` holds: cheap to make, different per key and group."""
    block = hashlib.sha256(key + bytes([group])).digest()
    data = bytearray((block * (n // len(block) + 1))[:n])
    layout = crash_namespace().groups[group].layout
    if n == layout.nbytes:
        zero_gaps(layout, data)  # a page's alignment gaps are zero (canonical bytes, format 3)
    return bytes(data)


WRITER = textwrap.dedent(
    """
    import json, os, random, signal, sys, time
    sys.path.insert(0, {tests!r})
    from test_crash_safety import GROUPS, crash_namespace, pattern
    from tierstore.native import loader as native
    from tierstore.config import TierStoreConfig
    from tierstore.rootstore.engine import IOEngine
    from tierstore.testing.pages import page_key

    root, kills, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    ns = crash_namespace()
    rng = random.Random(seed)
    # Warm up everything the children use once here (forked children inherit it).
    IOEngine(root, ns, GROUPS[0], config=TierStoreConfig(root=root, io_threads=1), staging_slots=1).close()
    native.start(wait=True)  # the compile too: forks then neither wait for it nor race it

    def child(k):
        cfg = TierStoreConfig(root=root, io_threads=2)
        engines = [IOEngine(root, ns, g, config=cfg, staging_slots=4) for g in GROUPS]
        crng = random.Random(seed * 1000 + k)
        os.write(1, b"R")  # ready: the kill lands during stores, not during start-up
        while True:
            key = page_key(crng.randrange(600))
            for g, eng in zip(GROUPS, engines):
                slot = eng.acquire_slot(timeout=None)
                slot.view[:] = pattern(key, g, len(slot.view))
                eng.submit_store(key, slot, 128)
                eng.poll()

    delays, startup, killed = [], [], []
    for k in range(kills):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            os.dup2(w, 1)
            try:
                child(k)
            finally:
                os._exit(1)
        os.close(w)
        t_ready = time.monotonic()
        os.read(r, 1)
        startup.append(time.monotonic() - t_ready)
        os.close(r)
        delay = rng.uniform(0.01, 0.15)
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
        delays.append(delay)
        killed.append(pid)
    print(json.dumps({{"kills": len(delays), "seconds_writing": sum(delays), "seconds_startup": sum(startup),
                      "pids": killed}}))
    """
)


@pytest.mark.slow
def test_sigkilled_writers_leave_no_torn_page(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    script = tmp_path / "writer.py"
    script.write_text(WRITER.format(tests=str(Path(__file__).parent)))
    proc = subprocess.run([sys.executable, str(script), str(root), str(KILLS), "7"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["kills"] == KILLS >= 20
    killed_pids = set(summary["pids"])

    ns = crash_namespace()
    pages = temps = 0
    mid_store: set[str] = set()  # page temps of killed writers: a kill between a temp's create and its rename
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            path = Path(dirpath) / name
            if name == MANIFEST_NAME:
                assert path.parent == root / ns.digest
                continue
            if path == root / ".tierstore-format":  # the root's format marker (fs/mapper.py)
                continue
            if path.parent == root and FORMAT_MARKER_TEMP_RE.match(name):  # the marker's temp, killed
                temps += 1  # before its rename (the marker is published by rename: never torn)
                continue
            if name.endswith(".kvp"):
                where = locate(root, path)
                assert where is not None and where.namespace == ns.digest, path
                header = inspect_page(path)  # never torn: every checksum and the size agree
                layout = ns.groups[where.group_index].layout
                out = bytearray(layout.nbytes)
                expect = PageExpectation(ns.digest_bytes, where.key, where.group_index, 0, layout)
                read_page(path, expect, memoryview(out))
                assert bytes(out) == pattern(where.key, where.group_index, layout.nbytes)
                assert header.file_size == path.stat().st_size
                pages += 1
            else:
                temp = parse_temp_name(name)
                assert temp is not None or name.startswith(".odirect-probe."), path
                if temp is not None and temp.pid in killed_pids:
                    mid_store.add(str(path))
                temps += 1
    assert pages > 20, "the writers stored too little to make the test meaningful"
    # Without a kill inside a store, the torn-page checks above would only have seen finished
    # stores. A store is most of a writer's loop, so most of the kills land inside one.
    assert mid_store, f"no kill landed while a store was in progress ({temps} temps)"

    report = run_fsck(FsckOptions(root=root, jobs=2, progress=False))
    counts = report.counts()
    assert counts["pages_ok"] == pages
    assert {p.category for p in report.problems} <= {"stale_temp"}, report.format_text()
    # A temp whose writer pid was reused by a live process counts as in flight, not stale.
    assert len(report.problems) + counts["temps_active"] == temps
    # Such a reuse is rare: the temps of the killed stores are what fsck reports as stale.
    assert mid_store & {p.path for p in report.problems}, report.format_text()
    if report.problems:
        repaired = run_fsck(FsckOptions(root=root, repair=True, jobs=2, progress=False))
        assert repaired.exit_code == 1 and repaired.left == 0
    if counts["temps_active"] == 0:
        assert run_fsck(FsckOptions(root=root, jobs=2, progress=False)).exit_code == 0
