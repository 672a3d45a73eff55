"""Scheduler-side manager: answers from the in-memory page index, RETRY while it cannot answer,
no file-system call on the scheduler thread, failed keys skipped until replaced."""

from __future__ import annotations

import builtins
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key  # noqa: E402

from tierstore.fs.mapper import FileMapper  # noqa: E402
from tierstore.index import index_prober, page_index  # noqa: E402
from tierstore.vllm.manager import TierStoreFileSpec, TierStoreManager  # noqa: E402

VLLM_GROUP = 3  # vLLM group id of the single tierstore group 0
NS = "ab" * 16


def make(root: Path, retry_after_s: float = 30.0, **kw: Any) -> tuple[TierStoreManager, FileMapper]:
    mapper = FileMapper(root, NS, 0)
    manager = TierStoreManager([mapper], {VLLM_GROUP: 0}, [128], [False], retry_after_s=retry_after_s, **kw)
    return manager, mapper


def put(mapper: FileMapper, key: bytes, data: bytes = b"page") -> Path:
    path = mapper.path_for(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)  # a new inode, as a real publish makes
    return path


def ask(manager: TierStoreManager, key: bytes, ctx: ReqContext, steps: int = 500) -> LookupResult:
    """What vLLM's scheduler ends up with: lookups, one per step, until the answer is not RETRY."""
    for _ in range(steps):
        result = manager.lookup(key, ctx)
        if result is not LookupResult.RETRY:
            return result
        assert manager.settle(5.0)
    raise AssertionError("lookup kept answering RETRY")


def until(pred: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.01)
    return pred()


def key_of(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


def test_cold_index_answers_retry_then_hit(tmp_path: Path) -> None:
    mapper = FileMapper(tmp_path, NS, 0)
    put(mapper, b"k" * 32)
    manager, _ = make(tmp_path, load_index=False)  # the index is still loading
    ctx = ReqContext("r")
    have, absent = make_offload_key(b"k" * 32, VLLM_GROUP), make_offload_key(b"x" * 32, VLLM_GROUP)
    assert manager.lookup(have, ctx) is LookupResult.RETRY
    assert manager.lookup(absent, ctx) is LookupResult.RETRY
    assert manager.has_pending_work()
    assert manager.settle()  # one background batch answers both
    assert manager.lookup(have, ctx) is LookupResult.HIT
    assert manager.lookup(absent, ctx) is LookupResult.MISS
    assert manager.counters["lookup_probes"] == 2 and manager.counters["lookup_retries"] == 2
    manager.shutdown()


def test_loaded_index_answers_without_probes(tmp_path: Path) -> None:
    mapper = FileMapper(tmp_path, NS, 0)
    for i in range(50):
        put(mapper, key_of(i))
    manager, _ = make(tmp_path)
    assert until(lambda: manager.pages.loaded)
    ctx = ReqContext("r")
    assert all(manager.lookup(make_offload_key(key_of(i), VLLM_GROUP), ctx) is LookupResult.HIT for i in range(50))
    assert manager.lookup(make_offload_key(key_of(99), VLLM_GROUP), ctx) is LookupResult.MISS
    assert manager.counters["lookup_probes"] == 0
    manager.shutdown()


class FsCallsOnThread:
    """Records file-system calls made on one thread (os.stat, os.lstat, os.scandir, os.listdir,
    os.open, open, Path.exists via os.stat)."""

    NAMES = ("stat", "lstat", "scandir", "listdir", "open", "access", "utime", "unlink", "replace")

    def __init__(self, monkeypatch: pytest.MonkeyPatch, thread: threading.Thread) -> None:
        self.calls: list[str] = []
        for name in self.NAMES:
            monkeypatch.setattr(os, name, self._wrap(f"os.{name}", getattr(os, name), thread))
        monkeypatch.setattr(builtins, "open", self._wrap("open", builtins.open, thread))

    def _wrap(self, name: str, fn: Callable[..., Any], thread: threading.Thread) -> Callable[..., Any]:
        def wrapper(*a: Any, **kw: Any) -> Any:
            if threading.current_thread() is thread:
                self.calls.append(f"{name}{a[:1]}")
            return fn(*a, **kw)
        return wrapper


@pytest.mark.parametrize("with_local", [False, True])
def test_scheduler_thread_never_calls_the_file_system(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      with_local: bool) -> None:
    mapper = FileMapper(tmp_path / "shared", NS, 0)
    local = [FileMapper(tmp_path / "local", NS, 0)] if with_local else None
    for i in range(300):
        put(mapper, key_of(i))
    keys = [make_offload_key(key_of(i), VLLM_GROUP) for i in range(600)]
    ctx = ReqContext("r")
    spy = FsCallsOnThread(monkeypatch, threading.current_thread())
    manager = TierStoreManager([mapper], {VLLM_GROUP: 0}, [128], [False], local_mappers=local,
                               index_refresh_s=0.05)
    answers: dict[int, LookupResult] = {}
    for _step in range(2000):  # a scheduler loop while the index loads and refreshes
        manager.lookup_prefix(keys, ctx)  # the connector's prefix loop, vectorized
        for i, key in enumerate(keys):
            answers[i] = manager.lookup(key, ctx)
        if all(a is not LookupResult.RETRY for a in answers.values()):
            break
        manager.on_schedule_end(None)
        time.sleep(0.002)
    out = manager.prepare_store(keys[250:350], ctx)
    assert out is not None and out.keys_to_store == keys[300:350]
    manager.complete_store(keys[300:350], ctx)
    manager.mark_failed(keys[0], "checksum")
    manager.mark_failed(keys[1], "timeout")
    manager.on_schedule_end(None)
    assert manager.lookup(keys[0], ctx) is LookupResult.MISS
    manager.reset_cache()
    monkeypatch.undo()  # the spy off before any settle() of the test itself
    assert spy.calls == [], spy.calls[:10]
    assert [answers[i] for i in range(600)] == [LookupResult.HIT] * 300 + [LookupResult.MISS] * 300
    manager.shutdown()


def test_content_failure_is_skipped_until_the_file_is_replaced(tmp_path: Path) -> None:
    put(FileMapper(tmp_path, NS, 0), b"k" * 32)  # before the index's one listing starts
    manager, mapper = make(tmp_path)
    ctx = ReqContext("r")
    key = make_offload_key(b"k" * 32, VLLM_GROUP)
    assert ask(manager, key, ctx) is LookupResult.HIT
    manager.mark_failed(key, "checksum")
    assert manager.lookup(key, ctx) is LookupResult.MISS
    assert manager.settle()
    assert ask(manager, key, ctx) is LookupResult.MISS
    assert manager.settle()
    assert ask(manager, key, ctx) is LookupResult.MISS
    put(mapper, b"k" * 32, b"a fresh page")
    assert manager.lookup(key, ctx) is LookupResult.MISS  # the re-check runs off this thread
    assert manager.settle()
    assert ask(manager, key, ctx) is LookupResult.HIT
    manager.shutdown()


def test_timeouts_are_retried_after_a_while(tmp_path: Path) -> None:
    put(FileMapper(tmp_path, NS, 0), b"k" * 32)  # before the index's one listing starts
    manager, _ = make(tmp_path, retry_after_s=0.0)
    key = make_offload_key(b"k" * 32, VLLM_GROUP)
    manager.mark_failed(key, "timeout")
    assert ask(manager, key, ReqContext("r")) is LookupResult.HIT
    slow, _ = make(tmp_path, retry_after_s=60.0)
    slow.mark_failed(key, "timeout")
    assert ask(slow, key, ReqContext("r")) is LookupResult.MISS
    manager.shutdown()
    slow.shutdown()


def test_prepare_store_skips_existing_and_in_flight_keys(tmp_path: Path) -> None:
    mapper = FileMapper(tmp_path, NS, 0)
    put(mapper, b"h" * 32)
    manager, _ = make(tmp_path)
    assert until(lambda: manager.pages.loaded)
    ctx = ReqContext("r")
    have, new = make_offload_key(b"h" * 32, VLLM_GROUP), make_offload_key(b"n" * 32, VLLM_GROUP)
    out = manager.prepare_store([have, new], ctx)
    assert out is not None and out.keys_to_store == [new]
    assert isinstance(out.store_spec, TierStoreFileSpec)
    assert out.store_spec.keys == [b"n" * 32] and out.store_spec.groups == [0]
    again = manager.prepare_store([new], ctx)
    assert again is not None and again.keys_to_store == []  # already being written
    manager.complete_store([new], ctx)  # the worker dropped it: nothing on disk
    assert manager.settle()
    assert manager.prepare_store([new], ctx).keys_to_store == [new]  # type: ignore[union-attr]
    manager.shutdown()


def test_own_stores_are_never_a_false_miss(tmp_path: Path) -> None:
    """A completed store answers RETRY until confirmed, then HIT, long before any refresh; with
    the store path's hook (``page_index.note_stored``) HIT at once."""
    manager, mapper = make(tmp_path, index_refresh_s=3600)
    assert until(lambda: manager.pages.loaded)
    ctx = ReqContext("r")
    a, b = make_offload_key(b"a" * 32, VLLM_GROUP), make_offload_key(b"b" * 32, VLLM_GROUP)
    assert manager.prepare_store([a, b], ctx).keys_to_store == [a, b]  # type: ignore[union-attr]
    put(mapper, b"a" * 32)
    put(mapper, b"b" * 32)
    page_index.note_stored(mapper.base, b"b" * 32)  # what the store path does in this process
    manager.complete_store([a, b], ctx)
    assert manager.lookup(a, ctx) is LookupResult.RETRY
    assert manager.lookup(b, ctx) is LookupResult.HIT
    assert ask(manager, a, ctx) is LookupResult.HIT
    page_index.note_removed(mapper.base, b"b" * 32)  # eviction / gc in this process
    assert manager.lookup(b, ctx) is LookupResult.MISS
    manager.shutdown()


def test_another_nodes_page_is_found_after_the_refresh_interval(tmp_path: Path) -> None:
    manager, _ = make(tmp_path, index_refresh_s=0.2)
    assert until(lambda: manager.pages.loaded)
    ctx = ReqContext("r")
    key = make_offload_key(b"o" * 32, VLLM_GROUP)
    assert manager.lookup(key, ctx) is LookupResult.MISS
    other_node = FileMapper(tmp_path, NS, 0)  # another process's mapper on the same root
    put(other_node, b"o" * 32)
    t0 = time.monotonic()
    assert until(lambda: manager.lookup(key, ctx) is LookupResult.HIT, timeout=10)
    assert time.monotonic() - t0 < 5  # a refresh interval (0.2 s) plus one listing, not more
    manager.shutdown()


def test_a_page_deleted_behind_our_back_costs_at_most_one_failed_load(tmp_path: Path) -> None:
    path = put(FileMapper(tmp_path, NS, 0), b"d" * 32)  # before the index's one listing starts
    manager, mapper = make(tmp_path, index_refresh_s=3600)
    ctx = ReqContext("r")
    key = make_offload_key(b"d" * 32, VLLM_GROUP)
    assert until(lambda: manager.pages.loaded)  # no listing after the unlink below
    assert ask(manager, key, ctx) is LookupResult.HIT
    path.unlink()  # gc on another node
    assert manager.lookup(key, ctx) is LookupResult.HIT  # a stale positive: the load will fail
    manager.mark_failed(key, "missing")  # the worker's report of that one failed load
    assert manager.lookup(key, ctx) is LookupResult.MISS
    assert manager.settle()
    for _ in range(3):  # every later request recomputes without trying to load it
        assert ask(manager, key, ctx) is LookupResult.MISS
    manager.shutdown()


def test_a_hung_shared_root_never_blocks_lookups(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that stopped answering (stats and creates hang): lookups keep answering at once
    (RETRY while in doubt), MISS once the deadline marked the root down; it comes back by
    itself."""
    root = tmp_path / "shared"
    manager, mapper = make(root, shared_deadline_s=0.2, load_index=False)  # cold: every key probes
    ctx = ReqContext("r")
    key = make_offload_key(b"k" * 32, VLLM_GROUP)
    put(mapper, b"k" * 32)
    assert ask(manager, key, ctx) is LookupResult.HIT

    hang = threading.Event()
    real_identity, real_open = index_prober.file_identity, os.open

    def hanging_identity(path):  # type: ignore[no-untyped-def]
        hang.wait(30)
        return real_identity(path)

    def hanging_create(path, flags, *a, **kw):  # type: ignore[no-untyped-def]  # the health probe
        if flags & os.O_CREAT and str(path).startswith(str(root)):
            hang.wait(30)
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(index_prober, "file_identity", hanging_identity)
    monkeypatch.setattr(os, "open", hanging_create)
    other = make_offload_key(b"o" * 32, VLLM_GROUP)
    assert manager.lookup(other, ctx) is LookupResult.RETRY
    manager.on_schedule_end(None)
    assert manager.lookup(other, ctx) is LookupResult.RETRY  # the stat hangs; we do not
    assert until(lambda: not manager.pages.shared_up, timeout=5)
    assert manager.lookup(other, ctx) is LookupResult.MISS  # down: MISS at once
    assert manager.lookup(key, ctx) is LookupResult.MISS
    assert manager.pages.counters["probe_timeouts"] == 1

    monkeypatch.setattr(index_prober, "file_identity", real_identity)
    hang.set()  # the server answers again
    assert until(lambda: manager.pages.shared_up, timeout=10)
    assert manager.lookup(key, ctx) is LookupResult.HIT
    manager.shutdown()


def test_repeated_hits_stop_when_the_page_leaves_the_index(tmp_path: Path) -> None:
    """A key answered HIT is answered again from memory, until a refresh finds its file gone
    (gc on another node), this process removes it, or its load fails."""
    for i in range(3):
        put(FileMapper(tmp_path, NS, 0), key_of(i))
    manager, mapper = make(tmp_path, index_refresh_s=0.1)
    assert until(lambda: manager.pages.loaded)
    ctx = ReqContext("r")
    keys = [make_offload_key(key_of(i), VLLM_GROUP) for i in range(3)]
    for _ in range(2):
        assert [manager.lookup(k, ctx) for k in keys] == [LookupResult.HIT] * 3
    assert manager.counters["lookups"] == manager.counters["lookup_hits"] == 6
    mapper.path_for(key_of(0)).unlink()  # gc on another node: the next refresh drops it
    assert until(lambda: manager.lookup(keys[0], ctx) is LookupResult.MISS, timeout=10)
    page_index.note_removed(mapper.base, key_of(1))  # an eviction in this process
    assert manager.lookup(keys[1], ctx) is LookupResult.MISS
    manager.mark_failed(keys[2], "checksum")  # its load failed
    assert manager.lookup(keys[2], ctx) is LookupResult.MISS
    manager.shutdown()


def _vllm_prefix(manager: TierStoreManager, keys: list[bytes], ctx: ReqContext) -> int | None:
    """vLLM 0.32's own prefix loop (one ``lookup`` per key, KV events off)."""
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (
        OffloadingEventsTracker,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
        OffloadingConnectorScheduler,
    )
    from vllm.v1.kv_offload.base import OffloadingKVEventsConfig

    loop = SimpleNamespace(manager=manager, _events_tracker=OffloadingEventsTracker(OffloadingKVEventsConfig(False, False)))
    return OffloadingConnectorScheduler._maximal_prefix_lookup(loop, keys, ctx, None, None, 0)


def _ours(manager: TierStoreManager, keys: list[bytes], ctx: ReqContext) -> int | None:
    """The connector's loop (``TierStoreConnectorScheduler``: one ``lookup_prefix``)."""
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (
        OffloadingEventsTracker,
    )
    from vllm.v1.kv_offload.base import OffloadingKVEventsConfig

    from tierstore.vllm.scheduler import TierStoreConnectorScheduler

    loop = SimpleNamespace(manager=manager, _events_tracker=OffloadingEventsTracker(OffloadingKVEventsConfig(False, False)))
    return TierStoreConnectorScheduler._maximal_prefix_lookup(loop, keys, ctx, None, None, 0)


@pytest.mark.parametrize("load_index", [True, False])
def test_prefix_lookups_in_one_call_answer_as_vllms_loop(tmp_path: Path, load_index: bool) -> None:
    """``lookup_prefix`` (vectorized leading hits, then ``lookup`` per key) gives vLLM's loop's
    answer and counters at every step: a cold index (RETRY), holes, failed and probing keys,
    cached hits, pages removed and added behind the cache."""
    mapper = FileMapper(tmp_path, NS, 0)
    n = 400
    for i in range(n):
        if i not in (250, 390):
            put(mapper, key_of(i))
    ours, _ = make(tmp_path, load_index=load_index)
    theirs, _ = make(tmp_path, load_index=load_index)
    if load_index:
        assert until(lambda: ours.pages.loaded and theirs.pages.loaded)
    ctx = ReqContext("r")
    keys = [make_offload_key(key_of(i), VLLM_GROUP) for i in range(n)]
    runs = [keys, keys[:200], keys[40:], keys[251:], keys[251:300], keys[245:260]]
    passes: list[int] = []  # keys decided by each vectorized pass (the path under test is taken)
    real_pass = ours.pages.known_prefix
    ours.pages.known_prefix = lambda *a, **k: passes.append(real_pass(*a, **k)) or passes[-1]  # type: ignore[method-assign]

    def step(note: str) -> list[int | None]:
        got = [_ours(ours, run, ctx) for run in runs]
        assert got == [_vllm_prefix(theirs, run, ctx) for run in runs], note
        assert ours.counters == theirs.counters, note
        for m in (ours, theirs):
            assert m.settle(5.0)
        return got

    first = step("first sight")
    if not load_index:
        assert first[0] is None  # unlisted directories: RETRY, probed in the background
    assert step("again") == [250, 200, 210, 139, 49, 5]
    assert max(passes) >= 200  # the first sight of a loaded index took the vectorized pass
    for m in (ours, theirs):
        m.mark_failed(keys[100], "checksum")  # its load failed: MISS until replaced
        m.complete_store(keys[320:322], ctx)  # stores to confirm: RETRY meanwhile
    assert step("failed and probing")[:3] == [100, 100, 60]
    for m in (ours, theirs):
        m._hits.clear()  # the set of HIT answers was full: the vectorized pass meets the failed key
    passes.clear()
    assert step("failed, HITs not cached")[:3] == [100, 100, 60]
    # keys[0:]: 8 one by one, then one pass finds index hits up to the hole at 250; the
    # failed keys[100] cuts them (the answer above is vLLM's 100, not 250).
    assert 242 in passes
    for m in (ours, theirs):
        page_index.note_removed(m.pages.shared.mappers[0][0].base, key_of(10))  # an eviction
        put(mapper, key_of(250))
        page_index.note_stored(m.pages.shared.mappers[0][0].base, key_of(250))  # a store of ours
    after = step("removal and store")
    assert after[0] == 10 and after[3] == 139
    ours.shutdown()
    theirs.shutdown()


def test_the_scheduler_keeps_vllms_loop_when_kv_events_are_on(tmp_path: Path) -> None:
    """With KV-cache events on, vLLM records each HIT key as it is found: the connector's
    scheduler then runs vLLM's own per-key loop (``lookup_prefix`` is not called)."""
    from types import SimpleNamespace

    from tierstore.vllm.scheduler import TierStoreConnectorScheduler

    calls: list[str] = []
    manager = SimpleNamespace(lookup=lambda key, ctx: calls.append("lookup") or LookupResult.HIT,
                              lookup_prefix=lambda keys, ctx: calls.append("prefix") or len(keys))
    recorded: list[bytes] = []
    events = SimpleNamespace(self_describing_enabled=True,
                             record_lookup=lambda req, cfg, idx, key: recorded.append(key))
    loop = SimpleNamespace(manager=manager, _events_tracker=events)
    keys = [make_offload_key(key_of(i), VLLM_GROUP) for i in range(5)]
    assert TierStoreConnectorScheduler._maximal_prefix_lookup(loop, keys, ReqContext("r"), None, None, 0) == 5
    assert calls == ["lookup"] * 5 and recorded == keys
    events.self_describing_enabled = False
    calls.clear()
    assert TierStoreConnectorScheduler._maximal_prefix_lookup(loop, keys, ReqContext("r"), None, None, 0) == 5
    assert calls == ["prefix"]
