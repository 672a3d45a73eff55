"""Local disk tier: cap under churn, LRU eviction order, accounting after restart and SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from tiers_helpers import DiskUsage, expected, key, load, page_files, store

from tierstore.config import TierStoreConfig
from tierstore.index.local_index import LocalIndex
from tierstore.metrics import MetricsRegistry
from tierstore.testing.pages import simple_namespace
from tierstore.tiers import TierChain

NS = simple_namespace()
PAGE_FILE = 8192  # 4096-byte header + 4096-byte payload of simple_namespace()


def chain(tmp_path: Path, cap_pages: int | None, **kw) -> TierChain:
    cfg = TierStoreConfig.from_dict({
        "root": str(tmp_path / "shared"), "local_root": str(tmp_path / "local"),
        "local_max_bytes": cap_pages * PAGE_FILE if cap_pages else None, **kw})
    return TierChain(cfg, NS, 0, metrics=MetricsRegistry(), shared=False)


def test_index_eviction_order_and_hit_refresh(tmp_path: Path) -> None:
    idx = LocalIndex(tmp_path, 3 * 100)
    for name in ("a", "b", "c"):
        rid, victims = idx.reserve(100)
        assert victims == []
        idx.commit(rid, name, 100)
        time.sleep(0.002)
    assert idx.lru_order() == ["a", "b", "c"]
    assert idx.touch("a")
    rid, victims = idx.reserve(100)
    assert [v.path for v in victims] == ["b"]  # a was refreshed by the hit
    idx.commit(rid, "d", 100)
    assert idx.lru_order() == ["c", "a", "d"]
    assert idx.used_bytes() == 300
    rid, victims = idx.reserve(100)  # deferred bookkeeping: the same, in one batch
    assert [v.path for v in victims] == ["c"]
    idx.defer("commit", rid, "e", 100)
    idx.defer("touch", "a")
    idx.defer("forget", "d")
    assert idx.sync(5)
    assert idx.lru_order() == ["e", "a"] and idx.used_bytes() == 200
    assert idx.reserve(301) == (None, [])  # larger than the whole cap
    idx.close()


def test_chain_cap_holds_under_churn(tmp_path: Path) -> None:
    cap_pages = 12
    st = chain(tmp_path, cap_pages)
    cap = cap_pages * PAGE_FILE
    stop = threading.Event()
    peak = [0, 0]

    usage = DiskUsage(tmp_path / "local")

    def monitor() -> None:
        while not stop.is_set():
            used, largest = usage.sample()
            peak[0] = max(peak[0], used)
            peak[1] = max(peak[1], largest)

    t = threading.Thread(target=monitor)
    t.start()
    try:
        for i in range(150):
            assert store(st, key(i)).ok
            if i % 3 == 0:  # hits refresh recency while stores churn
                ok, _, data = load(st, key(max(i - 5, 0)))
                assert not ok or data == expected(st, key(max(i - 5, 0)))
    finally:
        stop.set()
        t.join()
    assert st.flush(10)
    assert sum(page_files(tmp_path / "local").values()) <= cap
    assert peak[0] <= cap + peak[1], f"local usage peaked at {peak[0]} > cap {cap} + one file {peak[1]}"
    assert st.local.index.used_bytes() == sum(page_files(tmp_path / "local").values())
    assert st.m_local.get("evictions") >= 150 - cap_pages
    st.close()


def test_chain_eviction_order_follows_hits(tmp_path: Path) -> None:
    st = chain(tmp_path, 3)
    for i in range(3):
        assert store(st, key(i)).ok
        time.sleep(0.002)
    assert load(st, key(0))[0]  # refresh key 0
    assert st.flush(10)  # apply the deferred touch
    assert store(st, key(3)).ok  # evicts key 1, the least recently used
    assert [load(st, key(i))[0] for i in range(4)] == [True, False, True, True]
    st.close()


def test_accounting_survives_restart(tmp_path: Path) -> None:
    st = chain(tmp_path, 10)
    for i in range(6):
        assert store(st, key(i)).ok
    assert st.flush(10)
    order = st.local.index.lru_order()
    used = st.local.index.used_bytes()
    st.close()
    idx = LocalIndex(tmp_path / "local", 10 * PAGE_FILE)
    assert idx.last_reconcile is None  # clean shutdown: no scan needed
    assert idx.used_bytes() == used == sum(page_files(tmp_path / "local").values())
    assert idx.lru_order() == order
    idx.close()


_CHURN = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {tests!r})
    from tiers_helpers import key, store
    from tierstore.config import TierStoreConfig
    from tierstore.metrics import MetricsRegistry
    from tierstore.testing.pages import simple_namespace
    from tierstore.tiers import TierChain
    cfg = TierStoreConfig.from_dict({{"root": {shared!r}, "local_root": {local!r}, "local_max_bytes": {cap}}})
    st = TierChain(cfg, simple_namespace(), 0, metrics=MetricsRegistry(), shared=False)
    i = 0
    while True:
        slot = st.acquire_slot(5)
        from tiers_helpers import expected
        slot.view[:] = expected(st, key(i))
        st.submit_store(key(i), slot, 16)   # do not wait: keep stores in flight
        st.poll()
        if i == 20:
            print("ready", flush=True)
        i += 1
""")


@pytest.mark.slow
def test_accounting_after_sigkill(tmp_path: Path) -> None:
    cap = 16 * PAGE_FILE
    script = _CHURN.format(tests=str(Path(__file__).resolve().parents[1]), shared=str(tmp_path / "shared"),
                           local=str(tmp_path / "local"), cap=cap)
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        time.sleep(0.3)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(10)
    idx = LocalIndex(tmp_path / "local", cap)
    assert idx.wait_reconciled(60)  # the scan runs in the background, off the opening path
    rep = idx.last_reconcile
    assert rep is not None, "a killed session must trigger a reconciling scan"
    files = page_files(tmp_path / "local")
    assert idx.page_bytes() == sum(files.values())
    assert idx.count() == len(files)
    assert idx.used_bytes() == idx.page_bytes()  # the dead process's reservations are gone
    assert sum(files.values()) <= cap
    temps = [n for _, _, fs in os.walk(tmp_path / "local") for n in fs if n.endswith(".tmp")]
    assert temps == []  # temps of the dead writer were removed
    print(f"after SIGKILL: {len(files)} pages, reconcile {rep}")
    idx.close()


def test_broken_local_page_falls_through_and_is_dropped(tmp_path: Path) -> None:
    cfg = TierStoreConfig.from_dict({"root": str(tmp_path / "shared"), "local_root": str(tmp_path / "local"),
                                     "local_max_bytes": 1 << 20})
    st = TierChain(cfg, NS, 0, metrics=MetricsRegistry())
    k = key(1)
    assert store(st, k).ok
    assert st.flush(10)
    path = st.local.mapper.path_for(k)
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF  # flip a payload bit in the local copy only
    path.write_bytes(bytes(raw))
    ok, _, data = load(st, k)
    assert ok and data == expected(st, k)  # served (verified) from the shared tier
    assert st.m_local.failures().get("checksum") == 1
    assert st.m_shared.get("hits") == 1
    st.flush(10)
    ok, _, data = load(st, k)  # the promotion replaced the bad local copy
    assert ok and data == expected(st, k) and st.m_local.get("hits") == 1
    st.close()


@pytest.fixture
def tiny_tmpfs(tmp_path: Path):
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=128k", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs to provoke ENOSPC: {r.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)])


def test_enospc_on_local_leaves_shared_working(tmp_path: Path, tiny_tmpfs: Path) -> None:
    cfg = TierStoreConfig.from_dict({"root": str(tmp_path / "shared"), "local_root": str(tiny_tmpfs),
                                     "local_max_bytes": 1 << 30, "odirect": "off"})
    st = TierChain(cfg, NS, 0, metrics=MetricsRegistry())
    results = [store(st, key(i)) for i in range(20)]  # 12 x 8 KiB + the index > 128 KiB
    assert all(r.ok for r in results)  # the shared tier stored what the local tier could not
    assert st.flush(10)
    assert st.m_local.failures().get("enospc", 0) >= 1
    assert all(load(st, key(i))[2] == expected(st, key(i)) for i in range(20))
    st.close()


def test_enospc_on_shared_leaves_local_working(tmp_path: Path, tiny_tmpfs: Path) -> None:
    cfg = TierStoreConfig.from_dict({"root": str(tiny_tmpfs), "local_root": str(tmp_path / "local"),
                                     "local_max_bytes": 1 << 30, "odirect": "off"})
    st = TierChain(cfg, NS, 0, metrics=MetricsRegistry())
    assert all(store(st, key(i)).ok for i in range(20))
    st.flush(10)
    assert st.m_shared.failures().get("enospc", 0) >= 1
    assert all(load(st, key(i))[2] == expected(st, key(i)) for i in range(20))
    st.close()
