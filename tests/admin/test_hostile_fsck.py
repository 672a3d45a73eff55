"""fsck and the tiers' hit path on a root others can write to (issue 17): each hostile input
planted next to valid pages and a sentinel directory outside the root. fsck / fsck --repair /
the shared tier's touch must leave the sentinel alone (names, contents, mtimes), never hang,
report one finding per bad entry and keep reporting (and serving) the valid pages."""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

import pytest
from hostile_helpers import fsck_per_page, snapshot, swap_for_link, traced_peak, within

from tierstore.admin import fsck as fsck_mod
from tierstore.admin import fsck_read
from tierstore.admin.fsck import FsckOptions, FsckReport, run_fsck
from tierstore.errors import PageUnsafe
from tierstore.format.identity import MANIFEST_NAME, write_manifest
from tierstore.format.layout import attention_layout
from tierstore.fs.mapper import FileMapper
from tierstore.rootstore.rank_dir import RankDir
from tierstore.testing.pages import (
    corrupt_flip_bit,
    fill_pages,
    layout_namespace,
    page_key,
    simple_namespace,
)
from tierstore.tiers.shared import touch_page

NS = simple_namespace()
pytestmark = pytest.mark.timeout(120)


def fill(root: Path, n: int = 8) -> list[Path]:
    return [p.path for p in fill_pages(root, NS, n)]


def fsck(root: Path, **kw: object) -> FsckReport:
    return within(60, lambda: run_fsck(FsckOptions(root, progress=False, **kw)))  # type: ignore[return-value]


def kinds(rep: FsckReport) -> dict[str, tuple[str, str]]:
    return {p.path: (p.category, p.kind) for p in rep.problems}


# ------------------------------------------------------------------ reserved root entries
@pytest.mark.parametrize("name", [".tierstore-trash", ".tierstore", ".tierstore-gc.lease"])
def test_symlinked_reserved_entry_is_reported_and_only_the_link_removed(root: Path, sentinel: Path, name: str) -> None:
    paths = fill(root)
    before = snapshot(sentinel)
    (root / name).symlink_to(sentinel)
    rep = fsck(root)
    assert kinds(rep) == {str(root / name): ("symlink", "symlink")} and rep.exit_code == 4
    assert rep.pages_ok == len(paths)
    rep = fsck(root, repair=True)
    assert rep.exit_code == 1 and not (root / name).is_symlink()
    assert snapshot(sentinel) == before and all(p.exists() for p in paths)


def test_reserved_entry_of_the_wrong_type_is_reported(root: Path, sentinel: Path) -> None:
    fill(root)
    (root / ".tierstore-gc.lease").mkdir()  # a directory at the lease path
    (root / ".tierstore-trash").write_bytes(b"not a directory")
    os.mkfifo(root / ".tierstore")
    rep = fsck(root)
    assert {k: v for k, v in kinds(rep).items()} == {
        str(root / n): ("foreign", "reserved") for n in (".tierstore-gc.lease", ".tierstore-trash", ".tierstore")}
    rep = fsck(root, repair=True)  # quarantined, never deleted (it may be someone's data)
    assert rep.exit_code == 1 and not (root / ".tierstore").exists()


# ------------------------------------------------------------------ pages
def test_hard_linked_page_is_reported_never_read_and_outside_untouched(root: Path, sentinel: Path) -> None:
    paths = fill(root)
    os.unlink(paths[0])
    os.link(sentinel / "precious0.kvp", paths[0])
    before = snapshot(sentinel)
    rep = fsck(root)
    assert kinds(rep) == {str(paths[0]): ("foreign", "unsafe")} and "links" in rep.problems[0].message
    assert rep.pages_ok == len(paths) - 1
    rep = fsck(root, repair=True)
    assert rep.problems[0].action == "quarantined" and not paths[0].exists()
    assert snapshot(sentinel) == before


def test_symlinked_page_and_fanout_dir_are_not_followed(root: Path, sentinel: Path) -> None:
    paths = fill(root)
    os.unlink(paths[0])
    paths[0].symlink_to(sentinel / "precious0.kvp")
    fan = next(p.parent for p in paths[1:] if p.parent != paths[0].parent)
    moved = [p for p in paths if p.parent == fan]
    swap_for_link(fan, sentinel, "zz")
    before = snapshot(sentinel)
    rep = fsck(root)
    assert kinds(rep)[str(paths[0])] == ("symlink", "symlink") and kinds(rep)[str(fan)] == ("symlink", "symlink")
    assert rep.pages_ok == len(paths) - 1 - len(moved)
    fsck(root, repair=True)
    assert snapshot(sentinel) == before and not fan.exists() and not paths[0].exists()


def test_page_swapped_for_a_fifo_after_the_listing_does_not_hang(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    paths = fill(root)
    victim = str(paths[0])
    real = fsck_read.open_page

    def swap_then_open(name: str, *args: object, **kw: object) -> object:
        if kw.get("where") == victim and not stat.S_ISFIFO(os.lstat(victim).st_mode):
            os.unlink(victim)
            os.mkfifo(victim)  # nobody ever writes to it: a blocking open would hang for good
        return real(name, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(fsck_read, "open_page", swap_then_open)
    fsck_per_page(monkeypatch)
    rep = fsck(root)
    assert kinds(rep) == {victim: ("foreign", "unsafe")} and rep.pages_ok == len(paths) - 1


def test_fanout_dir_swapped_for_a_symlink_during_the_scan(root: Path, sentinel: Path,
                                                           monkeypatch: pytest.MonkeyPatch, fsck_path: str) -> None:
    paths = fill(root)
    fan = paths[0].parent
    inside = [p for p in paths if p.parent == fan]
    for p in inside:  # the outside directory holds files named like the pages
        (sentinel / p.name).write_bytes(p.read_bytes())
    before = snapshot(sentinel)
    real = fsck_read.PageVerifier._dir_fd
    swapped: list[bool] = []

    def swap_then_open(self: fsck_read.PageVerifier, parts: tuple[str, ...]) -> int:
        if parts[-1] == fan.name and not swapped:
            swapped.append(True)
            swap_for_link(fan, sentinel)
        return real(self, parts)

    monkeypatch.setattr(fsck_read.PageVerifier, "_dir_fd", swap_then_open)
    rep = fsck(root)
    assert swapped and snapshot(sentinel) == before
    assert {kinds(rep)[str(p)] for p in inside} == {("foreign", "unsafe")}
    assert rep.pages_ok == len(paths) - len(inside)


def test_directory_swapped_for_a_symlink_during_repair_touches_nothing_outside(
        root: Path, sentinel: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    paths = fill(root)
    corrupt_flip_bit(paths[0], -3, bit=5)
    fan = paths[0].parent
    (sentinel / paths[0].name).write_bytes(b"outside file named like the bad page")
    before = snapshot(sentinel)

    def swap() -> None:
        swap_for_link(fan, sentinel)

    monkeypatch.setattr(fsck_mod, "_before_repair_hook", swap)
    rep = fsck(root, repair=True)
    assert snapshot(sentinel) == before
    bad = next(p for p in rep.problems if p.path == str(paths[0]))
    assert bad.action is None and "symlink" in (bad.repair_error or "")
    assert (fan.with_name("moved") / paths[0].name).exists()  # not removed through the link


def test_too_open_page_mode_is_a_warning_and_repaired_through_the_fd(root: Path) -> None:
    paths = fill(root)
    os.chmod(root / NS.digest, 0o700)
    os.chmod(paths[0], 0o644)
    rep = fsck(root)
    assert rep.exit_code == 0 and rep.pages_ok == len(paths)  # content is fine: a warning
    assert [(w.path, w.category, w.kind) for w in rep.warnings] == [(str(paths[0]), "mode", "private")]
    assert "mode/private" in rep.format_text()
    fsck(root, repair=True)
    assert stat.S_IMODE(paths[0].stat().st_mode) == 0o600
    assert fsck(root, group_access=True).warnings == []  # 0600 is within a group fleet's 0660
    os.chmod(paths[1], 0o664)
    assert [w.path for w in fsck(root, group_access=True).warnings] == [str(paths[1])]


# ------------------------------------------------------------------ manifests
@pytest.mark.parametrize("plant", ["fifo", "huge", "nested", "overflow", "kind"])
def test_bad_manifest_is_one_finding_and_never_hangs(root: Path, plant: str) -> None:
    paths = fill(root)
    other = layout_namespace(attention_layout(("l0",), 1, 4, 8, "float16"), 4, model="other")
    write_manifest(root, other)
    m = root / other.digest / MANIFEST_NAME
    m.unlink()
    if plant == "fifo":
        os.mkfifo(m)
    elif plant == "huge":
        with open(m, "wb") as f:
            f.truncate(500 << 20)  # sparse: costs the planter nothing
    elif plant == "nested":
        m.write_text("[" * 100_000 + "]" * 100_000)
    elif plant == "overflow":
        m.write_text(json.dumps(other.manifest()).replace('"format_version": 3', '"format_version": 1e400'))
    else:
        m.write_text(json.dumps(other.manifest()).replace('"kind": ', '"kind": "x", "was": '))
    rep, peak = traced_peak(lambda: fsck(root))
    assert kinds(rep) == {str(m): ("manifest", "manifest")} and rep.pages_ok == len(paths)
    assert peak < 64 << 20


def test_planted_manifest_with_a_huge_layout_allocates_nothing_for_a_bogus_page(root: Path) -> None:
    fill(root)
    huge = layout_namespace(attention_layout(("l0",), 64, 4096, 1024, "float32"), 4096, model="huge")  # 4 GiB pages
    write_manifest(root, huge)
    key = page_key(1)
    path = FileMapper(root, huge.digest, 0).path_for(key)
    path.parent.mkdir(parents=True)
    with open(path, "wb") as f:  # a sparse file of the layout's size, no valid header
        f.truncate(huge.groups[0].layout.nbytes + 4096)
    rep, peak = traced_peak(lambda: fsck(root))
    assert kinds(rep)[str(path)][0] == "bad_page" and peak < 64 << 20


def test_buffers_stay_within_the_budget_across_threads(root: Path) -> None:
    paths = fill(root, 64)
    page = NS.groups[0].layout.nbytes
    rep = fsck(root, jobs=16, budget_bytes=3 * page)
    assert rep.pages_ok == len(paths) and 0 < rep.reads["peak_buffer_bytes"] <= 3 * page


# ------------------------------------------------------------------ one entry never ends the walk
def test_an_unexpected_exception_on_one_page_is_a_finding(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    paths = fill(root)
    real = fsck_read.PageVerifier._verify_fd

    def boom(self: fsck_read.PageVerifier, ref: object, fd: int, st: os.stat_result) -> object:
        if ref.path == str(paths[0]):  # type: ignore[attr-defined]
            raise RecursionError("planted")
        return real(self, ref, fd, st)  # type: ignore[arg-type]

    monkeypatch.setattr(fsck_read.PageVerifier, "_verify_fd", boom)
    fsck_per_page(monkeypatch)
    rep = fsck(root)
    assert kinds(rep) == {str(paths[0]): ("unreadable", "error")} and rep.pages_ok == len(paths) - 1


# ------------------------------------------------------------------ display-safe text
def test_text_output_escapes_names_and_survives_non_utf8(root: Path) -> None:
    fill(root)
    ns_dir = os.fsencode(root / NS.digest)
    evil = b"x\x1b[31m\nbad_page:checksum: forged line\xff.kvp"
    with open(os.path.join(ns_dir, evil), "wb") as f:
        f.write(b"planted")
    rep = fsck(root)
    text = rep.format_text()
    assert "\x1b" not in text and "\nbad_page:checksum: forged" not in text
    assert "\\x1b[31m\\nbad_page" in text and "\\xff" in text
    text.encode("utf-8")  # a strict UTF-8 stdout does not fail
    raw = json.dumps(rep.to_json())  # JSON keeps the name (escaped by JSON itself)
    assert json.loads(raw)["problems"][0]["path"].endswith(os.fsdecode(evil))


# ------------------------------------------------------------------ the shared tier's touch
def test_touch_is_fd_based_and_never_reaches_outside(root: Path, sentinel: Path) -> None:
    paths = fill(root)
    dirs = RankDir(root, (NS.digest, "g0", "r0"))
    try:
        old = time.time() - 5000
        os.utime(paths[1], (old, old))
        touch_page(dirs, page_key(1), str(paths[1]))  # a plain page: stamped
        assert paths[1].stat().st_mtime > old + 1000
        before = snapshot(sentinel)
        os.unlink(paths[0])
        os.link(sentinel / "precious0.kvp", paths[0])  # a hard link to an outside file
        with pytest.raises(PageUnsafe):
            touch_page(dirs, page_key(0), str(paths[0]))
        fan = paths[2].parent
        (sentinel / paths[2].name).write_bytes(b"outside file named like a page")
        before = snapshot(sentinel)
        swap_for_link(fan, sentinel)  # a fan-out directory replaced by a link
        with pytest.raises(PageUnsafe):
            touch_page(dirs, page_key(2), str(paths[2]))
        assert snapshot(sentinel) == before
    finally:
        dirs.close()


def test_chain_unsafe_shared_page_is_a_miss_and_the_tier_stays_up(tmp_path: Path, sentinel: Path) -> None:
    from tiers_helpers import expected, key, load, store

    from tierstore.config import TierStoreConfig
    from tierstore.metrics import MetricsRegistry
    from tierstore.tiers import TierChain, close_shared_state, open_group_store

    conf = TierStoreConfig(root=str(tmp_path / "shared"), host_bytes=1 << 20)
    st = open_group_store(conf, NS, 0, metrics=MetricsRegistry())
    try:
        assert store(st, key(1)).ok and store(st, key(2)).ok
    finally:
        st.close()
    shared_path = FileMapper(conf.root, NS.digest, 0).path_for(key(2))
    os.unlink(shared_path)
    os.link(sentinel / "precious0.kvp", shared_path)
    before = snapshot(sentinel)
    reg = MetricsRegistry()
    st = open_group_store(conf, NS, 0, metrics=reg)
    try:
        assert isinstance(st, TierChain) and st.shared is not None
        assert load(st, key(1))[2] == expected(st, key(1))  # valid page served (and touched)
        ok, kind, _ = within(30, lambda: load(st, key(2)))  # type: ignore[misc]
        assert not ok and kind == "unsafe"
        assert st.shared.health.up and reg.tier("shared").get("misses") == 1
        assert reg.tier("shared").failures().get("unsafe") == 1
        time.sleep(0.2)  # the touch of key(1) runs in the background
        assert snapshot(sentinel) == before and shared_path.stat().st_nlink == 2
    finally:
        st.close()
        close_shared_state()


def test_reserved_root_names_agree_with_their_owners() -> None:
    from tierstore.fs.lease import LEASE_NAME
    from tierstore.index.local_index import INDEX_DIR
    from tierstore.tiers.gc_scan import TRASH_DIR

    assert fsck_mod.RESERVED_ROOT_ENTRIES == {TRASH_DIR: True, LEASE_NAME: False, INDEX_DIR: True}
