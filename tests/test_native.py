"""The native (numba, GIL-free) page path gives xxhash's checksums, catches the same damage as
the Python path, and is what the engine's warm verified loads use once compiled."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import xxhash
from tiers_helpers import load_page, store_data

from tierstore import native, pagefile, safefs
from tierstore.config import TierStoreConfig
from tierstore.engine import IOEngine
from tierstore.format import section_sums
from tierstore.testing.pages import corrupt_flip_bit, hybrid_namespace, page_bytes, page_key

pytest.importorskip("numba", reason="the native path needs numba (a vLLM dependency)")


@pytest.fixture(scope="module", autouse=True)
def _compiled() -> None:
    assert native.start(wait=True), native.failure()


def _count_calls(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """Wrap ``native.<name>``: one entry per call, 1 when it did the work (not None)."""
    calls: list[int] = []
    real = getattr(native, name)

    def counted(*args: Any) -> Any:
        got = real(*args)
        calls.append(0 if got is None else 1)
        return got

    monkeypatch.setattr(native, name, counted)
    return calls


def _spans(sizes: list[int], gap: int = 0) -> list[tuple[int, int]]:
    spans, at = [], 0
    for n in sizes:
        spans.append((at, at + n))
        at += n + gap
    return spans


def test_native_section_sums_are_xxhash_byte_for_byte() -> None:
    rng = random.Random(5)
    sizes = [rng.randrange(1, 300_000) for _ in range(9)] + [0, 70_000]
    spans = _spans(sizes, gap=13)
    data = memoryview(rng.randbytes(spans[-1][1]))
    want = [xxhash.xxh3_64_intdigest(data[a:b]) for a, b in spans]
    for first, end in ((0, len(spans)), (2, 7), (9, 11)):
        got = native.section_sums(spans, data, first, end)
        assert got == want[first:end]
        assert section_sums(spans, data, first, end) == want[first:end]
    assert native.section_sums(spans, data, 9, 10) is None  # too small to gain: the Python path


def test_read_and_hash_reads_pieces_and_reports_a_short_file(tmp_path: Path) -> None:
    rng = random.Random(6)
    hl, spans = 4096, _spans([100_000, 50_000, 30_001], gap=7)
    body = rng.randbytes(hl + spans[-1][1])
    path = tmp_path / "f"
    path.write_bytes(body)
    plan = [(0, hl + spans[1][1], 0, 2), (hl + spans[1][1], len(body), 2, 3)]
    buf = memoryview(bytearray(len(body)))
    fd = os.open(path, os.O_RDONLY)
    try:
        got = native.read_and_hash(fd, buf, hl, plan, spans)
        assert got is not None and got[0] == len(body) and bytes(buf) == body
        assert got[1] == [xxhash.xxh3_64_intdigest(body[hl + a:hl + b]) for a, b in spans]
        os.truncate(path, len(body) - 5)
        got = native.read_and_hash(fd, memoryview(bytearray(len(body))), hl, plan, spans)
        assert got is not None and got[0] == len(body) - 5  # where the file ended
    finally:
        os.close(fd)
    got = native.read_and_hash(fd, buf, hl, plan, spans)  # a closed fd: a read error, no raise
    assert got is not None and got[0] == -1
    with pytest.raises(ValueError):
        native.read_and_hash(fd, buf[:100], hl, plan, spans)
    # Compiled once at start for the types callers pass: a call never compiles again (16 I/O
    # threads would queue on numba's compiler lock).
    assert [len(k.signatures) for k in native._kernels[:2]] == [1, 1]


def test_load_file_checks_the_file_like_open_page(tmp_path: Path) -> None:
    """One call opens, checks, reads and hashes; anything but a plain single-link file of the
    expected size is handed back (None) to the Python path, which names it."""
    (tmp_path / "aa").mkdir()
    body = random.Random(7).randbytes(4096 + 70_000)
    page = tmp_path / "aa" / "p.kvp"
    page.write_bytes(body)
    spans, plan = [(0, 70_000)], [(0, len(body), 0, 1)]
    flags = (safefs.DIR_FLAGS, pagefile.READ_FLAGS)
    rank_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)

    def load(name: str, size: int = len(body)) -> Any:
        return native.load_file(rank_fd, "aa", name, flags, size, False, memoryview(bytearray(len(body))),
                                4096, plan, spans)
    try:
        got = load("p.kvp")
        assert got is not None
        st = os.stat(page)
        assert got[0] == (st.st_dev, st.st_ino, st.st_ctime_ns)
        assert got[1] == [xxhash.xxh3_64_intdigest(body[4096:])]
        assert load("p.kvp", len(body) + 1) is None  # another size
        assert load("missing.kvp") is None
        os.symlink(page, tmp_path / "aa" / "link.kvp")
        assert load("link.kvp") is None  # not followed
        os.mkfifo(tmp_path / "aa" / "fifo.kvp")
        assert load("fifo.kvp") is None  # opened non-blocking, refused by its type
        os.link(page, tmp_path / "aa" / "second.kvp")
        assert load("p.kvp") is None  # two links
    finally:
        os.close(rank_fd)


@pytest.mark.parametrize("damaged_section", [None, 0, 3])
def test_engine_warm_loads_take_one_native_call_and_catch_damage(root: Path, damaged_section: int | None,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count_calls(monkeypatch, "load_file")
    ns = hybrid_namespace()
    eng = IOEngine(root, ns, 2, config=TierStoreConfig.from_dict({"root": str(root), "odirect": "off"}))
    layout, key = eng.layout, page_key(3)
    data = page_bytes(layout, key, 2)
    assert store_data(eng, key, data).ok
    if damaged_section is not None:
        hl = eng._header_len(len(key))
        corrupt_flip_bit(eng.mapper.path_for(key), hl + layout.offsets[damaged_section])
    res, got = load_page(eng, key)
    assert calls == [1]  # the whole page in one native call
    if damaged_section is None:
        assert res.ok and got == data, res.error
    else:
        assert not res.ok and res.error is not None and res.error.kind == "checksum", res.error
        assert layout.sections[damaged_section].name in str(res.error)
        assert eng.stats["bad_pages_discarded"] == 1  # the identity it read was recorded
    eng.close()


def test_python_path_reads_and_hashes_in_one_call_and_handles_a_short_read(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the fused open (another architecture, a cold page), the Python path still reads
    and hashes in one call; a read stopping early (the file shrank after its size was checked)
    falls back to piece-by-piece reads, which re-read the whole file."""
    monkeypatch.setattr(native, "load_file", lambda *a: None)
    calls: list[int] = []
    real = native.read_and_hash

    def short(*a: Any) -> Any:
        calls.append(1)
        return (a[3][-1][1] - 1, real(*a)[1])

    monkeypatch.setattr(native, "read_and_hash", short)
    ns = hybrid_namespace()
    eng = IOEngine(root, ns, 2, config=TierStoreConfig.from_dict({"root": str(root), "odirect": "off"}))
    key = page_key(4)
    data = page_bytes(eng.layout, key, 2)
    assert store_data(eng, key, data).ok
    res, got = load_page(eng, key)
    assert res.ok and got == data and calls == [1]
    eng.close()


def test_tierstore_native_0_keeps_the_python_path() -> None:
    code = "from tierstore import native; print(native.start(wait=True), native.ready())"
    env = {**os.environ, "TIERSTORE_NATIVE": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_unverified_loads_take_the_native_open_and_return_the_header_sums(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """verify=False (the GPU path hashes on the device): one native call, nothing hashed, the
    header's sums handed to the caller, and the file identity kept for a caller's rejection."""
    calls = _count_calls(monkeypatch, "load_file")
    ns = hybrid_namespace()
    eng = IOEngine(root, ns, 1, config=TierStoreConfig.from_dict({"root": str(root), "odirect": "off"}))
    key = page_key(5)
    data = page_bytes(eng.layout, key, 1)
    assert store_data(eng, key, data).ok
    corrupt_flip_bit(eng.mapper.path_for(key), -1)  # unnoticed without verification
    [res] = eng.wait([eng.submit_load(key, verify=False)], timeout=10)
    assert calls == [1]
    assert res.ok and not res.verified and res.slot is not None
    assert list(res.sums or ()) == [xxhash.xxh3_64_intdigest(data[a:b]) for a, b in eng.layout.spans]
    assert bytes(res.slot.view) != data
    eng.release_slot(res.slot)
    eng.settle(res, False, "checksum mismatch found by the caller")
    assert eng.flush(10)
    assert not eng.mapper.path_for(key).exists()
    eng.close()


def test_store_check_and_store_write(tmp_path: Path) -> None:
    (tmp_path / "ab").mkdir()
    rank_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    page = memoryview(random.Random(8).randbytes(100_000))
    spans = [(0, 60_000), (60_000, 100_000)]
    try:
        assert native.store_check(rank_fd, "zz", "p.kvp", safefs.DIR_FLAGS, page, spans)[0] == native.STORE_NO_DIR  # type: ignore[index]
        code, sums = native.store_check(rank_fd, "ab", "p.kvp", safefs.DIR_FLAGS, page, spans)  # type: ignore[misc]
        assert code == 0 and sums == [xxhash.xxh3_64_intdigest(page[a:b]) for a, b in spans]
        flags = (safefs.DIR_FLAGS, pagefile.temp_flags(False))
        assert native.store_write(rank_fd, "ab", "p.tmp", "p.kvp", flags, 0o600, page, 99_000, False) == 0
        assert (tmp_path / "ab" / "p.kvp").read_bytes() == bytes(page[:99_000])  # cut to exact_len
        assert (tmp_path / "ab" / "p.kvp").stat().st_mode & 0o777 == 0o600
        assert native.store_check(rank_fd, "ab", "p.kvp", safefs.DIR_FLAGS, page, spans)[0] == native.STORE_EXISTS  # type: ignore[index]
        (tmp_path / "ab" / "d.kvp").mkdir()  # the rename cannot replace a directory
        assert native.store_write(rank_fd, "ab", "q.tmp", "d.kvp", flags, 0o600, page, 100_000, True) < 0
        assert sorted(p.name for p in (tmp_path / "ab").iterdir()) == ["d.kvp", "p.kvp"]  # temp removed
        (tmp_path / "ab" / "r.tmp").write_bytes(b"x")  # O_EXCL: an existing temp is never written through
        assert native.store_write(rank_fd, "ab", "r.tmp", "r.kvp", flags, 0o600, page, 100_000, False) < 0
        assert (tmp_path / "ab" / "r.tmp").read_bytes() == b"x" or not (tmp_path / "ab" / "r.tmp").exists()
    finally:
        os.close(rank_fd)


@pytest.mark.parametrize("with_sums", [False, True])
def test_native_stores_write_the_python_paths_bytes(tmp_path: Path, with_sums: bool,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Canonical bytes: a page stored through the native calls is byte for byte the file the
    Python path writes (and the golden files pin that one)."""
    ns = hybrid_namespace()
    files = []
    for use_native in (True, False):
        root = tmp_path / ("n" if use_native else "p")
        if not use_native:
            monkeypatch.setattr(native, "store_check", lambda *a: None)
        eng = IOEngine(root, ns, 2, config=TierStoreConfig.from_dict({"root": str(root), "odirect": "off"}))
        key = page_key(9)
        data = page_bytes(eng.layout, key, 2)
        sums = [xxhash.xxh3_64_intdigest(data[a:b]) for a, b in eng.layout.spans] if with_sums else None
        slot = eng.acquire_slot(10)
        assert slot is not None
        slot.view[:] = data
        [res] = eng.wait([eng.submit_store(key, slot, 16, sums)], 10)
        assert res.ok and res.stored
        again = store_data(eng, key, data)
        assert again.ok and not again.stored  # the existing file counts as stored
        files.append(eng.mapper.path_for(key).read_bytes())
        eng.close()
    assert files[0] == files[1]


def test_module_scans_see_plain_dicts_after_numba_is_loaded() -> None:
    """vLLM's kernel-override scan calls ``vars(v).get`` on every module attribute with a
    ``__dict__``; numba's import (llvmlite's lazy library wrapper) must not break it, or an
    in-process vLLM engine started after a tierstore engine compiled fails to start."""
    import sys

    for module in list(sys.modules.values()):
        for value in list(getattr(module, "__dict__", {}).values()):
            if hasattr(value, "__dict__"):
                assert isinstance(vars(value), dict) or hasattr(vars(value), "get"), (module, value)
