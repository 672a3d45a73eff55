"""Create-only publication (``rootstore/publish.py``): an existing final name is "not stored",
never replaced; renameat2's refusal of RENAME_NOREPLACE switches a root to link(2) once; the
link window (a page with two links for a moment) neither fails a load nor gets the page moved
aside as planted; planted entries are moved aside, never deleted."""

from __future__ import annotations

import errno
import os
import stat
import time
from pathlib import Path
from typing import Any

import pytest
from tiers_helpers import load_page, store

from tierstore.config import TierStoreConfig
from tierstore.errors import PageStoreError
from tierstore.native import loader as native
from tierstore.rootstore import page_io, publish
from tierstore.rootstore.engine import IOEngine
from tierstore.rootstore.publish import CreateOnly
from tierstore.testing.pages import page_key, simple_namespace


def _memo(use_link: bool) -> CreateOnly:
    memo = CreateOnly("test")
    memo.use_link = use_link
    return memo


def _names(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


@pytest.mark.parametrize("use_link", [False, True], ids=["renameat2", "link"])
@pytest.mark.parametrize("relative", [False, True], ids=["paths", "dir_fd"])
def test_an_existing_final_name_is_not_stored_and_the_temp_is_removed(tmp_path: Path, use_link: bool,
                                                                       relative: bool) -> None:
    (tmp_path / "page.kvp").write_bytes(b"first")
    memo = _memo(use_link)
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY) if relative else None
    try:
        final, tmp = ("page.kvp", ".page.tmp") if relative else (str(tmp_path / "page.kvp"), str(tmp_path / ".page.tmp"))
        assert publish.publish(final, tmp, [b"second"], dir_fd=fd, where=str(tmp_path / "page.kvp"), memo=memo) is False
        assert publish.publish(final.replace("page", "other"), tmp, [b"other"], dir_fd=fd, memo=memo) is True
    finally:
        if fd is not None:
            os.close(fd)
    assert (tmp_path / "page.kvp").read_bytes() == b"first"  # never replaced
    assert _names(tmp_path) == ["other.kvp", "page.kvp"]  # no temp left
    assert (tmp_path / "other.kvp").read_bytes() == b"other" and os.stat(tmp_path / "other.kvp").st_nlink == 1
    assert memo.use_link is use_link


def _refusing(monkeypatch: pytest.MonkeyPatch, err: int) -> list[str]:
    calls: list[str] = []

    def refused(src: str, dst: str, *, dir_fd: int | None, flags: int) -> None:
        calls.append(dst)
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(publish, "renameat2", refused)
    return calls


@pytest.mark.parametrize("err", [errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP])
def test_a_refused_noreplace_falls_back_to_link_once_per_memo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             err: int) -> None:
    calls = _refusing(monkeypatch, err)
    memo = CreateOnly("test")
    assert memo.use_link is False  # renameat2 first (glibc has it here)
    for i in range(3):
        assert publish.publish(str(tmp_path / f"p{i}.kvp"), str(tmp_path / f".p{i}.tmp"), [b"x" * i], memo=memo)
    assert memo.use_link is True and len(calls) == 1  # not retried for every page
    assert publish.publish(str(tmp_path / "p0.kvp"), str(tmp_path / ".again.tmp"), [b"y"], memo=memo) is False
    assert _names(tmp_path) == ["p0.kvp", "p1.kvp", "p2.kvp"]
    assert all(os.stat(tmp_path / n).st_nlink == 1 for n in _names(tmp_path))
    assert (tmp_path / "p2.kvp").read_bytes() == b"xx"


def test_other_renameat2_errors_fail_the_store_and_keep_the_choice(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    _refusing(monkeypatch, errno.EIO)
    memo = CreateOnly("test")
    with pytest.raises(PageStoreError) as ei:
        publish.publish(str(tmp_path / "p.kvp"), str(tmp_path / ".p.tmp"), [b"x"], memo=memo)
    assert ei.value.kind == "io" and ei.value.errno == errno.EIO
    assert _names(tmp_path) == [] and memo.use_link is False


def test_a_link_answered_eexist_that_went_through_is_ours(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """NFS: a LINK the server did, answered EEXIST to a retransmission; the temp's link count
    says the final name is ours."""
    real_link = os.link

    def link_then_eexist(*args: Any, **kwargs: Any) -> None:
        real_link(*args, **kwargs)
        raise FileExistsError(errno.EEXIST, "File exists")

    monkeypatch.setattr(os, "link", link_then_eexist)
    assert publish.publish(str(tmp_path / "p.kvp"), str(tmp_path / ".p.tmp"), [b"x"], memo=_memo(True)) is True
    assert _names(tmp_path) == ["p.kvp"] and os.stat(tmp_path / "p.kvp").st_nlink == 1


def test_publish_page_answers_false_for_a_page_that_appeared_meanwhile(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    final = tmp_path / "p.kvp"
    final.write_bytes(b"racer")
    monkeypatch.setattr(Path, "exists", lambda self: False)  # the racer published after the check
    assert publish.publish_page(final, tmp_path / ".p.tmp", b"h", [b"x"]) is False
    assert final.read_bytes() == b"racer" and _names(tmp_path) == ["p.kvp"]


def test_memos_of_callers_without_one_are_per_file_system(tmp_path: Path) -> None:
    a = publish.memo_for(str(tmp_path / "x.kvp"), None)
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert publish.memo_for("x.kvp", fd) is a
    finally:
        os.close(fd)


def _stat(nlink: int) -> os.stat_result:
    return os.stat_result((stat.S_IFREG | 0o600, 1, 1, nlink, 0, 0, 10, 0, 0, 0))


def test_past_link_window_looks_again_only_at_two_links(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(page_io, "LINK_WINDOW_S", (0.0, 0.0, 0.0))
    seen = iter([_stat(2), _stat(1)])
    assert page_io.past_link_window(_stat(2), lambda: next(seen)).st_nlink == 1
    assert page_io.past_link_window(_stat(2), lambda: _stat(2)).st_nlink == 2  # still two: the caller refuses it
    never: list[int] = []
    assert page_io.past_link_window(_stat(3), lambda: never.append(1) or _stat(1)).st_nlink == 3
    assert page_io.past_link_window(_stat(1), lambda: never.append(1) or _stat(1)).st_nlink == 1
    assert never == []


# ------------------------------------------------------------------ through an engine
def _engine(root: Path, loop: str = "python") -> IOEngine:
    config = TierStoreConfig.from_dict({"root": str(root), "io_loop": loop, "io_threads": 1, "odirect": "off"})
    return IOEngine(root, simple_namespace(), 0, config=config)


def _in_link_window(monkeypatch: pytest.MonkeyPatch, path: Path) -> Path:
    """Give the page ``path`` a second name, as a link(2) publisher has between its link and the
    unlink of its temp; that name goes at the first pause of ``past_link_window``."""
    temp = path.with_name(f".{path.name}.host.1.abc.tmp")
    os.link(path, temp)
    real_sleep = time.sleep

    def sleep(seconds: float) -> None:
        if temp.exists():
            temp.unlink()  # the publisher drops its temp name
        real_sleep(seconds)

    monkeypatch.setattr(time, "sleep", sleep)
    return temp


@pytest.mark.parametrize("op", ["load", "store"])
def test_a_page_in_a_link_window_is_served_and_not_moved_aside(root: Path, monkeypatch: pytest.MonkeyPatch,
                                                              op: str) -> None:
    eng = _engine(root)
    key = page_key(1)
    assert store(eng, key).stored
    path = eng.mapper.path_for(key)
    _in_link_window(monkeypatch, path)
    if op == "load":
        res, _ = load_page(eng, key)
        assert res.ok, res.error
    else:
        res = store(eng, key)
        assert res.ok and not res.stored, res
    assert _names(path.parent) == [path.name] and eng.stats["planted_replaced"] == 0
    eng.close()


@pytest.mark.parametrize("loop", ["python", "native"])
@pytest.mark.parametrize("planted", ["fifo", "symlink", "hardlink"])
def test_a_planted_entry_is_moved_aside_and_the_page_stored(root: Path, tmp_path: Path, loop: str,
                                                            planted: str) -> None:
    if loop == "native":
        native.start(wait=True)  # the native store call and lane, where numba is here
    eng = _engine(root, loop)
    key = page_key(2)
    path = eng.mapper.path_for(key)
    outside = tmp_path / "outside"
    outside.write_bytes(b"someone's data")
    {"fifo": lambda: os.mkfifo(path), "symlink": lambda: os.symlink(outside, path),
     "hardlink": lambda: os.link(outside, path)}[planted]()
    res = store(eng, key)
    assert res.ok and res.stored, res
    asides = [n for n in _names(path.parent) if n.startswith(f".{path.name}.planted-")]
    assert len(asides) == 1 and eng.stats["planted_replaced"] == 1
    aside = os.lstat(path.parent / asides[0])
    assert {"fifo": stat.S_ISFIFO, "symlink": stat.S_ISLNK, "hardlink": stat.S_ISREG}[planted](aside.st_mode)
    assert outside.read_bytes() == b"someone's data"  # nothing deleted, nothing written through
    res, _ = load_page(eng, key)
    assert res.ok and os.stat(path).st_nlink == 1
    eng.close()


@pytest.mark.parametrize("loop", ["python", "native"])
def test_a_file_system_refusing_noreplace_is_found_out_by_the_first_store(tmp_path: Path, loop: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """sshfs (FUSE) answers renameat2's RENAME_NOREPLACE with EINVAL, as NFS does: the first
    store there switches the root's memo to link(2), in Python or inside the native kernel
    (whose store then succeeds in the same call), and later stores go straight to link(2)."""
    from nfs_standin import TwoNodeMount, unavailable_reason

    from tierstore.native import page_calls as native_page

    if (reason := unavailable_reason()) is not None:
        pytest.skip(f"sshfs stand-in unavailable: {reason}")
    codes: list[int | None] = []
    if loop == "native":
        if not native.start(wait=True):
            pytest.skip(f"native path unavailable: {native.failure()}")
        real = native_page.store_page
        monkeypatch.setattr(native_page, "store_page", lambda *a: codes.append(real(*a)) or codes[-1])
    else:
        monkeypatch.setenv("TIERSTORE_NATIVE", "0")
        monkeypatch.setattr(native, "page_kernels", lambda: None)  # the Python publish alone
    with TwoNodeMount(tmp_path / "mnt") as fs:
        eng = _engine(fs.a)
        assert eng.files.create_only.use_link is False
        for i in range(3):
            res = store(eng, page_key(i))
            assert res.ok and res.stored, res
        assert store(eng, page_key(0)).stored is False
        assert eng.files.create_only.use_link is True
        assert codes == ([0, 0, 0, native.STORE_EXISTS] if loop == "native" else [])  # the kernel fell back in-call
        for i in range(3):
            res, _ = load_page(eng, page_key(i))
            assert res.ok, res.error
        assert sorted(p.name for p in eng.mapper.path_for(page_key(0)).parent.parent.rglob("*") if p.is_file()) == \
            sorted(eng.mapper.path_for(page_key(i)).name for i in range(3))
        eng.close()
