"""IOEngine behaviour: round trips, publish rules, typed failures, queues, deadlines, ordering."""

from __future__ import annotations

import errno
import json
import os
import stat
import threading
import time
from pathlib import Path

import pytest
import zstandard
from tiers_helpers import load_page, store_data

from tierstore.bench import io as bench_io
from tierstore.bench.io_systems import RawSystem
from tierstore.config import TierStoreConfig
from tierstore.errors import ConfigError
from tierstore.format.header import Codec
from tierstore.format.identity import MANIFEST_NAME, Namespace, read_manifest
from tierstore.format.page_layout import PageLayout
from tierstore.fs.directio import O_DIRECT
from tierstore.native import loader as native
from tierstore.native import page_calls as native_page
from tierstore.rootstore import engine as engine_mod
from tierstore.rootstore.engine import IOEngine, probe_odirect
from tierstore.rootstore.page_read import inspect_page
from tierstore.testing.pages import (
    corrupt_flip_bit,
    hybrid_namespace,
    page_bytes,
    page_key,
    read_stored,
    simple_namespace,
    write_page,
)


def _engine(root: Path, ns: Namespace, group: int = 0, **cfg: object) -> IOEngine:
    extra = {k: cfg.pop(k) for k in ("staging_slots", "deadline_s", "rank", "tier_name", "file_ops") if k in cfg}
    config = TierStoreConfig.from_dict({"root": str(root), **cfg})
    return IOEngine(root, ns, group, config=config, **extra)  # type: ignore[arg-type]


@pytest.mark.parametrize("odirect", ["auto", "off"])
@pytest.mark.parametrize("codec", ["none", "zstd"])
@pytest.mark.parametrize("group", [0, 1, 2])
def test_round_trip_hybrid_groups(root: Path, codec: str, odirect: str, group: int) -> None:
    ns = hybrid_namespace()
    eng = _engine(root, ns, group, codec=codec, odirect=odirect if codec == "none" else "auto")
    layout = ns.groups[group].layout
    pages = {page_key(i): page_bytes(layout, page_key(i), group) for i in range(4)}
    for key, data in pages.items():
        res = store_data(eng, key, data)
        assert res.ok and res.stored and res.error is None, res
    for key, data in pages.items():
        path = eng.mapper.path_for(key)
        header = inspect_page(path, zstandard.ZstdDecompressor())
        assert header.codec == (Codec.ZSTD if codec == "zstd" else Codec.NONE)
        assert header.meta.key == key and header.meta.token_count == 16
        res, got = load_page(eng, key)
        assert res.ok, res.error
        assert got == data
    st = eng.stats
    assert st["stores_ok"] == 4 and st["loads_ok"] == 4 and st["free_slots"] == st["staging_slots"]
    eng.close()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "float8_e4m3fn"])
def test_round_trip_dtypes_and_byte_identity(root: Path, tmp_path: Path, dtype: str) -> None:
    """The engine's files are byte-identical to the reference encoder's (format + pagefile)."""
    ns = simple_namespace(dtype)
    eng = _engine(root, ns)
    ref_root = tmp_path / "ref"
    layout = ns.groups[0].layout
    for i in range(3):
        key = page_key(i)
        data = page_bytes(layout, key)
        assert store_data(eng, key, data).ok
        ref = write_page(ref_root, ns, 0, key, data=data)
        assert eng.mapper.path_for(key).read_bytes() == ref.path.read_bytes()
        assert read_stored(root, ns, ref) == data  # the reference reader accepts engine files
        res, got = load_page(eng, key)
        assert res.ok and got == data
    eng.close()


def test_unaligned_payload_tail(root: Path) -> None:
    """A payload that is not a multiple of 4096 bytes (O_DIRECT pads, then truncates)."""
    ns = hybrid_namespace(conv_dim=37, ssm_state_size=5)  # Mamba sections of odd sizes
    eng = _engine(root, ns, 2)
    layout = ns.groups[2].layout
    assert layout.nbytes % 4096
    key = page_key(7)
    data = page_bytes(layout, key, 2)
    assert store_data(eng, key, data).ok
    path = eng.mapper.path_for(key)
    assert path.stat().st_size == inspect_page(path).file_size
    res, got = load_page(eng, key)
    assert res.ok and got == data
    if O_DIRECT:  # drop the page from the cache so the O_DIRECT read path runs
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        res, got = load_page(eng, key)
        assert res.ok and got == data
    eng.close()


def test_codecs_read_each_other(root: Path) -> None:
    ns = simple_namespace("bfloat16")
    layout = ns.groups[0].layout
    plain, packed = _engine(root, ns, codec="none"), _engine(root, ns, codec="zstd")
    a, b = page_key(1), page_key(2)
    assert store_data(plain, a, page_bytes(layout, a)).ok
    assert store_data(packed, b, page_bytes(layout, b)).ok
    assert load_page(packed, a)[1] == page_bytes(layout, a)
    assert load_page(plain, b)[1] == page_bytes(layout, b)
    plain.close()
    packed.close()


def test_existing_page_counts_as_stored(root: Path) -> None:
    ns = simple_namespace()
    eng = _engine(root, ns)
    key = page_key(0)
    data = page_bytes(ns.groups[0].layout, key)
    first, second = store_data(eng, key, data), store_data(eng, key, data)
    assert first.ok and first.stored
    assert second.ok and not second.stored
    assert eng.stats["stores_existing"] == 1
    assert [p.name for p in eng.mapper.path_for(key).parent.iterdir()] == [eng.mapper.path_for(key).name]
    eng.close()


def test_manifest_and_contains(root: Path) -> None:
    ns = simple_namespace()
    eng = _engine(root, ns)
    assert read_manifest(root / ns.digest / MANIFEST_NAME).digest == ns.digest
    key = page_key(3)
    assert not eng.contains(key)
    assert store_data(eng, key, page_bytes(ns.groups[0].layout, key)).ok
    assert eng.contains(key)
    eng.close()


@pytest.mark.parametrize(
    ("damage", "kind"),
    [
        ("payload_bit", "checksum"),
        ("header_bit", "checksum"),
        ("truncate", "truncated"),
        ("zero", "format"),
        ("foreign", "foreign"),
        ("swapped", "key_mismatch"),
    ],
)
def test_damaged_pages_are_typed_failures(root: Path, damage: str, kind: str) -> None:
    ns = simple_namespace()
    eng = _engine(root, ns)
    layout = ns.groups[0].layout
    key, other = page_key(0), page_key(1)
    for k in (key, other):
        assert store_data(eng, k, page_bytes(layout, k)).ok
    path = eng.mapper.path_for(key)
    if damage == "payload_bit":
        corrupt_flip_bit(path, -100)
    elif damage == "header_bit":
        corrupt_flip_bit(path, 200)
    elif damage == "truncate":
        os.truncate(path, path.stat().st_size - 10)
    elif damage == "zero":
        path.write_bytes(bytes(path.stat().st_size))
    elif damage == "foreign":
        foreign = simple_namespace(model="someone/else")
        ref = write_page(root / "elsewhere", foreign, 0, key)
        os.replace(ref.path, path)
    elif damage == "swapped":
        os.replace(eng.mapper.path_for(other), path)
    res, data = load_page(eng, key)
    assert not res.ok and data is None and res.slot is None
    assert res.error is not None and res.error.kind == kind, res.error
    assert res.error.key == key
    assert eng.stats["loads_failed"] == {kind: 1}
    assert eng.free_slots == eng.stats["staging_slots"]
    # The damaged file is gone, so the key can be stored again and then loads clean.
    assert not path.exists() and eng.stats["bad_pages_discarded"] == 1
    res = store_data(eng, key, page_bytes(layout, key))
    assert res.ok and res.stored
    res, data = load_page(eng, key)
    assert res.ok and data == page_bytes(layout, key)
    eng.close()


@pytest.mark.parametrize("damaged_section", [None, 0, 1, 3])
@pytest.mark.parametrize("piece_bytes", [1, 3000, 1 << 20])
def test_warm_loads_verify_piece_by_piece(root: Path, damaged_section: int | None, piece_bytes: int) -> None:
    """Cached pages are read in pieces and each piece hashed as it lands: every piece size
    gives the same bytes, and damage in any section (first, middle, last piece) is caught."""
    ns = hybrid_namespace()
    eng = _engine(root, ns, 2)  # 4 sections of unequal sizes
    eng.warm_piece_bytes = piece_bytes
    layout = eng.layout
    key = page_key(7)
    data = page_bytes(layout, key, 2)
    assert store_data(eng, key, data).ok
    path = eng.mapper.path_for(key)
    hl = eng.header_len(len(key))
    if damaged_section is not None:
        corrupt_flip_bit(path, hl + layout.offsets[damaged_section] + layout.sections[damaged_section].nbytes - 1)
    path.read_bytes()  # bring the whole file into the page cache: the warm path
    plan = eng.files.read_plan(hl)
    assert plan[0][0] == 0 and plan[-1][1] == hl + layout.nbytes
    assert all(a[1] == b[0] for a, b in zip(plan, plan[1:], strict=False))  # contiguous pieces
    assert [i for p in plan for i in range(p[2], p[3])] == list(range(len(layout.sections)))
    if piece_bytes == 1:
        assert len(plan) == len(layout.sections)
    res, got = load_page(eng, key)
    if damaged_section is None:
        assert res.ok and got == data, res.error
    else:
        assert not res.ok and res.error is not None and res.error.kind == "checksum", res.error
        assert layout.sections[damaged_section].name in str(res.error)
    if eng.direct_loads:
        assert eng.stats["loads_odirect"] == 0  # it was served from the page cache
    assert eng.free_slots == eng.stats["staging_slots"]
    eng.close()


def test_missing_page(root: Path) -> None:
    eng = _engine(root, simple_namespace())
    res, _ = load_page(eng, page_key(42))
    assert not res.ok and res.error is not None and res.error.kind == "missing"
    eng.close()


def _block_worker(eng: IOEngine, op: str, gate: threading.Event, started: threading.Event) -> list[str]:
    """Make the engine's ``op`` block on ``gate`` (a stuck syscall); returns the call log."""
    assert eng.config.io_loop == "python", "the native lane never calls the wrapped file operation"
    calls: list[str] = []
    real = getattr(eng.ops, {"load": "load", "store": "store"}[op])

    def blocked(*a: object) -> object:
        calls.append(op)
        started.set()
        gate.wait(30)
        return real(*a)

    setattr(eng.ops, op, blocked)
    return calls


def _submit_stores_behind_a_blocked_first(eng: IOEngine, layout: PageLayout, n: int,
                                          started: threading.Event) -> list[int]:
    """Submit stores of pages 0..n-1; waits until the first one is running (and blocked)."""
    ids = []
    for i in range(n):
        slot = eng.acquire_slot()
        assert slot is not None
        slot.view[:] = page_bytes(layout, page_key(i))
        ids.append(eng.submit_store(page_key(i), slot, 16))
        if i == 0:
            assert started.wait(5)
    return ids


def test_queue_full_and_no_slot(root: Path) -> None:
    ns = simple_namespace()
    eng = _engine(root, ns, io_threads=1, queue_depth=2, staging_slots=5, io_loop="python")
    layout = ns.groups[0].layout
    gate, started = threading.Event(), threading.Event()
    _block_worker(eng, "store", gate, started)
    ids = _submit_stores_behind_a_blocked_first(eng, layout, 4, started)  # job 0 runs (blocked); 1 and 2 fill the queue
    # Job 3 found the queue full: completed at once, its slot back in the pool.
    [full] = [r for r in eng.poll() if r.job_id == ids[3]]
    assert not full.ok and full.error is not None and full.error.kind == "queue_full"
    assert eng.free_slots == 2
    # Loads take their own slot; with none left a load fails at once, also queue_full.
    held = [eng.acquire_slot(), eng.acquire_slot()]
    [noslot] = eng.wait([eng.submit_load(page_key(0))], timeout=0)
    assert noslot.error is not None and noslot.error.kind == "queue_full"
    for s in held:
        eng.release_slot(s)  # type: ignore[arg-type]
    gate.set()
    done = eng.wait(ids[:3], timeout=10)
    assert [r.ok for r in done] == [True, True, True]
    assert eng.stats["stores_failed"] == {"queue_full": 1}
    eng.close()


def test_deadline_holds_while_worker_is_stuck(root: Path) -> None:
    ns = simple_namespace()
    eng = _engine(root, ns, io_threads=1, staging_slots=3, deadline_s=0.3, io_loop="python")
    gate, started = threading.Event(), threading.Event()
    _block_worker(eng, "store", gate, started)
    slot = eng.acquire_slot()
    assert slot is not None
    key = page_key(0)
    slot.view[:] = page_bytes(ns.groups[0].layout, key)
    t0 = time.monotonic()
    job = eng.submit_store(key, slot, 16)
    assert started.wait(5)
    queued = eng.submit_load(page_key(1))  # waits behind the stuck worker, also times out
    res = eng.wait([job, queued], timeout=10)
    elapsed = time.monotonic() - t0
    assert 0.25 <= elapsed < 3.0
    assert [r.error.kind if r.error else None for r in res] == ["timeout", "timeout"]
    # The stuck worker still reads the store's slot: it must not be handed out again yet.
    assert eng.free_slots == 2
    gate.set()
    assert eng.flush(5)
    deadline = time.monotonic() + 5
    while eng.free_slots != 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert eng.free_slots == 3
    assert eng.stats["late_results_dropped"] == 1
    assert eng.poll() == []  # the late success is dropped, never reported
    inspect_page(eng.mapper.path_for(key))  # the late store published a complete page
    eng.close()


def test_fifo_under_a_page_name_fails_fast_and_typed(root: Path) -> None:
    """A FIFO where the page should be (issue 17): opened O_NONBLOCK and refused by fstat
    ("unsafe"), never blocking an I/O thread and never removed. (It used to block open() until
    the deadline; deadlines are covered with blocking jobs in test_ioqueue.py.)"""
    ns = simple_namespace()
    eng = _engine(root, ns, io_threads=2, deadline_s=0.3)
    key = page_key(5)
    path = eng.mapper.path_for(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path)
    t0 = time.monotonic()
    results = eng.wait([eng.submit_load(key) for _ in range(4)], timeout=10)
    assert [r.error.kind for r in results if r.error is not None] == ["unsafe"] * 4
    assert time.monotonic() - t0 < 0.3  # none waited for its deadline
    assert stat.S_ISFIFO(os.lstat(path).st_mode)  # left for fsck
    # The workers still serve: a normal store and load go through.
    other = page_key(6)
    data = page_bytes(ns.groups[0].layout, other)
    assert store_data(eng, other, data).ok
    assert load_page(eng, other)[1] == data
    assert eng.stats["late_results_dropped"] == 0
    assert eng.free_slots == eng.stats["staging_slots"]
    eng.close()


def test_loads_are_served_before_stores(root: Path) -> None:
    ns = simple_namespace()
    layout = ns.groups[0].layout
    # the Python I/O threads: the recorders below wrap their file operations (a lane bypasses them)
    eng = _engine(root, ns, io_threads=1, staging_slots=12, io_loop="python")
    for i in range(3):  # pages to load later
        assert store_data(eng, page_key(100 + i), page_bytes(layout, page_key(100 + i))).ok
    gate, started = threading.Event(), threading.Event()
    # (operation, page) each time a recorder is entered. A batch call may serve its pages through
    # the single-page call (it does while the native kernels are not loaded, or with
    # TIERSTORE_NATIVE=0), which records them a second time: a page counts where first seen.
    seen: list[tuple[str, int]] = []  # (operation, index of the page's key)
    index = {page_key(i): i for i in (*range(4), *range(100, 103))}
    real_load, real_loads, real_store, real_stores = eng.ops.load, eng.ops.load_many, eng.ops.store, eng.ops.store_many

    def rec_load(key: bytes, *a: object) -> tuple[int, tuple[int, ...] | None]:
        seen.append(("load", index[key]))
        return real_load(key, *a)  # type: ignore[arg-type]

    def rec_loads(items: list) -> list:  # the thread takes the three queued loads as one batch
        seen.extend(("load", index[item[0]]) for item in items)
        return real_loads(items)

    def rec_store(key: bytes, *a: object) -> tuple[bool, int]:
        seen.append(("store", index[key]))
        if not started.is_set():
            started.set()
            gate.wait(30)
        return real_store(key, *a)  # type: ignore[arg-type]

    def rec_stores(items: list) -> list:  # the three stores queued behind the loads: one batch
        seen.extend(("store", index[item[0]]) for item in items)
        return real_stores(items)

    eng.ops.load, eng.ops.load_many, eng.ops.store = rec_load, rec_loads, rec_store  # type: ignore[method-assign]
    eng.ops.store_many = rec_stores  # type: ignore[method-assign]
    ids = _submit_stores_behind_a_blocked_first(eng, layout, 4, started)
    ids += [eng.submit_load(page_key(100 + i)) for i in range(3)]
    gate.set()
    results = eng.wait(ids, timeout=10)
    assert all(r.ok for r in results)
    order = list(dict.fromkeys(seen))  # each (operation, page) once, in the order first seen
    # Stores 1 to 3 were queued before the loads, yet the thread served the loads first.
    assert order == [("store", 0), ("load", 100), ("load", 101), ("load", 102), ("store", 1), ("store", 2),
                     ("store", 3)]
    for r in results:
        if r.slot is not None:
            eng.release_slot(r.slot)
    eng.close()


def test_close_cancels_queued_loads_and_later_submits(root: Path) -> None:
    ns = simple_namespace()
    eng = _engine(root, ns, io_threads=1, io_loop="python")
    gate, started = threading.Event(), threading.Event()
    _block_worker(eng, "load", gate, started)
    first = eng.submit_load(page_key(0))
    assert started.wait(5)
    queued = eng.submit_load(page_key(1))
    closer = threading.Thread(target=eng.close, kwargs={"timeout": 1.0})
    closer.start()
    [res] = eng.wait([queued], timeout=5)
    assert res.error is not None and res.error.kind == "cancelled"
    gate.set()
    closer.join(5)
    [after] = eng.wait([eng.submit_load(page_key(2))], timeout=1)
    assert after.error is not None and after.error.kind == "cancelled"
    [r0] = eng.wait([first], timeout=5)
    assert r0.error is not None and r0.error.kind == "missing"


def test_slot_misuse_is_a_programming_error(root: Path) -> None:
    ns = simple_namespace()
    a, b = _engine(root, ns), _engine(root, ns)
    slot = a.acquire_slot()
    assert slot is not None
    with pytest.raises(ValueError):
        b.submit_store(page_key(0), slot, 16)
    a.release_slot(slot)
    with pytest.raises(ValueError):
        a.release_slot(slot)  # released twice
    with pytest.raises(ValueError):
        a.submit_store(page_key(0), slot, 16)  # a free slot is not the caller's to submit
    with pytest.raises(ValueError):
        a.submit_load(b"")
    a.close()
    b.close()


def test_staging_slots_are_aligned_tensors(root: Path) -> None:
    ns = hybrid_namespace()
    eng = _engine(root, ns, 2, staging_slots=3)
    slots = [eng.acquire_slot() for _ in range(3)]
    assert eng.acquire_slot(timeout=0.01) is None
    for s in slots:
        assert s is not None
        assert s.tensor.data_ptr() % 4096 == 0
        assert s.tensor.numel() == ns.groups[2].layout.nbytes == len(s.view)
        s.view[:3] = b"abc"
        assert bytes(s.tensor[:3].tolist()) == b"abc"  # view and tensor share memory
    assert len({s.tensor.data_ptr() for s in slots if s}) == 3
    for s in slots:
        eng.release_slot(s)  # type: ignore[arg-type]
    # The most recently released slot is handed out first (its memory is still in the CPU
    # cache), also to loads; a slot released long ago waits.
    assert eng.acquire_slot() is slots[-1]
    eng.release_slot(slots[-1])  # type: ignore[arg-type]
    eng.release_slot(held := eng.acquire_slot())  # type: ignore[arg-type]
    assert held is slots[-1]
    key = page_key(3)
    assert store_data(eng, key, page_bytes(eng.layout, key, 2)).ok
    [res] = eng.wait([eng.submit_load(key)], timeout=10)
    assert res.ok and res.slot is slots[-1]
    eng.release_slot(res.slot)
    eng.close()


def test_odirect_settings(root: Path, caplog: pytest.LogCaptureFixture) -> None:
    ns = simple_namespace()
    off = _engine(root, ns, odirect="off")
    assert off.stats["io_mode"] == "buffered"
    off.close()
    with pytest.raises(ConfigError, match="odirect"):
        _engine(root, ns, odirect="on", codec="zstd")
    ok, reason = probe_odirect(root)
    auto = _engine(root, ns, odirect="auto")
    assert auto.stats["io_mode"] == ("odirect" if ok else "buffered"), reason
    auto.close()


def test_odirect_fallback_is_visible(root: Path, monkeypatch: pytest.MonkeyPatch,
                                     caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(engine_mod, "probe_odirect", lambda d: (False, "Invalid argument (errno 22)"))
    ns = simple_namespace()
    with caplog.at_level("WARNING", logger="tierstore.engine"):
        eng = _engine(root, ns, odirect="auto")
    assert eng.stats["io_mode"] == "buffered"
    assert "Invalid argument" in eng.stats["odirect_reason"]
    assert any("O_DIRECT does not work" in r.getMessage() for r in caplog.records)
    key = page_key(0)
    assert store_data(eng, key, page_bytes(ns.groups[0].layout, key)).ok
    eng.close()
    with pytest.raises(ConfigError, match='"odirect" is "on"'):
        _engine(root, ns, odirect="on")


def test_store_error_is_per_key_and_temp_removed(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ns = simple_namespace()
    eng = _engine(root, ns, io_loop="python")  # the Python path names the error
    layout = ns.groups[0].layout
    good = page_key(0)
    assert store_data(eng, good, page_bytes(layout, good)).ok
    real = os.pwritev

    def failing(fd: int, bufs: object, offset: int) -> int:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(engine_mod.os, "pwritev", failing)
    # The native store (native.py) does not go through os.pwritev: let it fail too, as it does
    # on an I/O error (temp removed, code < 0); the Python path then redoes the store.
    monkeypatch.setattr(native_page, "store_page", lambda *a: native.STORE_FAILED)
    bad = page_key(1)
    res = store_data(eng, bad, page_bytes(layout, bad))
    monkeypatch.setattr(engine_mod.os, "pwritev", real)
    assert not res.ok and res.error is not None and res.error.kind == "io"
    assert not eng.mapper.path_for(bad).exists()
    assert not [p for p in eng.mapper.path_for(bad).parent.iterdir() if p.name.endswith(".tmp")]
    assert load_page(eng, good)[1] == page_bytes(layout, good)
    eng.close()


def test_waiters_wake_on_their_jobs_and_on_released_slots(root: Path) -> None:
    ns = simple_namespace()
    layout = ns.groups[0].layout
    eng = _engine(root, ns, io_threads=1, staging_slots=2, io_loop="python")
    gate, started = threading.Event(), threading.Event()
    _block_worker(eng, "store", gate, started)
    slot = eng.acquire_slot()
    assert slot is not None
    slot.view[:] = page_bytes(layout, page_key(0))
    job = eng.submit_store(page_key(0), slot, 16)
    assert started.wait(5)
    # Two callers wait for the same job; one more waits for a slot (the other one is held).
    got: dict[str, object] = {}
    held = eng.acquire_slot()
    assert held is not None

    def waiter(name: str) -> None:
        got[name] = eng.wait([job], timeout=10)

    def slot_waiter() -> None:
        got["slot"] = eng.acquire_slot(timeout=10)

    threads = [threading.Thread(target=waiter, args=(n,)) for n in ("a", "b")]
    threads.append(threading.Thread(target=slot_waiter))
    for t in threads:
        t.start()
    time.sleep(0.1)
    assert not got  # nobody returned early
    t0 = time.monotonic()
    eng.release_slot(held)
    threads[2].join(5)
    assert got.get("slot") is held and time.monotonic() - t0 < 2
    gate.set()
    for t in threads[:2]:
        t.join(5)
    results = [r for name in ("a", "b") for r in got[name]]  # type: ignore[attr-defined]
    assert len(results) == 1 and results[0].ok  # one caller got the result, neither hung
    eng.release_slot(held)
    eng.close()


def test_bench_io_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The benchmark runs end to end and reports the fields the issue asks for (not timings)."""
    rc = bench_io.main(["--root", str(tmp_path / "bench"), "--json", "--page-mib", "2",
                        "--total-mib", "8", "--repeat", "1", "--warm-passes", "1", "--threads", "2",
                        "--no-vllm", "--cache-drop", "fadvise"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("store_vs_raw", "load_vs_raw", "load_warm_vs_raw", "overhead_per_page", "cache_drop"):
        assert key in out
    size = out["sizes"]["2MiB"]
    assert size["header_bytes"] == 4096 and out["cache_drop"] == "fadvise"
    assert all(size["gbps"][s][ph] > 0 for s in ("raw", "tierstore") for ph in ("store", "load", "load_warm"))
    # Paired ratios: one per repeat (cold: per round), their median inside their range.
    assert size["samples_per_ratio"] == {"store": 1, "load": 2, "load_warm": 1}
    lo, hi = size["ratio_range"]["load_vs_raw"]
    assert lo <= size["ratios"]["load_vs_raw"] <= hi
    assert out["ratio_range"]["load_vs_raw"]["2MiB"] == [lo, hi]
    assert size["cpu_efficiency_vs_baseline"]["load_warm_vs_raw"] > 0
    assert not (tmp_path / "bench").exists()  # scratch files removed


def test_bench_io_raw_baseline_stores_into_new_files_each_repeat(tmp_path: Path) -> None:
    """The raw baseline never rewrites a file under the clock (tierstore's stores never do):
    each repeat writes new names, and the last repeat's files are unlinked before it."""
    page = 4096
    sources = [memoryview(bytes([i]) * page) for i in range(2)]
    raw = RawSystem(tmp_path / "raw", sources, 2, page)
    raw.store(3, 0)
    first = list(raw.paths)
    raw.drop_files()
    assert not any(p.exists() for p in first)
    raw.store(3, 1)
    assert not set(raw.paths) & set(first) and all(p.read_bytes() == bytes([i % 2]) * page
                                                   for i, p in enumerate(raw.paths))


def test_odirect_refused_at_run_time_rewrites_buffered(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ns = hybrid_namespace(conv_dim=37)  # unaligned payload: the padded O_DIRECT write is refused
    eng = _engine(root, ns, 2, odirect="auto", io_loop="python")
    if not eng.odirect:
        eng.close()
        pytest.skip("O_DIRECT does not work on this file system")
    real = os.pwritev
    calls = []

    def refuse_first(fd: int, bufs: object, offset: int) -> int:
        calls.append(fd)
        if len(calls) == 1:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, bufs, offset)  # type: ignore[arg-type]

    monkeypatch.setattr(engine_mod.os, "pwritev", refuse_first)
    # The native store's own O_DIRECT refusal hands the store to the Python path (tested here).
    monkeypatch.setattr(native_page, "store_page", lambda *a: native.STORE_FAILED)
    key = page_key(1)
    data = page_bytes(eng.layout, key, 2)
    res = store_data(eng, key, data)
    monkeypatch.setattr(engine_mod.os, "pwritev", real)
    assert res.ok and len(calls) == 2
    path = eng.mapper.path_for(key)
    assert path.stat().st_size == inspect_page(path).file_size
    assert load_page(eng, key)[1] == data
    eng.close()


# ---------------------------------------------------------------- checksums computed by the caller
def _section_sums(layout: PageLayout, data: bytes) -> tuple[int, ...]:
    from tierstore.format.checksums import checksum

    return tuple(checksum(data[o : o + s.nbytes]) for o, s in zip(layout.offsets, layout.sections, strict=True))


@pytest.mark.parametrize("odirect", ["auto", "off"])
def test_store_with_caller_sums_writes_the_same_file(root: Path, odirect: str) -> None:
    """Sums handed in (the GPU's) give the byte-identical file the engine writes by hashing."""
    ns = hybrid_namespace()
    layout = ns.groups[0].layout
    data = page_bytes(layout, page_key(1), 0)
    a, b = _engine(root / "a", ns, odirect=odirect), _engine(root / "b", ns, odirect=odirect)
    assert store_data(a, page_key(1), data).ok
    slot = b.acquire_slot(timeout=5)
    assert slot is not None
    slot.view[:] = data
    [res] = b.wait([b.submit_store(page_key(1), slot, 16, sums=_section_sums(layout, data))], timeout=10)
    assert res.ok and res.stored
    assert a.mapper.path_for(page_key(1)).read_bytes() == b.mapper.path_for(page_key(1)).read_bytes()
    with pytest.raises(ValueError, match="checksums for"):
        s2 = b.acquire_slot(timeout=5)
        b.submit_store(page_key(2), s2, 16, sums=(1,))  # type: ignore[arg-type]
    a.close()
    b.close()


def test_store_with_wrong_sums_is_caught_on_read(root: Path) -> None:
    """A wrong caller checksum is never served: the next verified read reports corruption."""
    ns = hybrid_namespace()
    layout = ns.groups[0].layout
    data = page_bytes(layout, page_key(3), 0)
    eng = _engine(root, ns)
    slot = eng.acquire_slot(timeout=5)
    assert slot is not None
    slot.view[:] = data
    bad = list(_section_sums(layout, data))
    bad[-1] ^= 1
    [res] = eng.wait([eng.submit_store(page_key(3), slot, 16, sums=bad)], timeout=10)
    assert res.ok
    res, got = load_page(eng, page_key(3))
    assert not res.ok and res.error is not None and res.error.kind == "checksum" and got is None
    eng.close()


@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_unverified_load_returns_header_sums(root: Path, codec: str) -> None:
    """verify=False skips hashing (codec none) and hands the header's sums to the caller; a
    page the engine had to decode (zstd) comes back verified."""
    ns = hybrid_namespace()
    layout = ns.groups[1].layout
    eng = _engine(root, ns, 1, codec=codec)
    data = page_bytes(layout, page_key(5), 1)
    assert store_data(eng, page_key(5), data).ok
    [res] = eng.wait([eng.submit_load(page_key(5), verify=False)], timeout=10)
    assert res.ok and res.slot is not None
    assert bytes(res.slot.view) == data
    if codec == "none":
        assert not res.verified and res.sums == _section_sums(layout, data)
    else:
        assert res.verified and res.sums is None
    eng.release_slot(res.slot)
    # a damaged payload is not noticed without verification: the caller's check must catch it
    corrupt_flip_bit(eng.mapper.path_for(page_key(5)), -1)
    [res] = eng.wait([eng.submit_load(page_key(5), verify=False)], timeout=10)
    if codec == "none":
        assert res.ok and not res.verified and res.sums == _section_sums(layout, data)
        assert bytes(res.slot.view) != data  # type: ignore[union-attr]
        eng.release_slot(res.slot)  # type: ignore[arg-type]
        eng.settle(res, False, "checksum mismatch found by the caller")
        assert eng.flush(10)  # the removal runs off the caller's thread
        assert not eng.mapper.path_for(page_key(5)).exists()
        assert eng.stats["bad_pages_discarded"] == 1
    else:
        assert not res.ok and res.error is not None
    # a damaged header is still caught without verification
    assert store_data(eng, page_key(6), page_bytes(layout, page_key(6), 1)).ok
    corrupt_flip_bit(eng.mapper.path_for(page_key(6)), 10)
    [res] = eng.wait([eng.submit_load(page_key(6), verify=False)], timeout=10)
    assert not res.ok and res.error is not None
    assert eng.stats["free_slots"] == eng.stats["staging_slots"]
    eng.close()


# ---------------------------------------------------------------- settle: one owner of a damaged page
def test_damaged_page_is_removed_once_by_the_engine_that_served_it(root: Path) -> None:
    """settle(result, False) removes the file that result was read from, once: a good page
    republished under the name afterwards survives a second settle."""
    ns = hybrid_namespace()
    layout = ns.groups[1].layout
    eng = _engine(root, ns, 1, tier_name="local")
    other = _engine(root, ns, 1)  # another store on the same files ("disk")
    key = page_key(9)
    data = page_bytes(layout, key, 1)
    assert store_data(eng, key, data).ok
    path = eng.mapper.path_for(key)
    corrupt_flip_bit(path, -1)
    [res] = eng.wait([eng.submit_load(key, verify=False)], timeout=10)
    assert res.ok and not res.verified and res.tier == "local" and res.slot is not None
    assert _section_sums(layout, bytes(res.slot.view)) != res.sums  # the caller's check fails
    eng.release_slot(res.slot)
    with pytest.raises(ValueError, match="tier"):
        other.settle(res, False, "not the engine that served it")
    assert path.exists()
    eng.settle(res, False, "section checksum mismatch after the copy")
    assert eng.flush(10)  # the removal runs off the caller's thread
    assert not path.exists()
    st = eng.stats
    assert st["bad_pages_discarded"] == 1 and st["loads_failed"] == {"checksum": 1} and st["loads_ok"] == 0
    # A good page is published again under the name; settling the old result again removes nothing.
    assert store_data(other, key, data).ok and path.exists()
    eng.settle(res, False, "settled twice")
    assert eng.flush(10) and path.exists() and eng.stats["bad_pages_discarded"] == 1
    assert eng.stats["loads_failed"] == {"checksum": 1}
    # A good unverified load settled ok counts as a load, once.
    [good] = eng.wait([eng.submit_load(key, verify=False)], timeout=10)
    assert good.ok and not good.verified and good.sums == _section_sums(layout, bytes(good.slot.view))  # type: ignore[union-attr]
    eng.release_slot(good.slot)  # type: ignore[arg-type]
    assert eng.stats["loads_awaiting_settle"] == 1
    eng.settle(good, True)
    eng.settle(good, True)
    assert eng.stats["loads_ok"] == 1 and eng.stats["loads_awaiting_settle"] == 0
    eng.close()
    other.close()


def test_engine_found_damage_removes_only_the_file_it_read(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A page republished between the damaged read and its removal is left alone."""
    ns = simple_namespace()
    layout = ns.groups[0].layout
    eng = _engine(root, ns, io_loop="python")  # load_then_republish wraps the Python path's load
    key = page_key(4)
    data = page_bytes(layout, key)
    assert store_data(eng, key, data).ok
    path = eng.mapper.path_for(key)
    good = path.read_bytes()
    corrupt_flip_bit(path, -1)
    real_load = eng.ops.load

    def load_then_republish(*a: object) -> object:
        try:
            return real_load(*a)  # type: ignore[arg-type]
        finally:  # another writer publishes a good copy before the engine removes the bad one
            tmp = path.with_name(path.name + ".republish.tmp")
            tmp.write_bytes(good)
            os.replace(tmp, path)

    monkeypatch.setattr(eng.ops, "load", load_then_republish)
    res, got = load_page(eng, key)
    assert not res.ok and res.error is not None and res.error.kind == "checksum" and got is None
    assert path.read_bytes() == good and eng.stats["bad_pages_discarded"] == 0
    monkeypatch.undo()
    assert load_page(eng, key)[1] == data
    eng.close()


class _RecordingFiles:
    """File operations a test passes to the engine: every call recorded, then the real one."""

    def __init__(self, files: object) -> None:
        self.files, self.calls = files, []

    def store(self, *a: object) -> tuple[bool, int]:
        self.calls.append("store")
        return self.files.store(*a)  # type: ignore[attr-defined]

    def store_many(self, items: list) -> list:
        self.calls.extend(["store"] * len(items))
        return self.files.store_many(items)  # type: ignore[attr-defined]

    def load(self, *a: object) -> object:
        self.calls.append("load")
        return self.files.load(*a)  # type: ignore[attr-defined]

    def load_many(self, items: list) -> list:
        self.calls.extend(["load"] * len(items))
        return self.files.load_many(items)  # type: ignore[attr-defined]


def test_injected_file_operations_see_every_job_even_where_the_native_lane_would_run(root: Path) -> None:
    """``IOEngine(file_ops=...)``: the engine's I/O threads call what the caller passed, and the
    native lane (compiled, it would bypass them) is not started, whatever ``io_loop`` says."""
    ns = simple_namespace()
    layout = ns.groups[0].layout
    made: list[_RecordingFiles] = []

    def wrap(files: object) -> _RecordingFiles:
        made.append(_RecordingFiles(files))
        return made[0]

    eng = _engine(root, ns, io_loop="native", file_ops=wrap)
    try:
        for i in range(6):
            assert store_data(eng, page_key(i), page_bytes(layout, page_key(i))).ok
        for i in range(6):
            assert load_page(eng, page_key(i))[1] == page_bytes(layout, page_key(i))
        assert made and eng.ops is made[0]
        assert made[0].calls.count("store") == 6 and made[0].calls.count("load") == 6
        assert eng.stats["jobs_native_loop"] == 0
    finally:
        eng.close()
