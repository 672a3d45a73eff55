"""A root others can write to (issue 17): each hostile input planted next to valid pages and a
sentinel directory outside the root; gc, the lease and safefs must leave the sentinel alone,
never hang, report the bad entry and keep the valid pages."""

from __future__ import annotations

import json
import os
import stat
import time
import tracemalloc
from pathlib import Path

import pytest
import zstandard
from hostile_helpers import nested_dirs, snapshot, swap_for_link, traced_peak, within, zstd_bomb

from tierstore.admin import gc_command
from tierstore.errors import ConfigError, PageCorrupt
from tierstore.format import safe_zstd
from tierstore.format.header import GroupKind, PageMeta, decode_header
from tierstore.format.mac import PageMac, PageUnauthenticated
from tierstore.format.page import encode_page
from tierstore.format.page_layout import PageLayout, SectionSpec
from tierstore.fs import display, safefs, trust
from tierstore.fs.lease import LEASE_NAME, Lease
from tierstore.testing.pages import fill_pages, simple_namespace
from tierstore.tiers import gc
from tierstore.tiers.gc_scan import TRASH_DIR

NS = simple_namespace()
pytestmark = pytest.mark.timeout(60)


def fill(root: Path, n: int = 6) -> list[Path]:
    paths = [p.path for p in fill_pages(root, NS, n)]
    base = time.time() - 1000
    for i, path in enumerate(paths):
        os.utime(path, (base + i, base + i))
    return paths


# ------------------------------------------------------------------ gc
def test_symlinked_trash_is_refused_and_outside_untouched(root: Path, sentinel: Path) -> None:
    paths = fill(root)
    before = snapshot(sentinel)
    (root / TRASH_DIR).symlink_to(sentinel)
    rep = within(30, lambda: gc.collect(root, 1 << 40, lease=Lease(root, settle_s=0)))
    assert snapshot(sentinel) == before
    assert any(TRASH_DIR in u and "symlink" in u for u in rep.unsafe)
    rep = within(30, lambda: gc.collect(root, 1, low_watermark=0.0, lease=Lease(root, settle_s=0)))
    assert snapshot(sentinel) == before and rep.evicted == 0
    assert all(p.exists() for p in paths)


def test_symlinked_namespace_and_fanout_are_not_walked(root: Path, sentinel: Path) -> None:
    paths = fill(root)
    before = snapshot(sentinel)
    (root / ("ab" * 16)).symlink_to(sentinel)  # a namespace-like name pointing outside
    fan = paths[0].parent
    swap_for_link(fan, sentinel, "zz")  # a fan-out directory replaced by a link
    rep = within(30, lambda: gc.collect(root, 1, low_watermark=0.0, lease=Lease(root, settle_s=0)))
    assert snapshot(sentinel) == before
    assert rep.evicted == len(paths) - sum(1 for p in paths if p.parent == fan)
    assert any("symlink" in u for u in rep.unsafe)


def test_fanout_swapped_for_symlink_between_scan_and_eviction(
        root: Path, sentinel: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    paths = fill(root)
    victim_dir = paths[0].parent
    # the outside directory holds a file of the victim's name: path-based eviction would take it
    (sentinel / paths[0].name).write_bytes(b"outside file named like the victim")
    before = snapshot(sentinel)

    def swap() -> None:
        swap_for_link(victim_dir, sentinel)

    monkeypatch.setattr(gc, "_after_scan_hook", swap)
    rep = within(30, lambda: gc.collect(root, 1, low_watermark=0.0, lease=Lease(root, settle_s=0)))
    assert snapshot(sentinel) == before
    assert any("since the scan" in u for u in rep.unsafe)
    assert (victim_dir.with_name("moved") / paths[0].name).exists()  # not evicted through the link


def test_sparse_foreign_file_does_not_make_gc_evict(root: Path) -> None:
    paths = fill(root)
    ns_dir = root / NS.digest
    with open(ns_dir / "huge.bin", "wb") as f:
        f.truncate(1 << 40)  # 1 TiB, no blocks allocated
    page_bytes = sum(p.stat().st_blocks * 512 for p in paths)
    rep = within(30, lambda: gc.collect(root, page_bytes * 2, lease=Lease(root, settle_s=0)))
    assert rep.evicted == 0 and all(p.exists() for p in paths)
    assert rep.total_before <= page_bytes * 2


def test_hard_linked_page_is_counted_foreign_and_not_touched(root: Path, sentinel: Path) -> None:
    paths = fill(root)
    target = sentinel / "precious0.kvp"
    os.unlink(paths[0])
    os.link(target, paths[0])
    before = snapshot(sentinel)
    rep = within(30, lambda: gc.collect(root, 1, low_watermark=0.0, lease=Lease(root, settle_s=0)))
    assert snapshot(sentinel) == before and paths[0].exists()
    assert any("links" in u for u in rep.unsafe)
    assert rep.evicted == len(paths) - 1


def test_fifo_and_deep_tree_and_odd_names(root: Path) -> None:
    paths = fill(root)
    fan = paths[0].parent
    os.mkfifo(fan / ("cd" * 8 + ".kvp"))
    os.mkfifo(fan / f".{'ab' * 8}.kvp.host.{'9' * 20}.abc.tmp")  # 20-digit pid temp name
    with nested_dirs(root / NS.digest, 1200):
        rep = within(30, lambda: gc.collect(root, 1, low_watermark=0.0, lease=Lease(root, settle_s=0)))
        assert rep.evicted == len(paths)
        assert any("not a regular file" in u for u in rep.unsafe)


# ------------------------------------------------------------------ lease
@pytest.mark.parametrize("expires", [32503680000.0, "Infinity", 1e308])
def test_lease_expiring_far_away_is_garbage(root: Path, expires: object) -> None:
    fill(root, 2)
    body = f'{{"owner": "evil:1:x", "host": "elsewhere", "pid": 1, "expires": {expires}}}'
    (root / LEASE_NAME).write_text(body)
    rep = within(30, lambda: gc.collect(root, 1, lease=Lease(root, settle_s=0)))
    assert not rep.busy and rep.evicted == 2


def test_lease_fifo_does_not_hang(root: Path) -> None:
    fill(root, 2)
    os.mkfifo(root / LEASE_NAME)
    rep = within(30, lambda: gc.collect(root, 1, lease=Lease(root, settle_s=0)))
    assert not rep.busy and rep.evicted == 2


def test_lease_symlink_is_not_followed(root: Path, sentinel: Path) -> None:
    fill(root, 2)
    before = snapshot(sentinel)
    (root / LEASE_NAME).symlink_to(sentinel / "precious1.kvp")
    rep = within(30, lambda: gc.collect(root, 1, lease=Lease(root, settle_s=0)))
    assert not rep.busy and snapshot(sentinel) == before


def test_lease_directory_is_reported_not_a_crash(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    paths = fill(root, 2)
    (root / LEASE_NAME).mkdir()
    rep = within(30, lambda: gc.collect(root, 1, lease=Lease(root, settle_s=0)))
    assert rep.lease_problem and "directory" in rep.lease_problem and not rep.busy
    assert rep.evicted == 0 and all(p.exists() for p in paths)
    import argparse
    parser = argparse.ArgumentParser()
    gc_command.add_arguments(parser)
    assert gc_command.run(parser.parse_args([str(root), "--max-bytes", "1"])) == 8  # operational error, as every command
    assert "directory" in capsys.readouterr().err  # errors on stderr, as every command


def test_lease_of_dead_holder_on_this_host_is_taken(root: Path) -> None:
    import socket
    import subprocess
    import sys
    fill(root, 2)
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(proc.stdout)
    body = {"owner": "me-before:1:x", "host": socket.gethostname(), "pid": dead_pid, "expires": time.time() + 30}
    (root / LEASE_NAME).write_text(json.dumps(body))
    rep = within(30, lambda: gc.collect(root, 1, lease=Lease(root, settle_s=0)))
    assert not rep.busy and rep.evicted == 2
    # a live holder on this host (this very process) keeps it
    body["pid"] = os.getpid()
    (root / LEASE_NAME).write_text(json.dumps(body))
    assert gc.collect(root, 1, lease=Lease(root, settle_s=0)).busy


def test_oversized_lease_is_not_read_whole(root: Path) -> None:
    with open(root / LEASE_NAME, "wb") as f:
        f.truncate(1 << 30)
    lease = Lease(root, settle_s=0)
    body, peak = traced_peak(lease.read)
    assert body is None
    assert peak < 1 << 20


# ------------------------------------------------------------------ safefs
def test_safefs_refuses_links_fifos_and_hardlinks(root: Path, sentinel: Path) -> None:
    (root / "link").symlink_to(sentinel / "precious0.kvp")
    (root / "dirlink").symlink_to(sentinel)
    os.mkfifo(root / "fifo")
    os.link(sentinel / "precious1.kvp", root / "hard")
    (root / "ok").write_bytes(b"fine")
    fd = safefs.open_root(root)
    try:
        for name, reason in (("link", "symlink"), ("fifo", "not_regular"), ("hard", "hardlink")):
            with pytest.raises(safefs.UnsafeEntry) as ei:
                within(10, lambda n=name: safefs.read_small(n, fd))
            assert ei.value.reason == reason
        with pytest.raises(safefs.UnsafeEntry) as ei:
            safefs.open_dir("dirlink", fd)
        assert ei.value.reason == "symlink"
        with pytest.raises(safefs.UnsafeEntry):
            safefs.open_dir_path(fd, ("dirlink", "x"), create=True)
        assert safefs.read_small("ok", fd) == b"fine"
        with pytest.raises(safefs.UnsafeEntry) as ei:
            safefs.read_small("ok", fd, cap=2)
        assert ei.value.reason == "too_large"
        st = safefs.lstat_at("ok", fd)
        os.rename(root / "ok", root / "ok2")
        (root / "ok").write_bytes(b"new")
        with pytest.raises(safefs.UnsafeEntry) as ei:
            safefs.unlink_at("ok", fd, safefs.identity(st))
        assert ei.value.reason == "changed" and (root / "ok").exists()
    finally:
        os.close(fd)
    assert not (sentinel / "x").exists()


def test_safefs_walk_is_iterative_and_closes_fds(root: Path, sentinel: Path) -> None:
    (root / "a" / "b").mkdir(parents=True)
    (root / "a" / "b" / "f").write_bytes(b"1")
    (root / "a" / "l").symlink_to(sentinel)
    fds_before = len(os.listdir("/proc/self/fd"))
    fd = safefs.open_root(root)
    try:
        seen = {d.parts: [n for n, _ in d.entries] for d in safefs.walk(fd, max_depth=8)}
        # abandoning a walk half-way closes what it holds
        it = safefs.walk(fd, max_depth=8)
        next(it)
        it.close()
    finally:
        os.close(fd)
    assert seen[("a", "b")] == ["f"] and ("a", "l") not in seen
    assert len(os.listdir("/proc/self/fd")) == fds_before


def test_safefs_creates_private_modes(root: Path) -> None:
    old = os.umask(0)
    try:
        fd = safefs.open_root(root)
        try:
            dfd = safefs.open_dir_path(fd, ("n", "g0"), create=True)
            os.close(dfd)
            safefs.write_file_atomic("f", fd, b"x", "f.tmp")
        finally:
            os.close(fd)
    finally:
        os.umask(old)
    assert stat.S_IMODE((root / "n").stat().st_mode) == 0o700
    assert stat.S_IMODE((root / "f").stat().st_mode) == 0o600
    assert safefs.GROUP_SHARED.dir_mode & stat.S_ISGID


# ------------------------------------------------------------------ zstd bomb
def test_zstd_bomb_memory_is_bounded_by_the_layout() -> None:
    declared = 64 << 20
    frame = zstd_bomb(declared)
    assert len(frame) < 64 << 10
    expected = 64 << 10  # the layout's section size
    tracemalloc.start()
    try:
        with pytest.raises(PageCorrupt, match="declares"):
            safe_zstd.decompress_capped(frame, expected)
        safe_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        # what python-zstandard does with max_output_size (why this module exists)
        zstandard.ZstdDecompressor().decompress(frame, max_output_size=expected)
        naive_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert safe_peak < expected + (1 << 20)
    assert naive_peak >= declared  # the measurement sees the allocation it guards against


def test_zstd_without_declared_size_is_streamed_with_a_cap() -> None:
    raw = os.urandom(1000) * 300
    frame = zstandard.ZstdCompressor(write_content_size=False).compress(raw)
    assert safe_zstd.declared_size(frame) is None
    assert bytes(safe_zstd.decompress_capped(frame, len(raw))) == raw
    tracemalloc.start()
    try:
        with pytest.raises(PageCorrupt, match="more"):
            safe_zstd.decompress_capped(frame, 4096)
        assert tracemalloc.get_traced_memory()[1] < 1 << 20
    finally:
        tracemalloc.stop()
    with pytest.raises(PageCorrupt):
        safe_zstd.decompress_capped(b"garbage" * 10, 4096)


def test_zstd_exact_frame_decodes_into_the_page_buffer() -> None:
    raw = os.urandom(5000)
    out = bytearray(5000)
    safe_zstd.decompress_into(zstandard.ZstdCompressor().compress(raw), out)
    assert bytes(out) == raw


# ------------------------------------------------------------------ display
@pytest.mark.parametrize(("raw", "shown"), [
    ("abc.kvp", "abc.kvp"),
    ("evil\nOK 0 problems", "evil\\nOK 0 problems"),
    ("\x1b[31mred", "\\x1b[31mred"),
    (os.fsdecode(b"bad\xffname"), "bad\\xffname"),
    (b"raw\xfe", "raw\\xfe"),
    ("rtl\u202eoverride", "rtl\\u202eoverride"),
    ("back\\slash", "back\\\\slash"),
    ("caf\u00e9 \u6f22", "caf\u00e9 \u6f22"),
    ("\x85c1", "\\x85c1"),
])
def test_display_escape(raw: str | bytes, shown: str) -> None:
    out = display.escape(raw)
    assert out == shown
    assert out.isprintable()
    out.encode("utf-8")  # strict UTF-8 stdout never fails


# ------------------------------------------------------------------ trust
def test_trust_refuses_foreign_writable_roots(root: Path) -> None:
    st = os.stat(root)
    me = os.geteuid()

    def fake(mode: int, uid: int) -> os.stat_result:
        return os.stat_result((stat.S_IFDIR | mode, st.st_ino, st.st_dev, 2, uid, st.st_gid, 0, 0, 0, 0))

    assert trust.root_problem(fake(0o700, me), me) is None
    assert trust.root_problem(fake(0o755, me + 1), me) is None  # read-only to us: not rearrangeable
    assert "world-writable" in trust.root_problem(fake(0o777, me), me)
    assert "group" in trust.root_problem(fake(0o2770, me + 1), me)
    assert trust.root_problem(fake(0o1777, me + 1), me)
    os.chmod(root, 0o777)
    try:
        with pytest.raises(ConfigError, match="trust_shared_root"):
            trust.check_root_trust(root)
        trust.check_root_trust(root, trust_shared_root=True)
    finally:
        os.chmod(root, 0o700)
    trust.check_root_trust(root)


# ------------------------------------------------------------------ MAC
def _page() -> tuple[bytes, bytes]:
    lay = PageLayout((SectionSpec("k", "float16", (2, 64)),))
    meta = PageMeta(b"\x01" * 16, b"key", 0, GroupKind.ATTENTION, 16)
    header, pieces = encode_page(meta, lay, os.urandom(lay.nbytes))
    return header, b"".join(bytes(p) for p in pieces)


def test_mac_rejects_pages_without_a_valid_tag(tmp_path: Path) -> None:
    key_file = tmp_path / "fleet.key"
    key_file.write_text(os.urandom(32).hex())
    key_file.chmod(0o600)
    mac = PageMac.from_key_file(key_file)
    header, payload = _page()
    decode_header(header)  # the checksums are valid: a forger can do that
    tag = mac.tag(header, payload)
    mac.verify(header, payload, tag)
    mac.verify(header, [payload[:10], payload[10:]], tag)  # pieces as written
    with pytest.raises(PageUnauthenticated, match="no MAC"):
        mac.verify(header, payload, None)
    forged = PageMac(os.urandom(32), mac.algorithm).tag(header, payload)
    with pytest.raises(PageUnauthenticated, match="mismatch"):
        mac.verify(header, payload, forged)
    tampered = bytearray(payload)
    tampered[0] ^= 1
    with pytest.raises(PageUnauthenticated):
        mac.verify(header, bytes(tampered), tag)
    other_alg = PageMac(bytes.fromhex(key_file.read_text()), 1 if mac.algorithm != 1 else mac.algorithm)
    mac.verify(header, payload, other_alg.tag(header, payload))  # any supported algorithm, same key


def test_mac_key_file_checks(tmp_path: Path, sentinel: Path) -> None:
    key_file = tmp_path / "fleet.key"
    key_file.write_bytes(os.urandom(32))
    key_file.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        PageMac.from_key_file(key_file)
    link = tmp_path / "link.key"
    link.symlink_to(sentinel / "precious0.kvp")
    with pytest.raises(ConfigError, match="mac_key_file"):
        PageMac.from_key_file(link)
    short = tmp_path / "short.key"
    short.write_bytes(b"abc")
    short.chmod(0o600)
    with pytest.raises(ConfigError, match="at least"):
        PageMac.from_key_file(short)
