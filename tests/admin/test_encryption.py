"""Encryption at rest (``encryption_key_file``, format/sealing.py): what an engine and fsck do
with sealed pages. A page on the export must not be its plaintext; the right key reads every
page back exactly; another key, or none, gets misses and deletes nothing; a page moved under
another name or forged without the key is never served; fsck without the key finds damage by
the ciphertext checksums and deletes nothing it cannot authenticate."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest
from tiers_helpers import expected, load, load_page, store

from tierstore.admin.fsck import EXIT_CLEAN, FsckOptions, run_fsck
from tierstore.config import TierStoreConfig
from tierstore.errors import ConfigError
from tierstore.format import sealing
from tierstore.format.checksums import checksum
from tierstore.format.header import (
    CHECKSUM_FIELD,
    FLAG_SEALED,
    SEALED_TRAILER_LEN,
    decode_header,
    header_len_of,
)
from tierstore.rootstore.engine import IOEngine
from tierstore.testing.pages import page_key, simple_namespace

NS = simple_namespace()
pytestmark = pytest.mark.timeout(120)


def key_file(tmp_path: Path, name: str, *, hex_text: bool = False, mode: int = 0o600) -> Path:
    path = tmp_path / name
    raw = os.urandom(32)
    if hex_text:
        path.write_text(raw.hex() + "\n")
    else:
        path.write_bytes(raw)
    path.chmod(mode)
    return path


def engine(root: Path, key: Path | None = None, **cfg: object) -> IOEngine:
    config = TierStoreConfig.from_dict({"root": str(root), "io_threads": 2,
                                        **({"encryption_key_file": str(key)} if key is not None else {}), **cfg})
    return IOEngine(root, NS, 0, config=config)


def stored(eng: IOEngine, n: int) -> dict[Path, bytes]:
    out = {}
    for i in range(n):
        assert store(eng, page_key(i)).ok
        path = eng.mapper.path_for(page_key(i))
        out[path] = path.read_bytes()
    return out


def windows(data: bytes, size: int = 64) -> set[bytes]:
    """Every aligned ``size``-byte window of ``data`` that is not all one byte value."""
    return {w for i in range(0, len(data) - size + 1, size) if len(set(w := data[i:i + size])) > 1}


def test_sealed_pages_hold_no_plaintext_and_read_back_exactly(tmp_path: Path) -> None:
    root, key = tmp_path / "root", key_file(tmp_path, "k")
    eng = engine(root, key)
    files = stored(eng, 4)
    plain = b"".join(expected(eng, page_key(i)) for i in range(4))
    on_disk = b"".join(p.read_bytes() for p in root.rglob("*") if p.is_file())
    assert not any(w in on_disk for w in windows(plain)), "a 64-byte window of a page's plaintext is on disk"
    for raw in files.values():
        header = decode_header(raw[:header_len_of(raw)])
        assert header.sealed and header.flags == FLAG_SEALED and len(raw) == header.file_size
    for i in range(4):
        ok, kind, data = load(eng, page_key(i))
        assert ok and data == expected(eng, page_key(i)), kind
    eng.close()
    # two writes of one page differ (a fresh nonce each), and both open
    first = next(iter(files))
    first.unlink()
    eng = engine(root, key)
    assert store(eng, page_key(0)).ok
    assert first.read_bytes() != files[first]
    assert load(eng, page_key(0))[2] == expected(eng, page_key(0))
    eng.close()


@pytest.mark.parametrize("other", ["another key", "no key"])
def test_another_key_or_none_misses_and_deletes_nothing(tmp_path: Path, other: str) -> None:
    root = tmp_path / "root"
    a = engine(root, key_file(tmp_path, "a"))
    files = stored(a, 3)
    a.close()
    b = engine(root, key_file(tmp_path, "b") if other == "another key" else None)
    for i in range(3):
        res, data = load_page(b, page_key(i))
        assert not res.ok and res.error.kind == "mac" and data is None, res.error
    assert b.flush(10)
    b.close()
    assert {p: p.read_bytes() for p in files} == files
    assert b.stats.get("bad_pages_discarded", 0) == 0


def test_a_plain_page_under_a_keyed_engine_is_a_miss_left_in_place(tmp_path: Path) -> None:
    root = tmp_path / "root"
    plain = engine(root)
    files = stored(plain, 2)
    plain.close()
    keyed = engine(root, key_file(tmp_path, "k"))
    for i in range(2):
        res, _ = load_page(keyed, page_key(i))
        assert not res.ok and res.error.kind == "mac", res.error
    keyed.close()
    assert {p: p.read_bytes() for p in files} == files


def _rewrite_header(raw: bytearray, *, key: bytes | None = None, token_count: int | None = None) -> None:
    """Change the header the way a writer without the key can: fields, then a valid checksum."""
    hl = header_len_of(raw)
    if key is not None:
        raw[72:72 + len(key)] = key
    if token_count is not None:
        struct.pack_into("<I", raw, 48, token_count)
    CHECKSUM_FIELD.pack_into(raw, hl - 8, checksum(memoryview(raw)[:hl - 8]))


@pytest.mark.parametrize("forgery", ["moved under another name", "token count changed"])
def test_a_page_moved_or_forged_without_the_key_is_never_served(tmp_path: Path, forgery: str) -> None:
    """The header is authenticated data: a sealed page copied under another key's name (its
    header rewritten to match, checksum recomputed), or with a changed field, does not open."""
    root, key = tmp_path / "root", key_file(tmp_path, "k")
    eng = engine(root, key)
    files = stored(eng, 2)
    src, dst = (eng.mapper.path_for(page_key(i)) for i in range(2))
    raw = bytearray(files[src])
    if forgery == "moved under another name":
        _rewrite_header(raw, key=page_key(1))
        victim = dst
    else:
        _rewrite_header(raw, token_count=7)
        victim = src
    victim.write_bytes(bytes(raw))
    res, data = load_page(eng, page_key(1 if victim == dst else 0))
    assert not res.ok and res.error.kind == "mac" and data is None, res.error
    eng.close()
    assert victim.read_bytes() == bytes(raw)  # not verifiable is not damage: left in place


def test_fsck_without_the_key_finds_a_flipped_ciphertext_byte_and_deletes_nothing(tmp_path: Path) -> None:
    root, key = tmp_path / "root", key_file(tmp_path, "k")
    eng = engine(root, key)
    files = stored(eng, 3)
    eng.close()
    assert run_fsck(FsckOptions(root=root)).exit_code == EXIT_CLEAN
    assert run_fsck(FsckOptions(root=root, encryption_key_file=key)).exit_code == EXIT_CLEAN
    path = next(iter(files))
    raw = bytearray(files[path])
    raw[-SEALED_TRAILER_LEN - 100] ^= 0x40  # a ciphertext byte of the last section
    path.write_bytes(bytes(raw))
    keyless = run_fsck(FsckOptions(root=root, repair=True))
    assert keyless.exit_code == 4, keyless.format_text()
    [finding] = keyless.problems
    assert finding.kind == "sealed_checksum" and finding.action is None and path.exists()
    keyed = run_fsck(FsckOptions(root=root, repair=True, encryption_key_file=key))
    [finding] = keyed.problems
    assert finding.kind == "checksum" and finding.action == "deleted" and not path.exists()
    assert run_fsck(FsckOptions(root=root, encryption_key_file=key)).exit_code == EXIT_CLEAN


def test_fsck_with_another_key_deletes_nothing(tmp_path: Path) -> None:
    root = tmp_path / "root"
    eng = engine(root, key_file(tmp_path, "a"))
    files = stored(eng, 2)
    eng.close()
    report = run_fsck(FsckOptions(root=root, repair=True, encryption_key_file=key_file(tmp_path, "b")))
    assert len(report.unverifiable) == 2 and all(u.action is None for u in report.unverifiable)
    assert {p: p.read_bytes() for p in files} == files


def test_the_namespace_is_the_keys_own(tmp_path: Path) -> None:
    a = sealing.PageSealer.from_key_file(key_file(tmp_path, "a", hex_text=True))
    b = sealing.PageSealer.from_key_file(key_file(tmp_path, "b"))
    assert a.namespace_marker != b.namespace_marker and a.namespace_marker.startswith("aes-256-gcm/")
    assert a.namer(b"x" * 32) != b.namer(b"x" * 32) and len(a.namer(b"x" * 32)) == 32


@pytest.mark.parametrize("problem", ["mode", "length"])
def test_a_key_file_others_can_read_or_of_the_wrong_length_is_refused(tmp_path: Path, problem: str) -> None:
    path = key_file(tmp_path, "k", mode=0o644 if problem == "mode" else 0o600)
    if problem == "length":
        path.write_bytes(os.urandom(16))
    with pytest.raises(ConfigError, match="encryption_key_file"):
        engine(tmp_path / "root", path)


def test_encryption_with_zstd_is_refused_naming_both_settings(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match='"encryption_key_file" needs "codec": "none"'):
        TierStoreConfig.from_dict({"root": str(tmp_path), "encryption_key_file": str(tmp_path / "k"),
                                   "codec": "zstd"})


def test_trailer_lengths_agree() -> None:
    assert sealing.TRAILER_LEN == SEALED_TRAILER_LEN


def test_a_page_is_sealed_with_the_key_its_page_key_names_and_opens_only_with_it(tmp_path: Path) -> None:
    """Tenants' keys (``tenant_key_files``): a page key starting with tenant A's key id is sealed
    with A's key; a node whose ring lacks A's key misses it and deletes nothing."""
    root, fleet, a, b = tmp_path / "root", key_file(tmp_path, "f"), key_file(tmp_path, "a"), key_file(tmp_path, "b")
    ring = sealing.KeyRing.from_files(fleet, {"tenant-a": str(a)})
    k = sealing.KeyRing.page_key(ring.tenants["tenant-a"], page_key(0))
    writer = engine(root, fleet, tenant_key_files={"tenant-a": str(a)})
    assert store(writer, k).ok
    path = writer.mapper.path_for(k)
    raw = path.read_bytes()
    assert raw[-12 - 8:-12] == ring.tenants["tenant-a"].key_id  # the trailer names A's key
    assert load(writer, k)[2] == expected(writer, k)
    writer.close()
    other = engine(root, fleet, tenant_key_files={"tenant-b": str(b)})
    res, data = load_page(other, k)
    assert not res.ok and res.error.kind == "mac" and data is None, res.error
    other.close()
    assert path.read_bytes() == raw
