"""TierStoreConfig: every bad setting is refused with a message naming it; good ones pass."""

from __future__ import annotations

from typing import Any

import pytest

from tierstore.config import TierStoreConfig, default_io_threads, io_threads_advice
from tierstore.errors import ConfigError

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
