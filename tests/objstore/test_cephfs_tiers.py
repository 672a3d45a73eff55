"""The shared tier's two-node scenarios on CephFS: a second real distributed file system beside
kernel NFS (tests/nfs_kernel/), on the Ceph lab (tierstore.testing.ceph_lab).

Two "nodes" are two ``ceph-fuse`` mounts of the lab's one CephFS, each under its own client
name (two CephFS clients, each with its own caches and capabilities), made once for this module
in the test process. Each test works in a directory of its own on the file system, reached
through both mounts. The scenarios:

1. node A (a chain with a local tier of its own) stores pages into the shared root on mount A;
   node B (its own local tier, mount B), which had missed them all before, loads every one of
   them from the shared tier, verified and byte-identical: how long until B saw them;
2. eight writers (four lone-root engines per mount, on threads released by one barrier) race to
   store one page, several rounds: exactly one ``stored=True``, no error, one file, no temp;
   and which create-only primitive ceph-fuse gets (``rootstore.publish.CreateOnly``);
3. ``tierstore gc`` from both mounts at once (two looping processes) with a cap of half the
   stored bytes: the root ends within the cap, fsck from either mount finds no problem, every
   page left loads byte-identical, and no two passes that kept the lease overlapped (a pass
   starved past the lease's ttl stops at its next renewal, ``lease_lost``);
4. ``rm -rf`` of the namespace from mount B while node A's engine (a lone root: its hits are
   the shared tier's) is open: A's next stores recreate it, A hits again within seconds, and
   node B sees the recreated pages.

Each test prints one line of the figures it measured. Needs the lab with CephFS (root, the Ceph
packages and ceph-fuse: ``tools/ceph-lab.sh``); skipped with the reason otherwise, and under
``CI=true`` that skip fails the run (tests/conftest.py).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from tiers_helpers import expected, key, load, load_page, store

from tierstore.config import TierStoreConfig
from tierstore.format.identity import page_file_size
from tierstore.metrics import MetricsRegistry
from tierstore.rootstore.publish import NOREPLACE_REFUSED, RENAME_NOREPLACE, renameat2
from tierstore.testing.ceph_lab import CephLab, CephLabError, ceph_available
from tierstore.testing.pages import simple_namespace
from tierstore.tiers import TierChain, open_group_store
from tierstore.tiers.gc_scan import TRASH_DIR

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
# 128 KiB pages (the sshfs stand-in's node namespace): a torn read would span several FUSE requests
NS = simple_namespace("float16", tokens_per_chunk=64, num_layers=2, num_kv_heads=4, head_size=64)
PAGE = page_file_size(NS, 0)
OPEN_WAIT_S = 30.0  # how long a chain's shared tier may take to open (its engine opens in a thread)
VISIBLE_WITHIN_S = 30.0  # scenario 1: the bound on node B's polling for node A's pages


def _chain(root: Path, local: Path | None = None) -> TierChain:
    """A node's chain on ``root`` (a lone root, or behind a local tier on ``local``), its shared
    tier open."""
    root.mkdir(parents=True, exist_ok=True)
    cfg: dict[str, Any] = {"root": str(root), "io_threads": 2}
    if local is not None:
        cfg.update(local_root=str(local), local_max_bytes=64 << 20)
    chain = open_group_store(TierStoreConfig.from_dict(cfg), NS, 0, metrics=MetricsRegistry())
    end = time.monotonic() + OPEN_WAIT_S
    while not chain.shared.available and time.monotonic() < end:
        time.sleep(0.02)
    assert chain.shared.available, f"the shared tier on {root} did not open within {OPEN_WAIT_S} s"
    return chain


def _close(*chains: TierChain) -> None:
    for chain in chains:
        chain.close(30)


def _page_files(root: Path) -> dict[str, int]:
    """The page files under ``root`` at their place (not in gc's trash), by relative path: size."""
    out = {}
    for dirpath, dirnames, files in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != TRASH_DIR]
        for name in files:
            if name.endswith(".kvp"):
                path = os.path.join(dirpath, name)
                out[os.path.relpath(path, root)] = os.stat(path).st_size
    return out


def _fsck(root: Path) -> dict[str, Any]:
    """``tierstore fsck ROOT --json``: its document, with its exit status as ``rc``."""
    proc = subprocess.run([sys.executable, "-m", "tierstore", "fsck", str(root), "--json"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip(), proc.stderr[-2000:]
    return json.loads(proc.stdout) | {"rc": proc.returncode}


class _Nodes:
    """This test's directory, as each node's mount shows it, and a local disk for local tiers."""

    def __init__(self, mount_a: Path, mount_b: Path, name: str, local: Path) -> None:
        self.a, self.b = mount_a / name, mount_b / name
        self.local = local
        self.a.mkdir()


@pytest.fixture(scope="module")
def cephfs_mounts(ceph_lab_session: CephLab) -> Iterator[tuple[Path, Path]]:
    """Two ceph-fuse mounts of the lab's CephFS (clients ``tiers-a-*``, ``tiers-b-*``)."""
    lab = ceph_lab_session
    if not lab.cephfs:
        pytest.skip(ceph_available(cephfs=True) or "the Ceph lab has no CephFS here")
    tag = uuid.uuid4().hex[:8]
    top = lab.data_dir / "mnt" / f"tiers-{tag}"  # not under pytest's tmp_path: no one else's cleanup walks in
    mounts: list[Path] = []
    began = time.monotonic()
    try:
        for node in ("a", "b"):
            mounts.append(lab.mount_cephfs(top / node, f"tiers-{node}-{tag}"))
        print(f"\ncephfs: two ceph-fuse mounts (client.tiers-a-{tag}, client.tiers-b-{tag}) up in "
              f"{time.monotonic() - began:.2f} s")
        yield mounts[0], mounts[1]
    finally:
        for mp in mounts:
            try:
                lab.unmount_cephfs(mp)
            except CephLabError:  # still busy (a test's leftover): detach it, the lab's stop reaps it
                lab.unmount_cephfs(mp, lazy=True)


@pytest.fixture
def nodes(ceph_lab: CephLab, cephfs_mounts: tuple[Path, Path], tmp_path: Path,
          request: pytest.FixtureRequest) -> _Nodes:
    """The two nodes' view of a fresh directory (``ceph_lab``: the lab is put back in service after)."""
    name = f"{request.node.name[:40]}-{uuid.uuid4().hex[:8]}"
    return _Nodes(*cephfs_mounts, name, tmp_path)


def test_node_b_loads_every_page_node_a_stored(nodes: _Nodes) -> None:
    n = 32
    a = _chain(nodes.a / "root", nodes.local / "local_a")
    b = _chain(nodes.b / "root", nodes.local / "local_b")
    try:
        keys = [key(i, seed=1) for i in range(n)]
        # B asks first: every page is a miss (its client may now cache "no such name")
        assert [load(b, k)[1] for k in keys] == ["missing"] * n
        began = time.monotonic()
        results = [store(a, k) for k in keys]
        assert [(r.ok, r.tier, r.stored) for r in results] == [(True, "local", True)] * n
        assert a.flush(30)  # the shared copies (written behind the local store) have landed
        stored_s = time.monotonic() - began
        flushed = time.monotonic()
        seen: dict[int, float] = {}
        served: Counter[str] = Counter()
        while len(seen) < n and time.monotonic() - flushed < VISIBLE_WITHIN_S:
            for i, k in enumerate(keys):
                if i in seen:
                    continue
                r, data = load_page(b, k)
                if r.ok:
                    seen[i] = time.monotonic() - flushed
                    served[r.tier] += 1
                    assert data == expected(b, k), f"page {i}: node B got other bytes than node A stored"
                else:
                    assert r.error.kind == "missing", r.error
            if len(seen) < n:
                time.sleep(0.02)
        assert len(seen) == n, f"node B saw {len(seen)}/{n} of node A's pages within {VISIBLE_WITHIN_S} s"
        assert served == {"shared": n}  # B never had them: its hits are the shared tier's
        # the files themselves, as each client reads them: the same bytes
        files = _page_files(nodes.a / "root")
        assert len(files) == n and set(files.values()) == {PAGE}
        assert all((nodes.a / "root" / rel).read_bytes() == (nodes.b / "root" / rel).read_bytes() for rel in files)
        again = [load(b, k) for k in keys]  # now from B's own local tier (promoted on the first hit)
        assert all(ok and data == expected(b, k) for (ok, _, data), k in zip(again, keys, strict=True))
    finally:
        _close(a, b)
    lat = list(seen.values())
    print(f"cephfs scenario 1 (visibility): node B loaded {n}/{n} pages node A stored ({PAGE} B each; "
          f"verified, byte-identical, all served by the shared tier); A stored them in {stored_s:.3f} s "
          f"(local + shared copies flushed); B saw the first {min(lat):.3f} s and all {max(lat):.3f} s "
          f"after A's flush (p50 {statistics.median(lat):.3f} s), having missed every one before")


def test_eight_writers_race_to_store_one_page(nodes: _Nodes) -> None:
    rounds, writers = 6, 8
    # which create-only primitive the file system gives (a fresh name: the kernel's own
    # EEXIST check for an existing one says nothing about the file system)
    probe = nodes.a / "probe"
    probe.write_bytes(b"p")
    try:
        renameat2(str(probe), str(nodes.a / "probe.new"), dir_fd=None, flags=RENAME_NOREPLACE)
        refused = None
    except OSError as exc:
        assert exc.errno in NOREPLACE_REFUSED, exc  # anything else would be a real failure
        refused = errno.errorcode.get(exc.errno, str(exc.errno))
    for name in ("probe", "probe.new"):
        (nodes.a / name).unlink(missing_ok=True)
    chains = [_chain((nodes.a if i < writers // 2 else nodes.b) / "root") for i in range(writers)]
    mount_of = ["A" if i < writers // 2 else "B" for i in range(writers)]
    winners: list[str] = []
    try:
        for rnd in range(rounds):
            k = key(100 + rnd, seed=2)
            data = expected(chains[0], k)
            slots = [c.acquire_slot(10) for c in chains]
            assert all(s is not None for s in slots)
            for s in slots:
                s.view[:] = data
            barrier = threading.Barrier(writers)
            out: list[Any] = [None] * writers

            def write(i: int, k: bytes = k, slots: list[Any] = slots, barrier: threading.Barrier = barrier,
                      out: list[Any] = out) -> None:
                barrier.wait()
                out[i] = chains[i].wait([chains[i].submit_store(k, slots[i], 64)], 30)

            threads = [threading.Thread(target=write, args=(i,)) for i in range(writers)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            results = [res[0] if res else None for res in out]
            assert all(r is not None for r in results), f"round {rnd}: a store did not complete"
            errors = [f"{mount_of[i]}{i}: {r.error}" for i, r in enumerate(results) if not r.ok]
            assert errors == [], f"round {rnd}"
            won = [i for i, r in enumerate(results) if r.stored]
            assert len(won) == 1, f"round {rnd}: stored=True from writers {won}"
            winner = chains[won[0]]
            winners.append(mount_of[won[0]])
            # one file under the page's name, as both clients list it: no second copy, no temp left
            rel = chains[0].mapper.path_for(k).relative_to(nodes.a / "root")
            for side in (nodes.a, nodes.b):
                entries = [e for e in os.listdir(side / "root" / rel.parent) if e.lstrip(".").startswith(k.hex())]
                assert entries == [rel.name], f"round {rnd}: {entries}"
                assert os.stat(side / "root" / rel).st_nlink == 1
            # the winner published through the primitive the probe found
            assert winner.shared.engine().files.create_only.use_link == (refused is not None)
            for c in (chains[0], chains[-1]):  # a writer on each mount reads the one page
                ok, kind, got = load(c, k)
                assert ok and got == data, kind
        on_link = sum(c.shared.engine().files.create_only.use_link for c in chains)
    finally:
        _close(*chains)
    method = (f"link(2) + unlink(2) (ceph-fuse refuses renameat2's RENAME_NOREPLACE with {refused})"
              if refused else "renameat2(RENAME_NOREPLACE)")
    print(f"cephfs scenario 2 (create-only race): {rounds} rounds of {writers} writers ({writers // 2} engines "
          f"per mount) storing one page: exactly 1 stored=True, 0 errors, 1 file each round (winners by mount: "
          f"{dict(Counter(winners))}); create-only: {method}; {on_link}/{writers} writers' memos switched to link "
          f"(the others only ever met an existing name, EEXIST)")


class _GcLoop:
    """``tierstore gc ROOT --max-bytes CAP --loop 0.1 --json`` in a process of its own (a node's
    gc, started by this test), its pass reports collected as they arrive."""

    def __init__(self, root: Path, cap: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tierstore", "gc", str(root), "--max-bytes", str(cap), "--loop", "0.1",
             "--json", "--lease-ttl", "15"],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def passes(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in list(self.lines) if line.startswith("{")]

    def stop(self) -> str:
        """End the loop (the process this test started); its stderr."""
        if self.proc.poll() is None:
            self.proc.terminate()
        _out, err = self.proc.communicate(timeout=30)
        self._reader.join(10)
        return err


def test_gc_from_both_mounts_at_once(nodes: _Nodes) -> None:
    n = 40
    writer = _chain(nodes.a / "root")
    try:
        keys = [key(i, seed=3) for i in range(n)]
        assert all(store(writer, k).ok for k in keys)
        assert writer.flush(30)
    finally:
        _close(writer)
    stored = sum(_page_files(nodes.a / "root").values())
    assert stored == n * PAGE
    cap = stored // 2
    gcs = [_GcLoop(side / "root", cap) for side in (nodes.a, nodes.b)]  # node A's gc, node B's gc
    began = time.monotonic()
    try:
        # until a pass evicted, each gc has reported a few passes, and a pass found the lease
        # held by the other (they did run at once)
        # (120 s: two gc processes importing tierstore on a CI worker beside a busy one)
        while time.monotonic() - began < 120 and not (
                all(len(g.passes()) >= 3 for g in gcs)
                and any(p.get("evicted") for g in gcs for p in g.passes())
                and any(p.get("busy") for g in gcs for p in g.passes())):
            assert all(g.proc.poll() is None for g in gcs), [g.stop()[-2000:] for g in gcs]
            time.sleep(0.1)
    finally:
        errs = [g.stop() for g in gcs]
    by_node = {name: g.passes() for name, g in zip("AB", gcs, strict=True)}
    every = [p for ps in by_node.values() for p in ps]
    assert every and all("error" not in p for p in every), (every[:3], [e[-2000:] for e in errs])
    assert all(p["lease_problem"] is None and not p["refused"] for p in every), every
    active = [(name, p) for name, ps in by_node.items() for p in ps if not p["busy"]]
    busy = len(every) - len(active)
    assert busy > 0, "the two gcs never met: no pass found the lease held"
    # one holder at a time: the passes that kept the lease to their end never overlap in time. A
    # pass starved past the lease's ttl (a busy CI machine) finds at its next renewal that the
    # lease expired, stops at once and says ``lease_lost``: the lease is advisory, as on NFS
    kept = [(name, p) for name, p in active if not p["lease_lost"]]
    lost = len(active) - len(kept)
    assert kept, active
    spans = sorted((datetime.fromisoformat(p["started_at"]), datetime.fromisoformat(p["finished_at"]), name)
                   for name, p in kept)
    overlaps = [(x, y) for x, y in zip(spans, spans[1:], strict=False) if y[0] < x[1]]
    assert overlaps == [], overlaps
    evicted = sum(p["evicted"] for _, p in active)
    assert evicted > 0
    assert all(p["total_after"] <= cap for _, p in kept), [p for _, p in kept]
    # the root as each client sees it: within the cap, the same pages
    left_a, left_b = _page_files(nodes.a / "root"), _page_files(nodes.b / "root")
    assert left_a == left_b
    left_bytes = sum(left_a.values())
    assert 0 < left_bytes <= cap
    assert evicted == n - len(left_a)
    # no page torn or wrong: fsck from either mount, and every page left loads on node B
    reports = {side: _fsck(root) for side, root in (("A", nodes.a / "root"), ("B", nodes.b / "root"))}
    for side, rep in reports.items():
        assert rep["rc"] == 0 and rep["counts"]["problems"] == 0, (side, rep["problems"][:5])
        assert rep["counts"]["pages_ok"] == len(left_a), (side, rep["counts"])
    reader = _chain(nodes.b / "root")
    try:
        outcomes = Counter()
        for k in keys:
            ok, kind, data = load(reader, k)
            outcomes["hit" if ok and data == expected(reader, k) else "wrong" if ok else kind] += 1
    finally:
        _close(reader)
    assert outcomes == {"hit": len(left_a), "missing": n - len(left_a)}, outcomes
    holders = Counter(name for name, p in active)
    evictors = Counter(name for name, p in active if p["evicted"])
    print(f"cephfs scenario 3 (gc from both mounts): {n} pages ({stored} B), cap {cap} B; {len(every)} passes "
          f"in {time.monotonic() - began:.1f} s, {len(active)} held the lease "
          f"(A {holders['A']}, B {holders['B']}; "
          f"evicting: {dict(evictors)}), {busy} found it held (busy), 0 overlapping, {lost} lease lost; evicted "
          f"{evicted} pages, root {left_bytes} B <= cap; fsck from A and B: 0 problems, {len(left_a)} pages ok; "
          f"node B: {outcomes['hit']} verified hits, {outcomes['missing']} clean misses")


def _rm_rf_namespace(nodes: _Nodes) -> float:
    """``rm -rf`` of the one namespace directory, on node B's client; how long it took."""
    namespaces = [p for p in (nodes.b / "root").iterdir() if p.is_dir() and not p.name.startswith(".")]
    assert [p.name for p in namespaces] == [NS.digest]
    began = time.monotonic()
    shutil.rmtree(namespaces[0])
    took = time.monotonic() - began
    assert not (nodes.a / "root" / NS.digest).exists()  # node A's client sees it gone at once
    return took


def test_rm_rf_of_the_namespace_while_node_a_is_open(nodes: _Nodes) -> None:
    n, window_s = 16, 20.0
    a = _chain(nodes.a / "root")  # a lone root: every hit is the shared tier's
    try:
        keys = [key(i, seed=4) for i in range(n)]
        assert all(store(a, k).stored for k in keys)
        assert all(load(a, k)[0] for k in keys)
        rm_s = _rm_rf_namespace(nodes)
        removed = time.monotonic()
        store_kinds: Counter[str] = Counter()
        stored_s = None
        rounds = 0
        while stored_s is None and time.monotonic() - removed < window_s:  # A's next stores
            rounds += 1
            results = [store(a, k) for k in keys]
            store_kinds.update("ok" if r.ok else r.error.kind for r in results)
            if all(r.ok for r in results):
                stored_s = time.monotonic() - removed
            else:
                time.sleep(0.1)
        assert stored_s is not None, \
            f"node A's stores did not recreate the namespace within {window_s} s: {dict(store_kinds)}"
        assert set(store_kinds) <= {"ok", "missing"}, store_kinds  # refused while the directory is reopened
        outcomes = [load(a, k) for k in keys]
        hit_s = time.monotonic() - removed
        assert all(ok and data == expected(a, k)
                   for (ok, _, data), k in zip(outcomes, keys, strict=True)), outcomes
        reopens = a.shared.engine().files.rank_dir.reopens
        assert reopens >= 1
        assert hit_s < 10.0, hit_s
    finally:
        _close(a)
    # the namespace is whole again, as node B's client sees it
    b = _chain(nodes.b / "root")
    try:
        assert all(load(b, k)[0] for k in keys)
    finally:
        _close(b)
    rep = _fsck(nodes.b / "root")
    assert rep["rc"] == 0 and rep["counts"]["problems"] == 0, rep["problems"][:5]
    assert rep["counts"]["pages_ok"] == n, rep["counts"]
    print(f"cephfs scenario 4 (rm -rf of the namespace): removed from mount B in {rm_s:.2f} s while node A's "
          f"engine was open; A's stores recreated it {stored_s:.2f} s later ({rounds} rounds of {n} stores: "
          f"{dict(store_kinds)}; rank directory reopened {reopens}x) and A hit all {n} again at {hit_s:.2f} s; "
          f"node B hits all {n}, fsck from B: 0 problems")


def test_rm_rf_while_node_a_keeps_serving(nodes: _Nodes) -> None:
    """As scenario 4, but node A keeps serving as an engine does: it asks for a page, misses, and
    stores it (recomputed), every 0.4 s; it hits again within seconds (README). It failed while a
    load's reopen, which cannot make the removed directory, held back the store's that can
    (``RankDir``: 0 of 15 stores in 6 s, on CephFS and ext4 alike)."""
    n, period_s, window_s = 4, 0.4, 6.0
    a = _chain(nodes.a / "root")
    try:
        keys = [key(i, seed=5) for i in range(n)]
        assert all(store(a, k).stored for k in keys)
        _rm_rf_namespace(nodes)
        removed = time.monotonic()
        store_kinds: Counter[str] = Counter()
        back_s = None
        tick = 0
        while back_s is None and time.monotonic() - removed < window_s:
            k = keys[tick % n]
            ok, kind, data = load(a, k)
            if ok:
                assert data == expected(a, k)
                back_s = time.monotonic() - removed
                break
            assert kind == "missing", kind
            r = store(a, k)
            store_kinds["ok" if r.ok else r.error.kind] += 1
            tick += 1
            time.sleep(max(0.0, removed + tick * period_s - time.monotonic()))
        reopens = a.shared.engine().files.rank_dir.reopens
    finally:
        _close(a)
    again = f"{back_s:.2f} s" if back_s is not None else f"never within {window_s} s"
    print(f"cephfs scenario 4b (rm -rf while node A keeps loading and storing every {period_s} s): "
          f"hit again after {again}; "
          f"stores {dict(store_kinds)}; rank directory reopened {reopens}x")
    assert back_s is not None, f"node A never recreated its namespace: stores {dict(store_kinds)}"
