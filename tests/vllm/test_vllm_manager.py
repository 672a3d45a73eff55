"""Scheduler-side manager: lookups by file existence, failed keys skipped until replaced."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key  # noqa: E402

from tierstore.mapper import FileMapper  # noqa: E402
from tierstore.vllm.manager import TierStoreFileSpec, TierStoreManager  # noqa: E402

VLLM_GROUP = 3  # vLLM group id of the single tierstore group 0


def make(root: Path, retry_after_s: float = 30.0) -> tuple[TierStoreManager, FileMapper]:
    mapper = FileMapper(root, "ab" * 16, 0)
    return TierStoreManager([mapper], {VLLM_GROUP: 0}, [128], [False], retry_after_s=retry_after_s), mapper


def put(mapper: FileMapper, key: bytes, data: bytes = b"page") -> Path:
    path = mapper.path_for(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)  # a new inode, as a real publish makes
    return path


def test_lookup_is_file_existence(tmp_path: Path) -> None:
    manager, mapper = make(tmp_path)
    ctx = ReqContext("r")
    key = make_offload_key(b"k" * 32, VLLM_GROUP)
    assert manager.lookup(key, ctx) == LookupResult.MISS
    put(mapper, b"k" * 32)
    assert manager.lookup(key, ctx) == LookupResult.HIT
    assert manager.counters == {"lookups": 2, "lookup_hits": 1, "skipped_failed": 0}


def test_content_failure_is_skipped_until_the_file_is_replaced(tmp_path: Path) -> None:
    manager, mapper = make(tmp_path)
    ctx = ReqContext("r")
    key = make_offload_key(b"k" * 32, VLLM_GROUP)
    put(mapper, b"k" * 32)
    manager.mark_failed(key, "checksum")
    assert manager.lookup(key, ctx) == LookupResult.MISS
    assert manager.lookup(key, ctx) == LookupResult.MISS
    put(mapper, b"k" * 32, b"a fresh page")
    assert manager.lookup(key, ctx) == LookupResult.HIT


def test_timeouts_are_retried_after_a_while(tmp_path: Path) -> None:
    manager, mapper = make(tmp_path, retry_after_s=0.0)
    key = make_offload_key(b"k" * 32, VLLM_GROUP)
    put(mapper, b"k" * 32)
    manager.mark_failed(key, "timeout")
    assert manager.lookup(key, ReqContext("r")) == LookupResult.HIT
    slow, _ = make(tmp_path, retry_after_s=60.0)
    slow.mark_failed(key, "timeout")
    assert slow.lookup(key, ReqContext("r")) == LookupResult.MISS


def test_prepare_store_skips_existing_and_in_flight_keys(tmp_path: Path) -> None:
    manager, mapper = make(tmp_path)
    ctx = ReqContext("r")
    have, new = make_offload_key(b"h" * 32, VLLM_GROUP), make_offload_key(b"n" * 32, VLLM_GROUP)
    put(mapper, b"h" * 32)
    out = manager.prepare_store([have, new], ctx)
    assert out is not None and out.keys_to_store == [new]
    assert isinstance(out.store_spec, TierStoreFileSpec)
    assert out.store_spec.keys == [b"n" * 32] and out.store_spec.groups == [0]
    again = manager.prepare_store([new], ctx)
    assert again is not None and again.keys_to_store == []  # already being written
    manager.complete_store([new], ctx)
    assert manager.prepare_store([new], ctx).keys_to_store == [new]  # type: ignore[union-attr]


def test_a_hung_shared_root_never_blocks_lookups_past_the_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stat that hangs (an NFS server that stopped answering) turns into misses within the
    deadline; later lookups answer at once while the root is down; it comes back by itself."""
    import threading
    import time

    from tierstore.vllm import manager as manager_mod

    root = tmp_path / "shared"
    mapper = FileMapper(root, "ab" * 16, 0)
    manager = TierStoreManager([mapper], {VLLM_GROUP: 0}, [128], [False], shared_deadline_s=0.2)
    ctx = ReqContext("r")
    key = make_offload_key(b"k" * 32, VLLM_GROUP)
    put(mapper, b"k" * 32)
    assert manager.lookup(key, ctx) == LookupResult.HIT

    hang = threading.Event()
    real_identity, real_stat = manager_mod._file_identity, os.stat

    def hanging_identity(path):  # type: ignore[no-untyped-def]
        hang.wait(30)
        return real_identity(path)

    def hanging_stat(path, *a, **kw):  # type: ignore[no-untyped-def]  # the health probe
        if str(path) == str(root):
            hang.wait(30)
        return real_stat(path, *a, **kw)

    monkeypatch.setattr(manager_mod, "_file_identity", hanging_identity)
    monkeypatch.setattr(manager_mod.os, "stat", hanging_stat)
    t0 = time.monotonic()
    assert manager.lookup(key, ctx) == LookupResult.MISS
    first = time.monotonic() - t0
    t0 = time.monotonic()
    for _ in range(20):
        assert manager.lookup(key, ctx) == LookupResult.MISS
    later = time.monotonic() - t0
    assert 0.15 <= first < 1.0, first
    assert later < 0.1, later  # down: no waiting at all
    assert not manager._shared_stat.health.up and manager._shared_stat.timeouts == 1

    monkeypatch.setattr(manager_mod, "_file_identity", real_identity)
    hang.set()  # the server answers again
    deadline = time.monotonic() + 10
    while not manager._shared_stat.health.up and time.monotonic() < deadline:
        time.sleep(0.05)
    assert manager.lookup(key, ctx) == LookupResult.HIT
