"""Shared-tier gc on a plain directory: cap, LRU by touch stamp, lease, trash, temps, CLI."""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tierstore.admin import gc_command
from tierstore.format.identity import MANIFEST_NAME
from tierstore.fs.lease import LEASE_NAME, Lease
from tierstore.fs.mapper import FileMapper
from tierstore.testing.pages import fill_pages, simple_namespace
from tierstore.tiers import gc, gc_evict
from tierstore.tiers.gc_daemon import GcDaemon
from tierstore.tiers.gc_report import GcReport
from tierstore.tiers.gc_scan import TRASH_DIR

NS = simple_namespace()
REPO = Path(__file__).resolve().parents[2]


def pages(root: Path) -> dict[str, int]:
    out = {}
    for dirpath, _, files in os.walk(root / NS.digest):
        for n in files:
            if n.endswith(".kvp"):
                out[n] = os.stat(os.path.join(dirpath, n)).st_mtime_ns
    return out


def fill(root: Path, n: int) -> list[Path]:
    stored = fill_pages(root, NS, n)
    paths = []
    base = time.time() - 1000
    for i, p in enumerate(stored):
        path = FileMapper(root, NS.digest, p.group_index, p.rank).path_for(p.key)
        os.utime(path, (base + i, base + i))  # page i used at base + i
        paths.append(path)
    return paths


def test_gc_evicts_least_recently_touched_down_to_watermark(tmp_path: Path) -> None:
    paths = fill(tmp_path, 20)
    size = paths[0].stat().st_size
    # a hit on the two oldest pages refreshes their stamp (what readers do on a shared hit)
    for p in paths[:2]:
        os.utime(p)
    cap = 10 * size
    rep = gc.collect(tmp_path, cap, low_watermark=0.8)
    assert not rep.busy and rep.pages == 20
    assert rep.total_after <= cap * 0.8
    left = {p.name for p in paths if p.exists()}
    # evicted: the oldest untouched pages 2.., kept: the two touched ones and the newest
    assert paths[0].name in left and paths[1].name in left
    evicted = [p for p in paths if not p.exists()]
    assert evicted == paths[2 : 2 + len(evicted)]
    assert rep.evicted == len(evicted) > 0
    assert list((tmp_path / TRASH_DIR).iterdir()) == []  # grace 0: unlinked at once
    assert not (tmp_path / LEASE_NAME).exists()  # lease released


def test_gc_under_cap_does_nothing(tmp_path: Path) -> None:
    paths = fill(tmp_path, 5)
    rep = gc.collect(tmp_path, 1 << 30)
    assert rep.evicted == 0 and all(p.exists() for p in paths)


def test_gc_respects_a_live_lease_and_takes_an_expired_one(tmp_path: Path) -> None:
    fill(tmp_path, 5)
    other = Lease(tmp_path, ttl_s=30, settle_s=0)
    assert other.acquire()
    rep = gc.collect(tmp_path, 1, lease=Lease(tmp_path, settle_s=0))
    assert rep.busy and rep.evicted == 0
    # the other evictor died: its lease expires (ttl + skew) and we take over
    (tmp_path / LEASE_NAME).write_text(json.dumps({"owner": "dead:1:x", "expires": time.time() - 60}))
    rep = gc.collect(tmp_path, 1, lease=Lease(tmp_path, settle_s=0))
    assert not rep.busy and rep.evicted == 5


def test_lease_garbage_counts_as_absent_and_loser_detects_loss(tmp_path: Path) -> None:
    (tmp_path / LEASE_NAME).write_bytes(b"\x00garbage")
    a = Lease(tmp_path, settle_s=0, ttl_s=0.3)
    assert a.acquire()
    b = Lease(tmp_path, settle_s=0, ttl_s=0.3, skew_s=0)
    assert not b.acquire()
    time.sleep(0.35)
    assert b.acquire()  # a's lease expired
    assert not a.renew_if_due()  # a sees b's owner id and stops


def test_trash_grace_and_stale_temps(tmp_path: Path) -> None:
    paths = fill(tmp_path, 6)
    size = paths[0].stat().st_size
    tmp = paths[0].with_name(f".{'ab' * 16}.kvp.otherhost.4242.deadbeef.tmp")
    tmp.write_bytes(b"x" * 100)
    old = time.time() - 7200
    os.utime(tmp, (old, old))
    cap = 3 * size + 2000  # slack; the manifest (about 1 KiB) is metadata: it never counts
    rep = gc.collect(tmp_path, cap, low_watermark=1.0, trash_grace_s=30)
    assert rep.temps_removed == 1 and not tmp.exists()
    assert rep.evicted == 3
    trash = list((tmp_path / TRASH_DIR).iterdir())
    assert len(trash) == 3  # still there during the grace period
    rep2 = gc.collect(tmp_path, cap, low_watermark=1.0, trash_grace_s=0)
    assert rep2.trash_removed == 3 and rep2.evicted == 0
    assert list((tmp_path / TRASH_DIR).iterdir()) == []


def test_trash_grace_is_judged_by_the_servers_clock_not_the_evictors(tmp_path: Path) -> None:
    """A trash entry's name starts with its eviction time by the evicting node's clock; a node
    whose clock lagged by a day named it a day old. The sweep judges the grace by the time the
    server gave the rename (the entry's ctime) against the server's now: kept for the grace,
    swept after it (the old code swept it at once)."""
    paths = fill(tmp_path, 6)
    size = paths[0].stat().st_size
    gc.collect(tmp_path, 3 * size + 2000, low_watermark=1.0, trash_grace_s=30)
    trash = tmp_path / TRASH_DIR
    day_ago = time.time_ns() - 86400 * 10**9
    for entry in sorted(trash.iterdir()):
        entry.rename(trash / f"{day_ago}.{entry.name.split('.', 1)[1]}")  # as the lagging evictor named it
    rep = gc.collect(tmp_path, 10 * size, low_watermark=1.0, trash_grace_s=1.5)
    assert rep.trash_removed == 0 and len(list(trash.iterdir())) == 3
    time.sleep(1.6)
    rep = gc.collect(tmp_path, 10 * size, low_watermark=1.0, trash_grace_s=1.5)
    assert rep.trash_removed == 3 and list(trash.iterdir()) == []


def test_open_reader_keeps_whole_page_while_evicted(tmp_path: Path) -> None:
    paths = fill(tmp_path, 2)
    data = paths[0].read_bytes()
    with open(paths[0], "rb") as f:
        head = f.read(100)
        rep = gc.collect(tmp_path, 1, low_watermark=0.0)
        assert rep.evicted == 2 and not paths[0].exists()
        assert head + f.read() == data


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    paths = fill(tmp_path, 8)
    size = paths[0].stat().st_size
    parser = argparse.ArgumentParser()
    gc_command.add_arguments(parser)
    args = parser.parse_args([str(tmp_path), "--max-bytes", str(4 * size), "--json"])
    assert gc_command.run(args) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["evicted"] >= 4 and rep["total_after"] <= 4 * size
    assert rep["tierstore_gc"] == 2 and rep["started_at"].endswith("Z")  # a schema version, ISO times
    assert gc_command.parse_bytes("10G") == 10 << 30 and gc_command.parse_bytes("512MiB") == 512 << 20
    for bad in ("lots", "inf", "1e999", "1.5e9", "-5G", "0"):  # "inf" raised OverflowError (a traceback)
        with pytest.raises(argparse.ArgumentTypeError):
            gc_command.parse_bytes(bad)
    assert gc_command.run(parser.parse_args([str(tmp_path / "nope"), "--max-bytes", "1"])) == 8  # as fsck, ls, stats


@pytest.mark.parametrize("threads", [1, 8])
def test_batches_in_directory_order_still_evict_the_exact_lru_prefix(tmp_path: Path, threads: int,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gc_evict, "_EVICT_BATCH", 3)  # many batches, each reordered by directory
    paths = fill(tmp_path, 30)
    size = paths[0].stat().st_size
    os.utime(paths[4])  # hit since the fill: now the most recent, not a victim
    rep = gc.collect(tmp_path, 20 * size, low_watermark=0.5, lease=Lease(tmp_path, settle_s=0),
                     evict_threads=threads)
    evicted = [p for p in paths if not p.exists()]
    lru = [p for i, p in enumerate(paths) if i != 4]
    assert evicted == lru[: len(evicted)]  # exactly the least recently used, whatever the batching
    assert rep.evicted == len(evicted) and rep.total_after <= 10 * size


def test_eviction_costs_a_bounded_number_of_file_system_calls_per_page(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # 2,000 pages over the 256 fan-out directories (about 8 each). Per victim gc opens it once
    # (its re-check: an open revalidates NFS attributes, an lstat reads the client's cache) and
    # unlinks it once; directories are opened once per (batch, directory), never once per
    # victim from the root (it was 4 opens, 3 stats, a rename and an unlink per victim).
    stored = fill_pages(tmp_path, NS, 2000)
    fanouts = {FileMapper(tmp_path, NS.digest, p.group_index, p.rank).path_for(p.key).parent for p in stored}
    calls = {"open": 0, "stat": 0, "unlink": 0, "rename": 0}

    def counting(name: str, real):  # type: ignore[no-untyped-def]
        def call(*a, **kw):  # type: ignore[no-untyped-def]
            calls[name] += 1
            return real(*a, **kw)
        return call

    for name in calls:
        monkeypatch.setattr(os, name, counting(name, getattr(os, name)))
    rep = gc.collect(tmp_path, 1, low_watermark=0.0, lease=Lease(tmp_path, settle_s=0))
    assert rep.evicted == 2000 and rep.vanished == rep.skipped_recent == 0
    assert calls["unlink"] <= rep.evicted + 2  # + the lease file
    assert calls["rename"] <= 2  # the lease only: grace 0 unlinks at the page's place
    assert calls["stat"] <= 20  # the lease's: a victim's attributes come from an fstat of its open
    # the walk opens each directory once, eviction once per directory and batch (4 levels deep),
    # and each victim once
    assert calls["open"] <= rep.evicted + 5 * len(fanouts) + 50, calls


def _tree(root: Path) -> dict[str, tuple[int, int, int]]:
    """Every entry under ``root`` (hidden ones too): (inode, size, mtime_ns)."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for n in dirs + files:
            st = os.lstat(os.path.join(dirpath, n))
            out[os.path.relpath(os.path.join(dirpath, n), root)] = (st.st_ino, st.st_size, st.st_mtime_ns)
    return out


@pytest.mark.parametrize("grace", [0.0, 30.0])
def test_a_dry_run_changes_nothing_and_predicts_the_real_pass(tmp_path: Path, grace: float,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Over its cap, with a stale temp and (second pass) old trash: the dry run leaves every
    entry as it was (no lease, no trash directory created) and reports exactly what the real
    pass then does."""
    paths = fill(tmp_path, 12)
    size = paths[0].stat().st_size
    tmp = paths[0].with_name(f".{'ab' * 16}.kvp.otherhost.4242.deadbeef.tmp")
    tmp.write_bytes(b"x" * 100)
    os.utime(tmp, (time.time() - 7200,) * 2)
    cap = 5 * size
    plans = []
    for _ in range(2):  # the second pass finds the first one's trash (grace 30: kept; the pass after: due)
        before = _tree(tmp_path)
        plan = gc.collect(tmp_path, cap, low_watermark=0.8, trash_grace_s=grace, dry_run=True)
        assert _tree(tmp_path) == before, "the dry run changed the tree"
        assert plan.dry_run and not plan.refused
        plans.append(plan)
        real = gc.collect(tmp_path, cap, low_watermark=0.8, trash_grace_s=grace)
        for field in ("pages", "evicted", "evicted_bytes", "temps_removed", "trash_removed", "total_before",
                      "total_after"):
            assert getattr(plan, field) == getattr(real, field), field
        grace = 0.0
    assert plans[0].evicted > 0 and plans[0].temps_removed == 1
    assert plans[1].trash_removed == (plans[0].evicted if plans[0].trash_bytes else 0)
    parser = argparse.ArgumentParser()
    gc_command.add_arguments(parser)
    assert gc_command.run(parser.parse_args([str(tmp_path), "--max-bytes", "1", "--dry-run"])) == 0
    assert "nothing changed" in capsys.readouterr().out


def test_gc_refuses_a_directory_that_is_not_a_cache(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    home = tmp_path / "home"
    (home / "alice").mkdir(parents=True)
    (home / "alice" / "thesis.tex").write_text("years of work")
    rep = gc.collect(home, 1)
    assert rep.refused and "not a cache" in rep.refused and rep.evicted == 0
    assert sorted(os.listdir(home)) == ["alice"]  # no lease, no trash written there
    parser = argparse.ArgumentParser()
    gc_command.add_arguments(parser)
    assert gc_command.run(parser.parse_args([str(home), "--max-bytes", "1"])) == 8
    err = capsys.readouterr().err
    assert "refusing" in err and "root" in err
    empty = tmp_path / "empty"  # a cache not written yet is fine
    empty.mkdir()
    assert not gc.collect(empty, 1).refused
    # ... also while tierstore's own entries are all it holds: a down tier's probe file (the
    # tier went down before its engine made the namespace directory), the format marker
    (empty / ".tierstore-probe-0123abcd").write_bytes(b"")
    (empty / ".tierstore-format").write_text('{"format": 1, "layouts": ["rank_dirs"], "writer": "tierstore"}')
    assert not gc.collect(empty, 1).refused


def _gc_process(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``tierstore gc ROOT`` as an operator runs it: its own process, Python's default logging
    (a library warning reaches stderr, which pytest's log capture hides in-process)."""
    return subprocess.run([sys.executable, "-m", "tierstore", "gc", str(root), "--max-bytes", "1G", *args],
                          capture_output=True, text=True, timeout=120, cwd=REPO)


def test_a_refusal_is_said_once_and_a_healthy_cache_says_nothing_on_stderr(tmp_path: Path) -> None:
    """Run as a process: a directory that is not a cache gets one stderr line (the CLI's,
    naming what to do; the library no longer warns as well) and exit 8; a healthy cache
    (pages, its manifest, a format marker) gets a result on stdout and nothing on stderr."""
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("not pages")
    for extra in ([], ["--json"]):
        proc = _gc_process(notes, *extra)
        assert proc.returncode == 8, proc
        assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("tierstore gc: refusing "), proc.stderr
        assert "not a cache" in proc.stderr and "pass the directory" in proc.stderr
    healthy = tmp_path / "cache"
    fill(healthy, 3)
    (healthy / ".tierstore-format").write_text('{"format": 1, "layouts": ["rank_dirs"], "writer": "tierstore"}')
    for extra in ([], ["--json"]):
        proc = _gc_process(healthy, *extra)
        assert proc.returncode == 0 and proc.stdout.strip() and proc.stderr == "", proc


def test_own_metadata_is_not_foreign_and_real_foreign_files_still_warn(tmp_path: Path,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    """A namespace's manifest is tierstore's own file (as fsck sees it): counted in
    metadata_bytes, no warning, never toward the cap; a stray file there is foreign: counted
    in other_bytes and warned about once, naming fsck."""
    paths = fill(tmp_path, 4)
    manifest = tmp_path / NS.digest / MANIFEST_NAME
    caplog.set_level(logging.WARNING, logger="tierstore.tiers.gc")
    rep = gc.collect(tmp_path, 1 << 30)
    assert rep.metadata_bytes == manifest.stat().st_size > 0 and rep.other_bytes == 0
    assert rep.total_before == rep.page_bytes == sum(p.stat().st_size for p in paths)
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    (tmp_path / NS.digest / "stray.bin").write_bytes(b"x" * 123)
    (paths[0].parent / MANIFEST_NAME).write_bytes(b"{}")  # a manifest's name out of its place: foreign
    rep = gc.collect(tmp_path, 1 << 30)
    assert rep.other_bytes == 125 and rep.metadata_bytes == manifest.stat().st_size
    assert rep.total_before == rep.page_bytes  # neither counts toward the cap
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert "125 bytes" in warning and "tierstore fsck" in warning
    doc = gc_command.report_json(rep)
    assert doc["tierstore_gc"] == 2 and doc["metadata_bytes"] == rep.metadata_bytes  # an added field: same version


def _run_daemon(root: Path, max_bytes: int, done: Callable[[GcDaemon], bool]) -> GcDaemon:
    """A background gc daemon on ``root`` passing every 10 ms until ``done(daemon)`` (at most
    30 s), then stopped."""
    daemon = GcDaemon(str(root), max_bytes, interval_s=0.01)
    daemon._thread.start()
    try:
        end = time.monotonic() + 30
        while not done(daemon) and time.monotonic() < end:
            time.sleep(0.01)
    finally:
        daemon.stop()
        daemon._thread.join(10)
    return daemon


def test_the_daemon_says_a_refusal_the_library_only_returns(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """collect logs a refusal at debug (its caller says it); the background daemon, which has
    no caller to print it, logs it as a warning."""
    (tmp_path / "todo.txt").write_text("not pages")
    caplog.set_level(logging.DEBUG, logger="tierstore.tiers.gc")
    assert gc.collect(tmp_path, 1).refused
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    daemon = _run_daemon(tmp_path, 1, lambda _: any(r.levelno >= logging.WARNING for r in caplog.records))
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert daemon.runs >= 1 and warnings and all("not a cache" in w and str(tmp_path) in w for w in warnings)


def test_an_unsafe_entry_is_said_once_by_the_cli_and_once_by_the_daemon(tmp_path: Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    """A symlinked fan-out directory is never followed; the gc command prints it once (its
    "refused" line on stdout, no library warning on stderr); the background daemon, which has
    no caller to print it, warns once while it stands, not on every pass."""
    paths = fill(tmp_path, 2)
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.mkdir()
    fan = paths[0].parent
    (fan.parent / "zz").symlink_to(outside, target_is_directory=True)
    proc = _gc_process(tmp_path)
    assert proc.returncode == 0 and proc.stderr == "", proc
    refused = [line for line in proc.stdout.splitlines() if "refused" in line]
    assert len(refused) == 1 and "zz" in refused[0] and "symlink" in refused[0], proc.stdout
    caplog.set_level(logging.DEBUG, logger="tierstore.tiers.gc")
    daemon = _run_daemon(tmp_path, 1 << 30, lambda d: d.runs >= 5)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert daemon.runs >= 5 and len(warnings) == 1 and "zz" in warnings[0] and "fsck" in warnings[0], warnings


def test_a_loop_outlives_a_pass_that_fails_on_the_file_system(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """`gc --loop` whose pass raises OSError (EIO: a soft NFS mount timing out) says it on
    stderr and as a JSON line with ``retry_in_s``, counts an error pass, and goes on to the next
    pass, which evicts; a single pass still ends with exit 8 (cli.main's operational error)."""
    from prometheus_client.parser import text_string_to_metric_families

    from tierstore.admin import cli

    fill(tmp_path / "root", 6)
    prom = tmp_path / "gc.prom"
    real_pass, calls = gc_command.one_pass, []

    def flaky_pass(*args: object) -> GcReport:
        calls.append(1)
        if len(calls) == 1:
            raise OSError(5, "Input/output error", str(tmp_path / "root"))
        if len(calls) == 3:
            raise KeyboardInterrupt  # the operator's ^C ends the loop
        return real_pass(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(gc_command, "one_pass", flaky_pass)
    argv = ["gc", str(tmp_path / "root"), "--max-bytes", "1", "--json", "--metrics-textfile", str(prom)]
    assert cli.main([*argv, "--loop", "0.01"]) == 32
    out, err = capsys.readouterr()
    failed, passed = (json.loads(line) for line in out.splitlines())
    assert "Input/output error" in failed["error"] and failed["retry_in_s"] == 0.01, failed
    assert passed["evicted"] == 6 and "error" not in passed, passed
    assert err.count("a pass failed") == 1 and "trying again" in err, err
    runs = {s.labels["result"]: s.value for fam in text_string_to_metric_families(prom.read_text())
            for s in fam.samples if s.name == "tierstore_gc_runs_total"}
    assert runs["error"] == 1 and runs["ok"] == 1, runs
    calls.clear()
    assert cli.main(argv) == 8  # one pass: the error is the command's result
    assert "Input/output error" in capsys.readouterr().err


def test_an_unreadable_format_marker_fails_the_pass_a_foreign_one_refuses(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A marker the file system does not hand over (EIO) is no verdict on the root: the pass
    raises and a loop tries again; a marker that is not tierstore's (a symlink) is a refusal."""
    from tierstore.fs import mapper

    root = tmp_path / "root"
    fill(root, 2)
    (root / ".tierstore-format").symlink_to(tmp_path / "elsewhere")
    assert "symlink" in (gc.collect(root, 1 << 30).refused or "")
    (root / ".tierstore-format").unlink()

    def eio(_root: object) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(mapper, "read_format_marker", eio)
    with pytest.raises(OSError, match="Input/output error"):
        gc.collect(root, 1 << 30)


def test_probe_and_lease_files_left_behind_are_removed_once_old(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A health probe or a lease clock probe whose unlink failed (a soft mount's timeout, a
    killed process) is removed by gc once older than its temp age, at the root and in a group
    directory (the head-slice fallback probes there), and never counted as foreign bytes;
    younger ones are kept (their writer may still be about to unlink them)."""
    import errno

    from tierstore.fs import deadline, safefs
    from tierstore.fs import lease as lease_mod

    fill_pages(tmp_path, NS, pages_per_group=2)
    group_dir = tmp_path / NS.digest / "g0"

    def unlink_times_out(*a: object, **k: object) -> None:
        raise OSError(errno.EIO, "the server did not answer the unlink")

    before = set(tmp_path.rglob(".tierstore*"))
    with monkeypatch.context() as soft_mount:  # the real writers, their unlinks failing
        soft_mount.setattr(deadline.os, "unlink", unlink_times_out)
        soft_mount.setattr(lease_mod.os, "unlink", unlink_times_out)
        for where in (tmp_path, group_dir, group_dir):
            with pytest.raises(OSError):
                deadline.probe_root(where)
        root_fd = safefs.open_root(tmp_path)
        try:
            assert lease_mod.server_now(root_fd) is not None
        finally:
            os.close(root_fd)
    left = sorted(set(tmp_path.rglob(".tierstore*")) - before - {tmp_path / lease_mod.CLOCK_NAME})  # kept: not a leftover
    assert len(left) == 4, left
    fresh, *old = left
    for path in old:
        os.utime(path, (time.time() - 7200, time.time() - 7200))
    rep = gc.collect(tmp_path, max_bytes=1 << 40, temp_max_age_s=3600)
    assert not any(p.exists() for p in old) and fresh.exists()
    assert rep.temps_removed == len(old) and rep.other_bytes == 0, rep
    assert (tmp_path / lease_mod.CLOCK_NAME).exists()  # the clock file is not swept


def test_a_silly_renamed_file_at_the_root_does_not_make_it_foreign(tmp_path: Path) -> None:
    """An NFS or FUSE client leaves ``.nfs*`` / ``.fuse_hidden*`` in place of a file replaced
    while open (the lease, read by one node while another renamed its new lease over it): gc
    still takes the root for a cache (before: "not a cache directory", and the gc loop exited;
    seen with two sshfs mounts under load)."""
    (tmp_path / ".fuse_hidden0000000a00000001").write_text("{}")
    (tmp_path / ".nfs000000000012345600000001").write_text("{}")
    rep = gc.collect(tmp_path, max_bytes=1 << 30)
    assert rep.refused is None, rep.refused


def test_the_recheck_before_evicting_reads_the_servers_attributes(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A page another node stamped after this gc's scan is not evicted even when this client's
    attribute cache still has its old mtime (an NFS client answers ``lstat`` from it for up to
    60 s): the recheck opens the victim, which revalidates (close-to-open), and the next page in
    LRU order goes instead. The cache is played here by an ``lstat`` that returns the attributes
    from before the stamp."""
    fill_pages(tmp_path, NS, pages_per_group=2)
    files = sorted(p for p in (tmp_path / NS.digest).rglob("*.kvp") if "/g0/" in str(p))
    hot, cold = files[0], files[1]
    now = time.time()
    os.utime(hot, (now - 7200, now - 7200))  # by its stamp the hot page is the LRU victim...
    os.utime(cold, (now - 3600, now - 3600))
    cached = {hot.name: os.lstat(hot)}
    real_lstat = gc.safefs.lstat_at

    def stale_lstat(name: str, dir_fd: int) -> os.stat_result:
        return cached.get(name) or real_lstat(name, dir_fd)

    monkeypatch.setattr(gc.safefs, "lstat_at", stale_lstat)
    monkeypatch.setattr(gc, "_after_scan_hook", lambda: os.utime(hot))  # ...but another node hits it now
    others = sum(p.stat().st_size for p in (tmp_path / NS.digest).rglob("*.kvp")) - hot.stat().st_size
    rep = gc.collect(tmp_path, max_bytes=others, low_watermark=1.0)
    assert hot.exists() and not cold.exists(), rep
    assert rep.skipped_recent == 1, rep


def test_a_pass_whose_lease_was_taken_over_says_so(tmp_path: Path) -> None:
    """A pass starved past its lease's ttl between renewals: another node takes the expired lease
    and the pass ends before its next renewal. It must report ``lease_lost`` (its span overlapped
    the other's) and leave the other's lease in place (before: it reported a clean pass)."""
    fill(tmp_path, 5)

    class TakenOver(Lease):
        def acquire(self) -> bool:
            ok = super().acquire()
            if ok:  # another node's write, as if ours had expired unrenewed
                (tmp_path / LEASE_NAME).write_text(json.dumps({"owner": "other:1:x", "expires": time.time() + 60}))
            return ok

    rep = gc.collect(tmp_path, 1, lease=TakenOver(tmp_path, settle_s=0, ttl_s=3600))
    assert rep.lease_lost and not rep.busy
    assert json.loads((tmp_path / LEASE_NAME).read_text())["owner"] == "other:1:x"
    assert gc.collect(tmp_path, 1, lease=Lease(tmp_path, settle_s=0)).busy  # the other's lease is live
