"""The engine and the page readers against a root others can write to (issue 17): each hostile
input planted next to valid pages (and a sentinel directory outside the root); the bad entry
gets a typed error without a hang or an allocation beyond the layout, the sentinel is left
alone, the valid pages are still served. Also: creation modes, the trust check, and the
opt-in MAC (a forged page with valid checksums is never served)."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest
from hostile_helpers import snapshot, swap_for_link, traced_peak, zstd_bomb
from tiers_helpers import load_page, store

from tierstore.config import TierStoreConfig
from tierstore.errors import ConfigError, PageError
from tierstore.format import mac as mac_mod
from tierstore.format.header import MAC_TRAILER_LEN, Codec, PageMeta, SectionEntry, encode_header
from tierstore.format.identity import Namespace
from tierstore.format.page import encode_page
from tierstore.rootstore.engine import IOEngine, IOResult
from tierstore.rootstore.page_read import inspect_page, read_page
from tierstore.rootstore.rank_dir import file_identity
from tierstore.testing.pages import page_bytes, page_key, simple_namespace

NS = simple_namespace()
pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "root"
    r.mkdir(mode=0o755)
    os.chmod(r, 0o755)
    return r


def engine(root: Path, ns: Namespace = NS, **cfg: object) -> IOEngine:
    deadline = cfg.pop("deadline_s", None)
    config = TierStoreConfig.from_dict({"root": str(root), "io_threads": 2, **cfg})
    return IOEngine(root, ns, 0, config=config, deadline_s=deadline)  # type: ignore[arg-type]


def valid_pages(eng: IOEngine, n: int = 4) -> list[bytes]:
    keys = [page_key(100 + i) for i in range(n)]
    for k in keys:
        assert store(eng, k).ok
    return keys


def assert_served(eng: IOEngine, keys: list[bytes]) -> None:
    for k in keys:
        res, data = load_page(eng, k)
        assert res.ok and data == page_bytes(eng.layout, k), res.error


def _meta(eng: IOEngine, key: bytes) -> PageMeta:
    return PageMeta(NS.digest_bytes, key, 0, eng.group.kind, 16)


# ------------------------------------------------------------------ memory bounded by the layout
def test_zstd_frame_declaring_a_huge_size_is_refused_within_the_layout(root: Path) -> None:
    eng = engine(root, codec="zstd")
    keys = valid_pages(eng)
    bad = page_key(7)
    lay = eng.layout
    frame = zstd_bomb(256 << 20)  # a few KiB declaring 256 MiB
    entries, pieces, pos = [], [], 0
    for spec in lay.sections:  # every section the same bomb, frames at canonical offsets
        start = -(-pos // 64) * 64
        pieces.append(bytes(start - pos) + frame)
        entries.append(SectionEntry(spec, start, len(frame), 0))
        pos = start + len(frame)
    header = encode_header(_meta(eng, bad), Codec.ZSTD, entries, pos)
    path = eng.mapper.path_for(bad)
    path.write_bytes(header + b"".join(pieces))
    (res, _), peak = traced_peak(lambda: load_page(eng, bad))
    assert not res.ok and res.error is not None and res.error.kind in ("checksum", "format"), res.error
    assert peak < lay.nbytes + (8 << 20), peak  # not the 256 MiB the frame declares
    assert not path.exists()  # bad content: removed so the key can be stored again
    assert_served(eng, keys)
    eng.close()


@pytest.mark.parametrize("codec", ["zstd", "none"])
def test_sparse_file_declaring_a_3_gib_payload_is_refused_without_allocation(root: Path, codec: str) -> None:
    eng = engine(root, codec=codec)
    keys = valid_pages(eng)
    bad = page_key(8)
    lay = eng.layout
    huge = 3 << 30
    entries = [SectionEntry(s, 0, 16, 0) for s in lay.sections]
    header = encode_header(_meta(eng, bad), Codec.ZSTD, entries, huge)
    path = eng.mapper.path_for(bad)
    with open(path, "wb") as f:  # sparse: costs the writer nothing
        f.write(header)
        f.truncate(len(header) + huge)
    t0 = time.monotonic()
    (res, _), peak = traced_peak(lambda: load_page(eng, bad))
    assert isinstance(res, IOResult) and not res.ok and res.error.kind == "format", res.error
    assert peak < lay.nbytes + (8 << 20), peak
    assert time.monotonic() - t0 < 5
    # fsck's reader (no expectation): the zstd payload bound refuses it before allocating.
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(header)
        f.truncate(len(header) + huge)
    with pytest.raises(PageError, match="more than zstd emits"):
        traced_peak(lambda: inspect_page(path))
    assert_served(eng, keys)
    eng.close()


# ------------------------------------------------------------------ links, FIFOs, directories
def test_symlinked_and_hard_linked_pages_are_not_served_nor_touched(root: Path, sentinel: Path) -> None:
    eng = engine(root)
    keys = valid_pages(eng)
    before = snapshot(sentinel)
    a, b = page_key(9), page_key(10)
    pa, pb = eng.mapper.path_for(a), eng.mapper.path_for(b)
    # a copy of a valid page outside, linked in both ways under the root
    eng2 = engine(root.parent / "other")
    assert store(eng2, a).ok and store(eng2, b).ok
    (sentinel / "linked_a").write_bytes(eng2.mapper.path_for(a).read_bytes())
    (sentinel / "linked_b").write_bytes(eng2.mapper.path_for(b).read_bytes())
    before = snapshot(sentinel)
    os.symlink(sentinel / "linked_a", pa)
    os.link(sentinel / "linked_b", pb)
    for k in (a, b):
        res, data = load_page(eng, k)
        assert not res.ok and data is None and res.error.kind == "unsafe", res.error
        # the store moves the entry itself aside (rename), never writes through it or deletes it
        assert store(eng, k).stored
    assert not pa.is_symlink() and pb.stat().st_nlink == 1
    aside_a, aside_b = ([q for q in p.parent.iterdir() if q.name.startswith(f".{p.name}.planted-")] for p in (pa, pb))
    assert len(aside_a) == 1 and os.readlink(aside_a[0]) == str(sentinel / "linked_a")
    # the hard link kept under its aside name (fsck --repair quarantines it): the outside file's two links
    assert len(aside_b) == 1 and os.path.samefile(aside_b[0], sentinel / "linked_b")
    assert (sentinel / "linked_b").stat().st_nlink == 2
    assert snapshot(sentinel) == before
    assert_served(eng, [a, b])
    assert_served(eng, keys)
    eng.close()
    eng2.close()


def test_fanout_dir_swapped_for_a_symlink_after_start(root: Path, sentinel: Path) -> None:
    eng = engine(root)
    keys = valid_pages(eng)
    victim = page_key(11)
    fan = eng.mapper.path_for(victim).parent
    for p in fan.iterdir():  # this fan-out may hold a valid page: keep it out of the check
        keys = [k for k in keys if eng.mapper.path_for(k) != p]
    name = eng.mapper.path_for(victim).name
    (sentinel / name).write_bytes(b"outside file named like the page")
    before = snapshot(sentinel)
    swap_for_link(fan, sentinel)
    res, _ = load_page(eng, victim)
    assert not res.ok and res.error.kind == "unsafe", res.error
    res = store(eng, victim)
    assert not res.ok and res.error.kind == "unsafe", res.error
    # the discard of a "bad" page never unlinks through the link, even with the right identity
    st = os.stat(sentinel / name)
    eng._remove_damaged(victim, file_identity(st), PageError("test"))
    assert snapshot(sentinel) == before
    assert_served(eng, keys)
    eng.close()


@pytest.mark.parametrize("where", ["namespace", "rank", "fanout"])
def test_symlinked_directories_are_refused_at_start(root: Path, sentinel: Path, where: str) -> None:
    eng = engine(root)
    base = eng.mapper.base
    eng.close()
    target = {"namespace": base.parent.parent, "rank": base, "fanout": base / "3f"}[where]
    swap_for_link(target, sentinel, target.name + ".real")
    before = snapshot(sentinel)
    with pytest.raises(ConfigError, match="symlink"):
        engine(root)
    assert snapshot(sentinel) == before


# ------------------------------------------------------------------ modes and trust
def test_private_modes_by_default_and_group_modes_when_asked(root: Path, tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        eng = engine(root)
        [k] = valid_pages(eng, 1)
        assert stat.S_IMODE(eng.mapper.path_for(k).stat().st_mode) == 0o600
        assert stat.S_IMODE(eng.mapper.path_for(k).parent.stat().st_mode) == 0o700
        assert stat.S_IMODE(eng.mapper.base.stat().st_mode) == 0o700
        eng.close()
        shared = tmp_path / "shared"
        shared.mkdir()
        eng = engine(shared, shared_group_access=True)
        [k] = valid_pages(eng, 1)
        assert stat.S_IMODE(eng.mapper.path_for(k).stat().st_mode) == 0o660
        assert stat.S_IMODE(eng.mapper.path_for(k).parent.stat().st_mode) == 0o2770
        eng.close()
    finally:
        os.umask(old)


def test_untrusted_root_is_refused_unless_the_setting_says_so(root: Path) -> None:
    os.chmod(root, 0o777)  # world-writable without the sticky bit: anyone can rename our namespaces
    with pytest.raises(ConfigError, match="trust_shared_root"):
        engine(root)
    engine(root, trust_shared_root=True).close()


@pytest.mark.parametrize("bad", [{"trust_shared_root": "yes"}, {"shared_group_access": 1},
                                 {"mac_key_file": ""}, {"mac_key_file": 3}])
def test_new_settings_are_validated(root: Path, bad: dict[str, object]) -> None:
    with pytest.raises(ConfigError, match=next(iter(bad))):
        TierStoreConfig.from_dict({"root": str(root), **bad})


# ------------------------------------------------------------------ MAC
def _key_file(tmp_path: Path, name: str) -> str:
    p = tmp_path / name
    p.write_text(os.urandom(32).hex())
    os.chmod(p, 0o600)
    return str(p)


@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_mac_pages_round_trip_and_forged_pages_are_never_served(root: Path, tmp_path: Path, codec: str) -> None:
    assert MAC_TRAILER_LEN == mac_mod.TRAILER_LEN
    key_file = _key_file(tmp_path, "fleet.key")
    eng = engine(root, codec=codec, mac_key_file=key_file)
    keys = valid_pages(eng)
    assert_served(eng, keys)
    size = eng.mapper.path_for(keys[0]).stat().st_size
    if codec == "none":
        assert size == eng.header_len(len(keys[0])) + eng.layout.nbytes + MAC_TRAILER_LEN
    # a key-less writer (valid checksums, no tag) and a writer with another key
    forged = page_key(20)
    other = page_key(21)
    plain = engine(root.parent / "plain", codec=codec)
    assert store(plain, forged).ok
    thief = engine(root.parent / "thief", codec=codec, mac_key_file=_key_file(tmp_path, "other.key"))
    assert store(thief, other).ok
    for src, k in ((plain, forged), (thief, other)):
        dst = eng.mapper.path_for(k)
        planted = src.mapper.path_for(k).read_bytes()
        for verify in (True, False):  # verify=False too: the MAC is checked before serving
            dst.write_bytes(planted)
            [res] = eng.wait([eng.submit_load(k, verify=verify)], timeout=10)
            assert not res.ok and res.slot is None and res.error.kind == "mac", res.error
            # not verifiable with this key is not damage: a miss, the file left as it is
            assert dst.read_bytes() == planted
    # the general reader refuses them too; a key-less reader still reads a tagged page
    pm = mac_mod.PageMac.from_key_file(key_file)
    out = memoryview(bytearray(eng.layout.nbytes))
    read_page(eng.mapper.path_for(keys[0]), eng.expectation(keys[0]), out, mac=pm)
    assert bytes(out) == page_bytes(eng.layout, keys[0])
    read_page(eng.mapper.path_for(keys[0]), eng.expectation(keys[0]), out)
    # a tag over other bytes: flip one payload byte and fix nothing else
    p = eng.mapper.path_for(keys[1])
    raw = bytearray(p.read_bytes())
    raw[-MAC_TRAILER_LEN - 1] ^= 1
    p.write_bytes(bytes(raw))
    res, _ = load_page(eng, keys[1])
    assert not res.ok and res.error.kind in ("mac", "checksum")
    assert_served(eng, [keys[0], *keys[2:]])
    for e in (eng, plain, thief):
        e.close()


def test_mac_page_without_a_key_configured_writes_golden_bytes(root: Path) -> None:
    """No key: the bytes are exactly encode_page's (flags 0), what tests/format/test_golden.py pins."""
    eng = engine(root)
    [k] = valid_pages(eng, 1)
    header, pieces = encode_page(_meta(eng, k), eng.layout, page_bytes(eng.layout, k))
    assert eng.mapper.path_for(k).read_bytes() == header + b"".join(bytes(p) for p in pieces)
    eng.close()
