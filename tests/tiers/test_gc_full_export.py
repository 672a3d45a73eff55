"""A full export heals without anyone deleting a file: on a real size-capped tmpfs filled to
the last block (pages, then a filler), ``tierstore gc`` cannot write its lease (ENOSPC), unlinks
a few least recently used pages without it, takes it and runs its pass; a node whose stores
were skipped as "full" (its gc in another process) stores again within one probe interval.

Needs root (it mounts a tmpfs); under ``CI=true`` a skip fails the run (tests/conftest.py).
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from tiers_helpers import key, store

from tierstore.config import TierStoreConfig
from tierstore.fs import deadline
from tierstore.fs.lease import CLOCK_NAME, LEASE_NAME, server_now
from tierstore.metrics import MetricsRegistry
from tierstore.rootstore.engine import IOEngine
from tierstore.testing.pages import simple_namespace
from tierstore.tiers.tier import EngineTier

REPO = Path(__file__).resolve().parents[2]
EXPORT_BYTES = 1 << 20
PROBE_S = 1.0


@pytest.fixture
def full_export(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs, unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a size-capped tmpfs needs root")
    export = tmp_path / "export"
    export.mkdir()
    # a few inodes too, so a test can use the last of them up quickly
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={EXPORT_BYTES},nr_inodes=2048", "tmpfs", str(export)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield export
    finally:
        subprocess.run(["umount", "-l", str(export)], check=False)


def _fill(path: Path) -> None:
    """Write ``path`` until the file system refuses (ENOSPC): not one free block left."""
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\xff" * 4096)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc


def _gc(root: Path, max_bytes: int) -> tuple[int, dict, str]:
    """``tierstore gc ROOT --max-bytes N --json`` in its own process (as another node runs it)."""
    proc = subprocess.run([sys.executable, "-m", "tierstore", "gc", str(root), "--max-bytes", str(max_bytes),
                           "--json"], capture_output=True, text=True, timeout=120, cwd=REPO)
    docs = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return proc.returncode, docs[-1] if docs else {}, proc.stderr


@pytest.mark.parametrize("cap", ["half", "above_the_export"])
def test_gc_heals_a_full_export_and_stores_resume_within_one_probe(full_export: Path, cap: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """``cap`` half: the usual case, the cap below what filled the export; above the export: the
    cap was set larger than the export holds, so only the full export says evict."""
    monkeypatch.setattr(deadline, "FULL_PROBE_S", PROBE_S)
    root = full_export / "root"
    eng = IOEngine(root, simple_namespace("float16", tokens_per_chunk=16), 0,
                   config=TierStoreConfig(root=str(root), io_threads=2))
    tier = EngineTier("shared", eng, MetricsRegistry().tier("shared"), 16)
    try:
        stored = 0
        while (r := store(tier, key(stored))).ok:
            stored += 1
        assert r.error is not None and r.error.kind == "enospc", r.error
        _fill(full_export / "filler")
        assert tier.space is not None and tier.space.full
        full_at = time.monotonic()
        max_bytes = stored * 8192 // 2 if cap == "half" else 1 << 30
        rc, rep, err = _gc(root, max_bytes)
        gc_done = time.monotonic()
        print(json.dumps({"pages_stored": stored, "cap": max_bytes, "gc": rep}))
        # without the room pass: exit 8, "cannot write the lease ... No space left", evicted 0
        assert rc == 0 and rep.get("lease_problem") is None, (rc, rep, err)
        assert rep["room_evicted"] >= 1 and rep["evicted"] >= rep["room_evicted"], rep
        if cap == "half":
            assert rep["total_after"] <= max_bytes, rep
        assert not (root / LEASE_NAME).exists()  # released at the end of the pass
        # this process's tier was not told (gc ran elsewhere): its next trial store finds the room
        resumed = None
        i = stored
        while time.monotonic() - full_at < 60:
            i += 1
            if store(tier, key(i)).ok:
                resumed = time.monotonic()
                break
            time.sleep(0.05)
        assert resumed is not None, "stores never resumed"
        print(json.dumps({"seconds_from_enospc_to_first_store": round(resumed - full_at, 2)}))
        assert not tier.space.full
        # within one probe of the room being made (a trial is due at most PROBE_S after the last)
        assert resumed - gc_done <= PROBE_S + 1.0, resumed - gc_done
    finally:
        tier.close()


def test_the_servers_clock_is_read_on_a_full_export(full_export: Path) -> None:
    """A lease is judged by the server's clock; on a full export no probe byte fits, and the
    old code fell back to this node's clock exactly there. Now a file's times are set to the
    server's now (no space needed): the probe file itself when it could be created, else the
    kept clock file, which an earlier call on a healthy export created."""
    root = full_export / "root"
    root.mkdir()
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert server_now(root_fd) is not None  # healthy: the probe; the clock file kept
        assert (root / CLOCK_NAME).exists()
        _fill(full_export / "filler")
        before = time.time()
        now = server_now(root_fd)
        assert now is not None and before - 2 <= now <= time.time() + 2  # tmpfs: the server is this host
        assert [p.name for p in root.iterdir()] == [CLOCK_NAME]  # no probe file left behind
        while True:  # and with no inode left either: only the kept clock file answers
            try:
                (full_export / f"inode{time.monotonic_ns()}").touch()
            except OSError:
                break
        assert server_now(root_fd) is not None
    finally:
        os.close(root_fd)
