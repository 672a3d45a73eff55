"""The one stale-temp rule (tierstore.fs.stale_temps): never a live writer's temp, always a dead one's."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tierstore.fs.mapper import FileMapper, host_tag
from tierstore.fs.stale_temps import TempWriter, sweep_stale_temps, temp_writer, writer_gone


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _temp(d: Path, host: str, pid: int, key: str = "ab" * 16, age_s: float = 0.0) -> Path:
    p = d / f".{key}.kvp.{host}.{pid}.0123456789ab.tmp"
    p.write_bytes(b"x" * 100)
    if age_s:
        t = time.time() - age_s
        os.utime(p, (t, t))
    return p


def test_names_of_all_four_temp_kinds_parse() -> None:
    assert temp_writer(f".{'ab' * 8}.kvp.{host_tag()}.123.abcdef.tmp") == TempWriter(host_tag(), 123)
    assert temp_writer(".manifest.json.node-7.42.0a1b2c3d.tmp") == TempWriter("node-7", 42)
    assert temp_writer(".odirect-probe.99.140000.tmp") == TempWriter(None, 99)
    assert temp_writer(".tierstore-format.node-7.43.0a1b2c3d4e5f.tmp") == TempWriter("node-7", 43)
    for other in ("abcd.kvp", "notes.tmp", ".nfs000123", "manifest.json"):
        assert temp_writer(other) is None
    # the temp name a mapper writes is recognised with this process as the writer
    name = FileMapper("/r", "0" * 32, 0).temp_path_for(b"\x01" * 16).name
    assert temp_writer(name) == TempWriter(host_tag(), os.getpid())


def test_same_host_live_writer_is_never_gone_whatever_the_grace() -> None:
    gone, why = writer_gone(TempWriter(host_tag(), os.getpid()), time.time(), grace_s=0, now=time.time() + 86400)
    assert not gone and "alive" in why


def test_same_host_dead_writer_is_gone_at_once() -> None:
    gone, _ = writer_gone(TempWriter(host_tag(), _dead_pid()), time.time(), grace_s=3600)
    assert gone


def test_reused_pid_counts_as_gone() -> None:
    # our pid is alive, but this process started after a temp written a day ago under "our" pid
    gone, why = writer_gone(TempWriter(host_tag(), os.getpid()), time.time() - 86400, grace_s=1e9)
    if not Path("/proc/self/stat").exists():
        pytest.skip("no /proc: pid reuse cannot be detected")
    # the process started after mtime -> the temp's writer was an earlier holder of the pid
    assert gone and "started after" in why


def test_other_host_only_by_age_and_never_with_a_future_mtime() -> None:
    w = TempWriter("some-other-node", os.getpid())
    assert not writer_gone(w, time.time() - 10, grace_s=60)[0]
    assert writer_gone(w, time.time() - 120, grace_s=60)[0]
    assert not writer_gone(w, time.time() + 3600, grace_s=60)[0]  # clock skew
    assert not writer_gone(TempWriter(None, 1), time.time() - 10, grace_s=60)[0]
    assert writer_gone(TempWriter(None, 1), time.time() - 120, grace_s=60)[0]


def test_sweep_removes_only_provably_dead_writers(tmp_path: Path) -> None:
    fan = tmp_path / "ns" / "g0" / "r0" / "ab"
    fan.mkdir(parents=True)
    page = fan / ("ab" * 16 + ".kvp")
    page.write_bytes(b"page")
    live = _temp(fan, host_tag(), os.getpid(), key="cd" * 16)  # young: a write in progress
    dead = _temp(fan, host_tag(), _dead_pid(), key="ef" * 16)
    remote_young = _temp(fan, "other-node", 12345, key="12" * 16, age_s=30)
    remote_old = _temp(fan, "other-node", 12345, key="34" * 16, age_s=7200)
    probe = fan.parent / ".odirect-probe.1.2.tmp"
    probe.write_bytes(b"p")
    os.utime(probe, (time.time() - 7200,) * 2)
    foreign = fan / "notes.tmp"
    foreign.write_bytes(b"user file")
    hidden = tmp_path / ".tierstore-local-index"
    hidden.mkdir()
    hidden_dead = _temp(hidden, host_tag(), _dead_pid())

    dry = sweep_stale_temps(tmp_path, grace_s=3600, dry_run=True)
    assert (dry.removed, dry.kept) == (3, 2) and dead.exists()

    rep = sweep_stale_temps(tmp_path, grace_s=3600)
    assert (rep.scanned, rep.removed, rep.kept, rep.errors) == (5, 3, 2, [])
    assert rep.removed_bytes == 100 + 100 + 1
    assert not dead.exists() and not remote_old.exists() and not probe.exists()
    assert live.exists() and remote_young.exists() and page.exists() and foreign.exists()
    assert hidden_dead.exists()  # hidden directories (index, trash) belong to their owners
    again = sweep_stale_temps(tmp_path, grace_s=3600)
    assert again.removed == 0


def test_sweep_keeps_the_temp_of_a_live_writer_process(tmp_path: Path) -> None:
    # a real second process holding its temp open, as an engine mid-write on a shared root
    code = ("import sys,time,pathlib;from tierstore.fs.mapper import FileMapper;"
            "p=FileMapper(sys.argv[1],'0'*32,0).temp_path_for(b'\\x07'*16);"
            "p.parent.mkdir(parents=True,exist_ok=True);p.write_bytes(b'half');print(p,flush=True);time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        assert proc.stdout is not None
        temp = Path(proc.stdout.readline().strip())
        rep = sweep_stale_temps(tmp_path, grace_s=0)  # no grace at all: liveness alone keeps it
        assert temp.exists() and rep.removed == 0 and rep.kept == 1
    finally:
        proc.kill()
        proc.wait()
    rep = sweep_stale_temps(tmp_path, grace_s=3600)
    assert rep.removed == 1 and not temp.exists()
