"""fsck's batched native path (fsck_batch): what it takes, what it hands back, same verdicts.

The damage matrix, symlinks, orphans and misplaced pages run on both paths in test_fsck.py
(``fsck_path``); here: the batch really verifies the engine's pages, it hands every page it did
not find good back to the per-page path (swaps after the listing included), its refs carry the
same identity a ``stat`` gives, and a large root starts its compile.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tierstore.admin.fan_dir_walk import PageVerdict
from tierstore.admin.findings import fingerprint
from tierstore.admin.fsck import FsckOptions, run_fsck
from tierstore.admin.fsck_batch import NativeBatch
from tierstore.admin.fsck_read import PageVerifier
from tierstore.admin.namespace_dirs import NamespaceDir
from tierstore.admin.walk import walk_root
from tierstore.format.header import Codec
from tierstore.format.identity import Namespace, write_manifest
from tierstore.native import loader as native
from tierstore.testing import corrupt_flip_bit, fill_pages
from tierstore.testing.pages import page_bytes, page_key, write_page


@pytest.fixture
def native_ready() -> None:
    native.start(wait=True)
    if not NativeBatch.ready():
        pytest.skip(f"the native path is not available here: {native.failure() or 'not x86-64 Linux'}")


def _report(root: Path, monkeypatch: pytest.MonkeyPatch, python_only: bool) -> dict:
    with monkeypatch.context() as m:
        if python_only:
            m.setattr(NativeBatch, "ready", staticmethod(lambda: False))
        rep = run_fsck(FsckOptions(root, progress=False, jobs=2))
    return rep.to_json() | {"native_pages": rep.reads["native_pages"]}


def test_batch_verifies_the_engine_pages_and_reports_as_the_python_path(
        root: Path, hybrid_ns: Namespace, native_ready: None, monkeypatch: pytest.MonkeyPatch) -> None:
    plain = fill_pages(root, hybrid_ns, 6)
    zstd = fill_pages(root, hybrid_ns, 2, seed=1, codec=Codec.ZSTD)  # another header: per page
    corrupt_flip_bit(plain[0].path, -3, bit=5)
    os.chmod(plain[1].path, 0o644)  # a mode warning, from the batch's fstat
    native_rep = _report(root, monkeypatch, python_only=False)
    python_rep = _report(root, monkeypatch, python_only=True)
    assert python_rep["native_pages"] == 0
    # Every good uncompressed page went through the batch; the damaged one and zstd did not.
    assert native_rep["native_pages"] == len(plain) - 1
    assert native_rep["counts"]["pages_ok"] == len(plain) + len(zstd) - 1
    for rep in (native_rep, python_rep):
        del rep["seconds"], rep["started_at"], rep["finished_at"], rep["reads"], rep["native_pages"]
    assert native_rep == python_rep  # problems, warnings, counts and per-group stats (tokens, ages)
    assert [p["kind"] for p in native_rep["problems"]] == ["checksum"]
    assert [w["path"] for w in native_rep["warnings"]] == [str(plain[1].path)]


def test_batch_hands_back_every_page_it_did_not_find_good(root: Path, native_ready: None, tmp_path: Path) -> None:
    """Pages swapped after the listing (symlink, FIFO, second link, damage, another size) come
    back as None for the per-page path, which names them; good pages carry stat's identity."""
    from tierstore.testing import simple_namespace

    ns = simple_namespace()
    write_manifest(root, ns)
    layout = ns.groups[0].layout
    pages = [write_page(root, ns, 0, page_key(i), data=page_bytes(layout, bytes([i]))) for i in range(6)]
    seen: list[NamespaceDir] = []  # the namespace dir, manifest loaded, as the walk passes it
    walk_root(root, visitor=lambda ref: seen.append(ref.ns) or PageVerdict())
    nsd = seen[0]
    outside = tmp_path / "outside.kvp"
    outside.write_bytes(pages[0].path.read_bytes())
    bad = {}
    bad[pages[1].path] = "symlink"
    os.unlink(pages[1].path)
    os.symlink(outside, pages[1].path)
    bad[pages[2].path] = "fifo"
    os.unlink(pages[2].path)
    os.mkfifo(pages[2].path)
    bad[pages[3].path] = "second link"
    os.link(pages[3].path, tmp_path / "hardlink")
    bad[pages[4].path] = "damaged"
    corrupt_flip_bit(pages[4].path, -3, bit=1)

    verifier = PageVerifier(root)
    try:
        for page in pages:
            got = verifier.visit_batch(nsd, 0, 0, nsd.group(0), str(page.path.parent),
                                       [(page.path.name, page.key)])
            if page.path in bad:
                assert got == [None], bad[page.path]
            else:
                ref, verdict = got[0]
                assert ref.fingerprint == fingerprint(os.lstat(page.path))
                assert ref.size == page.path.stat().st_size and ref.key == page.key
                assert verdict.problem is None and verdict.token_count == page.token_count
    finally:
        verifier.close()
    assert verifier.native_pages == len(pages) - len(bad)
    # The per-page path names each of them.
    rep = run_fsck(FsckOptions(root, progress=False))
    kinds = {p.path: (p.category, p.kind) for p in rep.problems}
    assert kinds[str(pages[4].path)] == ("bad_page", "checksum")
    assert kinds[str(pages[1].path)][0] == "symlink"
    assert {str(pages[2].path), str(pages[3].path)} <= set(kinds)


def test_a_large_root_starts_the_compile(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-page path starts the native compile after COMPILE_AFTER_PAGES pages, not before
    (a small root never pays it)."""
    from tierstore.admin import fsck_read
    from tierstore.testing import simple_namespace

    ns = simple_namespace()
    for i in range(5):
        write_page(root, ns, 0, page_key(i))
    calls: list[int] = []
    monkeypatch.setattr(native, "start", lambda wait=False: calls.append(1) or False)
    monkeypatch.setattr(NativeBatch, "ready", staticmethod(lambda: False))
    monkeypatch.setattr(fsck_read, "COMPILE_AFTER_PAGES", 6)
    assert run_fsck(FsckOptions(root, progress=False)).pages_ok == 5
    assert calls == []
    monkeypatch.setattr(fsck_read, "COMPILE_AFTER_PAGES", 3)
    assert run_fsck(FsckOptions(root, progress=False)).pages_ok == 5
    assert calls == [1]
