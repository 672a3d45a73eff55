"""Issue 17 for ``ls``/``stats`` (the root walk) and the local index: each hostile input planted next
to valid pages and a sentinel directory outside the root; the readers must leave the sentinel
alone, never hang, report the bad entry and still report the valid pages."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
from hostile_helpers import nested_dirs, snapshot, within

from tierstore.admin import cli
from tierstore.admin.findings import MANIFEST
from tierstore.admin.render import format_listing, format_stats
from tierstore.admin.stats import collect_stats
from tierstore.admin.walk import walk_root
from tierstore.errors import ConfigError
from tierstore.index.local_index import LocalIndex
from tierstore.index.local_scan import Reconciler
from tierstore.testing.pages import fill_pages, simple_namespace

NS = simple_namespace()
pytestmark = pytest.mark.timeout(60)
N_PAGES = 6


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "root"
    r.mkdir()
    fill_pages(r, NS, N_PAGES)
    return r


def _planted_namespace(root: Path, manifest: bytes | None) -> Path:
    """A digest-named namespace directory with ``manifest`` (a page next to it)."""
    d = root / ("f" * 32)
    (d / "g0" / "r0" / "00").mkdir(parents=True)
    (d / "g0" / "r0" / "00" / "abcd.kvp").write_bytes(b"x" * 64)
    if manifest is not None:
        (d / "manifest.json").write_bytes(manifest)
    return d


def _valid_manifest() -> dict:
    return NS.manifest()


def _with(**changes: object) -> bytes:
    m = _valid_manifest()
    m["namespace"] = "f" * 32
    for path, value in changes.items():
        target = m
        *parents, last = path.split("__")
        for p in parents:
            target = target[int(p)] if isinstance(target, list) else target[p]
        target[last] = value
    return json.dumps(m).encode()


HOSTILE_MANIFESTS = {
    "non_integer_kind": _with(groups__0__kind="attention"),
    "unknown_dtype": _with(dtype="float128x"),
    "huge_number": _with(groups__0__block_size=10 ** 400).replace(b"1" + b"0" * 400, b"1e400"),
    "nested_json": b"[" * 200_000 + b"]" * 200_000,
    "not_json": b"\xff\xfe garbage",
    "oversized": b" " * (5 << 20) + b"{}",
    "escape_sequences": _with(model="evil\x1b[2J\nFORGED LINE"),
}


@pytest.mark.parametrize("listing", [True, False], ids=["listing", "exact"])
@pytest.mark.parametrize("name", sorted(HOSTILE_MANIFESTS))
def test_hostile_manifest_is_a_finding(root: Path, sentinel: Path, name: str, listing: bool,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    before = snapshot(sentinel)
    _planted_namespace(root, HOSTILE_MANIFESTS[name])
    os.symlink(sentinel, root / NS.digest / "g0" / "r0" / "zz")  # and a link to outside
    stats = within(30, lambda: collect_stats(root, listing=listing))
    assert isinstance(stats, dict)
    by_ns = {n["namespace"]: n for n in stats["namespaces"]}
    assert by_ns[NS.digest]["files"] == N_PAGES  # the valid pages are still reported
    planted = by_ns["f" * 32]
    if name != "escape_sequences":
        assert planted["manifest_error"], name
        assert stats["other"][MANIFEST] >= 1
    text = format_stats(stats) + "\n" + format_listing(stats)
    assert "\x1b" not in text and "FORGED LINE" not in text.replace("\\nFORGED LINE", "")
    assert snapshot(sentinel) == before
    argv = ["stats", str(root)] + ([] if listing else ["--exact"])
    assert cli.main(argv) == 0  # no traceback, no exit 8
    assert "\x1b" not in capsys.readouterr().out


def test_manifest_that_is_a_fifo_or_symlink_does_not_hang(root: Path, sentinel: Path) -> None:
    before = snapshot(sentinel)
    d = _planted_namespace(root, None)
    os.mkfifo(d / "manifest.json")
    d2 = root / ("e" * 32)
    d2.mkdir()
    os.symlink(sentinel / "precious0.kvp", d2 / "manifest.json")
    stats = within(30, lambda: collect_stats(root, listing=True))
    errors = {n["namespace"]: n["manifest_error"] for n in stats["namespaces"]}  # type: ignore[index]
    assert errors["f" * 32] and errors["e" * 32] and errors[NS.digest] is None
    assert snapshot(sentinel) == before


def test_twenty_digit_pid_temp_names_are_findings(root: Path) -> None:
    fan = next((root / NS.digest / "g0" / "r0").glob("*/*.kvp")).parent
    (fan / f".{'ab' * 8}.kvp.host.{'9' * 20}.abc.tmp").write_bytes(b"t")
    (root / NS.digest / f".manifest.json.host.{'9' * 20}.abc.tmp").write_bytes(b"t")
    for listing in (True, False):
        inv = within(30, lambda listing=listing: walk_root(root, listing=listing))
        odd = [f for f in inv.findings if "9" * 20 in f.path]  # type: ignore[attr-defined]
        assert len(odd) == 2 and all(f.category == "foreign" for f in odd)
    assert cli.main(["ls", str(root)]) == 0


def test_listing_counts_match_exact(root: Path) -> None:
    fill_pages(root, simple_namespace("float8_e4m3fn"), 5)
    fast = collect_stats(root, listing=True)
    exact = collect_stats(root, read_headers=False)
    for f, e in zip(fast["namespaces"], exact["namespaces"], strict=True):
        assert [g["files"] for g in f["groups"]] == [g["files"] for g in e["groups"]]
        # codec none: the layout's page size is the file size
        assert f["bytes"] == e["bytes"] and f["bytes_source"] == "layout" and e["bytes_source"] == "stat"
        assert f["groups"][0]["oldest"] is None and f["groups"][0]["newest"] is not None


# ------------------------------------------------------------------ local index
@pytest.mark.parametrize("linked", ["meta_dir", "database"])
def test_local_index_refuses_a_symlinked_meta_dir_or_database(tmp_path: Path, sentinel: Path, linked: str) -> None:
    local = tmp_path / "local"
    meta = local / ".tierstore"
    if linked == "meta_dir":
        local.mkdir()
        os.symlink(sentinel, meta)
    else:
        meta.mkdir(parents=True)
        os.symlink(sentinel / "precious0.kvp", meta / "index.sqlite")
    before = snapshot(sentinel)
    with pytest.raises(ConfigError, match="symlink"):
        LocalIndex(local, 1 << 20)
    assert snapshot(sentinel) == before


@pytest.mark.slow
def test_local_index_reconcile_survives_deep_trees_links_and_odd_pids(tmp_path: Path, sentinel: Path) -> None:
    local = tmp_path / "local"
    pages = fill_pages(local, NS, N_PAGES)
    fan = pages[0].path.parent
    (fan / f".{'ab' * 8}.kvp.host.{'9' * 20}.abc.tmp").write_bytes(b"t")
    os.symlink(sentinel, fan.parent / "ee")  # a linked fan-out directory: never followed
    with nested_dirs(local / NS.digest, 1200):
        before = snapshot(sentinel)
        idx = LocalIndex(local, 1 << 30)  # fresh index over a non-empty root: background scan
        assert within(30, lambda: idx.wait_reconciled(30))
        assert idx.count() == N_PAGES
        assert idx.last_reconcile is not None and idx.last_reconcile.added == N_PAGES
        idx.close()
    assert snapshot(sentinel) == before


@pytest.mark.slow
def test_local_index_opens_before_its_reconcile_ends(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    local = tmp_path / "local"
    fill_pages(local, NS, N_PAGES)
    gate = threading.Event()
    original = Reconciler._scan

    def slow_scan(self, rep, started):  # type: ignore[no-untyped-def]
        gate.wait(20)
        return original(self, rep, started)

    monkeypatch.setattr(Reconciler, "_scan", slow_scan)
    idx = LocalIndex(local, 1 << 30)
    assert idx.reconciling and idx.count() == 0  # open, usable, scan still pending
    rid, _ = idx.reserve(100)
    assert rid is not None
    gate.set()
    assert idx.wait_reconciled(20) and idx.count() == N_PAGES
    idx.close()


def test_local_eviction_never_follows_a_swapped_fanout_directory(tmp_path: Path, sentinel: Path) -> None:
    """A local-tier eviction removes its pages through directory fds opened without following
    links: a fan-out directory swapped for a symlink to the sentinel loses nothing outside."""
    from hostile_helpers import snapshot, swap_for_link

    from tierstore.index.local_index import Evicted, LocalIndex

    root = tmp_path / "local"
    fan = root / "ns" / "g0" / "r0" / "aa"
    fan.mkdir(parents=True)
    (fan / "page.kvp").write_bytes(b"x")
    (sentinel / "page.kvp").write_bytes(b"outside")  # the victim's name, outside the root
    before = snapshot(sentinel)
    idx = LocalIndex(root, 1 << 20)
    try:
        moved = swap_for_link(fan, sentinel, "aside")
        idx._unlink([Evicted("ns/g0/r0/aa/page.kvp", 1)])
        assert snapshot(sentinel) == before  # not removed through the link
        fan.unlink()
        moved.rename(fan)
        idx._unlink([Evicted("ns/g0/r0/aa/page.kvp", 1)])
        assert not (fan / "page.kvp").exists()  # the real directory: removed
    finally:
        idx.close()
