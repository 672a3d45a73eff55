"""FileMapper: path layout, fan-out distribution, locate round trip, temp names."""

from __future__ import annotations

import os
import random
from collections import Counter
from pathlib import Path

import pytest

from tierstore.fs.mapper import (
    FANOUT_DIRS,
    MAX_KEY_BYTES,
    FileMapper,
    fanout,
    host_tag,
    is_fanout_name,
    locate,
    parse_index_dir,
    parse_page_name,
    parse_temp_name,
)

NS = "0123456789abcdef0123456789abcdef"


def test_path_layout(tmp_path: Path) -> None:
    m = FileMapper(tmp_path, NS, 2, rank=3)
    key = bytes(range(32))
    assert m.path_for(key) == tmp_path / NS / "g2" / "r3" / fanout(key) / f"{key.hex()}.kvp"
    assert fanout(key) in FANOUT_DIRS and len(set(FANOUT_DIRS)) == 256


def test_fanout_spreads_keys_evenly() -> None:
    rng = random.Random(1234)
    keys = [rng.randbytes(32) for _ in range(100_000)]
    dirs = Counter(fanout(k) for k in keys)
    # 10^5 keys over 256 directories: 390 each, standard deviation 20. A skewed hash would
    # show up as directories far outside 290..500.
    assert sorted(dirs) == sorted(FANOUT_DIRS)
    assert min(dirs.values()) > 290 and max(dirs.values()) < 500


def test_fanout_of_sequential_keys_is_spread() -> None:
    # Keys that differ only in their last byte (or are small integers) still spread: 78 each.
    dirs = Counter(fanout(i.to_bytes(8, "big")) for i in range(20_000))
    assert len(dirs) == 256 and max(dirs.values()) <= 120


def test_make_fanout_dirs_creates_the_missing_ones(tmp_path: Path) -> None:
    m = FileMapper(tmp_path, NS, 1, rank=2)
    assert m.make_fanout_dirs() == 256
    assert sorted(p.name for p in m.base.iterdir()) == sorted(FANOUT_DIRS)
    (m.base / "7f").rmdir()
    assert m.make_fanout_dirs() == 1  # only what is missing
    assert m.make_fanout_dirs() == 0
    assert (m.base / "7f").is_dir()


@pytest.mark.parametrize("key_len", [1, 8, 32, MAX_KEY_BYTES])
def test_locate_round_trip(tmp_path: Path, key_len: int) -> None:
    rng = random.Random(key_len)
    for group, rank in [(0, 0), (3, 7), (12, 0)]:
        m = FileMapper(tmp_path, NS, group, rank)
        key = rng.randbytes(key_len)
        loc = locate(tmp_path, m.path_for(key))
        assert loc is not None
        assert (loc.namespace, loc.group_index, loc.rank, loc.key) == (NS, group, rank, key)
        assert len(m.path_for(key).name.encode()) < 255


def test_locate_rejects_wrong_places(tmp_path: Path) -> None:
    m = FileMapper(tmp_path, NS, 0)
    key = bytes(32)
    path = m.path_for(key)
    aa = fanout(key)
    wrong = f"{(int(aa, 16) + 1) % 256:02x}"
    assert locate(tmp_path, path.parent.parent / wrong / path.name) is None  # wrong fan-out
    assert locate(tmp_path, path.parent / "x.kvp") is None
    assert locate(tmp_path, path.parent.parent / path.name) is None  # too shallow
    assert locate(tmp_path, path.parent / aa / path.name) is None  # too deep (the old aa/bb tree)
    assert locate(tmp_path / "elsewhere", path) is None  # not under root
    assert locate(tmp_path, tmp_path / NS / "gx" / "r0" / aa / path.name) is None
    assert locate(tmp_path, path.with_name(f"{key.hex()}.tmp")) is None
    for g, r in (("g00", "r0"), ("g0", "r01"), ("g+0", "r0"), ("g0", "r\u0660")):  # not what a mapper writes
        assert locate(tmp_path, tmp_path / NS / g / r / aa / path.name) is None, (g, r)


def test_index_and_fanout_names() -> None:
    assert [parse_index_dir(n, "g") for n in ("g0", "g7", "g12", "g", "g07", "r1", "g-1", "g 1", "g\u0661")] == [
        0, 7, 12, None, None, None, None, None, None]
    assert parse_index_dir("r3", "r") == 3
    assert [is_fanout_name(n) for n in ("00", "af", "AF", "a", "abc", "g0")] == [True, True, False, False, False, False]


def test_key_length_limits(tmp_path: Path) -> None:
    m = FileMapper(tmp_path, NS, 0)
    with pytest.raises(ValueError):
        m.path_for(b"")
    with pytest.raises(ValueError):
        m.path_for(bytes(MAX_KEY_BYTES + 1))


def test_temp_names_parse(tmp_path: Path) -> None:
    m = FileMapper(tmp_path, NS, 1, 2)
    key = bytes(range(20))
    names = {m.temp_path_for(key).name for _ in range(50)}
    assert len(names) == 50  # unique per call
    for name in names:
        t = parse_temp_name(name)
        assert t is not None
        assert (t.key_hex, t.host, t.pid) == (key.hex(), host_tag(), os.getpid())
        assert parse_page_name(name) is None  # a temp is never taken for a page
    tmp = m.temp_path_for(key)
    assert tmp.parent == m.path_for(key).parent  # same directory: rename stays atomic
    assert locate(tmp_path, tmp) is None


def test_page_names_parse() -> None:
    assert parse_page_name("00ff.kvp") == b"\x00\xff"
    for bad in ("0ff.kvp", "00FF.kvp", "00ff.kvp.tmp", ".00ff.kvp", "zz.kvp", "00ff", ".nfs000001"):
        assert parse_page_name(bad) is None, bad
    for bad in (".00ff.kvp.host.12.ab", "00ff.kvp.host.12.ab.tmp", ".00ff.kvp.host.x.ab.tmp"):
        assert parse_temp_name(bad) is None, bad


def test_fast_string_paths_are_the_mapper_paths(tmp_path: Path) -> None:
    """The engine's hot-path strings and the pathlib paths come from one rule."""
    m = FileMapper(tmp_path, NS, 1, rank=2)
    key = bytes(range(40))
    assert m.final_path(key) == str(m.path_for(key))
    for tmp in (m.temp_path(key), m.temp_path(key, m.final_path(key)), str(m.temp_path_for(key))):
        assert os.path.dirname(tmp) == str(m.path_for(key).parent)
        parsed = parse_temp_name(os.path.basename(tmp))
        assert parsed is not None and parsed.key_hex == key.hex() and parsed.pid == os.getpid()
    assert m.temp_path(key) != m.temp_path(key)  # unique
    with pytest.raises(ValueError):
        m.temp_path_for(b"")
