"""fsck: every kind of damage is detected on read and by fsck, and --repair fixes it safely."""

from __future__ import annotations

import datetime as _dt
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from hostile_helpers import fsck_per_page

from tierstore.admin.cli import main
from tierstore.admin.fsck import FsckReport, _repair
from tierstore.admin.render import human_bytes
from tierstore.admin.walk import walk_root
from tierstore.errors import (
    PageCorrupt,
    PageError,
    PageForeign,
    PageFormatError,
    PageKeyMismatch,
    PageTruncated,
)
from tierstore.format.header import Codec
from tierstore.format.identity import MANIFEST_NAME, Namespace, write_manifest
from tierstore.fs.mapper import FileMapper, fanout, host_tag
from tierstore.testing import (
    StoredPage,
    corrupt_flip_bit,
    fill_pages,
    hybrid_namespace,
    page_key,
    read_stored,
    write_page,
)
from tierstore.testing.pages import page_bytes


@pytest.fixture
def filled(root: Path, hybrid_ns: Namespace) -> list[StoredPage]:
    """3 pages per group of the hybrid namespace, plus 2 zstd pages per group."""
    return fill_pages(root, hybrid_ns, 3) + fill_pages(root, hybrid_ns, 2, seed=1, codec=Codec.ZSTD)


def fsck(root: Path, *args: str) -> tuple[int, dict]:
    """Run the CLI in-process with --json; returns (exit code, report)."""
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["fsck", str(root), "--json", *args])
    return rc, json.loads(buf.getvalue())


def _problems(report: dict) -> dict[str, tuple[str, str]]:
    return {p["path"]: (p["category"], p["kind"]) for p in report["problems"]}


def test_clean_tree(root: Path, filled: list[StoredPage], fsck_path: str) -> None:
    before = time.time()
    rc, rep = fsck(root)
    assert rc == 0, rep["problems"]
    assert rep["counts"]["pages_ok"] == len(filled)
    assert rep["counts"]["bytes_ok"] == sum(p.path.stat().st_size for p in filled)
    assert rep["counts"]["problems"] == 0
    _assert_run_times(rep, before)


def _assert_run_times(rep: dict, before: float) -> None:
    """``started_at``/``finished_at``: ISO 8601 UTC as gc writes them, around the run, as far
    apart as ``seconds`` says; added to schema version 1 without changing it."""
    assert rep["tierstore_fsck"] == 1
    started, finished = (_dt.datetime.fromisoformat(rep[k].replace("Z", "+00:00")) for k in ("started_at", "finished_at"))
    assert rep["started_at"].endswith("Z") and "T" in rep["started_at"] and started.utcoffset() == _dt.timedelta(0)
    assert before - 0.01 <= started.timestamp() <= finished.timestamp() <= time.time() + 0.01
    assert abs((finished - started).total_seconds() - rep["seconds"]) < 0.05


def test_text_sizes_are_human_readable_as_in_ls_and_stats(root: Path, filled: list[StoredPage],
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fsck", str(root)]) == 0
    out = capsys.readouterr().out
    size = human_bytes(sum(p.path.stat().st_size for p in filled))
    assert f"{len(filled)} pages ok ({size})" in out and size.endswith(" KiB"), out  # was "(0.1 MiB)"


# -- the corruption matrix ----------------------------------------------------------------

def _flip_payload(pages: list[StoredPage], root: Path) -> list[tuple[StoredPage, type[PageError], str]]:
    p = pages[0]
    corrupt_flip_bit(p.path, -3, bit=5)
    return [(p, PageCorrupt, "checksum")]


def _flip_payload_zstd(pages: list[StoredPage], root: Path) -> list[tuple[StoredPage, type[PageError], str]]:
    p = next(p for p in pages if p.path.stat().st_size < 4096 + len(p.data))  # a compressed page
    corrupt_flip_bit(p.path, 4096 + 20, bit=2)  # inside the first zstd frame
    return [(p, PageCorrupt, "checksum")]


def _flip_header(pages: list[StoredPage], root: Path) -> list[tuple[StoredPage, type[PageError], str]]:
    p = pages[4]
    corrupt_flip_bit(p.path, 100, bit=0)  # inside the section table
    return [(p, PageCorrupt, "checksum")]


def _flip_header_checksum(pages: list[StoredPage], root: Path) -> list[tuple[StoredPage, type[PageError], str]]:
    p = pages[5]
    corrupt_flip_bit(p.path, 4096 - 1, bit=7)
    return [(p, PageCorrupt, "checksum")]


def _truncate(pages: list[StoredPage], root: Path) -> list[tuple[StoredPage, type[PageError], str]]:
    a, b, c = pages[1], pages[6], pages[7]
    os.truncate(a.path, a.path.stat().st_size - 100)  # inside the payload
    os.truncate(b.path, 2000)  # inside the header
    os.truncate(c.path, 0)  # empty
    return [(a, PageTruncated, "truncated"), (b, PageTruncated, "truncated"), (c, PageTruncated, "truncated")]


def _extend(pages: list[StoredPage], root: Path) -> list[tuple[StoredPage, type[PageError], str]]:
    p = pages[2]
    with open(p.path, "ab") as f:
        f.write(b"\0" * 10)
    return [(p, PageTruncated, "truncated")]


def _zero_fill(pages: list[StoredPage], root: Path) -> list[tuple[StoredPage, type[PageError], str]]:
    p = pages[3]
    p.path.write_bytes(bytes(p.path.stat().st_size))
    return [(p, PageFormatError, "format")]


def _swap(pages: list[StoredPage], root: Path) -> list[tuple[StoredPage, type[PageError], str]]:
    a, b = pages[0], pages[1]  # same group, same size, different keys
    assert a.path.stat().st_size == b.path.stat().st_size and a.key != b.key
    tmp = a.path.with_name("swap")
    os.rename(a.path, tmp)
    os.rename(b.path, a.path)
    os.rename(tmp, b.path)
    return [(a, PageKeyMismatch, "key_mismatch"), (b, PageKeyMismatch, "key_mismatch")]


def _swap_groups(pages: list[StoredPage], root: Path) -> list[tuple[StoredPage, type[PageError], str]]:
    # Same key and same size in groups 0 and 1 (both attention with the same layout).
    a = pages[0]
    b = next(p for p in pages if p.group_index == 1 and p.key == a.key)
    data_a, data_b = a.path.read_bytes(), b.path.read_bytes()
    assert len(data_a) == len(data_b)
    a.path.write_bytes(data_b)
    b.path.write_bytes(data_a)
    return [(a, PageKeyMismatch, "key_mismatch"), (b, PageKeyMismatch, "key_mismatch")]


def _foreign_namespace(pages: list[StoredPage], root: Path) -> list[tuple[StoredPage, type[PageError], str]]:
    # The same model shape under another namespace (another revision): same layout, same size.
    other = hybrid_namespace(revision="r1")
    p = pages[2]
    src = write_page(root.parent / "other-root", other, p.group_index, p.key)
    shutil.copyfile(src.path, p.path)
    return [(p, PageForeign, "foreign")]


def _garbage(pages: list[StoredPage], root: Path) -> list[tuple[StoredPage, type[PageError], str]]:
    p = pages[8]
    p.path.write_bytes(os.urandom(5000))
    return [(p, PageFormatError, "format")]


def _garbage_with_magic(pages: list[StoredPage], root: Path) -> list[tuple[StoredPage, type[PageError], str]]:
    p = pages[9]
    raw = bytearray(p.path.read_bytes())
    raw[16:4096] = os.urandom(4096 - 16)  # valid magic/version/flags/length, random rest
    p.path.write_bytes(raw)
    return [(p, PageCorrupt, "checksum")]


DAMAGE: dict[str, Callable[[list[StoredPage], Path], list[tuple[StoredPage, type[PageError], str]]]] = {
    "flip-payload": _flip_payload,
    "flip-payload-zstd": _flip_payload_zstd,
    "flip-header": _flip_header,
    "flip-header-checksum": _flip_header_checksum,
    "truncate": _truncate,
    "extend": _extend,
    "zero-fill": _zero_fill,
    "swap-same-size": _swap,
    "swap-across-groups": _swap_groups,
    "copied-from-other-namespace": _foreign_namespace,
    "garbage": _garbage,
    "garbage-with-magic": _garbage_with_magic,
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damage_is_detected_on_read_and_by_fsck_and_repaired(
    root: Path, hybrid_ns: Namespace, filled: list[StoredPage], damage: str, fsck_path: str
) -> None:
    damaged = DAMAGE[damage](filled, root)
    damaged_paths = {str(p.path) for p, _, _ in damaged}

    # 1. A read with the engine's expectation raises the typed error, never returns data.
    for page, error, _ in damaged:
        with pytest.raises(error):
            read_stored(root, hybrid_ns, page)

    # 2. fsck reports exactly the damaged files, with that kind, and exits 4.
    rc, rep = fsck(root)
    assert rc == 4
    assert _problems(rep) == {str(p.path): ("bad_page", kind) for p, _, kind in damaged}
    assert rep["counts"]["pages_ok"] == len(filled) - len(damaged)

    # 3. --repair removes them (exit 1); a second fsck is clean (exit 0).
    rc, rep = fsck(root, "--repair")
    assert rc == 1
    assert all(p["action"] == "deleted" for p in rep["problems"])
    assert not any(Path(p).exists() for p in damaged_paths)
    rc, rep = fsck(root)
    assert rc == 0, rep["problems"]
    # Every undamaged page is still there and intact.
    for page in filled:
        if str(page.path) not in damaged_paths:
            assert read_stored(root, hybrid_ns, page) == page.data


def test_quarantine_bad_keeps_bad_pages_for_inspection(root: Path, filled: list[StoredPage]) -> None:
    _flip_payload(filled, root)
    rc, rep = fsck(root, "--repair", "--quarantine-bad")
    assert rc == 1
    moved = Path(rep["quarantine"]) / filled[0].path.relative_to(root)
    assert moved.is_file() and not filled[0].path.exists()
    assert fsck(root)[0] == 0  # the quarantine is not walked


def test_misplaced_page(root: Path, hybrid_ns: Namespace, filled: list[StoredPage], fsck_path: str) -> None:
    p = filled[0]
    wrong = p.path.parent.parent / f"{(int(fanout(p.key), 16) + 1) % 256:02x}"
    wrong.mkdir(exist_ok=True)
    shutil.move(p.path, wrong / p.path.name)
    rc, rep = fsck(root)
    assert rc == 4 and _problems(rep) == {str(wrong / p.path.name): ("bad_page", "misplaced")}
    assert fsck(root, "--repair")[0] == 1 and fsck(root)[0] == 0


# -- temps, orphans, foreign files, NFS leftovers ------------------------------------------

def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _age(path: Path, seconds: float) -> None:
    t = time.time() - seconds
    os.utime(path, (t, t))


def test_temp_files(root: Path, hybrid_ns: Namespace, filled: list[StoredPage]) -> None:
    leaf = filled[0].path.parent
    khex = page_key(100).hex()
    dead = leaf / f".{khex}.kvp.{host_tag()}.{_dead_pid()}.aaaa.tmp"  # stale at once
    live = leaf / f".{khex}.kvp.{host_tag()}.{os.getpid()}.bbbb.tmp"  # our own pid: in flight
    remote_young = leaf / f".{khex}.kvp.otherhost.1234.cccc.tmp"
    remote_old = leaf / f".{khex}.kvp.otherhost.1234.dddd.tmp"
    live_but_old = leaf / f".{khex}.kvp.{host_tag()}.{os.getpid()}.eeee.tmp"
    manifest_tmp = root / hybrid_ns.digest / f".{MANIFEST_NAME}.some.host.99.0123abcd.tmp"
    # Manifest temps are named with the same host tag as page temps (identity.write_manifest).
    manifest_dead = root / hybrid_ns.digest / f".{MANIFEST_NAME}.{host_tag()}.{_dead_pid()}.0123abcd.tmp"
    manifest_live = root / hybrid_ns.digest / f".{MANIFEST_NAME}.{host_tag()}.{os.getpid()}.4567abcd.tmp"
    for p in (dead, live, remote_young, remote_old, live_but_old, manifest_tmp, manifest_dead, manifest_live):
        p.write_bytes(b"partial")
    _age(remote_old, 7200)
    _age(live_but_old, 7200)
    _age(manifest_tmp, 7200)
    rc, rep = fsck(root)
    assert rc == 4
    stale = {str(dead), str(remote_old), str(live_but_old), str(manifest_tmp), str(manifest_dead)}
    assert _problems(rep) == {p: ("stale_temp", "temp") for p in stale}
    assert rep["counts"]["temps_active"] == 3
    # A shorter --tmp-age makes the young remote temp stale too (the live pid stays in flight
    # only while young).
    rc, rep = fsck(root, "--tmp-age", "0")
    assert set(_problems(rep)) == stale | {str(remote_young), str(live), str(manifest_live)}
    rc, rep = fsck(root, "--repair")
    assert rc == 1
    assert live.exists() and remote_young.exists() and manifest_live.exists()
    assert not any(Path(p).exists() for p in stale)
    assert fsck(root)[0] == 0


def test_orphans(root: Path, hybrid_ns: Namespace, filled: list[StoredPage], fsck_path: str) -> None:
    # Group 5 does not exist in the manifest; rank 1 is outside a tp=1 layout.
    bad_group = FileMapper(root, hybrid_ns.digest, 5).path_for(page_key(1))
    bad_group.parent.mkdir(parents=True)
    shutil.copyfile(filled[0].path, bad_group)
    bad_rank = write_page(root, hybrid_ns, 0, page_key(1), rank=1)
    rc, rep = fsck(root)
    assert rc == 4
    assert _problems(rep) == {str(bad_group): ("orphan", "orphan"), str(bad_rank.path): ("orphan", "orphan")}
    assert fsck(root, "--repair")[0] == 1
    assert fsck(root)[0] == 0
    # With a tp=2 namespace, rank 1 is a proper place.
    ns2 = hybrid_namespace(tp_size=2)
    fill_pages(root, ns2, 2, ranks=(0, 1))
    assert fsck(root)[0] == 0


def test_foreign_files_and_nfs_leftovers(root: Path, hybrid_ns: Namespace, filled: list[StoredPage]) -> None:
    leaf = filled[0].path.parent
    ns_dir = root / hybrid_ns.digest
    foreign = {
        root / "notes.txt": "file",
        root / "random-dir": "dir",
        ns_dir / "README": "file",
        ns_dir / "g0" / "r0" / "zz": "dir",
        leaf / "page.kvp.bak": "file",
        leaf / "subdir": "dir",
        ns_dir / "g01": "dir",  # not the mapper's spelling of g1
    }
    for path, kind in foreign.items():
        if kind == "dir":
            path.mkdir()
            (path / "inner").write_text("x")
        else:
            path.write_text("user data")
    old_nfs, young_nfs, fuse = leaf / ".nfs00000000012345", leaf / ".nfs0000000009999", ns_dir / ".fuse_hidden0000000a00000001"
    for p in (old_nfs, young_nfs, fuse):
        p.write_bytes(b"x")
    _age(old_nfs, 7200)
    _age(fuse, 7200)
    reserved = [root / ".tierstore-gc.lease", root / ".tierstore-trash", ns_dir / ".tierstore"]
    reserved[0].write_text("{}")
    reserved[1].mkdir()
    reserved[2].mkdir()
    (root / "lost+found").mkdir()

    rc, rep = fsck(root)
    assert rc == 4
    expected = {str(p): ("foreign", k) for p, k in foreign.items()}
    expected |= {str(old_nfs): ("nfs_leftover", "silly_rename"), str(fuse): ("nfs_leftover", "silly_rename")}
    assert _problems(rep) == expected
    rc, rep = fsck(root, "--repair")
    assert rc == 1
    qdir = Path(rep["quarantine"])
    for path, kind in foreign.items():
        assert not path.exists()
        moved = qdir / path.relative_to(root)
        assert (moved / "inner").read_text() == "x" if kind == "dir" else moved.read_text() == "user data"
    assert not old_nfs.exists() and young_nfs.exists() and not fuse.exists()
    assert all(p.exists() for p in reserved)
    assert fsck(root)[0] == 0


def test_manifest_problems(root: Path, hybrid_ns: Namespace, filled: list[StoredPage]) -> None:
    manifest = root / hybrid_ns.digest / MANIFEST_NAME
    manifest.unlink()
    _flip_payload(filled, root)
    rc, rep = fsck(root)
    # Without a manifest the pages are still checked against their place and their own header.
    assert rc == 4
    assert _problems(rep) == {str(manifest): ("manifest", "manifest"), str(filled[0].path): ("bad_page", "checksum")}
    assert rep["counts"]["pages_ok"] == len(filled) - 1
    rc, rep = fsck(root, "--repair")
    assert rc == 4  # the missing manifest needs a human
    assert not filled[0].path.exists()
    manifest.write_text("{broken")
    rc, rep = fsck(root)
    assert rc == 4 and _problems(rep) == {str(manifest): ("manifest", "manifest")}
    assert "unreadable manifest" in rep["problems"][0]["message"]


def test_namespace_dir_with_wrong_name(root: Path, hybrid_ns: Namespace, filled: list[StoredPage]) -> None:
    wrong = root / ("f" * 32)
    os.rename(root / hybrid_ns.digest, wrong)
    rc, rep = fsck(root)
    assert rc == 4
    kinds = {v for v in _problems(rep).values()}
    assert kinds == {("manifest", "manifest"), ("bad_page", "foreign")}


def test_namespace_of_another_format_is_reported_and_left_alone(root: Path, hybrid_ns: Namespace,
                                                                 filled: list[StoredPage]) -> None:
    # A tree written by tierstore page format 1 (two fan-out levels, aa/bb): nodes that still run
    # that version may use it, and its pages are never served here.
    import dataclasses

    old = dataclasses.replace(hybrid_ns, format_version=1)
    write_manifest(root, old)
    page = root / old.digest / "g0" / "r0" / "ab" / "cd" / (page_key(3).hex() + ".kvp")
    page.parent.mkdir(parents=True)
    page.write_bytes(b"a page of format 1")
    for args in ((), ("--repair",)):
        rc, rep = fsck(root, *args)
        assert rc == 4  # needs a human: nothing is deleted
        assert _problems(rep) == {str(root / old.digest / MANIFEST_NAME): ("manifest", "manifest")}
        assert "page format 1" in rep["problems"][0]["message"]
        assert rep["counts"]["pages_ok"] == len(filled)  # the current namespace is walked as usual
    assert page.read_bytes() == b"a page of format 1"


# -- symlink safety ---------------------------------------------------------------------------

def test_symlinks_are_never_followed(tmp_path: Path, root: Path, hybrid_ns: Namespace, filled: list[StoredPage], fsck_path: str) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    victim_file = outside / "precious.kvp"
    victim_file.write_bytes(b"not a page, not yours")
    # An outside tree that looks like a namespace, with a corrupt page in it.
    other = hybrid_namespace(revision="other")
    other_pages = fill_pages(outside / "tree", other, 2)
    corrupt_flip_bit(other_pages[0].path, -1)

    leaf = filled[0].path.parent
    links = [
        leaf / (page_key(77).hex() + ".kvp"),  # page-named link to an outside file
        root / other.digest,  # namespace-looking link to an outside namespace
        root / hybrid_ns.digest / "g0" / "r0" / "ff",  # fan-out-looking link
        leaf / "zz-link",  # a link beside the pages
    ]
    os.symlink(victim_file, links[0])
    os.symlink(outside / "tree" / other.digest, links[1])
    os.symlink(outside / "tree" / other.digest / "g0" / "r0", links[2])
    os.symlink(outside, links[3])

    rc, rep = fsck(root)
    assert rc == 4
    assert _problems(rep) == {str(p): ("symlink", "symlink") for p in links}
    rc, rep = fsck(root, "--repair")
    assert rc == 1
    assert all(p["action"] == "unlinked" for p in rep["problems"])
    assert not any(os.path.lexists(p) for p in links)
    assert victim_file.read_bytes() == b"not a page, not yours"
    assert all(p.path.exists() for p in other_pages)  # the corrupt outside page is untouched
    assert fsck(root)[0] == 0


def test_repair_refuses_a_directory_swapped_for_a_symlink_after_the_scan(
    tmp_path: Path, root: Path, filled: list[StoredPage]
) -> None:
    _flip_payload(filled, root)
    bad = filled[0].path
    inv = walk_root(root, visitor=__import__("tierstore.admin.fsck", fromlist=["PageVerifier"]).PageVerifier(root))
    assert [f.path for f in inv.findings] == [str(bad)]
    # After the scan an attacker (or a confused admin) replaces the leaf directory by a
    # symlink to a directory outside ROOT holding a file of the same name.
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / bad.name).write_bytes(b"outside file")
    shutil.rmtree(bad.parent)
    os.symlink(outside, bad.parent)
    report = FsckReport(root=str(root), repair=True, problems=inv.findings)
    _repair(report, inv.root, quarantine_bad=False)
    assert report.problems[0].action is None and report.problems[0].repair_error
    assert (outside / bad.name).read_bytes() == b"outside file"
    assert report.exit_code == 4


def test_repair_skips_a_file_replaced_after_the_scan(root: Path, hybrid_ns: Namespace, filled: list[StoredPage]) -> None:
    _flip_payload(filled, root)
    bad = filled[0]
    from tierstore.admin.fsck import PageVerifier

    inv = walk_root(root, visitor=PageVerifier(root))
    bad.path.unlink()  # gc removed it, a writer republished a good page under the same name
    write_page(root, hybrid_ns, bad.group_index, bad.key)
    report = FsckReport(root=str(root), repair=True, problems=inv.findings)
    _repair(report, inv.root, quarantine_bad=False)
    assert report.problems[0].action is None and "changed since the scan" in report.problems[0].repair_error
    assert read_stored(root, hybrid_ns, bad) == bad.data


# -- operation ---------------------------------------------------------------------------------

def test_operational_errors(tmp_path: Path, root: Path, filled: list[StoredPage]) -> None:
    before = time.time()
    rc, rep = fsck(tmp_path / "missing")
    assert rc == 8 and rep["error"]
    _assert_run_times(rep, before)  # an error's document has its times too
    (tmp_path / "afile").write_text("x")
    assert fsck(tmp_path / "afile")[0] == 8
    assert fsck(root, "--namespace", "nomatch")[0] == 8


def test_namespace_filter_and_jobs(root: Path, hybrid_ns: Namespace, filled: list[StoredPage]) -> None:
    other = hybrid_namespace(model="another/model")
    other_pages = fill_pages(root, other, 2)
    corrupt_flip_bit(other_pages[0].path, -1)
    assert fsck(root, "--namespace", hybrid_ns.digest[:8])[0] == 0
    rc, rep = fsck(root, "--namespace", other.digest)
    assert rc == 4 and rep["counts"]["pages_ok"] == len(other_pages) - 1
    serial = fsck(root, "--jobs", "1")[1]
    parallel = fsck(root, "--jobs", "16")[1]
    assert serial["problems"] == parallel["problems"]
    assert serial["counts"] == parallel["counts"]


def test_live_tree_vanishing_files_are_not_problems(root: Path, hybrid_ns: Namespace, filled: list[StoredPage]) -> None:
    # A visitor that deletes the page before reading it behaves like gc racing fsck.
    from tierstore.admin.fsck import PageVerifier

    verifier = PageVerifier(root)

    def racing(ref):  # type: ignore[no-untyped-def]
        os.unlink(ref.path)
        return verifier(ref)

    inv = walk_root(root, visitor=racing)
    assert inv.findings == [] and inv.vanished == len(filled)


def test_text_output(root: Path, filled: list[StoredPage], capsys: pytest.CaptureFixture[str]) -> None:
    _flip_payload(filled, root)
    assert main(["fsck", str(root)]) == 4
    out = capsys.readouterr().out
    assert f"bad_page/checksum: {filled[0].path}" in out and "--repair" in out
    assert main(["fsck", str(root), "--repair"]) == 1
    assert "[deleted]" in capsys.readouterr().out


def test_page_bytes_is_deterministic() -> None:
    # page_bytes is deterministic: the same arguments give the same bytes.
    layout = hybrid_namespace().groups[2].layout
    assert page_bytes(layout, b"k", 2) == page_bytes(layout, b"k", 2) != page_bytes(layout, b"k", 2, seed=1)


@pytest.mark.parametrize("odirect", ["auto", "off"])
def test_pages_stored_by_the_engine_are_clean_and_canonical(tmp_path: Path, hybrid_ns: Namespace, odirect: str) -> None:
    pytest.importorskip("torch")
    from tierstore.config import TierStoreConfig
    from tierstore.rootstore.engine import IOEngine

    root = tmp_path / "engine-root"
    ref_root = tmp_path / "ref-root"
    for g, group in enumerate(hybrid_ns.groups):
        with IOEngine(root, hybrid_ns, g, config=TierStoreConfig(root=str(root), odirect=odirect, io_threads=2)) as eng:
            jobs = []
            for i in range(3):
                slot = eng.acquire_slot(timeout=5)
                assert slot is not None
                data = page_bytes(group.layout, page_key(i), g)
                slot.view[: len(data)] = data
                jobs.append(eng.submit_store(page_key(i), slot, group.tokens_per_chunk))
            results = eng.wait(jobs, timeout=30)
            assert all(r.ok for r in results), [r.error for r in results]
        for i in range(3):
            ref = write_page(ref_root, hybrid_ns, g, page_key(i))
            assert FileMapper(root, hybrid_ns.digest, g).path_for(page_key(i)).read_bytes() == ref.path.read_bytes()
    rc, rep = fsck(root)
    assert rc == 0, rep["problems"]
    assert rep["counts"]["pages_ok"] == 9 and rep["counts"]["temps_active"] == 0


def test_leftover_odirect_probe_is_a_temp(root: Path, hybrid_ns: Namespace, filled: list[StoredPage]) -> None:
    probe = root / hybrid_ns.digest / "g0" / "r0" / ".odirect-probe.123.456.tmp"
    probe.write_bytes(bytes(4096))
    assert fsck(root)[0] == 0  # young: an engine may be probing right now
    _age(probe, 7200)
    rc, rep = fsck(root)
    assert rc == 4 and _problems(rep) == {str(probe): ("stale_temp", "temp")}
    assert fsck(root, "--repair")[0] == 1 and not probe.exists()


def test_a_failing_visitor_stops_the_walk_early(root: Path, hybrid_ns: Namespace) -> None:
    fill_pages(root, hybrid_ns, 40)
    calls = []

    def boom(ref):  # type: ignore[no-untyped-def]
        calls.append(ref.path)
        raise RuntimeError("visitor bug")

    with pytest.raises(RuntimeError, match="visitor bug"):
        walk_root(root, visitor=boom, jobs=2)
    assert len(calls) < 20  # the other worker stops at its next directory


def test_progress_line_only_when_enabled(root: Path, filled: list[StoredPage]) -> None:
    import io

    from tierstore.admin.fsck import PageVerifier
    from tierstore.admin.progress import Progress

    shown, hidden = io.StringIO(), io.StringIO()
    for stream, enabled in ((shown, True), (hidden, False)):
        progress = Progress("fsck", stream=stream, enabled=enabled)
        walk_root(root, visitor=PageVerifier(root), progress=progress)
        progress.close()
    assert "100.0%" in shown.getvalue() and f"{len(filled)} files" in shown.getvalue()
    assert hidden.getvalue() == ""
    assert Progress("x", stream=io.StringIO()).enabled is False  # not a terminal


@pytest.mark.parametrize(("shape", "why"), [
    ((2**30, 2**30, 2), "more than any page"),  # 2^63 bytes: over format.MAX_PAGE_BYTES, every reader refuses
    ((2**30, 2), "more than fsck verifies without a manifest"),  # 8 GiB: over fsck's own bound
])
def test_crafted_huge_page_does_not_exhaust_memory(
    root: Path, hybrid_ns: Namespace, filled: list[StoredPage], shape: tuple[int, ...], why: str
) -> None:
    # A checksum-valid zstd page declaring a huge section, in a namespace whose manifest is
    # gone (so no layout to compare with): fsck must report it, not allocate it.
    from tierstore.format.header import GroupKind, SectionEntry, encode_header
    from tierstore.format.page_layout import SectionSpec
    from tierstore.testing import page_meta

    (root / hybrid_ns.digest / MANIFEST_NAME).unlink()
    key = page_key(500)
    meta = page_meta(hybrid_ns, 0, key)
    assert meta.group_kind == GroupKind.ATTENTION
    huge = SectionEntry(SectionSpec("x", "float32", shape), 0, 16, 0)
    path = FileMapper(root, hybrid_ns.digest, 0).path_for(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(encode_header(meta, Codec.ZSTD, [huge], 16) + bytes(16))
    rc, rep = fsck(root)
    assert rc == 4
    assert _problems(rep)[str(path)] == ("bad_page", "format")
    assert why in next(p["message"] for p in rep["problems"] if p["path"] == str(path))


def test_repair_refuses_a_root_that_is_not_a_cache(tmp_path: Path) -> None:
    home = tmp_path / "home"
    (home / "alice").mkdir(parents=True)
    (home / "alice" / "thesis.tex").write_text("years of work")
    rc, rep = fsck(home)
    assert rc == 4 and _problems(rep) == {str(home / "alice"): ("foreign", "dir")}
    rc, rep = fsck(home, "--repair")
    assert rc == 8 and "refusing" in rep["error"]
    assert (home / "alice" / "thesis.tex").read_text() == "years of work"
    assert not (home / ".quarantine").exists()


def test_temp_of_a_killed_unreaped_writer_is_stale(root: Path, filled: list[StoredPage]) -> None:
    import signal

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        temp = filled[0].path.parent / f".{page_key(1).hex()}.kvp.{host_tag()}.{proc.pid}.abcd.tmp"
        temp.write_bytes(b"partial")
        assert fsck(root)[0] == 0  # writer alive: in flight
        proc.send_signal(signal.SIGKILL)
        deadline = time.time() + 10
        while time.time() < deadline and fsck(root)[0] == 0:
            time.sleep(0.05)
        rc, rep = fsck(root)  # a zombie until reaped below: already stale
        assert rc == 4 and _problems(rep) == {str(temp): ("stale_temp", "temp")}
    finally:
        proc.kill()
        proc.wait()


def test_io_errors_are_reported_but_never_repaired_by_deletion(root: Path, filled: list[StoredPage], monkeypatch) -> None:
    import errno

    import tierstore.admin.fsck_read as fsck_mod
    from tierstore.errors import PageIOError

    real = fsck_mod.open_page
    target = str(filled[0].path)

    def flaky(name, *args, **kw):  # type: ignore[no-untyped-def]
        if kw.get("where") == target:
            raise PageIOError("read failed: Input/output error", errno=errno.EIO, path=target)
        return real(name, *args, **kw)

    monkeypatch.setattr(fsck_mod, "open_page", flaky)
    fsck_per_page(monkeypatch)
    rc, rep = fsck(root, "--repair")
    assert rc == 4 and _problems(rep) == {target: ("unreadable", "io")}
    assert filled[0].path.exists()


# -- canonical bytes and --deep -------------------------------------------------------------

def _golden_gdn_tree(root: Path) -> tuple[Path, object]:
    """The golden GDN page (sections with alignment gaps) at its place in a tree."""
    from tierstore.testing import golden

    gp = next(g for g in golden.golden_pages() if g.name == "gdn_gaps")
    write_manifest(root, gp.namespace)
    path = FileMapper(root, gp.namespace.digest, 0, 0).path_for(gp.meta.key)
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(golden.GOLDEN_DIR / gp.filename, path)
    return path, gp


def test_non_zero_gap_bytes_make_a_bad_page(root: Path, fsck_path: str) -> None:
    path, gp = _golden_gdn_tree(root)
    assert fsck(root)[0] == 0 and fsck(root, "--deep")[0] == 0
    data = bytearray(path.read_bytes())
    data[4096 + gp.layout.gaps[0][0]] = 0x42  # not covered by any checksum
    path.write_bytes(bytes(data))
    for args in ((), ("--deep",)):
        rc, rep = fsck(root, *args)
        assert rc == 4 and _problems(rep) == {str(path): ("bad_page", "checksum")}
        assert "alignment gap" in rep["problems"][0]["message"]


def test_deep_reports_nan_and_inf_that_checksums_cannot_see(root: Path, hybrid_ns: Namespace,
                                                            filled: list[StoredPage]) -> None:
    assert fsck(root, "--deep")[0] == 0  # realistic values: nothing to report
    layout = hybrid_ns.groups[2].layout
    good = bytearray(page_bytes(layout, page_key(90), 2))
    o_bf16 = layout.offsets[0]  # a bf16 conv state: quiet NaN 0x7FC0
    good[o_bf16 : o_bf16 + 2] = (0x7FC0).to_bytes(2, "little")
    nan_page = write_page(root, hybrid_ns, 2, page_key(90), data=bytes(good))
    inf = bytearray(page_bytes(layout, page_key(91), 2))
    o_f32 = layout.offsets[1]  # an fp32 SSM state: +Inf
    inf[o_f32 + 8 : o_f32 + 12] = (0x7F800000).to_bytes(4, "little")
    inf_page = write_page(root, hybrid_ns, 2, page_key(91), data=bytes(inf), codec=Codec.ZSTD)
    assert fsck(root)[0] == 0  # valid checksums: only the deep check sees them
    rc, rep = fsck(root, "--deep")
    assert rc == 4
    assert _problems(rep) == {str(nan_page.path): ("bad_page", "nonfinite"), str(inf_page.path): ("bad_page", "nonfinite")}
    assert "NaN/Inf" in rep["problems"][0]["message"]
    rc, rep = fsck(root, "--deep", "--repair")
    assert rc == 1 and not nan_page.path.exists() and not inf_page.path.exists()
    assert fsck(root, "--deep")[0] == 0


def test_deep_check_page_dtype_rules() -> None:
    import numpy as np

    from tierstore.admin.fsck import deep_check_page
    from tierstore.format.header import decode_header
    from tierstore.format.page import encode_page
    from tierstore.format.page_layout import PageLayout, SectionSpec
    from tierstore.testing.pages import page_meta

    for dtype, bad in (("float8_e4m3fn", 0x7F), ("float8_e5m2", 0xFC), ("float16", 0x7C00), ("uint8", None)):
        layout = PageLayout((SectionSpec("s", dtype, (8,)),))
        ns = hybrid_namespace()
        meta = page_meta(ns, 0, page_key(1))
        buf = bytearray(np.full(layout.nbytes, 0x01, dtype=np.uint8).tobytes())
        header = decode_header(encode_page(meta, layout, buf)[0])
        assert deep_check_page(header, memoryview(buf)) is None
        if bad is not None:
            size = layout.sections[0].itemsize
            buf[size : 2 * size] = bad.to_bytes(size, "little")
            assert deep_check_page(header, memoryview(buf))[0] == "nonfinite"


def test_deep_counts_non_canonical_pages_of_an_older_format_and_leaves_them(root: Path, monkeypatch) -> None:
    """A format-2 tree (gaps not zeroed then): fsck reports the namespace, --deep also counts
    its pages with non-zero gap bytes; nothing is read as ours or changed, --repair included."""
    import dataclasses

    import tierstore.format.header as fmt
    from tierstore.format.header import PageMeta
    from tierstore.format.page import encode_page
    from tierstore.testing import golden

    gp = next(g for g in golden.golden_pages() if g.name == "gdn_gaps")
    old = dataclasses.replace(gp.namespace, format_version=2)
    write_manifest(root, old)
    monkeypatch.setattr(fmt, "FORMAT_VERSION", 2)  # encode_header writes the module's version
    paths = []
    for i, gap_byte in enumerate((0, 0x37, 0x99)):
        key = page_key(i)
        header, _ = encode_page(PageMeta(old.digest_bytes, key, 0, gp.meta.group_kind, 16), gp.layout, gp.expected)
        payload = bytearray(gp.expected)
        for a, b in gp.layout.gaps:
            payload[a:b] = bytes([gap_byte]) * (b - a)
        path = FileMapper(root, old.digest, 0, 0).path_for(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(header + bytes(payload))
        paths.append(path)
    monkeypatch.undo()
    before = [p.read_bytes() for p in paths]
    manifest = str(root / old.digest / MANIFEST_NAME)
    rc, rep = fsck(root)
    assert rc == 4 and _problems(rep) == {manifest: ("manifest", "manifest")}
    for args in (("--deep",), ("--deep", "--repair")):
        rc, rep = fsck(root, *args)
        assert rc == 4
        kinds = sorted((p["path"], p["kind"]) for p in rep["problems"])
        assert kinds == [(manifest, "manifest"), (manifest, "noncanonical")]
        msg = next(p["message"] for p in rep["problems"] if p["kind"] == "noncanonical")
        assert "page format 2: 2 of 3 page(s)" in msg
    assert [p.read_bytes() for p in paths] == before


@pytest.mark.slow
def test_fsck_gates_its_threads_by_what_pays_off(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """By default fsck's 64 threads pass an adaptive gate. Pages that each take a slow mount's
    latency (a 4 ms sleep per page, no CPU) drive the limit up from 4 on a fast root, and keep
    it at 64 on a root that answers slowly; an explicit --jobs is kept as given."""
    from tierstore.admin import fsck as fsck_module
    from tierstore.admin.fsck import FsckOptions, PageVerifier, run_fsck
    from tierstore.testing import simple_namespace

    ns = simple_namespace()
    write_manifest(root, ns)
    data = page_bytes(ns.groups[0].layout, b"gate")
    for i in range(4000):
        write_page(root, ns, 0, page_key(i), data=data)
    real = PageVerifier._verify_fd

    def slow(self: PageVerifier, *args: object) -> object:  # the page is open (a read in flight)
        time.sleep(0.004)
        return real(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(PageVerifier, "_verify_fd", slow)
    fsck_per_page(monkeypatch)
    rep = run_fsck(FsckOptions(root, progress=False))
    assert rep.pages_ok == 4000 and not rep.problems
    assert rep.reads["adaptive"] and rep.reads["threads"] == 64
    assert rep.reads["limit_max"] >= 32 and rep.reads["max_in_flight"] >= 16  # climbed from 4
    monkeypatch.setattr(fsck_module, "root_latency_s", lambda root: 0.01)  # a 10 ms mount
    slow_root = run_fsck(FsckOptions(root, progress=False))
    # The gate's verdict is the limit; the in-flight peak only shows the threads really ran past
    # the fast root's start of 4 (a loaded 2-core machine has reached 47 of 64, not always 48).
    assert slow_root.reads["limit_final"] == 64 and slow_root.reads["max_in_flight"] > 32
    monkeypatch.undo()
    fsck_per_page(monkeypatch)
    assert fsck_module.root_latency_s(root) < fsck_module.SLOW_ROOT_S  # this disk starts low
    fixed = run_fsck(FsckOptions(root, jobs=3, progress=False))
    assert fixed.pages_ok == 4000
    assert not fixed.reads["adaptive"] and fixed.reads["limit_max"] == 3 and fixed.reads["max_in_flight"] <= 3
