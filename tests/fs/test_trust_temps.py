"""Temp-file writers across PID namespaces (fs/mapper.py ``host_tag``, fs/stale_temps.py, fs/lease.py):
pods on one node with one host name (hostNetwork), or long names cut to one prefix, each in its
own PID namespace, must not judge each other's writers by a local pid. A writer's tag carries
the host name, the boot id and the PID namespace, so only a writer of our namespace is judged
by pid; any other by age (another host's rule)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

from tierstore.admin.fsck import FsckOptions, run_fsck
from tierstore.fs.lease import LEASE_NAME, Lease
from tierstore.fs.mapper import host_tag
from tierstore.fs.stale_temps import TempWriter, sweep_stale_temps, writer_gone
from tierstore.testing.pages import fill_pages, hybrid_namespace

TAG_RE = re.compile(r"^[A-Za-z0-9-]{1,40}$")  # what temp names may carry (mapper._TEMP_RE)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _sibling_host_name_tag() -> str:
    """The tag a writer with our host name but nothing else of ours puts in a name: how a pod
    sharing the host name wrote it before writer tags (and what it looked like here too)."""
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:40] or "host"


def test_a_fresh_temp_of_a_sibling_with_our_host_name_is_kept(tmp_path: Path) -> None:
    """A temp named with our host name and a pid that is dead here (alive in the sibling's own
    PID namespace, writing): before, the sweep removed it at once and failed the sibling's
    store; now it is another writer's, kept until it is older than the grace."""
    fan = tmp_path / "ns" / "g0" / "r0" / "ab"
    fan.mkdir(parents=True)
    sibling = fan / f".{'cd' * 16}.kvp.{_sibling_host_name_tag()}.{_dead_pid()}.0123456789ab.tmp"
    sibling.write_bytes(b"x" * 100)
    rep = sweep_stale_temps(tmp_path, grace_s=3600)
    assert sibling.exists() and rep.removed == 0 and rep.kept == 1
    old = time.time() - 7200
    os.utime(sibling, (old, old))
    rep = sweep_stale_temps(tmp_path, grace_s=3600)
    assert not sibling.exists() and rep.removed == 1


def test_fsck_counts_a_siblings_fresh_temp_as_in_flight(tmp_path: Path) -> None:
    root = tmp_path / "root"
    ns = hybrid_namespace()
    pages = fill_pages(root, ns, 1)
    fan = Path(pages[0].path).parent
    sibling = fan / f".{'cd' * 16}.kvp.{_sibling_host_name_tag()}.{_dead_pid()}.0123456789ab.tmp"
    sibling.write_bytes(b"x" * 100)
    rep = run_fsck(FsckOptions(root, repair=True, progress=False))
    assert rep.temps_active == 1 and sibling.exists(), rep.format_text()


def test_writer_tags_tell_pid_namespaces_boots_and_long_names_apart() -> None:
    """The tag: at most 40 characters of the temp-name alphabet, the host name first; another
    PID namespace, another boot or another host name with the same first 40 characters gives
    another tag; the same three give the same one."""
    from tierstore.fs.mapper import writer_tag

    host, boot = "gpu-node-17.cluster.example", "676d6fe0-d438-4eb5-88cb-a15f3c7dbccb"
    mine = writer_tag(host, boot, "4026531836")
    assert TAG_RE.match(mine) and mine.startswith("gpu-node-17-cluster-exampl")
    assert writer_tag(host, boot, "4026531836") == mine
    assert writer_tag(host, boot, "4026532179") != mine  # another PID namespace
    assert writer_tag(host, "another-boot", "4026531836") != mine
    long_a, long_b = "vllm-" + "x" * 40 + "-a", "vllm-" + "x" * 40 + "-b"  # one 40-character prefix
    assert writer_tag(long_a, boot, "1") != writer_tag(long_b, boot, "1")
    assert all(TAG_RE.match(writer_tag(h, boot, "1")) for h in (long_a, "", "ünïcode.host_name"))
    assert TAG_RE.match(host_tag()) and host_tag() == writer_tag(
        socket.gethostname(), Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
        str(os.stat("/proc/self/ns/pid").st_ino))


def test_our_own_dead_writers_temps_still_go_at_once(tmp_path: Path) -> None:
    """The control: a temp with our tag and a dead pid is stale at once; a live pid's never."""
    dead = tmp_path / f".{'ab' * 16}.kvp.{host_tag()}.{_dead_pid()}.0123456789ab.tmp"
    live = tmp_path / f".{'ef' * 16}.kvp.{host_tag()}.{os.getpid()}.0123456789ab.tmp"
    for p in (dead, live):
        p.write_bytes(b"x")
    rep = sweep_stale_temps(tmp_path, grace_s=3600)
    assert not dead.exists() and live.exists() and rep.removed == 1
    assert writer_gone(TempWriter(_sibling_host_name_tag(), _dead_pid()), time.time())[0] is (
        _sibling_host_name_tag() == host_tag())


def test_a_gc_lease_of_a_sibling_with_our_host_name_is_not_taken_as_dead(tmp_path: Path) -> None:
    """A live lease whose holder has our host name and a pid dead here, written by a sibling in
    another PID namespace (its ``writer`` differs): not taken over before it expires. A lease
    of our own writer with a dead pid is (the control)."""
    root = tmp_path / "root"
    root.mkdir()

    def plant(writer: str) -> None:
        body = {"owner": "sibling:1:x", "ttl": 60, "expires": time.time() + 60, "host": socket.gethostname(),
                "pid": _dead_pid(), "writer": writer}
        (root / LEASE_NAME).write_text(json.dumps(body))

    plant("sibling-0123456789ab")  # a tag of another PID namespace
    lease = Lease(root, ttl_s=60)
    assert lease.read() is not None and not lease.acquire()
    plant(host_tag())
    assert lease.read() is None and lease.acquire()
