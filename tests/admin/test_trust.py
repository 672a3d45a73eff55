"""What tierstore trusts on a root others can write to, beyond the hostile-input tests: a page
that cannot be checked with this node's key is a miss that nobody removes, the exit statuses
that say so, and the other trust boundaries of the security review (temp-file writers across
PID namespaces, names planted as FIFOs or directories, the gc metrics port, the lane's fault
build, the MAC's algorithm, the hash-seed marker, fsck's memory against a planted manifest).

Each test fails on the code before its fix (the commit that added it says how it was shown)."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import pytest
from tiers_helpers import load_page, store

from tierstore.admin import cli
from tierstore.admin.fsck import EXIT_UNVERIFIABLE, FsckOptions, run_fsck
from tierstore.config import TierStoreConfig
from tierstore.format import mac as mac_mod
from tierstore.format.header import MAC_TRAILER_LEN
from tierstore.rootstore.engine import IOEngine
from tierstore.testing.pages import page_bytes, page_key, simple_namespace

NS = simple_namespace()
REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(120)


def key_file(tmp_path: Path, name: str) -> Path:
    """A fleet key file as an operator makes one (owner-only)."""
    path = tmp_path / name
    path.write_text(os.urandom(32).hex())
    path.chmod(0o600)
    return path


def engine(root: Path, key: Path | None = None, **cfg: object) -> IOEngine:
    config = TierStoreConfig.from_dict({"root": str(root), "io_threads": 2,
                                        **({"mac_key_file": str(key)} if key is not None else {}), **cfg})
    return IOEngine(root, NS, 0, config=config)


def stored_pages(eng: IOEngine, n: int) -> dict[Path, bytes]:
    """Store ``n`` pages; their paths and file bytes."""
    out = {}
    for i in range(n):
        k = page_key(i)
        assert store(eng, k).ok
        path = eng.mapper.path_for(k)
        out[path] = path.read_bytes()
    return out


# ------------------------------------------------------------------ a key mismatch is a miss
@pytest.mark.parametrize("verify", [True, False])
def test_an_engine_with_another_key_misses_and_deletes_nothing(tmp_path: Path, verify: bool) -> None:
    """A rolling key rotation: pages written with key A, read by an engine with key B, are
    misses of kind ``mac`` and stay on disk byte for byte (before: B removed every page it read)."""
    root = tmp_path / "root"
    a = engine(root, key_file(tmp_path, "a.key"))
    pages = stored_pages(a, 4)
    a.close()
    b = engine(root, key_file(tmp_path, "b.key"))
    for i in range(4):
        [res] = b.wait([b.submit_load(page_key(i), verify=verify)], timeout=10)
        assert not res.ok and res.error.kind == "mac" and res.slot is None, res.error
        assert "not verifiable with this key" in str(res.error)
    assert b.flush(10)
    b.close()
    assert {p: p.read_bytes() for p in pages} == pages
    assert b.stats.get("bad_pages_discarded", 0) == 0


def test_an_untagged_page_under_a_keyed_engine_is_a_miss_left_in_place(tmp_path: Path) -> None:
    """A node that has no key yet (a rolling enablement) wrote the page: never served, never removed."""
    root = tmp_path / "root"
    plain = engine(root)
    pages = stored_pages(plain, 2)
    plain.close()
    keyed = engine(root, key_file(tmp_path, "fleet.key"))
    for i in range(2):
        res, _ = load_page(keyed, page_key(i))
        assert not res.ok and res.error.kind == "mac", res.error
    keyed.close()
    assert {p: p.read_bytes() for p in pages} == pages


@pytest.mark.parametrize("verify", [True, False])
def test_damage_in_a_page_of_another_key_is_still_damage_and_removed(tmp_path: Path, verify: bool) -> None:
    """The content checks need no key: a flipped payload byte in another key's page is a
    ``checksum`` failure (removed, so the key can be stored again), not ``mac``."""
    root = tmp_path / "root"
    a = engine(root, key_file(tmp_path, "a.key"))
    [path] = stored_pages(a, 1)
    a.close()
    raw = bytearray(path.read_bytes())
    raw[-MAC_TRAILER_LEN - 100] ^= 0x40  # inside the last section's bytes
    path.write_bytes(bytes(raw))
    b = engine(root, key_file(tmp_path, "b.key"))
    [res] = b.wait([b.submit_load(page_key(0), verify=verify)], timeout=10)
    assert not res.ok and res.error.kind == "checksum", res.error
    assert b.flush(10)
    b.close()
    assert not path.exists()


def test_a_node_without_blake3_misses_blake3_pages_and_deletes_none(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Pages tagged with BLAKE3 read by a node without the package (same key): not verifiable
    there, so a miss; before, they were removed as damage."""
    if mac_mod._blake3 is None:
        pytest.skip("needs the blake3 package to write BLAKE3 tags")
    root = tmp_path / "root"
    key = key_file(tmp_path, "fleet.key")
    a = engine(root, key)
    pages = stored_pages(a, 2)
    a.close()
    monkeypatch.setattr(mac_mod, "_blake3", None)
    b = engine(root, key)
    assert b.mac is not None and b.mac.name == "blake2b"
    for i in range(2):
        res, _ = load_page(b, page_key(i))
        assert not res.ok and res.error.kind == "mac" and "blake3" in str(res.error), res.error
    b.close()
    assert {p: p.read_bytes() for p in pages} == pages


def test_fsck_repair_with_another_key_deletes_nothing_and_says_so(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """``fsck --repair --mac-key-file B`` over key A's pages: every page is counted as not
    verifiable with this key (exit 64), none is deleted; a damaged one is still damage
    (4 + 64); ``--remove-unverifiable`` is the operator's explicit way to drop them (exit 1)."""
    root = tmp_path / "root"
    a = engine(root, key_file(tmp_path, "a.key"))
    pages = stored_pages(a, 6)
    a.close()
    b_key = key_file(tmp_path, "b.key")
    rep = run_fsck(FsckOptions(root, repair=True, progress=False, mac_key_file=b_key))
    assert rep.exit_code == EXIT_UNVERIFIABLE == 64, rep.format_text()
    assert len(rep.unverifiable) == 6 and rep.problems == [] and rep.pages_ok == 0
    assert {u.kind for u in rep.unverifiable} == {"mac"} and all(u.action is None for u in rep.unverifiable)
    assert rep.to_json()["counts"]["unverifiable"] == 6
    assert "6 page(s) not verifiable with this key" in rep.format_text()
    assert {p: p.read_bytes() for p in pages} == pages
    # the command: the same exit status, text and JSON
    assert cli.main(["fsck", str(root), "--repair", "--mac-key-file", str(b_key), "--no-progress"]) == 64
    assert "not verifiable with this key" in capsys.readouterr().out
    assert {p: p.read_bytes() for p in pages} == pages
    # damage in one of them is still damage: repaired (deleted), the rest kept
    damaged = sorted(pages)[0]
    raw = bytearray(damaged.read_bytes())
    raw[-MAC_TRAILER_LEN - 1] ^= 1
    damaged.write_bytes(bytes(raw))
    assert cli.main(["fsck", str(root), "--mac-key-file", str(b_key), "--no-progress"]) == 4 + 64
    assert cli.main(["fsck", str(root), "--repair", "--mac-key-file", str(b_key), "--no-progress"]) == 1 + 64
    assert not damaged.exists() and all(p.exists() for p in pages if p != damaged)
    # --remove-unverifiable needs --repair and the key; with them, the pages go
    assert cli.main(["fsck", str(root), "--remove-unverifiable", "--no-progress"]) == 2
    assert cli.main(["fsck", str(root), "--repair", "--remove-unverifiable", "--mac-key-file", str(b_key),
                     "--no-progress"]) == 1
    assert not any(p.exists() for p in pages)
    assert cli.main(["fsck", str(root), "--mac-key-file", str(b_key), "--no-progress"]) == 0


def test_the_readme_exit_table_is_the_commands() -> None:
    """The exit statuses in README.md's table are those ``tierstore --help`` prints, meaning
    for meaning (up to markdown), the new 64 included."""
    readme = (REPO / "README.md").read_text()
    table = readme[readme.index("| status | meaning |"):]
    rows = re.findall(r"^\| (\d+) \| (.+?) \|$", table[: table.index("\n\n")], re.M)
    cli_rows = re.findall(r"^  (\d+)\s+(.+)$", cli.EXIT_TABLE, re.M)

    def norm(text: str) -> str:
        return re.sub(r"[`\\]", "", text).replace(":", "").replace(";", "").replace(",", "").lower().split("(")[0]

    assert [n for n, _ in rows] == [n for n, _ in cli_rows], (rows, cli_rows)
    for (n, mine), (_, theirs) in zip(rows, cli_rows, strict=True):
        assert norm(mine).split()[:3] == norm(theirs).split()[:3], (n, mine, theirs)
    assert "64" in [n for n, _ in rows] and cli.EXIT_UNVERIFIABLE == EXIT_UNVERIFIABLE == 64


def test_page_bytes_survive_a_round_trip_under_the_key(tmp_path: Path) -> None:
    """The control: the writing key reads its pages back exactly (verify on and off)."""
    root = tmp_path / "root"
    key = key_file(tmp_path, "fleet.key")
    eng = engine(root, key)
    stored_pages(eng, 3)
    for i in range(3):
        for verify in (True, False):
            [res] = eng.wait([eng.submit_load(page_key(i), verify=verify)], timeout=10)
            assert res.ok, res.error
            assert bytes(res.slot.view) == page_bytes(eng.layout, page_key(i))
            if not res.verified:
                eng.settle(res, True)
            eng.release_slot(res.slot)
    eng.close()


# ------------------------------------------------------------------ fsck's memory against a planted manifest
@pytest.mark.parametrize("mode", ["plain", "deep", "mac"])
def test_fsck_verifies_a_huge_manifest_page_in_pieces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      mode: str) -> None:
    """A planted manifest.json declaring a huge page, and a valid sparse page of that size:
    fsck (``--deep`` and with a MAC key too) verifies it through a small buffer, not one of
    the declared size."""
    import tracemalloc

    from hostile_helpers import fsck_per_page

    from tierstore.format.header import FLAG_MAC, Codec
    from tierstore.format.identity import write_manifest
    from tierstore.format.layout import attention_layout
    from tierstore.format.page import encode_page
    from tierstore.fs.mapper import FileMapper
    from tierstore.testing.pages import layout_namespace, page_meta

    fsck_per_page(monkeypatch)
    root = tmp_path / "root"
    root.mkdir()
    huge = layout_namespace(attention_layout(("l0",), 8, 8192, 1024, "float16"), 8192, model="huge")
    nbytes = huge.groups[0].layout.nbytes
    assert nbytes >= 256 << 20
    write_manifest(root, huge)
    key = page_key(1)
    zeros = bytes(nbytes)
    mac_key = key_file(tmp_path, "fleet.key") if mode == "mac" else None
    header, _ = encode_page(page_meta(huge, 0, key), huge.groups[0].layout, zeros, Codec.NONE, None,
                            FLAG_MAC if mac_key else 0)
    path = FileMapper(root, huge.digest, 0).path_for(key)
    path.parent.mkdir(parents=True)
    with open(path, "wb") as f:  # zeros: a valid page that costs the planter a few KiB
        f.write(bytes(header))
        f.truncate(len(header) + nbytes)
        if mac_key is not None:
            f.seek(len(header) + nbytes)
            f.write(mac_mod.PageMac.from_key_file(mac_key).tag(header, zeros))
    del zeros
    tracemalloc.start()
    try:
        rep = run_fsck(FsckOptions(root, progress=False, deep=mode == "deep", mac_key_file=mac_key))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert rep.pages_ok == 1 and rep.problems == []
    assert peak < 48 << 20  # pieces of VERIFY_PIECE_BYTES and their --deep temporaries


# ------------------------------------------------------------------ gc's metrics endpoint
@pytest.mark.parametrize("flags, addr", [([], "127.0.0.1"), (["--metrics-address", "0.0.0.0"], "0.0.0.0"),
                                         (["--metrics-addr", "10.0.0.5"], "10.0.0.5")])
def test_gc_metrics_listen_on_loopback_unless_widened(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      flags: list[str], addr: str) -> None:
    """``tierstore gc --metrics-port`` serves an unauthenticated endpoint: on 127.0.0.1 unless
    ``--metrics-address`` asks for more."""
    import argparse

    import prometheus_client

    from tierstore.admin import gc_command, metrics_export

    bound: list[tuple[int, str]] = []
    monkeypatch.setattr(prometheus_client, "start_http_server",
                        lambda port, addr="", **kw: bound.append((port, addr)))
    parser = argparse.ArgumentParser()
    gc_command.add_arguments(parser)
    args = parser.parse_args([str(tmp_path), "--max-bytes", "1", "--metrics-port", "9109", *flags])
    assert metrics_export.start(args, tmp_path, 1) is not None
    assert bound == [(9109, addr)]


# ------------------------------------------------------------------ the lane's fault builds
@pytest.mark.parametrize("value, needle", [("yes", "not a known value"),
                                           ("unfixed", "TIERSTORE_LANE_FAULTS_TESTS_ONLY=1"),
                                           ("1", "TIERSTORE_LANE_FAULTS_TESTS_ONLY=1")])
def test_a_stray_lane_faults_value_never_builds_fault_kernels(value: str, needle: str) -> None:
    """``TIERSTORE_LANE_FAULTS`` left in an environment: an unknown value, or a fault build
    (``1``, ``unfixed``) without its test-only opt-in, keeps the kernels from loading, with the
    setting named."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TIERSTORE_LANE_FAULTS_TESTS_ONLY"}
    env.update(TIERSTORE_LANE_FAULTS=value, PYTHONPATH=str(REPO))
    code = "from tierstore.native import loader; print(loader.start(wait=True), loader.failure())"
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert got.returncode == 0, got.stderr[-2000:]
    assert got.stdout.startswith("False ") and "TIERSTORE_LANE_FAULTS" in got.stdout and needle in got.stdout


# ------------------------------------------------------------------ the hash seed stays secret
def test_the_namespace_records_nothing_of_the_hash_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    """manifest.json and the namespace digest must not carry a brute-forceable digest of
    PYTHONHASHSEED (at most 32 bits): two seeds give the same marker, and no digest of the
    seed appears in it."""
    import hashlib

    from tierstore.vllm.namespace import hash_seed_marker

    markers = []
    for seed in ("12345", "4294967295"):
        monkeypatch.setenv("PYTHONHASHSEED", seed)
        stable, marker = hash_seed_marker("sha256")
        assert stable and seed not in marker
        digest = hashlib.sha256(seed.encode()).hexdigest()
        assert not any(digest[i:i + 8] in marker for i in range(0, len(digest) - 8))
        markers.append(marker)
    assert markers[0] == markers[1] != "default"


# ------------------------------------------------------------------ the MAC without blake3
def test_a_mac_without_blake3_warns_once_naming_the_package(monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    """Without the blake3 package the fleet MAC falls back to keyed BLAKE2b (several times
    slower): said once, at start, with the command that fixes it."""
    import logging

    monkeypatch.setattr(mac_mod, "_blake3", None)
    if hasattr(mac_mod, "_fallback_warned"):
        monkeypatch.setattr(mac_mod, "_fallback_warned", type(mac_mod._fallback_warned)())
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            assert mac_mod.PageMac(os.urandom(32)).name == "blake2b"
    said = [r.getMessage() for r in caplog.records if "blake3" in r.getMessage()]
    assert len(said) == 1 and "pip install blake3" in said[0] and "mac_key_file" in said[0]


# ------------------------------------------------------------------ a planted entry under a page name
@pytest.mark.parametrize("plant", ["fifo", "directory", "symlink", "hardlink"])
def test_a_store_over_a_planted_entry_replaces_it_and_deletes_nothing(tmp_path: Path, plant: str) -> None:
    """A FIFO, directory, symlink or hard link under a page's name is not the page (a load
    refuses it as unsafe and never removes it): the store must not report it stored, which
    blocked the key for good, nor stop at it, which blocks it until an operator repairs the
    root. The entry is moved aside (pages are published create-only, so nothing replaces it:
    a directory keeps its content, a link its target, a hard link its other name) and the page
    is stored and served after; fsck reports the moved entry."""
    from tierstore.admin.findings import FOREIGN

    root = tmp_path / "root"
    eng = engine(root)
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"someone's data")
    try:
        k = page_key(7)
        path = eng.mapper.path_for(k)
        path.parent.mkdir(parents=True, exist_ok=True)
        if plant == "fifo":
            os.mkfifo(path)
        elif plant == "directory":
            path.mkdir()
            (path / "inside").write_bytes(b"kept")
        elif plant == "symlink":
            path.symlink_to(outside)
        else:
            os.link(outside, path)
        res, _ = load_page(eng, k)
        assert not res.ok and res.error.kind == "unsafe"
        stored = store(eng, k)
        assert stored.ok and stored.stored, stored.error
        res, data = load_page(eng, k)
        assert res.ok and data == page_bytes(eng.layout, k), res.error
        assert eng.stats["planted_replaced"] == 1
        assert outside.read_bytes() == b"someone's data"
        aside = [p for p in path.parent.iterdir() if ".planted-" in p.name]
        assert len(aside) == 1 and aside[0].name.startswith(f".{path.name}.planted-")
        if plant == "directory":
            assert (aside[0] / "inside").read_bytes() == b"kept"
        elif plant == "fifo":
            assert stat.S_ISFIFO(aside[0].lstat().st_mode)
        elif plant == "symlink":
            assert os.readlink(aside[0]) == str(outside)
        else:
            assert os.path.samefile(aside[0], outside)
        rep = run_fsck(FsckOptions(root, progress=False))
        assert len(rep.problems) == 1 and rep.pages_ok == 1, rep.format_text()
        if plant != "symlink":
            assert [p.category for p in rep.problems] == [FOREIGN], rep.format_text()
    finally:
        eng.close()


# ------------------------------------------------------------------ a crafted header costs nothing
@pytest.mark.parametrize("verify", [True, False])
def test_a_header_of_another_shape_is_refused_before_it_is_parsed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  verify: bool) -> None:
    """A checksum-valid header declaring 65,535 one-byte sections, planted under a page's name:
    a keyed engine refuses it as ``format`` from its length and section count alone (the
    section table is never parsed: before, ~450 ms of GIL went into the parse, ahead of the
    MAC check), and the engine's own pages still load."""
    from tierstore.format import header as page_mod
    from tierstore.format.page_layout import SectionSpec

    root = tmp_path / "root"
    eng = engine(root, key_file(tmp_path, "fleet.key"))
    [good, planted] = stored_pages(eng, 2)
    sections = [page_mod.SectionEntry(SectionSpec("s", "uint8", (1,)), 0, 0, 0)] * 65_535
    meta = page_mod.PageMeta(NS.digest_bytes, page_key(1), 0, page_mod.GroupKind.ATTENTION, 16)
    header = page_mod.encode_header(meta, page_mod.Codec.ZSTD, sections, 0)
    planted.write_bytes(header)  # the header alone: no larger than a page of the layout may be
    parsed: list[int] = []
    real_parse = page_mod._parse_header
    monkeypatch.setattr(page_mod, "_parse_header", lambda buf, hl: parsed.append(hl) or real_parse(buf, hl))
    [res] = eng.wait([eng.submit_load(page_key(1), verify=verify)], timeout=10)
    assert not res.ok and res.error.kind == "format", res.error
    assert "65535 sections" in str(res.error) and "not parsed" in str(res.error)
    assert len(header) not in parsed, parsed  # the crafted table was never walked
    [ok] = eng.wait([eng.submit_load(page_key(0), verify=verify)], timeout=10)
    assert ok.ok, ok.error
    eng.release_slot(ok.slot)
    eng.close()
    assert good.exists()
