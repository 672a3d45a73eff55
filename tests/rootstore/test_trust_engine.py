"""What an engine with a fleet key says at start: its page I/O leaves the native lane (which
computes no MACs) for Python I/O threads; said once per process, not per engine."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import pytest

from tierstore.config import TierStoreConfig
from tierstore.rootstore import engine as engine_mod
from tierstore.rootstore.engine import IOEngine
from tierstore.testing.pages import simple_namespace


def test_a_keyed_engine_says_once_that_its_io_leaves_the_native_lane(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(engine_mod, "_MAC_COSTS_SAID", threading.Event())
    key = tmp_path / "fleet.key"
    key.write_text(os.urandom(32).hex())
    key.chmod(0o600)
    caplog.set_level(logging.INFO, logger="tierstore.engine")
    engines = [IOEngine(tmp_path / f"root{i}", simple_namespace(), 0, staging_slots=2, config=TierStoreConfig.from_dict(
        {"root": str(tmp_path / f"root{i}"), "mac_key_file": str(key), "io_threads": 1})) for i in range(2)]
    for eng in engines:
        eng.close()
    said = [r.getMessage() for r in caplog.records if "native" in r.getMessage() and "mac_key_file" in r.getMessage()]
    assert len(said) == 1 and "Python I/O threads" in said[0], said
