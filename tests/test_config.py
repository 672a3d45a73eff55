"""TierStoreConfig: every bad setting is refused with a message naming it; good ones pass."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

import tierstore.config as cfgmod
from tierstore.config import TierStoreConfig, default_io_threads, io_threads_advice
from tierstore.errors import ConfigError
from tierstore.fs.display import parse_size

ROOT = {"root": "/mnt/kvcache"}


def test_defaults_and_a_full_valid_config() -> None:
    cfg = TierStoreConfig.from_dict(dict(ROOT))
    assert (cfg.codec, cfg.odirect, cfg.io_threads, cfg.max_bytes) == ("none", "auto", default_io_threads(), None)
    assert cfg.transfer_scratch_mib is None  # automatic: kernels.scratch.transfer_scratch_pages
    full = TierStoreConfig.from_dict({
        **ROOT, "local_root": "/nvme/kv", "local_max_bytes": 1 << 30, "host_bytes": 0, "max_bytes": 1 << 40,
        "gc_interval_s": 60, "codec": "zstd", "zstd_level": 3, "io_threads": 8, "fsync": True,
        "odirect": "off", "flush_timeout_s": 0, "chunk_tokens": 256, "namespace_tag": "prod",
        "staging_slots": 32, "transfer_scratch_mib": 128,
    })
    assert full.root_path.as_posix() == "/mnt/kvcache" and full.zstd_level == 3


@pytest.mark.parametrize(("cpus", "default"), [(1, 4), (2, 4), (8, 4), (12, 6), (16, 8), (128, 8)])
def test_the_io_threads_default_follows_the_cores(cpus: int, default: int) -> None:
    """Half the usable cores, at least 4 (a disk queue), at most 8 (one engine per KV-cache
    group and tier: a hybrid model's worker multiplies it)."""
    assert default_io_threads(cpus) == default
    assert io_threads_advice(default, cpus) is None


def test_io_threads_far_past_the_knee_are_warned_about() -> None:
    """Warned past twice max(the measured knee, 16, or the cores), naming the setting."""
    assert io_threads_advice(32, 2) is None and io_threads_advice(256, 128) is None
    advice = io_threads_advice(33, 2)
    assert advice is not None and '"io_threads" is 33' in advice and "default (4)" in advice
    assert io_threads_advice(257, 128) is not None


@pytest.mark.parametrize(("settings", "named"), [
    ({"cache_dir": "/x"}, "cache_dir"),  # unknown key
    ({"codec": "lz4"}, "codec"),
    ({"odirect": "yes"}, "odirect"),
    ({"io_threads": 0}, "io_threads"),
    ({"queue_depth": 2.5}, "queue_depth"),
    ({"deadline_ms": -1}, "deadline_ms"),
    ({"deadline_s": -1}, "deadline_s"),
    ({"shared_deadline_s": 0}, "shared_deadline_s"),
    ({"max_bytes": 0}, "max_bytes"),
    ({"local_root": "/nvme", "local_max_bytes": -5}, "local_max_bytes"),
    ({"local_max_bytes": 1 << 30}, "local_root"),  # a cap needs the tier's directory
    ({"host_bytes": -1}, "host_bytes"),
    ({"zstd_level": 23}, "zstd_level"),
    ({"chunk_tokens": 0}, "chunk_tokens"),
    ({"staging_slots": 1}, "staging_slots"),
    ({"staging_slots": True}, "staging_slots"),
    ({"transfer_scratch_mib": 0}, "transfer_scratch_mib"),
    ({"transfer_scratch_mib": 1.5}, "transfer_scratch_mib"),
    ({"shared_touch_interval_s": -1.0}, "shared_touch_interval_s"),
    ({"flush_timeout_s": -1}, "flush_timeout_s"),
    ({"flush_timeout_s": "soon"}, "flush_timeout_s"),
    ({"gc_interval_s": 5}, "max_bytes"),  # gc needs a cap to keep
])
def test_bad_setting_is_named(settings: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        TierStoreConfig.from_dict({**ROOT, **settings})


def test_root_is_required_and_the_message_says_how() -> None:
    for d in ({}, {"root": ""}):
        with pytest.raises(ConfigError, match='set "root" in kv_connector_extra_config'):
            TierStoreConfig.from_dict(d)


def test_replace_validates() -> None:
    cfg = TierStoreConfig.from_dict(dict(ROOT))
    assert cfg.replace(io_threads=2).io_threads == 2
    with pytest.raises(ConfigError, match="io_threads"):
        cfg.replace(io_threads=0)


# ------------------------------------------------------------------ strict types (issue 34, item 5)

def test_every_setting_has_one_kind_of_rule() -> None:
    """Each field is a bool, an integer, a byte size, seconds, a path, a choice, a free name or a
    map of names to paths:
    exactly one, so a new setting cannot slip past the strict checks."""
    kinds = [set(cfgmod._BOOLS), set(cfgmod._INTEGERS), set(cfgmod._BYTE_SIZES), set(cfgmod._SECONDS),
             set(cfgmod._PATHS), set(cfgmod._CHOICES), set(cfgmod._NAMES), set(cfgmod._PATH_MAPS),
             set(cfgmod._URLS)]
    names = [f.name for f in dataclasses.fields(TierStoreConfig)]
    assert sorted(n for kind in kinds for n in kind) == sorted(names)


def test_the_reported_cases() -> None:
    """Issue 34's list: each refused with a ConfigError naming the setting (no bare TypeError),
    or, for "500G", accepted as tierstore gc --max-bytes accepts it."""
    for settings, named in [({"fsync": "false"}, "fsync"), ({"zstd_level": "3"}, "zstd_level"),
                            ({"chunk_tokens": "256"}, "chunk_tokens"), ({"host_bytes": 1.5e9}, "host_bytes"),
                            ({"io_threads": True}, "io_threads"), ({"local_root": ROOT["root"]}, "local_root")]:
        with pytest.raises(ConfigError, match=f'setting "{named}"'):
            TierStoreConfig.from_dict({**ROOT, **settings})
    assert TierStoreConfig.from_dict({**ROOT, "max_bytes": "500G"}).max_bytes == 500 << 30


@pytest.mark.parametrize("name", cfgmod._BOOLS)
@pytest.mark.parametrize("value", ["false", "true", "", 0, 1, None, 1.0])
def test_booleans_are_only_json_true_or_false(name: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=f'setting "{name}" must be true or false') as e:
        TierStoreConfig.from_dict({**ROOT, name: value})
    assert repr(value) in str(e.value)


@pytest.mark.parametrize("name", cfgmod._BOOLS)
def test_booleans_accept_true_and_false(name: str) -> None:
    assert getattr(TierStoreConfig.from_dict({**ROOT, name: True}), name) is True
    assert getattr(TierStoreConfig.from_dict({**ROOT, name: False}), name) is False


@pytest.mark.parametrize("name", sorted(cfgmod._INTEGERS))
@pytest.mark.parametrize(("value", "why"), [(True, "true/false is not a number"), (False, "true/false"),
                                            (4.0, "float"), (3.5, "float"), ("4", "a string"),
                                            ([4], "list")])
def test_integers_refuse_bools_floats_and_strings(name: str, value: Any, why: str) -> None:
    with pytest.raises(ConfigError, match=f'setting "{name}" must be an integer') as e:
        TierStoreConfig.from_dict({**ROOT, name: value})
    assert why in str(e.value)


def test_integers_keep_their_ranges_and_their_unset() -> None:
    for name, (least, most, _, unset) in cfgmod._INTEGERS.items():
        assert getattr(TierStoreConfig.from_dict({**ROOT, name: least}), name) == least
        with pytest.raises(ConfigError, match=f'setting "{name}"'):
            TierStoreConfig.from_dict({**ROOT, name: least - 1})
        if most is not None:
            assert getattr(TierStoreConfig.from_dict({**ROOT, name: most}), name) == most
            with pytest.raises(ConfigError, match=f'setting "{name}" must be an integer 1..22'):
                TierStoreConfig.from_dict({**ROOT, name: most + 1})
        if unset:
            assert getattr(TierStoreConfig.from_dict({**ROOT, name: None}), name) is None
        else:
            with pytest.raises(ConfigError, match=f'setting "{name}"'):
                TierStoreConfig.from_dict({**ROOT, name: None})


def _sized(name: str, value: Any) -> dict[str, Any]:
    """A config dict with one byte-size setting (the local cap needs its tier)."""
    return {**ROOT, name: value, **({"local_root": "/nvme/kv"} if name == "local_max_bytes" else {})}


@pytest.mark.parametrize("name", sorted(cfgmod._BYTE_SIZES))
@pytest.mark.parametrize("text", ["500G", "500GiB", "500gb", " 500G ", "1048576", "512M", "512K", "1.5T", "2t"])
def test_byte_sizes_read_strings_as_the_gc_cli_does(name: str, text: str) -> None:
    """One rule: the config's byte count is what ``tierstore gc --max-bytes TEXT`` gets, and a
    size string gives the same config as its byte count."""
    n = parse_size(text)
    cfg = TierStoreConfig.from_dict(_sized(name, text))
    assert getattr(cfg, name) == n and type(getattr(cfg, name)) is int
    assert cfg == TierStoreConfig.from_dict(_sized(name, n))


def test_500G_and_its_byte_count_are_the_same_config() -> None:
    as_text = TierStoreConfig.from_dict({**ROOT, "max_bytes": "500G", "gc_interval_s": 60, "host_bytes": "1G",
                                         "local_root": "/nvme/kv", "local_max_bytes": "1.5T"})
    as_int = TierStoreConfig.from_dict({**ROOT, "max_bytes": 536870912000, "gc_interval_s": 60,
                                        "host_bytes": 1 << 30, "local_root": "/nvme/kv",
                                        "local_max_bytes": 3 << 39})
    assert as_text == as_int


@pytest.mark.parametrize("name", sorted(cfgmod._BYTE_SIZES))
@pytest.mark.parametrize("value", [1.5e9, 1024.0, True, False, "lots", "-1G", "0", "0.0001K", "inf", "nan",
                                   "1e999", "", [1024]])
def test_byte_sizes_refuse_floats_bools_and_bad_strings(name: str, value: Any) -> None:
    """A float is refused even when whole (1.5e9): the message names the setting and the forms."""
    with pytest.raises(ConfigError, match=f'setting "{name}" must be an integer number of bytes') as e:
        TierStoreConfig.from_dict(_sized(name, value))
    assert '"500G"' in str(e.value) and "tierstore gc --max-bytes" in str(e.value)
    if isinstance(value, float):
        assert "float" in str(e.value)


def test_byte_size_bounds() -> None:
    assert TierStoreConfig.from_dict({**ROOT, "host_bytes": 0}).host_bytes == 0  # off
    assert TierStoreConfig.from_dict({**ROOT, "max_bytes": None}).max_bytes is None  # no cap
    for settings, named in [({"max_bytes": 0}, "max_bytes"), ({"host_bytes": -1}, "host_bytes"),
                            ({"host_bytes": None}, "host_bytes"),
                            ({"local_root": "/nvme/kv", "local_max_bytes": 0}, "local_max_bytes")]:
        with pytest.raises(ConfigError, match=f'setting "{named}"'):
            TierStoreConfig.from_dict({**ROOT, **settings})


def test_replace_reads_size_strings_and_the_constructor_is_told_how() -> None:
    cfg = TierStoreConfig.from_dict(dict(ROOT))
    assert cfg.replace(max_bytes="10G").max_bytes == 10 << 30
    with pytest.raises(ConfigError, match='setting "max_bytes"'):
        cfg.replace(max_bytes=1e10)
    direct = TierStoreConfig(root="/mnt/kvcache", max_bytes="10G")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match='setting "max_bytes" is the string .*from_dict'):
        direct.validate()


@pytest.mark.parametrize("name", cfgmod._SECONDS)
@pytest.mark.parametrize("value", [True, "30", float("nan"), float("inf"), -0.5])
def test_seconds_refuse_bools_strings_and_non_finite(name: str, value: Any) -> None:
    extra = {"max_bytes": 1 << 30} if name == "gc_interval_s" else {}
    with pytest.raises(ConfigError, match=f'setting "{name}" must be a finite number of seconds'):
        TierStoreConfig.from_dict({**ROOT, **extra, name: value})


@pytest.mark.parametrize(("local", "relation"), [
    ("/mnt/kvcache", "the same directory"),
    ("/mnt/kvcache/", "the same directory"),
    ("/mnt/./kvcache/../kvcache", "the same directory"),
    ("/mnt/kvcache/local", '"local_root" inside "root"'),
    ("/mnt", '"root" inside "local_root"'),
    ("/", '"root" inside "local_root"'),
])
def test_local_root_apart_from_root(local: str, relation: str) -> None:
    with pytest.raises(ConfigError, match='setting "local_root" must be a directory apart from "root"') as e:
        TierStoreConfig.from_dict({**ROOT, "local_root": local})
    assert relation in str(e.value) and "LRU eviction" in str(e.value) and "gc" in str(e.value)


def test_local_root_is_compared_as_an_absolute_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Relative paths and ``..`` are normalised, without touching the file system (the paths need
    not exist, and ``root`` may be a hung mount: a symlink alias is not resolved); siblings, and a
    name that only shares a prefix, are apart."""
    shared = tmp_path / "shared"
    shared.mkdir()
    monkeypatch.chdir(tmp_path)
    for local in ("shared", str(tmp_path / "x" / ".." / "shared"), str(shared / "not-yet" / "local")):
        with pytest.raises(ConfigError, match='setting "local_root"'):
            TierStoreConfig.from_dict({"root": str(shared), "local_root": local})
    with pytest.raises(ConfigError, match="the same directory"):
        TierStoreConfig.from_dict({"root": "shared", "local_root": str(shared)})
    for local in ("local", str(tmp_path / "shared2"), str(tmp_path / "missing" / "local")):
        assert TierStoreConfig.from_dict({"root": str(shared), "local_root": local}).local_root == local
    assert TierStoreConfig.from_dict({"root": str(shared), "local_root": ""}).local_root == ""  # off, as before
    with pytest.raises(ConfigError, match="same directory"):
        TierStoreConfig(root=shared, local_root=str(shared)).replace()  # type: ignore[arg-type]


def test_paths_are_strings() -> None:
    for settings, named in [({"root": 5}, "root"), ({"local_root": 5}, "local_root"),
                            ({"root": ["/mnt/kv"]}, "root")]:
        with pytest.raises(ConfigError, match=f'setting "{named}" must be a directory path'):
            TierStoreConfig.from_dict({**ROOT, **settings})


def test_valid_configs_as_the_repository_writes_them() -> None:
    """The forms tests, tools and the adapter pass: ints for sizes and counts, JSON booleans,
    float seconds, None for optional settings, Path roots built directly."""
    for d in [
        {**ROOT, "local_root": "/nvme/kv", "local_max_bytes": 64 << 20, "shared_deadline_s": 5,
         "shared_touch_interval_s": 0.5},
        {**ROOT, "max_bytes": 6 * 8192 + 4096, "gc_interval_s": 0.2},
        {**ROOT, "host_bytes": 1 << 16, "local_root": None, "local_max_bytes": None},
        {**ROOT, "deadline_s": 1e10, "io_loop": "python", "io_batch_pages": 1, "odirect": "on"},
        {**ROOT, "fsync": False, "trust_shared_root": True, "shared_group_access": False, "mac_key_file": "/k"},
        {**ROOT, "chunk_tokens": None, "staging_slots": None, "transfer_scratch_mib": None, "model_id": "m"},
        {**ROOT, "index_refresh_s": 0, "flush_timeout_s": 0.0, "gc_interval_s": 0},
    ]:
        TierStoreConfig.from_dict(d)
    assert TierStoreConfig(root=Path("/mnt/kvcache"), io_threads=2).replace(io_threads=3).io_threads == 3  # type: ignore[arg-type]


def test_validating_a_config_does_not_touch_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``root`` may be a hung NFS mount at engine start: resolving it (a stat per component)
    blocked config validation in uninterruptible sleep. Validation calls no stat at all."""
    import os as os_mod

    def no_stat(*a: object, **kw: object) -> None:
        raise AssertionError("config validation touched the file system")

    for name in ("stat", "lstat"):
        monkeypatch.setattr(os_mod, name, no_stat)
    cfg = TierStoreConfig.from_dict({"root": str(tmp_path / "nfs"), "local_root": str(tmp_path / "nvme"),
                                     "max_bytes": "500G"})
    assert cfg.max_bytes == 500 << 30


# ------------------------------------------------------------ durations in seconds (issue 34, item 5)

DEADLINES = [("deadline_s", "deadline_ms", 10.0), ("shared_deadline_s", "shared_deadline_ms", 5.0)]


def test_deadlines_are_seconds_with_the_old_defaults() -> None:
    cfg = TierStoreConfig.from_dict(dict(ROOT))
    assert (cfg.deadline_s, cfg.shared_deadline_s) == (10.0, 5.0)
    cfg = TierStoreConfig.from_dict({**ROOT, "deadline_s": 0.25, "shared_deadline_s": 3})
    assert (cfg.deadline_s, cfg.shared_deadline_s) == (0.25, 3)
    assert not hasattr(cfg, "deadline_ms") and not hasattr(cfg, "shared_deadline_ms")


@pytest.mark.parametrize(("new", "old", "default"), DEADLINES)
def test_the_removed_millisecond_names_are_refused_naming_the_seconds_setting(new: str, old: str,
                                                                               default: float) -> None:
    """0.3's millisecond settings: an error that names the seconds setting and the value to
    write (2500 ms: 2.5), alone, beside the new name, or with a value that is no duration."""
    for given in ({old: 2500}, {old: 2500, new: 2.5}):
        with pytest.raises(ConfigError, match=f'setting "{old}" \\(milliseconds\\) was removed in 0.4') as e:
            TierStoreConfig.from_dict({**ROOT, **given})
        assert f'write "{new}" in seconds instead, e.g. "{new}": 2.5' in str(e.value)
    with pytest.raises(ConfigError, match=f'"{new}": 5'):
        TierStoreConfig.from_dict({**ROOT, old: "fast"})


def test_new_names_log_nothing(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="tierstore.config"):
        TierStoreConfig.from_dict({**ROOT, "deadline_s": 1, "shared_deadline_s": 1})
    assert not [r for r in caplog.records if r.name == "tierstore.config"]


@pytest.mark.parametrize(("new", "old", "default"), DEADLINES)
@pytest.mark.parametrize(("value", "why"), [(True, "true/false"), (False, "true/false"), ("5", "a string"),
                                            (-1, ""), (-0.5, ""), (0, ""), (0.0, ""), (float("inf"), ""),
                                            (float("nan"), ""), (None, ""), ([5], "")])
def test_bad_deadlines_are_refused_naming_the_setting_and_the_form(new: str, old: str, default: float,
                                                                   value: Any, why: str) -> None:
    with pytest.raises(ConfigError, match=f'setting "{new}" must be a finite number of seconds > 0') as e:
        TierStoreConfig.from_dict({**ROOT, new: value})
    assert why in str(e.value)


def test_replace_refuses_the_removed_names_too() -> None:
    cfg = TierStoreConfig.from_dict(dict(ROOT))
    assert cfg.replace(deadline_s=2).deadline_s == 2
    for bad in ({"deadline_s": float("inf")}, {"deadline_ms": 300}, {"shared_deadline_ms": 1500}):
        with pytest.raises(ConfigError, match="deadline"):
            cfg.replace(**bad)
