"""The scheduler's start-up writes under the root (issue 33, defect 2): the namespace manifest
and the stale-temp sweep run on a thread, so a hung export delays the connector's constructor
by at most ``shared_deadline_s``; an error within the deadline is still raised there."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from tierstore.errors import ConfigError
from tierstore.format.identity import MANIFEST_NAME
from tierstore.testing.pages import simple_namespace
from tierstore.vllm import connector


def test_a_hung_root_delays_the_start_by_at_most_the_deadline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hung = threading.Event()
    swept: list[str] = []
    real_write = connector.write_manifest

    def hanging_write(root: object, ns: object) -> object:
        hung.wait(30)  # the export does not answer until released
        return real_write(root, ns)  # type: ignore[arg-type]

    monkeypatch.setattr(connector, "write_manifest", hanging_write)
    monkeypatch.setattr(connector, "sweep_at_start", lambda root, digest, local: swept.append(digest))
    ns = simple_namespace()
    t0 = time.monotonic()
    thread = connector.start_root_chores(str(tmp_path), ns, None, 0.3)
    assert 0.25 <= time.monotonic() - t0 < 2.0  # old code: the constructor waited as long as the export hung
    assert thread.is_alive() and swept == []
    hung.set()  # the export answers: the manifest is written, then the sweep runs
    thread.join(10)
    assert (tmp_path / ns.digest / MANIFEST_NAME).exists() and swept == [ns.digest]


def test_a_manifest_error_within_the_deadline_is_raised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(root: object, ns: object) -> object:
        raise ConfigError("refusing the cache tree: a symlink")

    monkeypatch.setattr(connector, "write_manifest", refuse)
    with pytest.raises(ConfigError, match="symlink"):
        connector.start_root_chores(str(tmp_path), simple_namespace(), None, 5.0)
