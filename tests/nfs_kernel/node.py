"""The kernel-NFS scenarios, run inside the QEMU guest (tierstore/testing/nfs_guest.py) by
tests/nfs_kernel/test_kernel_nfs.py: one process, so torch (the engine's staging memory, 30-80 s
to import under emulation) is imported once for all of them.

Each "node" is a TierChain on its own kernel NFS mount of one export: node A on an NFSv3 mount
(``nosharecache``: its own superblock, so its own attribute, lookup and page caches), node B on an
NFSv4.2 mount (scenario c adds C, hard v3, and D, soft v4.2). Two mounts are two NFS clients as
far as caching goes, whichever process uses them. Every loaded page is compared with the bytes it
must have; each scenario writes RESULTS/<scenario>.json with its counts and timings (the test
asserts on them). Scenarios: a concurrent store/load with gc, b ``rm -rf`` of a namespace, c the
server stopped (2 minutes), d a full export, e two gc nodes with skewed clocks, f head-sliced
pages' LRU stamp and an old tool on a newer root, g the page index's server operations, h a
user quota, i reader-side ESTALE (a third client removing and replacing pages being read), j a
hot set that survives gc run by a long-lived client, k a writer and toucher whose clock is a day
behind (a process of its own under faketime).

    python tests/nfs_kernel/node.py --results DIR [--only a,b,c,...] [--outage SECONDS]
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import random
import shutil
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared node helpers

from nfs_node_worker import namespace  # noqa: E402  (the sshfs stand-in's node namespace)
from tiers_helpers import expected, key  # noqa: E402

from tierstore.config import TierStoreConfig  # noqa: E402
from tierstore.errors import BAD_CONTENT_KINDS  # noqa: E402
from tierstore.format.head_slices import HeadRange, slice_layout, split_dir_name  # noqa: E402
from tierstore.format.identity import Namespace, page_file_size  # noqa: E402
from tierstore.fs.mapper import PAGE_SUFFIX, FileMapper, fanout  # noqa: E402
from tierstore.index import page_index  # noqa: E402
from tierstore.metrics import MetricsRegistry  # noqa: E402
from tierstore.testing import nfs_guest  # noqa: E402
from tierstore.testing.pages import hybrid_namespace, page_bytes, page_key, simple_namespace  # noqa: E402
from tierstore.tiers import TierChain, open_group_store  # noqa: E402
from tierstore.tiers.head_slice_store import DirectorySlices, HeadSliceStore  # noqa: E402

V3 = "vers=3,nosharecache,nolock"
V42 = "vers=4.2,nosharecache"
# variants of scenario a: the caching options under test, added to both nodes' mounts
CACHING = {"default": "", "lookupcache_positive": "lookupcache=positive", "actimeo0": "actimeo=0"}
DEADLINE_S = 2.0  # deadline_s of scenario c's engines (shared_deadline_s: they have a local tier)
# the other scenarios' lone roots: the default deadline_s. Opening a lone root on a fresh export
# (256 fan-out mkdirs over NFS) takes more than 2 s under emulation, and a lone root that does not
# open within its deadline starts down (its first calls refused), which is scenario c's case only.
LONE_ROOT_DEADLINE_S = 10.0
WAIT_S = 120.0  # how long a caller waits for one result: far past any deadline, to see overruns
GC_LEASE_TTL_S = 5.0  # the gc processes' --lease-ttl
RECOVERY_LIMIT_S = 45.0  # scenario d: how long stores may stay off once the export has space again
PAGE_SEEDS = {"a": 10, "b": 20, "c": 30, "d": 40, "e": 50, "f": 60, "g": 70, "h": 80, "i": 90, "j": 100, "k": 110}
E_PAGES, E_SKEW_S, E_SECONDS = 48, 30.0, 30.0  # scenario e: pages first stored, clock skew, storing time
F_PAGES = 16  # scenario f: head-sliced pages stored (half of them loaded again)
G_PAGES = 10_000  # scenario g: page files of the index (10^5 takes minutes to create under emulation)
G_REFRESHES = 4  # scenario g: refreshes counted per rule and client
# scenario f's TP=2 rank: KV head 1 of 2 of a small bf16 model
SLICED_NS = simple_namespace("bfloat16", num_kv_heads=2)
SLICED_FULL = SLICED_NS.groups[0].layout
F_HEADS = HeadRange(1, 1)  # disjoint key sets per scenario
# the engine's two I/O loops (``io_loop``): the compiled lane (the default) and Python threads
IO_LOOPS = ("native", "python")


def mounted(export: str, name: str, options: str) -> Path:
    """Mount ``export`` at /mnt/<name> with ``options`` (once) and return the mount point."""
    mnt = Path("/mnt") / name
    if not os.path.ismount(mnt):
        nfs_guest.mount_export(export, mnt, ",".join(o for o in options.split(",") if o))
    return mnt


class Node:
    """One node's TierChain on ``root`` with typed, timed store and load calls; thread-safe
    counts (one lock). ``local`` adds a local tier of ``local_pages`` pages (a fleet's layout:
    the shared tier then has its up/down health)."""

    def __init__(self, name: str, root: Path, local: Path | None = None, local_pages: int = 2,
                 deadline_s: float = DEADLINE_S, make_root: bool = True, extra: dict[str, Any] | None = None,
                 io_loop: str = "native", ns: Namespace | None = None, staging_slots: int | None = None) -> None:
        self.name, self.root, self.io_loop = name, root, io_loop
        ns = ns or namespace()
        if make_root:  # not on a hung export: a mkdir there blocks (a hard mount: until the server is back)
            root.mkdir(parents=True, exist_ok=True)
        self.deadline_s = deadline_s
        cfg: dict[str, Any] = {"root": str(root), "deadline_s": deadline_s, "io_loop": io_loop, **(extra or {})}
        if local is not None:
            local.mkdir(parents=True, exist_ok=True)
            cfg.update(local_root=str(local), local_max_bytes=local_pages * page_file_size(ns, 0),
                       shared_deadline_s=deadline_s, shared_touch_interval_s=0.5)
        self.metrics = MetricsRegistry()
        started = time.monotonic()
        self.store_ = TierChain(TierStoreConfig.from_dict(cfg), ns, 0, metrics=self.metrics,
                                **({} if staging_slots is None else {"staging_slots": staging_slots}))
        self.opened_at, self.open_s = started, time.monotonic() - started
        self.lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.failures: Counter[str] = Counter()  # "load:kind" / "store:kind"
        self.errnos: Counter[str] = Counter()  # errno names of failures (ESTALE among them)
        self.longest_s = {"load": 0.0, "store": 0.0}
        self.late: list[dict[str, Any]] = []  # calls that returned past deadline + 1 s
        # calls in flight (thread id -> (op, started)), for LateWatch's stack dumps of late ones
        self.inflight: dict[int, tuple[str, float]] = {}
        self.late_stacks: list[dict[str, Any]] = []  # every thread's stack while a call ran late
        # the bytes of the pages this node loads again and again (the guest's CPU is scarce:
        # making a page's bytes is numpy work that every other thread of the process waits on)
        self._expected_pages: dict[bytes, bytes] = {}

    def _note(self, op: str, started: float, ok: bool, error: Any) -> float:
        took = time.monotonic() - started
        with self.lock:
            self.longest_s[op] = max(self.longest_s[op], took)
            if took > self.deadline_s + 1.0:  # when (monotonic, as the scenarios' timelines) and why
                self.late.append({"op": op, "seconds": round(took, 2), "ok": ok, "at": round(started, 2),
                                  "kind": None if error is None else error.kind,
                                  "error": None if error is None else str(error)[:240]})
            if error is not None:
                self.failures[f"{op}:{error.kind}"] += 1
                if error.errno:
                    self.errnos[errno.errorcode.get(error.errno, str(error.errno))] += 1
        return took

    def store(self, i: int, seed: int) -> tuple[bool, str | None]:
        """Store page ``key(i, seed)``: (ok, error kind; "no_result" when nothing came back)."""
        st, k = self.store_, key(i, seed)
        waited = time.monotonic()
        slot = st.acquire_slot(WAIT_S)
        with self.lock:
            self.longest_s["slot_wait"] = max(self.longest_s.get("slot_wait", 0.0), time.monotonic() - waited)
        if slot is None:
            return False, "no_slot"
        slot.view[:] = expected(st, k)
        started = time.monotonic()  # the deadline runs from submit (a slot wait is the caller's)
        self.inflight[threading.get_ident()] = ("store", started)
        res = st.wait([st.submit_store(k, slot, 64)], WAIT_S)
        self.inflight.pop(threading.get_ident(), None)
        r = res[0] if res else None
        self._note("store", started, bool(r and r.ok), r.error if r else None)
        with self.lock:
            self.counts["stores"] += 1
            self.counts["stores_ok" if r and r.ok else "stores_failed"] += 1
            if r is not None and r.ok:
                self.counts[f"stored_on:{r.tier}"] += 1  # a chain's store: the first durable tier that took it
        if r is None:
            return False, "no_result"
        return r.ok, None if r.ok else r.error.kind

    def load(self, i: int, seed: int) -> str:
        """Load page ``key(i, seed)``: "hit", "wrong" (bytes differ: must never happen), "miss"
        or the failure's kind ("no_result" when nothing came back within WAIT_S)."""
        st, k = self.store_, key(i, seed)
        started = time.monotonic()
        self.inflight[threading.get_ident()] = ("load", started)
        res = st.wait([st.submit_load(k)], WAIT_S)
        self.inflight.pop(threading.get_ident(), None)
        r = res[0] if res else None
        self._note("load", started, bool(r and r.ok), r.error if r and not r.ok else None)
        if r is None:
            outcome = "no_result"
        elif r.ok:
            good = bytes(r.slot.view) == self._expected(k)
            st.release_slot(r.slot)
            outcome = "hit" if good else "wrong"
        else:
            outcome = "miss" if r.error.kind == "missing" else r.error.kind
        with self.lock:
            self.counts["loads"] += 1
            self.counts[outcome] += 1
        return outcome

    def _expected(self, k: bytes) -> bytes:
        data = self._expected_pages.get(k)
        if data is None:
            data = expected(self.store_, k)
            if len(self._expected_pages) < 256:
                self._expected_pages[k] = data
        return data

    def summary(self) -> dict[str, Any]:
        tiers = {t: {k: v for k, v in m.items() if not k.endswith("_seconds")}
                 for t, m in self.metrics.snapshot().items()}
        with self.lock:
            rejected = sum(v for k, v in self.failures.items() if k.split(":")[1] in BAD_CONTENT_KINDS)
            return {"counts": dict(self.counts), "failures": dict(self.failures), "errnos": dict(self.errnos),
                    "estale": self.errnos.get("ESTALE", 0), "bad_content_rejected": rejected,
                    "longest_s": {k: round(v, 3) for k, v in self.longest_s.items()}, "late": self.late[:20],
                    "late_count": len(self.late), "open_s": round(self.open_s, 2), "tiers": tiers,
                    "late_stacks": self.late_stacks[:3], "io_loop": self.io_loop, "jobs": engine_jobs(self.store_)}

    def close(self) -> None:
        self.store_.flush(60)
        self.store_.close(60)


def engine_jobs(chain: TierChain) -> dict[str, dict[str, int]]:
    """{tier: jobs its engine ran, and how many of them the native lane ran}: which I/O loop
    really served a node (the lane starts at its first job once the kernels are compiled)."""
    return {name.removesuffix("_engine"): {"run": st.get("jobs_run", 0), "native_loop": st.get("jobs_native_loop", 0)}
            for name, st in chain.stats.items() if name.endswith("_engine")}


def io_loop(k: int) -> str:
    """The ``io_loop`` of a scenario's k-th node: the two loops alternate, so every scenario with
    two nodes or more runs both, and each mount kind meets each loop somewhere in the module."""
    return IO_LOOPS[k % 2]


class LogCapture(logging.Handler):
    """tierstore's WARNING-and-above records (what an operator would see in the log)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []
        self.count = 0
        self.shared_down = self.shared_back = 0  # the shared tier's health changes

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1
        message = record.getMessage()
        self.shared_down += "shared tier is down" in message
        self.shared_back += "shared tier answers again" in message
        if len(self.lines) < 30:
            self.lines.append(f"{record.levelname} {record.name}: {message}"[:400])


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)


def _spread(seconds: list[float]) -> dict[str, Any]:
    """How many, and their median, 99th percentile and largest (``_quantile``'s rounding)."""
    return {"samples": len(seconds), "p50_s": _quantile(seconds, 0.5), "p99_s": _quantile(seconds, 0.99),
            "max_s": _quantile(seconds, 1.0)}


def visibility(a: Node, b: Node, seed: int, pages: int, limit_s: float, fast_s: float = 5.0) -> dict[str, Any]:
    """Node A's store to node B's first hit (and B's to A's, alternately), one key at a time:
    the reader misses the key once (its client may now cache "no such name"), the writer stores
    it, the reader polls it every 20 ms for up to ``fast_s``; a key not seen by then is polled
    once per later step until ``limit_s`` (its figure then only as fine as those steps).
    Returns p50/p99 and how many were never seen."""
    latencies: list[float] = []
    slow: dict[int, tuple[Node, float]] = {}
    wrong = stored = went_slow = 0
    give_up = time.monotonic() + limit_s

    def poll_slow() -> None:
        nonlocal wrong
        for j, (reader, stored_at) in list(slow.items()):
            outcome = reader.load(j, seed)
            wrong += outcome == "wrong"
            if outcome == "hit":
                latencies.append(time.monotonic() - stored_at)
                del slow[j]

    for i in range(pages):
        writer, reader = (a, b) if i % 2 == 0 else (b, a)
        reader.load(i, seed)  # a miss
        ok, _kind = writer.store(i, seed)
        if not ok:
            continue
        stored += 1
        stored_at = time.monotonic()
        while True:
            outcome = reader.load(i, seed)
            wrong += outcome == "wrong"
            if outcome == "hit":
                latencies.append(time.monotonic() - stored_at)
                break
            if time.monotonic() - stored_at > fast_s:
                slow[i] = (reader, stored_at)
                went_slow += 1
                break
            time.sleep(0.02)
        poll_slow()
    while slow and time.monotonic() < give_up:
        time.sleep(0.2)
        poll_slow()
    return {"pages": pages, "stored": stored, "seen": len(latencies), "wrong": wrong,
            "p50_s": _quantile(latencies, 0.5), "p99_s": _quantile(latencies, 0.99),
            "max_s": round(max(latencies), 3) if latencies else None,
            "mean_s": round(statistics.fmean(latencies), 3) if latencies else None,
            "slower_than_fast_s": went_slow, "fast_s": fast_s,
            "limit_s": limit_s}


class GcProcess:
    """``tierstore gc ROOT`` looping every 0.3 s under ``cap``: a third process (it imports no
    torch). Its JSON pass reports are collected by a reader thread, each with the monotonic
    time it arrived (``at``: one clock for every gc process of the guest). ``skew_s`` runs it
    with ``time.time`` that many seconds ahead: a node whose clock is wrong (file times still
    come from the server)."""

    def __init__(self, root: Path, cap: int, skew_s: float = 0.0) -> None:
        args = [str(root), "--max-bytes", str(cap), "--loop", "0.3", "--json", "--lease-ttl", str(GC_LEASE_TTL_S)]
        if skew_s:
            # patched before tierstore is imported, so every time.time() the gc and its lease make is skewed
            argv = [sys.executable, "-c",
                    f"import sys, time; real = time.time; time.time = lambda: real() + {skew_s!r}; "
                    "from tierstore.admin.cli import main; raise SystemExit(main(['gc', *sys.argv[1:]]))", *args]
        else:
            argv = [sys.executable, "-m", "tierstore", "gc", *args]
        self.skew_s = skew_s
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.passes: list[dict[str, Any]] = []
        self.first_pass = threading.Event()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.passes.append(json.loads(line) | {"at": time.monotonic()})
                self.first_pass.set()

    def active(self) -> list[dict[str, Any]]:
        """The passes that held the lease (not ``busy``) and did not fail."""
        return [p for p in self.passes if not p.get("busy") and "error" not in p]

    def stop(self) -> dict[str, Any]:
        self.proc.terminate()  # the gc this scenario started
        _out, err = self.proc.communicate(timeout=60)
        self.reader.join(10)
        active = self.active()
        return {"passes": len(self.passes), "active": len(active), "rc": self.proc.returncode,
                "evicted": sum(p.get("evicted", 0) for p in active),
                "vanished": sum(p.get("vanished", 0) for p in active),
                "lease_lost": sum(bool(p.get("lease_lost")) for p in active),
                "max_total_after": max((p.get("total_after", 0) for p in active), default=0),
                "errors": [p for p in self.passes if "error" in p][:3], "stderr_tail": err[-1500:]}


def _work(node: Node, own: range, all_keys: int, seed: int, seconds: float, rng_seed: int) -> None:
    """The stand-in worker's mix: 35 % stores of own keys, loads of any key (both nodes' keys)."""
    rng = random.Random(rng_seed)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if rng.random() < 0.35:
            node.store(rng.choice(own), seed)
        else:
            i = rng.randrange(all_keys)
            if node.load(i, seed) == "hit" and i not in own:
                with node.lock:
                    node.counts["cross_node_hits"] += 1


def scenario_a(results: Path) -> dict[str, Any]:
    """Visibility latency for each caching variant (one root each), then concurrent store/load
    on the default-caching pair while `tierstore gc` evicts down to half the key set."""
    seed = PAGE_SEEDS["a"]
    out: dict[str, Any] = {"visibility": {}}
    nodes: dict[str, tuple[Node, Node]] = {}
    for variant, extra in CACHING.items():
        ma = mounted(nfs_guest.EXPORT, f"a3_{variant}", f"{V3},{extra}")
        mb = mounted(nfs_guest.EXPORT, f"b42_{variant}", f"{V42},{extra}")
        k = len(nodes)  # the loops swap sides from one variant to the next
        nodes[variant] = (Node("a", ma / f"a_{variant}", deadline_s=LONE_ROOT_DEADLINE_S, io_loop=io_loop(k)),
                          Node("b", mb / f"a_{variant}", deadline_s=LONE_ROOT_DEADLINE_S, io_loop=io_loop(k + 1)))
    page = page_file_size(namespace(), 0)
    n_keys, cap, seconds = 48, 12 * page, 30.0  # the cap: a quarter of the key set
    a, b = nodes["default"]
    oversleep = Oversleep()  # what excuses a late call: the guest starved (as in scenario c)
    gc = GcProcess(a.root, cap)  # starts while the visibility runs (its import takes a while)
    for k, (variant, (na, nb)) in enumerate(nodes.items()):
        out["visibility"][variant] = visibility(na, nb, seed + 1 + k, 10, 60.0)
    out["gc_started_s"] = gc.first_pass.wait(120)
    workers = [threading.Thread(target=_work, args=(a, range(0, n_keys // 2 + 4), n_keys, seed, seconds, 1)),
               threading.Thread(target=_work, args=(b, range(n_keys // 2 - 4, n_keys), n_keys, seed, seconds, 2))]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    out["gc"] = gc.stop()
    out["gc"]["cap"] = cap
    for pair in nodes.values():
        for n in pair:
            for call in n.late:
                call["oversleep_s"] = round(oversleep.worst(call["at"], call["at"] + call["seconds"]), 3)
    out["oversleep"], out["deadline_s"] = oversleep.close(), LONE_ROOT_DEADLINE_S
    out["nodes"] = {f"{v}_{n.name}": n.summary() for v, pair in nodes.items() for n in pair}
    for pair in nodes.values():
        for n in pair:
            n.close()
    return out


def _all_hit(node: Node, pages: int, seed: int) -> tuple[bool, Counter[str]]:
    outcomes = Counter(node.load(i, seed) for i in range(pages))
    return outcomes["hit"] == pages, outcomes


def scenario_b(results: Path) -> dict[str, Any]:
    """Defect 3: `rm -rf ROOT/<namespace>` by node B's client while both engines stay open; a
    new engine on B stores the same pages. Does every engine hit again within 30 s?"""
    seed, pages, window_s = PAGE_SEEDS["b"], 24, 30.0
    ma, mb = mounted(nfs_guest.EXPORT, "a3_default", V3), mounted(nfs_guest.EXPORT, "b42_default", V42)
    a = Node("a", ma / "b_root", deadline_s=LONE_ROOT_DEADLINE_S, io_loop=io_loop(0))
    b = Node("b", mb / "b_root", deadline_s=LONE_ROOT_DEADLINE_S, io_loop=io_loop(1))
    stored = sum(a.store(i, seed)[0] for i in range(pages))
    before_ok, before = _all_hit(b, pages, seed)
    server_root = _server_path(b.root, mb)
    top_before = sorted(os.listdir(server_root))  # the namespace's directory, its manifest, the format marker
    removed = sorted(os.listdir(b.root))
    for name in removed:  # node B's client: the operator's rm -rf ROOT/* (dot files too)
        path = b.root / name
        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    # no engine restarts: the open engines store again, and put the root's metadata back
    removed_at = time.monotonic()
    store_back_s, j = None, 0
    while store_back_s is None and time.monotonic() - removed_at < 30:
        if a.store(1000 + j, seed)[0]:
            store_back_s = round(time.monotonic() - removed_at, 2)
        j += 1
    while time.monotonic() - removed_at < 60 and sorted(os.listdir(server_root)) != top_before:
        time.sleep(0.5)
    metadata_back_s = round(time.monotonic() - removed_at, 2) if sorted(os.listdir(server_root)) == top_before else None
    fsck_rc, fsck_out, fsck_err = _tool("fsck", str(ma / "b_root"))
    no_restart = {"top_before": top_before, "store_back_s": store_back_s, "metadata_back_s": metadata_back_s,
                  "top_after": sorted(os.listdir(server_root)), "fsck_rc": fsck_rc,
                  "fsck_tail": (fsck_out + fsck_err)[-400:]}
    b_new = Node("b_new", mb / "b_root", deadline_s=LONE_ROOT_DEADLINE_S, io_loop=io_loop(0))
    restored = sum(b_new.store(i, seed)[0] for i in range(pages))
    started = time.monotonic()
    first_full_hit: dict[str, float | None] = {"a": None, "b": None, "b_new": None}
    seen: dict[str, Counter[str]] = {n: Counter() for n in first_full_hit}
    a_store_visible_s = None
    a_store_kinds: Counter[str] = Counter()
    new_i = pages  # pages A stores after the rm -rf: can B's new engine see them?
    while time.monotonic() - started < window_s:
        for node in (a, b, b_new):
            if first_full_hit[node.name] is None:
                ok, outcomes = _all_hit(node, pages, seed)
                seen[node.name].update(outcomes)
                if ok:
                    first_full_hit[node.name] = round(time.monotonic() - started, 2)
        if a_store_visible_s is None:
            ok, kind = a.store(new_i, seed)
            a_store_kinds[kind or "ok"] += 1
            if ok and b_new.load(new_i, seed) == "hit":
                a_store_visible_s = round(time.monotonic() - started, 2)
            new_i += 1
        if all(v is not None for v in first_full_hit.values()) and a_store_visible_s is not None:
            break
        time.sleep(0.5)
    out = {"pages": pages, "stored_by_a": stored, "b_hits_before": before["hit"], "b_before_ok": before_ok,
           "removed": removed, "restored_by_b_new": restored, "window_s": window_s,
           "first_full_hit_s": first_full_hit, "outcomes_while_waiting": {k: dict(v) for k, v in seen.items()},
           "a_store_then_b_new_hit_s": a_store_visible_s, "a_store_results": dict(a_store_kinds),
           "no_restart": no_restart,
           "nodes": {n.name: n.summary() for n in (a, b, b_new)}}
    for n in (a, b, b_new):
        n.close()
    return out


# scenario c's clients: every pairing of NFS version and mount kind (node: mount name, options).
# soft: a call the server does not answer fails after timeo (deciseconds) x retrans; hard: it
# blocks until the server is back, so only the engine's deadline bounds it.
C_MOUNTS = {"a": ("a3_soft", f"{V3},soft,timeo=10,retrans=1"), "b": ("b42_hard", f"{V42},hard"),
            "c": ("c3_hard", f"{V3},hard"), "d": ("d42_soft", f"{V42},soft,timeo=10,retrans=1")}
# each loop on a v3 and a v4.2 mount, one soft and one hard
C_LOOPS = {"a": IO_LOOPS[0], "b": IO_LOOPS[0], "c": IO_LOOPS[1], "d": IO_LOOPS[1]}
LATE_START_S = 10.0  # scenario c: new engines start this long into the outage
LATE_CALLS = 5  # ... and each makes this many loads and this many stores while it lasts
GROUPS_ROOT = "c_groups_root"  # the late multi-group engine's root (hard v3)
LATE_LOCAL_PAGES = 64  # the late chains' local tiers: room for every page they store in the scenario
BACKLOG_LIMIT_S = 60.0  # how long after serving again a chain's backlog may take to reach the export
# How long a node (and a new engine) may take to serve again once the server is back. A hard
# mount's client retries a stopped server's RPCs with timeo=600 (60 s) and up, so its first
# answer may come a minute after the restart, later on a starved CI guest (node C's loads
# came back after more than 60 s in one CI run, node A's after 59 s); 3-16 s when the guest
# has its CPUs.
SERVE_LIMIT_S = 150.0


def _late_engines(seed: int, own: int, mounts: dict[str, Path], local: Path, started: threading.Event,
                  restarted: threading.Event, t0: float, out: dict[str, Any]) -> None:
    """Scenario c's engines started while the export hangs: a fleet chain on the hard v4.2
    mount and a lone root (deadline 2 s) on the hard v3 mount, on the root the other nodes use
    (made before the outage: a mkdir on a hung mount would block). Each constructor's time,
    LATE_CALLS loads of pages the other nodes stored before the outage and LATE_CALLS stores of
    new pages during the outage, then, once the server is back, the time until it serves: the
    chain a load from the shared tier (a page its empty local tier cannot have) and a store;
    the lone root a store and a load of the page it stored. Results go into ``out``."""
    started.wait()
    # the chains' local tiers hold every page they store here: what they stored during the outage
    # is still there for the backlog to upload once the server is back
    nodes = {"new_chain": Node("new_chain", mounts["b"] / "c_root", local / "new_chain", make_root=False,
                               io_loop=io_loop(0), local_pages=LATE_LOCAL_PAGES),
             "new_root": Node("new_root", mounts["c"] / "c_root", make_root=False, io_loop=io_loop(1)),
             "new_chain_py": Node("new_chain_py", mounts["d"] / "c_root", local / "new_chain_py", make_root=False,
                                  io_loop=io_loop(1), local_pages=LATE_LOCAL_PAGES)}
    out["nodes"] = nodes
    # a hybrid model's engine opens one tier per KV-cache group, one after another: on the hung
    # export all of them within one deadline (one health per root), not one deadline per group;
    # on a root no other engine of this process uses (whose outage it would already know)
    ns = hybrid_namespace()
    opened = time.monotonic()
    groups = [open_group_store(TierStoreConfig.from_dict({"root": str(mounts["c"] / GROUPS_ROOT), "deadline_s": DEADLINE_S}),
                               ns, g, metrics=MetricsRegistry()) for g in range(len(ns.groups))]
    out["groups_open"] = {"groups": len(groups), "seconds": round(time.monotonic() - opened, 2), "at": opened,
                          "up": sum(g.tiers[-1].available for g in groups)}
    out["started_at_s"] = round(time.monotonic() - t0, 2)
    for k, (name, node) in enumerate(nodes.items()):
        base = 5000 + 1000 * k
        out["outage_loads"][name] = dict(Counter(node.load(i, seed) for i in range(LATE_CALLS)))
        out["outage_stores"][name] = dict(Counter(node.store(base + i, seed)[1] or "ok" for i in range(LATE_CALLS)))
        out["outage_stored_on"][name] = {k2: v for k2, v in node.summary()["counts"].items() if k2.startswith("stored_on:")}
    out["outage_calls_done_at_s"] = round(time.monotonic() - t0, 2)
    restarted.wait()
    back = time.monotonic()
    serve: dict[str, float | None] = {name: None for name in nodes}
    attempt = 0
    while time.monotonic() - back < SERVE_LIMIT_S and None in serve.values():
        for k, (name, node) in enumerate(nodes.items()):
            if serve[name] is not None:
                continue
            i = 5000 + 1000 * k + LATE_CALLS + attempt
            ok, _kind = node.store(i, seed)
            if node.store_.local is not None:  # a chain: a page of node a's, stored before the outage: only the shared tier has it
                served = ok and node.load(attempt % own, seed) == "hit" and node.store_.shared.available
            else:
                served = ok and node.load(i, seed) == "hit"
            if served:
                serve[name] = round(time.monotonic() - back, 2)
        attempt += 1
        time.sleep(1.0)
    out["serve_after_restart_s"] = serve
    back_up = time.monotonic()
    while time.monotonic() - back_up < SERVE_LIMIT_S and not all(g.tiers[-1].available for g in groups):
        time.sleep(0.5)
    out["groups_open"]["up_after_restart_s"] = (round(time.monotonic() - back, 2)
                                                if all(g.tiers[-1].available for g in groups) else None)
    for g in groups:
        g.close(10)
    # the chains' backlogs: every page stored on the local tier during the outage reaches the
    # export (seen on the server's own tmpfs) with nobody storing it again
    chains = {name: k for k, name in enumerate(nodes) if nodes[name].store_.local is not None}
    expect = {name: [key(5000 + 1000 * k + i, seed) for i in range(LATE_CALLS)] for name, k in chains.items()}
    server = {name: FileMapper(_server_path(nodes[name].root, mounts[m]), namespace().digest, 0, 0)
              for name, m in (("new_chain", "b"), ("new_chain_py", "d"))}
    arrived: dict[str, float | None] = {name: None for name in chains}
    while time.monotonic() - back < SERVE_LIMIT_S + BACKLOG_LIMIT_S and None in arrived.values():
        for name in chains:
            if arrived[name] is None and all(os.path.exists(server[name].final_path(k)) for k in expect[name]):
                arrived[name] = round(time.monotonic() - back, 2)
        time.sleep(0.5)
    out["backlog"] = {"outage_pages": LATE_CALLS, "on_export_after_restart_s": arrived,
                      "on_export": {name: sum(os.path.exists(server[name].final_path(k)) for k in expect[name])
                                    for name in chains},
                      "uploads": {name: nodes[name].summary()["tiers"].get("shared", {}) for name in chains}}


class Oversleep:
    """How late this guest wakes a thread: one sleeps 50 ms at a time and records how much
    longer it took (the guest's CPU starvation, as every thread here sees it: two emulated
    vCPUs, on a host core another CI worker also wants). A call late by less than the worst
    oversleep during it was late because the guest could not run it, not because it waited."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []  # (monotonic start, seconds over 50 ms)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="oversleep", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            started = time.monotonic()
            time.sleep(0.05)
            self.samples.append((started, time.monotonic() - started - 0.05))

    def worst(self, start: float, end: float) -> float:
        return max((over for t, over in self.samples if start - 0.05 <= t <= end), default=0.0)

    def close(self) -> dict[str, Any]:
        self.stop.set()
        self.thread.join(2)
        return _spread([o for _, o in self.samples])


class ControlCalls:
    """The same calls with no NFS under them: a node like the others (a fleet chain, a local tier
    in front of a shared root, deadline 2 s) whose shared root is on the guest's tmpfs, loading
    another writer's pages every 0.1 s and storing new ones every 0.2 s on threads of its own.
    It runs in a process of its own (``ControlProcess``): the same vCPUs and the same guest, but
    not the nodes' GIL, so a stall of the nodes' process is not excused by itself. A node's call
    is late because it waited on its mount (or on its own process) only if it was later than
    these were at the same time: a call crosses several threads (caller, chain, admission or I/O
    thread, back), and each hand-off waits its turn on a starved guest, which one sleeping
    thread (``Oversleep``) undercounts."""

    OWN = 16  # the writer's pages, loaded by the control as a node loads the next node's

    def __init__(self, root: Path, local: Path, seed: int) -> None:
        writer = Node("control_writer", root)
        for i in range(self.OWN):
            writer.store(i, seed)
        writer.close()
        self.node = Node("control", root, local)
        self.seed = seed
        self.samples: list[tuple[float, float]] = []  # (monotonic start, seconds the call took)
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._loads, name="control-loads", daemon=True),
                        threading.Thread(target=self._stores, name="control-stores", daemon=True)]
        for t in self.threads:
            t.start()

    def _loads(self) -> None:
        rng = random.Random("control")
        while not self.stop.wait(0.1):
            started = time.monotonic()
            self.node.load(rng.randrange(self.OWN), self.seed)
            self.samples.append((started, time.monotonic() - started))

    def _stores(self) -> None:
        i = 100_000
        while not self.stop.wait(0.2):
            started = time.monotonic()
            self.node.store(i, self.seed)
            self.samples.append((started, time.monotonic() - started))
            i += 1

    def worst(self, start: float, end: float) -> float:
        """The slowest control call that overlapped [start, end]."""
        return max((took for t, took in self.samples if t <= end and t + took >= start), default=0.0)

    def close(self) -> dict[str, Any]:
        self.stop.set()
        for t in self.threads:
            t.join(5)
        outcomes = dict(self.node.counts)
        self.node.close()
        return _spread([d for _, d in self.samples]) | {"outcomes": outcomes}


CONTROL_DIR = Path("/var/tmp/nfs_kernel_control")  # the guest's tmpfs: go/stop/running files, its samples


class ControlProcess:
    """Scenario c's excuse for the guest's own slowness, measured outside the nodes' process:
    ``node.py --control SEED`` runs ``ControlCalls`` and an ``Oversleep`` thread. Started once
    the kernels are compiled (its imports, 30-80 s under emulation, overlap the first
    scenarios); its calls run from ``start_calls`` to ``close``. ``worst(start, end)``: the
    slowest control call, or the worst oversleep, that overlapped [start, end] (monotonic
    clocks are the guest's, one for every process)."""

    def __init__(self, seed: int, stderr: Path) -> None:
        shutil.rmtree(CONTROL_DIR, ignore_errors=True)
        CONTROL_DIR.mkdir(parents=True)
        with open(stderr, "ab") as err:
            self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--results", str(CONTROL_DIR),
                                          "--control", str(seed)], stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=err)
        self.calls: list[tuple[float, float]] = []
        self.oversleep: list[tuple[float, float]] = []

    def start_calls(self, timeout_s: float = 300.0) -> float:
        """Let the control start its calls; seconds until it said it runs (raises past ``timeout_s``)."""
        started = time.monotonic()
        (CONTROL_DIR / "go").touch()
        while not (CONTROL_DIR / "running").exists():
            if self.proc.poll() is not None or time.monotonic() - started > timeout_s:
                raise RuntimeError(f"the control process did not start its calls (exit {self.proc.poll()})")
            time.sleep(0.2)
        return time.monotonic() - started

    def close(self) -> dict[str, Any]:
        (CONTROL_DIR / "stop").touch()
        self.proc.wait(120)
        found = json.loads((CONTROL_DIR / "samples.json").read_text())
        self.calls = [tuple(x) for x in found["calls"]]
        self.oversleep = [tuple(x) for x in found["oversleep"]]
        return found["summary"] | {"oversleep": found["oversleep_summary"], "pid": self.proc.pid}

    def worst(self, start: float, end: float) -> float:
        calls = max((took for t, took in self.calls if t <= end and t + took >= start), default=0.0)
        over = max((o for t, o in self.oversleep if start - 0.05 <= t <= end), default=0.0)
        return max(calls, over)


def control_main(seed: int) -> int:
    """The control process (``ControlProcess``): wait for ``go``, run the calls until ``stop``,
    write their samples."""
    deadline = time.monotonic() + 3600  # never outlive a scenario run that died
    while not (CONTROL_DIR / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    local = Path("/var/tmp/nfs_kernel_local")
    oversleep = Oversleep()
    control = ControlCalls(local / "control_shared", local / "control_local", seed)
    (CONTROL_DIR / "running").touch()
    while not (CONTROL_DIR / "stop").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    calls, over = list(control.samples), list(oversleep.samples)
    summary, over_summary = control.close(), oversleep.close()
    (CONTROL_DIR / "samples.json").write_text(json.dumps({"calls": calls, "oversleep": over, "summary": summary,
                                                          "oversleep_summary": over_summary}))
    return 0


# A step longer than this waited on something (a step measures 50-90 ms under emulation, p99 73 ms
# in a 2-minute outage; a step that touched the hung mount would last the 2 s deadline or the whole
# outage), unless the control process was as slow at the same time.
STEP_BOUND_S = 0.5
# A scheduler step every 0.1 s: under emulation a step is ~50-90 ms of Python, and a guest kept
# busier than its two vCPUs (load average 20 with a step every 20 ms, beside a busy CI worker)
# delays every thread, the nodes' calls included.
STEP_S = 0.1


class SchedulerSteps:
    """What vLLM's scheduler thread asks tierstore in each step, timed: node A's page lookups
    (``IndexedLookup``, the scheduler side's index of the shared root: ``known_prefix`` of a
    prompt's keys, then ``answer`` for the key after them, and the prober's verdicts drained),
    every ``STEP_S`` on a thread of its own. No call may touch the file system, hung or not."""

    def __init__(self, root: Path, seed: int, keys: int, t0: float) -> None:
        from tierstore.index.indexed_lookup import IndexedLookup

        self.lookup = IndexedLookup([FileMapper(root, namespace().digest, 0, 0)], refresh_s=5.0,
                                    deadline_s=DEADLINE_S).start()
        self.keys = [key(i, seed) for i in range(keys)]
        self.t0, self.steps = t0, []  # (seconds since t0, step seconds)
        self.started: list[float] = []  # each step's monotonic start (for the guest's delay during it)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="scheduler-steps", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            started = time.monotonic()
            hits = self.lookup.known_prefix(0, self.keys)
            if hits < len(self.keys):
                self.lookup.answer(0, self.keys[hits])
            while not self.lookup.results.empty():  # the prober's verdicts, as the manager drains them
                self.lookup.results.get_nowait()
            done = time.monotonic()
            self.started.append(started)
            self.steps.append((started - self.t0, done - started))
            time.sleep(STEP_S)

    def summary(self, stopped: float, restarted: float, oversleep: Oversleep, control: ControlProcess) -> dict[str, Any]:
        """The steps' figures; each step longer than ``STEP_BOUND_S``, with this process's worst
        oversleep and the control process's worst during it (what excuses it: the test)."""
        self.stop.set()
        self.thread.join(5)
        during = [d for t, d in self.steps if stopped <= t <= restarted]
        slow = [{"at_s": round(t, 2), "seconds": round(d, 3), "oversleep_s": round(oversleep.worst(a, a + d), 3),
                 "control_s": round(control.worst(a, a + d), 3)}
                for a, (t, d) in zip(self.started, self.steps, strict=True) if d > STEP_BOUND_S]
        self.lookup.close()
        return {"steps": len(self.steps), "steps_during_outage": len(during), "steps_over_bound": slow,
                "bound_s": STEP_BOUND_S,
                "longest_step_ms": round(max((d for _, d in self.steps), default=0.0) * 1000, 3),
                "longest_step_during_outage_ms": round(max(during, default=0.0) * 1000, 3),
                "p99_step_ms": round(sorted(d for _, d in self.steps)[int(0.99 * len(self.steps))] * 1000, 3)
                if self.steps else None, "thread_stuck": self.thread.is_alive()}


class LateWatch:
    """Every 0.2 s, looks for a node's call in flight past deadline + 1 s and records every
    thread's stack once per such call (at most 3 per node): where a late call waits, whether on
    a lock, the mount or the guest's CPUs, is in the result, not guessed."""

    def __init__(self, nodes: Callable[[], list[Node]]) -> None:
        self._nodes = nodes
        self._seen: set[tuple[int, float]] = set()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="late-watch", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            now = time.monotonic()
            for node in self._nodes():
                for ident, (op, started) in list(node.inflight.items()):
                    if now - started <= node.deadline_s + 1.0 or (ident, started) in self._seen:
                        continue
                    self._seen.add((ident, started))
                    if len(node.late_stacks) < 3:
                        node.late_stacks.append({"op": op, "at": round(started, 2), "after_s": round(now - started, 2),
                                                 "caller": ident, "stacks": _thread_stacks()})

    def close(self) -> None:
        self._stop.set()
        self.thread.join(5)


def _thread_stacks() -> dict[str, list[str]]:
    """{thread name (ident): its innermost frames as "file:line function"} of every thread."""
    names = {t.ident: t.name for t in threading.enumerate()}
    out = {}
    for ident, frame in sys._current_frames().items():
        frames = traceback.extract_stack(frame)[-8:]
        out[f"{names.get(ident, '?')} ({ident})"] = [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames]
    return out


def scenario_c(results: Path, outage_s: float, control: ControlProcess) -> dict[str, Any]:
    """The server stopped for ``outage_s`` under load, four nodes on four kinds of mount (A soft
    v3, B hard v4.2, C hard v3, D soft v4.2), each a fleet chain (local + shared tier); two new
    engines start LATE_START_S into the outage (``_late_engines``). No call may return later
    than its deadline + 1 s; failures typed; recovery time once the server is back."""
    seed, own = PAGE_SEEDS["c"], 16
    mounts = {n: mounted(nfs_guest.EXPORT, name, options) for n, (name, options) in C_MOUNTS.items()}
    local = Path("/var/tmp/nfs_kernel_local")
    nodes = {n: Node(n, mounts[n] / "c_root", local / n, io_loop=C_LOOPS[n]) for n in C_MOUNTS}
    (mounts["c"] / GROUPS_ROOT).mkdir(exist_ok=True)  # before the outage: a mkdir on the hung mount blocks
    for k, node in enumerate(nodes.values()):
        for i in range(own):
            node.store(k * own + i, seed)
    timeline: dict[str, float] = {}
    events: dict[str, list[tuple[float, str, str]]] = {n: [] for n in nodes}
    stop = threading.Event()
    t0 = time.monotonic()

    def loads(node: Node, other: range) -> None:
        rng = random.Random(node.name)
        while not stop.is_set():
            outcome = node.load(rng.choice(other), seed)
            events[node.name].append((time.monotonic() - t0, "load", outcome))
            time.sleep(0.1)

    def stores(node: Node, base: int) -> None:
        i = base
        while not stop.is_set():
            ok, kind = node.store(i, seed)
            events[node.name].append((time.monotonic() - t0, "store", "ok" if ok else str(kind)))
            i += 1
            time.sleep(0.2)

    threads: dict[str, list[threading.Thread]] = {}
    for k, (name, node) in enumerate(nodes.items()):
        other = (k + 1) % len(nodes)  # each node loads the next one's pages: all from the shared tier
        threads[name] = [threading.Thread(target=loads, args=(node, range(other * own, (other + 1) * own))),
                         threading.Thread(target=stores, args=(node, 1000 * (k + 1)))]
    late: dict[str, Any] = {"outage_loads": {}, "outage_stores": {}, "outage_stored_on": {}}
    scheduler = SchedulerSteps(nodes["a"].root, seed, 4 * own, t0)
    oversleep = Oversleep()
    control_wait_s = control.start_calls()
    watch = LateWatch(lambda: [*nodes.values(), *late.get("nodes", {}).values()])
    late_start, restarted = threading.Event(), threading.Event()
    late_thread = threading.Thread(target=_late_engines, daemon=True,
                                   args=(seed, own, mounts, local, late_start, restarted, t0, late))
    for t in [*(t for ts in threads.values() for t in ts), late_thread]:
        t.start()
    time.sleep(5)
    timeline["stopped"] = time.monotonic() - t0
    loadavg = {"before_stop": Path("/proc/loadavg").read_text().split()[:3]}  # the guest's CPU demand
    nfs_guest.server_stop()
    timeline["server_stopped"] = time.monotonic() - t0  # rpc.nfsd 0 returned: no thread answers
    time.sleep(LATE_START_S)
    late_start.set()
    time.sleep(max(0.0, outage_s - LATE_START_S))
    timeline["restarted"] = time.monotonic() - t0
    loadavg["at_restart"] = Path("/proc/loadavg").read_text().split()[:3]
    nfs_guest.server_start()
    restarted.set()
    recovered: dict[str, dict[str, float | None]] = {}
    limit = timeline["restarted"] + SERVE_LIMIT_S
    while time.monotonic() - t0 < limit:
        recovered = {n: {op: next((round(t - timeline["restarted"], 2) for t, o, what in events[n]
                                   if t > timeline["restarted"] and o == op and what in ("hit", "ok")), None)
                         for op in ("load", "store")} for n in events}
        if all(v is not None for r in recovered.values() for v in r.values()):
            break
        time.sleep(0.5)
    stop.set()
    for t in (t for ts in threads.values() for t in ts):
        t.join(WAIT_S)
    late_thread.join(SERVE_LIMIT_S + 30)
    during = {n: dict(Counter(f"{op}:{what}" for t, op, what in ev
                              if timeline["stopped"] <= t <= timeline["restarted"])) for n, ev in events.items()}
    new_nodes: dict[str, Node] = late.pop("nodes", {})
    every = {**nodes, **new_nodes}
    control_summary = control.close() | {"waited_for_start_s": round(control_wait_s, 2)}
    scheduler_steps = scheduler.summary(timeline["stopped"], timeline["restarted"], oversleep, control)
    for node in every.values():  # each late call beside the guest's worst delays during it
        for call in node.late:
            call["oversleep_s"] = round(oversleep.worst(call["at"], call["at"] + call["seconds"]), 3)
            call["control_s"] = round(control.worst(call["at"], call["at"] + call["seconds"]), 3)
    oversleep_summary = oversleep.close()
    watch.close()
    out = {"outage_s": outage_s, "deadline_s": DEADLINE_S, "mounts": {n: C_MOUNTS[n][1] for n in nodes}, "t0": round(t0, 2), "loadavg": loadavg,
           "timeline": {k: round(v, 2) for k, v in timeline.items()},
           "outcomes_during_outage": during, "recovered_after_restart_s": recovered,
           "scheduler_steps": scheduler_steps, "oversleep": oversleep_summary, "control_calls": control_summary,
           "threads_stuck": {n: sum(t.is_alive() for t in ts) for n, ts in threads.items()}
           | {"new_engines": int(late_thread.is_alive())},
           "new_engines": late | {"open_s": {n: round(node.open_s, 2) for n, node in new_nodes.items()},
                                  # what the guest itself lost during each open (as for late calls)
                                  "open_excuse_s": {n: round(control.worst(node.opened_at, node.opened_at + node.open_s), 3)
                                                    for n, node in new_nodes.items()},
                                  "groups_open_excuse_s": round(control.worst(
                                      late["groups_open"]["at"], late["groups_open"]["at"] + late["groups_open"]["seconds"]), 3)
                                  if "groups_open" in late else None,
                                  "start_limit_s": DEADLINE_S + 2.0, "late_start_s": LATE_START_S},
           "nodes": {n.name: n.summary() for n in every.values()},
           "shared_up_at_end": {n.name: n.store_.stats.get("shared_up") for n in every.values()},
           # down/up changes of each shared tier: 2 per outage when its probe tells the truth
           "health_transitions": {n.name: n.store_.shared.health.transitions for n in every.values()},
           "health_changes": {n.name: [[round(at - t0, 2), "up" if up else "down"]
                                       for at, up in n.store_.shared.health.changes] for n in every.values()}}
    for n in every.values():
        n.close()
    return out


def _wall_interval(p: dict[str, Any], skew_s: float) -> tuple[float, float] | None:
    """A gc pass's [start, end] on the true wall clock: its ISO times minus its clock's skew."""
    if not p.get("started_at") or not p.get("finished_at"):
        return None
    start, end = (datetime.fromisoformat(p[k]).timestamp() - skew_s for k in ("started_at", "finished_at"))
    return start, end


def _gc_pair(root: Path, mount_b: Path, skew_s: float, seed: int, seconds: float) -> dict[str, Any]:
    """Scenario e, one run: ``E_PAGES`` pages stored on ``root`` (a v3 mount), two ``tierstore
    gc`` loops under a quarter of them, one on that mount and one on the v4.2 mount of the same
    directory with its clock ``skew_s`` ahead, while a node stores a new page every ~0.25 s and
    loads back a recent one, for ``seconds``."""
    node = Node("e", root, deadline_s=LONE_ROOT_DEADLINE_S)
    page = page_file_size(namespace(), 0)
    cap = E_PAGES // 4 * page
    stored = sum(node.store(i, seed)[0] for i in range(E_PAGES))
    gcs = {"v3": GcProcess(root, cap), "v42": GcProcess(mount_b / root.name, cap, skew_s=skew_s)}
    for gc in gcs.values():
        gc.first_pass.wait(120)
    end, i = time.monotonic() + seconds, E_PAGES
    loads: Counter[str] = Counter()
    # Both gcs must have held the lease for the run to show anything about turns: a guest starved
    # by the other CI worker once gave one of them no turn in 30 s (21 passes, every one busy), so
    # the stores go on, at most ``seconds`` more, until each has had one.
    while time.monotonic() < end or (time.monotonic() < end + seconds
                                     and not all(gc.active() for gc in gcs.values())):
        ok, _kind = node.store(i, seed)
        stored += ok
        loads[node.load(i - random.randrange(4), seed)] += 1  # a recent page: a hit, or a miss once evicted
        i += 1
        time.sleep(0.25)
    time.sleep(1.5)  # a few more passes after the last store (0.3 s apart)
    reports = {name: gc.stop() for name, gc in gcs.items()}
    # counted on the server's side of the export: a client's listing may be cached for 30 s
    left = [f for f in (Path(nfs_guest.EXPORT) / root.name).rglob("*.kvp") if f.is_file()]
    end_bytes = sum(f.stat().st_size for f in left)
    evicted = sum(r["evicted"] for r in reports.values())
    # the fewest evictions that leave the root within its cap: what was stored beyond it
    needed = max(stored - cap // page, 1)
    active = {name: gc.active() for name, gc in gcs.items()}
    # passes of one gc that held the lease within a lease ttl of a pass of the other (turns taken
    # quickly: each pass releases the lease at its end), and passes whose spans really overlapped
    near = sum(1 for p in active["v3"] if any(abs(p["at"] - q["at"]) <= GC_LEASE_TTL_S for q in active["v42"]))
    # A pass that found at a renewal that its lease had expired (a guest that starved it past
    # ttl + skew: the lease is advisory) stops at once and says ``lease_lost``; the overlap that
    # counts is between passes that kept the lease to their end.
    spans = {name: [w for p in passes if not p.get("lease_lost") and (w := _wall_interval(p, gcs[name].skew_s))]
             for name, passes in active.items()}
    overlapping = sum(1 for a0, a1 in spans["v3"] if any(a0 < b1 and b0 < a1 for b0, b1 in spans["v42"]))
    out = {"skew_s": skew_s, "cap": cap, "page_bytes": page, "pages_stored": stored, "evicted": evicted,
           "evicted_by": {name: r["evicted"] for name, r in reports.items()},
           "vanished_by": {name: r["vanished"] for name, r in reports.items()},
           "active_passes": {name: r["active"] for name, r in reports.items()},
           "passes": {name: r["passes"] for name, r in reports.items()},
           "lease_lost": {name: r["lease_lost"] for name, r in reports.items()},
           "needed": needed, "over_eviction_factor": round(evicted / needed, 3),
           "passes_both_active_within_lease_ttl": near, "overlapping_active_passes": overlapping,
           "pages_at_end": len(left), "bytes_at_end": end_bytes, "bytes_at_end_over_cap": round(end_bytes / cap, 3),
           "loads": dict(loads), "gc_errors": {name: r["errors"] for name, r in reports.items()},
           "gc_rc": {name: r["rc"] for name, r in reports.items()},
           "gc_stderr": {name: r["stderr_tail"][-600:] for name, r in reports.items()},
           "node": node.summary()}
    node.close()
    return out


def scenario_e(results: Path) -> dict[str, Any]:
    """Defect 6: two gc nodes, one with its clock 30 s ahead, on a v3 and a v4.2 mount of one
    root while a node keeps storing: does the skewed one over-evict (take a live lease, or keep a
    dead one)? Then the same with both clocks right."""
    seed = PAGE_SEEDS["e"]
    ma = mounted(nfs_guest.EXPORT, "a3_default", V3)
    mb = mounted(nfs_guest.EXPORT, "b42_default", V42)
    return {"skewed": _gc_pair(ma / "e_skewed", mb, E_SKEW_S, seed, E_SECONDS),
            "right": _gc_pair(ma / "e_right", mb, 0.0, seed + 1, E_SECONDS)}


def _fill(path: Path) -> int:
    """Write zeros into ``path`` (on the server's side of the export) until ENOSPC; bytes written."""
    written = 0
    block = b"\0" * (1 << 20)
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                written += f.write(block)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
    return written


def _stores_again(nodes: tuple[Node, ...], seed: int) -> tuple[dict[str, Counter[str]], dict[str, float | None]]:
    """Once gc made room: a store per node every second until one succeeds (the tier's trial
    store, one per probe interval, finds the room); ({node: outcomes}, {node: seconds until its
    first stored page, or None within RECOVERY_LIMIT_S})."""
    freed = time.monotonic()
    after: dict[str, Counter[str]] = {n.name: Counter() for n in nodes}
    stores_again_s: dict[str, float | None] = {n.name: None for n in nodes}
    i = 0
    while time.monotonic() - freed < RECOVERY_LIMIT_S and None in stores_again_s.values():
        for k, n in enumerate(nodes):
            if stores_again_s[n.name] is None:
                ok, kind = n.store(1000 * (k + 1) + i, seed)
                after[n.name][kind or "ok"] += 1
                if ok:
                    stores_again_s[n.name] = round(time.monotonic() - freed, 2)
        i += 1
        time.sleep(1.0)
    return after, stores_again_s


def scenario_d(results: Path) -> dict[str, Any]:
    """A full export (a size-capped tmpfs filled to its last block): stores must fail typed
    `enospc`, loads of existing pages still verify, nothing wrong is served; then `tierstore gc`
    runs with nobody deleting anything, and the nodes store again (how long after gc)."""
    seed, pages = PAGE_SEEDS["d"], 16
    ma = mounted(nfs_guest.SMALL_EXPORT, "sa3", V3)
    mb = mounted(nfs_guest.SMALL_EXPORT, "sb42", V42)
    capture = LogCapture()
    logging.getLogger("tierstore").addHandler(capture)
    a = Node("a", ma / "d_root", deadline_s=LONE_ROOT_DEADLINE_S, io_loop=io_loop(1))
    b = Node("b", mb / "d_root", deadline_s=LONE_ROOT_DEADLINE_S, io_loop=io_loop(0))
    stored = sum(a.store(i, seed)[0] for i in range(pages))
    filler = Path(nfs_guest.SMALL_EXPORT) / "filler"
    filled = _fill(filler)
    full_stores = {n.name: Counter(n.store(100 * (k + 1) + i, seed)[1] or "ok" for i in range(8))
                   for k, n in enumerate((a, b))}
    loads_full = {n.name: Counter(n.load(i, seed) for i in range(pages)) for n in (a, b)}
    # nobody deletes anything: `tierstore gc` on node A's mount, the cap half the pages found
    # (its lease cannot be written on the full export: it makes room without it first)
    page_bytes = sum(f.stat().st_size for f in (Path(nfs_guest.SMALL_EXPORT) / "d_root").rglob("*.kvp"))
    gc_rc, gc_out, gc_err = _tool("gc", str(ma / "d_root"), "--max-bytes", str(page_bytes // 2), "--json")
    gc_docs = [json.loads(line) for line in gc_out.splitlines() if line.startswith("{")]
    after, stores_again_s = _stores_again((a, b), seed)
    logging.getLogger("tierstore").removeHandler(capture)
    filler.unlink()  # the figures are taken: leave the export as it was
    out = {"pages": pages, "stored_before": stored, "filler_bytes": filled,
           "gc": {"rc": gc_rc, "report": gc_docs[-1] if gc_docs else None, "stderr": gc_err[-600:],
                  "cap": page_bytes // 2},
           "stores_while_full": {k: dict(v) for k, v in full_stores.items()},
           "loads_while_full": {k: dict(v) for k, v in loads_full.items()},
           "stores_after_freeing": {k: dict(v) for k, v in after.items()},
           "stores_again_after_freeing_s": stores_again_s, "recovery_limit_s": RECOVERY_LIMIT_S,
           "log_lines": capture.lines, "nodes": {n.name: n.summary() for n in (a, b)}}
    for n in (a, b):
        n.close()
    return out


def _server_path(client_path: Path, mount: Path) -> Path:
    """The server's own path (the exported tmpfs) of ``client_path`` under the NFS ``mount``."""
    return Path(nfs_guest.EXPORT) / client_path.relative_to(mount)


def _files(top: Path) -> set[str]:
    """Every file under ``top`` (relative paths), as the server sees it."""
    return {str(f.relative_to(top)) for f in top.rglob("*") if not f.is_dir()}


def _tool(*args: str) -> tuple[int, str, str]:
    """``tierstore ARGS`` as a subprocess (an operator's command): exit status, stdout, stderr."""
    run = subprocess.run([sys.executable, "-m", "tierstore", *args], capture_output=True, text=True, timeout=300)
    return run.returncode, run.stdout, run.stderr


def _sliced_chain(root: Path, local: Path, loop: str) -> TierChain:
    """A TP=2 rank's chain (rank 1: KV head 1 of 2) as the vLLM spec builds it: its slice
    directory ``h1-1`` and the slice's layout in both tiers; a short LRU-stamp interval."""
    local.mkdir(parents=True, exist_ok=True)
    cfg = TierStoreConfig.from_dict({"root": str(root), "local_root": str(local), "deadline_s": LONE_ROOT_DEADLINE_S,
                                     "shared_deadline_s": LONE_ROOT_DEADLINE_S, "shared_touch_interval_s": 0.1,
                                     "io_loop": loop})
    return TierChain(cfg, SLICED_NS, 0, rank=1, head_start=F_HEADS.start, head_count=F_HEADS.count,
                     staging_slots=6, rank_dir=split_dir_name(F_HEADS), layout=slice_layout(SLICED_FULL, F_HEADS),
                     metrics=MetricsRegistry())


def scenario_f(results: Path) -> dict[str, Any]:
    """Defect 7 on real NFS: pages stored through a head-sliced store (directory ``h1-1``) on a
    v4.2 mount; half of them loaded by another node through its shared tier: their server-side
    mtimes (gc's LRU stamp) advance, the others' do not, and `tierstore gc` under half the bytes
    evicts exactly the unloaded half. Defect 5: a root whose format marker names a layout this
    version does not know: `tierstore fsck --repair` and `tierstore gc` (v3 mount) exit 8 and
    move or remove nothing."""
    seed = PAGE_SEEDS["f"]
    mb = mounted(nfs_guest.EXPORT, "b42_default", V42)
    root = mb / "f_root"
    root.mkdir(parents=True, exist_ok=True)
    server_root = _server_path(root, mb)
    layout = slice_layout(SLICED_FULL, F_HEADS)
    keys = [page_key(i, seed=seed) for i in range(F_PAGES)]
    writer_inner = _sliced_chain(root, Path("/var/tmp/nfs_kernel_local/f_writer"), io_loop(0))
    source = DirectorySlices(root / SLICED_NS.digest / "g0", SLICED_NS.digest_bytes, 0, SLICED_FULL, refresh_s=0)
    writer = HeadSliceStore(writer_inner, F_HEADS, SLICED_FULL, source)
    stored = 0
    for k in keys:
        slot = writer.acquire_slot(10)
        assert slot is not None, "no staging slot"
        slot.view[:layout.nbytes] = page_bytes(layout, k)
        (res,) = writer.wait([writer.submit_store(k, slot, 16)], 30)
        stored += bool(res.ok)
    flushed = writer.flush(60)
    writer_jobs = engine_jobs(writer_inner)
    writer.close()
    source.close()
    slice_dir = server_root / SLICED_NS.digest / "g0" / split_dir_name(F_HEADS)
    paths = [slice_dir / fanout(k) / f"{k.hex()}{PAGE_SUFFIX}" for k in keys]
    on_server = sum(p.is_file() for p in paths)
    old = time.time() - 3600
    for p in paths:  # on the server: every page an hour old, so a stamp stands out
        os.utime(p, (old, old))
    loaded = keys[::2]
    reader = _sliced_chain(root, Path("/var/tmp/nfs_kernel_local/f_reader"), io_loop(1))  # an empty local tier
    outcomes: Counter[str] = Counter()
    for k in loaded:
        (res,) = reader.wait([reader.submit_load(k)], 30)
        if res.ok:
            outcomes["hit" if bytes(res.slot.view[:layout.nbytes]) == page_bytes(layout, k) else "wrong"] += 1
            outcomes[f"tier:{res.tier}"] += 1
            reader.release_slot(res.slot)
        else:
            outcomes[res.error.kind] += 1
    stamped_at = time.monotonic()
    loaded_paths = {p for p, k in zip(paths, keys, strict=True) if k in loaded}
    while time.monotonic() - stamped_at < 20 and not all(p.stat().st_mtime > old + 60 for p in loaded_paths):
        time.sleep(0.2)  # the stamp is a background utime
    stamp_s = round(time.monotonic() - stamped_at, 2)
    reader_jobs = engine_jobs(reader)
    reader.close()
    advanced = {"loaded": sum(p.stat().st_mtime > old + 60 for p in loaded_paths),
                "not_loaded": sum(p.stat().st_mtime > old + 60 for p in paths if p not in loaded_paths)}
    m3 = mounted(nfs_guest.EXPORT, "f3", V3)  # a fresh v3 client: no cached attributes of these files
    size = paths[0].stat().st_size
    cap = size * (F_PAGES // 2)
    # --low-watermark 1: evict down to the cap itself, so exactly the half that was not loaded goes
    rc, gc_out, gc_err = _tool("gc", str(m3 / "f_root"), "--max-bytes", str(cap), "--low-watermark", "1", "--json")
    gc_report = json.loads(gc_out) if gc_out.startswith("{") else {}
    survived = {"loaded": sum(p.exists() for p in loaded_paths),
                "not_loaded": sum(p.exists() for p in paths if p not in loaded_paths)}
    # defect 5: a newer tierstore's marker (an extra layout) and a directory of that layout
    marker = server_root / ".tierstore-format"
    marker_before = json.loads(marker.read_text()) if marker.exists() else None
    body = dict(marker_before or {"format": 1, "layouts": ["rank_dirs", "head_slice_dirs"]})
    body["layouts"] = [*body.get("layouts", []), "v9_dirs"]
    marker.write_text(json.dumps(body))
    future = slice_dir.parent / "v9-0" / "00"
    future.mkdir(parents=True, exist_ok=True)
    (future / "page").write_bytes(b"x")
    before = _files(server_root)
    fsck_rc, fsck_out, fsck_err = _tool("fsck", str(m3 / "f_root"), "--repair")
    after_fsck = _files(server_root)
    gc1_rc, gc1_out, gc1_err = _tool("gc", str(m3 / "f_root"), "--max-bytes", "1")
    after_gc = _files(server_root)
    return {"pages": F_PAGES, "stored": stored, "flushed": flushed, "on_server": on_server,
            "nodes": {"writer": {"io_loop": io_loop(0), "jobs": writer_jobs},
                      "reader": {"io_loop": io_loop(1), "jobs": reader_jobs}},
            "slice_dir": slice_dir.name, "page_file_bytes": size, "loaded": len(loaded),
            "load_outcomes": dict(outcomes), "mtime_advanced": advanced, "stamp_wait_s": stamp_s,
            "gc": {"rc": rc, "cap": cap, "evicted": gc_report.get("evicted"), "output_tail": (gc_out + gc_err)[-300:]},
            "survived_gc": survived, "marker_before": marker_before, "marker_written": body,
            "old_tool": {"fsck_repair_rc": fsck_rc, "gc_rc": gc1_rc, "files_before": len(before),
                         "moved_or_removed_by_fsck": sorted(before - after_fsck)[:10],
                         "added_by_fsck": sorted(after_fsck - before)[:10],
                         "moved_or_removed_by_gc": sorted(after_fsck - after_gc)[:10],
                         "added_by_gc": sorted(after_gc - after_fsck)[:10],
                         "fsck_tail": (fsck_out + fsck_err)[-300:], "gc_tail": (gc1_out + gc1_err)[-300:]}}


def _nfsd_delta(before: dict[str, list[int]], after: dict[str, list[int]], version: str) -> dict[str, int]:
    """Server operations between two ``nfsd_counters`` readings: per NFSv3 procedure, or per
    NFSv4 operation (and ``compounds``: the RPCs that carried them); zero counts left out."""
    out: dict[str, int] = {}
    if version == "v3":
        for name, b, a in zip(nfs_guest.PROC3, before["proc3"][1:], after["proc3"][1:], strict=False):
            if a - b:
                out[name] = a - b
        return out
    ops_b, ops_a = before.get("proc4ops", [0])[1:], after.get("proc4ops", [0])[1:]
    for op, (b, a) in enumerate(zip(ops_b, ops_a, strict=False)):
        if a - b:
            out[nfs_guest.PROC4OPS.get(op, f"op{op}")] = a - b
    out["compounds"] = after["proc4"][2] - before["proc4"][2]  # proc4: count, NULL, COMPOUND
    return out


def _counted(index: page_index.PageIndex, version: str, refreshes: int, full_relist_every: int) -> dict[str, Any]:
    """``refreshes`` refreshes of ``index`` (``load_all``: what the loader thread does every
    index_refresh_s) under ``FULL_RELIST_EVERY = full_relist_every``, and the nfsd operations
    they cost (per refresh) and this client's time per refresh."""
    saved = page_index.FULL_RELIST_EVERY
    page_index.FULL_RELIST_EVERY = full_relist_every
    listings = index.listings
    try:
        before = nfs_guest.nfsd_counters()
        started = time.monotonic()
        for _ in range(refreshes):
            index.load_all()
        seconds = time.monotonic() - started
        after = nfs_guest.nfsd_counters()
    finally:
        page_index.FULL_RELIST_EVERY = saved
    ops = _nfsd_delta(before, after, version)
    total = sum(v for k, v in ops.items() if k != "compounds")
    return {"refreshes": refreshes, "ops": ops, "ops_per_refresh": round(total / refreshes, 1),
            "rpcs_per_refresh": round(ops.get("compounds", total) / refreshes, 1),
            "listings_per_refresh": (index.listings - listings) / refreshes,
            "seconds_per_refresh": round(seconds / refreshes, 3)}


def _index_refreshes(mount: Path, version: str) -> dict[str, Any]:
    """Scenario g, one client: a PageIndex of ``G_PAGES`` pages on ``mount``, listed once (the
    start), then refreshes of an unchanged index under each rule. The current rule's refreshes
    are of two kinds: a stat per directory (the mtime unchanged), and, every FULL_RELIST_EVERY-th
    time, the stat and a listing of all 256 (the same calls as the old rule's every refresh, on
    the same code path): its average per refresh is ((FULL_RELIST_EVERY - 1) x the first + the
    second) / FULL_RELIST_EVERY, both measured."""
    index = page_index.PageIndex(FileMapper(mount / "g_root", namespace().digest, 0, 0).base)
    started = time.monotonic()
    index.load_all()
    first_s = round(time.monotonic() - started, 2)
    assert len(index) == G_PAGES, (len(index), G_PAGES)
    # a rule that never re-lists an unchanged directory within these refreshes (they are fewer)
    skip = _counted(index, version, G_REFRESHES, G_REFRESHES + 1)
    full = _counted(index, version, G_REFRESHES, 1)  # the old rule: every directory listed every time
    every = page_index.FULL_RELIST_EVERY
    current = ((every - 1) * skip["ops_per_refresh"] + full["ops_per_refresh"]) / every
    old = full["ops_per_refresh"]
    return {"first_listing_s": first_s, "unchanged_stat_only": skip, "full_relist": full,
            "current_ops_per_refresh": round(current, 1), "old_ops_per_refresh": old,
            "current_ops_per_node_minute_at_30s": round(current * 2, 1),
            "old_ops_per_node_minute_at_30s": round(old * 2, 1),
            "old_over_current": round(old / current, 2) if current else None,
            "current_seconds_per_refresh": round(((every - 1) * skip["seconds_per_refresh"]
                                                  + full["seconds_per_refresh"]) / every, 3),
            "old_seconds_per_refresh": full["seconds_per_refresh"]}


# scenario i: 16 MiB pages (many READs each), read by nodes on v3 and v4.2 while a third client
# replaces and removes them
I_NS = simple_namespace("float16", tokens_per_chunk=64, num_layers=256, num_kv_heads=4, head_size=64)
I_PAGES, I_SECONDS = 2, 25.0  # two pages: each replaced several times a second
I_ESTALE, I_MAX_SECONDS = 3, 90.0


def _server_copy(src: str, dst: str) -> None:
    """``dst`` made a copy of ``src`` by the server (v4.2 COPY: copy_file_range on one export),
    so a client replaces a 16 MiB page in milliseconds without sending its bytes."""
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        left = os.fstat(fin.fileno()).st_size
        while left > 0:
            done = os.copy_file_range(fin.fileno(), fout.fileno(), left)
            if done <= 0:
                raise OSError(errno.EIO, f"copy_file_range returned {done}")
            left -= done


def scenario_i(results: Path) -> dict[str, Any]:
    """Reader-side ESTALE: nodes on v3 (one per I/O loop) and on v4.2 (native) load 16 MiB pages
    over and over while a third client X (its own v4.2 mount) replaces one page file after
    another by a rename over it (a new file, the same bytes: the server frees the old one) and
    now and then removes one (put back later). A v3 read on a file handle whose file is gone
    from the server fails ESTALE: every load must still be the right bytes or a typed miss, and
    ESTALE is counted."""
    seed = PAGE_SEEDS["i"]
    ma, mb = mounted(nfs_guest.EXPORT, "a3_default", V3), mounted(nfs_guest.EXPORT, "b42_default", V42)
    mx = mounted(nfs_guest.EXPORT, "x42", V42)
    x = Node("x", mx / "i_root", deadline_s=LONE_ROOT_DEADLINE_S, io_loop="python", ns=I_NS, staging_slots=1)
    stored = sum(x.store(i, seed)[0] for i in range(I_PAGES))
    x.close()
    paths = [FileMapper(mx / "i_root", I_NS.digest, 0, 0).final_path(key(i, seed)) for i in range(I_PAGES)]
    masters = mx / "i_masters"
    masters.mkdir(exist_ok=True)
    for i, path in enumerate(paths):
        _server_copy(path, str(masters / str(i)))
    # v3 with each loop; v4.2: an open file's state keeps a removed file readable on the server
    readers = [Node(name, mount / "i_root", deadline_s=LONE_ROOT_DEADLINE_S, io_loop=loop, ns=I_NS, staging_slots=2)
               for name, mount, loop in (("a", ma, "python"), ("a_native", ma, "native"), ("b", mb, "native"))]
    stop = threading.Event()
    churn: Counter[str] = Counter()

    def read(node: Node, rng_seed: int) -> None:
        rng = random.Random(rng_seed)
        while not stop.is_set():
            node.load(rng.randrange(I_PAGES), seed)

    def replace() -> None:
        rng = random.Random("x")
        removed: set[int] = set()
        while not stop.is_set():
            i = rng.randrange(I_PAGES)
            if i not in removed and rng.random() < 0.1:
                os.unlink(paths[i])
                removed.add(i)
                churn["removed"] += 1
            else:
                tmp = f"{paths[i]}.x-{churn['replaced']}"
                _server_copy(str(masters / str(i)), tmp)
                os.rename(tmp, paths[i])
                removed.discard(i)
                churn["replaced"] += 1

    threads = [threading.Thread(target=read, args=(n, k)) for k, n in enumerate(readers)]
    threads.append(threading.Thread(target=replace))
    for t in threads:
        t.start()
    # at least I_SECONDS; then until the v3 python node met ESTALE I_ESTALE times (a starved CI
    # guest runs fewer loads, and each meets ESTALE by chance), I_MAX_SECONDS at most
    began = time.monotonic()
    while time.monotonic() - began < I_MAX_SECONDS and (
            time.monotonic() - began < I_SECONDS or readers[0].errnos.get("ESTALE", 0) < I_ESTALE):
        time.sleep(0.5)
    stop.set()
    ran_s = round(time.monotonic() - began, 1)
    for t in threads:
        t.join(WAIT_S)
    out = {"pages": I_PAGES, "page_bytes": page_file_size(I_NS, 0), "stored": stored, "seconds_run": ran_s,
           "churn": dict(churn), "nodes": {n.name: n.summary() for n in readers},
           "estale_metric": {n.name: n.summary()["tiers"].get("root", {}).get("failures", {}).get("estale", 0)
                             for n in readers}}
    for n in readers:
        n.close()
    return out


J_PAGES, J_HOT, J_ROUNDS = 40, 10, 4  # scenario j: pages stored, the hot set, its load rounds


def scenario_j(results: Path) -> dict[str, Any]:
    """The fleet's hot set survives gc: a long-lived node (v3, default caching, a local tier that
    holds the hot set) stores ``J_PAGES`` pages, all of them made an hour old on the server, and
    then hits a hot set of ``J_HOT`` from its local tier, round after round (each hit stamps the
    shared copy, rate-limited, off the request path). Another long-lived client (v4.2, default
    caching) that listed every page while they were all old runs `tierstore gc` to half the
    bytes within its attribute cache's lifetime: its scan sees stale mtimes, and its re-check
    before evicting must see the stamps. A fresh node then loads the hot set from the export."""
    seed = PAGE_SEEDS["j"]
    ma, mb = mounted(nfs_guest.EXPORT, "a3_default", V3), mounted(nfs_guest.EXPORT, "b42_default", V42)
    local = Path("/var/tmp/nfs_kernel_local/j_hot")
    hot_node = Node("hot", ma / "j_root", local, local_pages=J_HOT + 4, io_loop=io_loop(0))
    stored = sum(hot_node.store(i, seed)[0] for i in range(J_PAGES))
    hot_node.store_.flush(60)
    mapper = FileMapper(_server_path(ma / "j_root", ma), namespace().digest, 0, 0)
    paths = [Path(mapper.final_path(key(i, seed))) for i in range(J_PAGES)]
    old = time.time() - 3600
    for p in paths:  # on the server: every page an hour old
        os.utime(p, (old, old))
    client_b = FileMapper(mb / "j_root", namespace().digest, 0, 0)
    cached = sum(os.stat(client_b.final_path(key(i, seed))).st_mtime < old + 60 for i in range(J_PAGES))
    hot = list(range(J_PAGES - J_HOT, J_PAGES))  # the last stored: still in the local tier
    outcomes: Counter[str] = Counter()
    for _ in range(J_ROUNDS):
        for i in hot:
            outcomes[hot_node.load(i, seed)] += 1
        time.sleep(0.6)  # past the node's touch interval (0.5 s)
    stamped_at = time.monotonic()
    while time.monotonic() - stamped_at < 30 and not all(paths[i].stat().st_mtime > old + 60 for i in hot):
        time.sleep(0.2)  # the stamps are background utimes
    stamped = sum(paths[i].stat().st_mtime > old + 60 for i in hot)
    local_hits = hot_node.summary()["tiers"].get("local", {}).get("hits", 0)
    cap = sum(p.stat().st_size for p in paths) // 2
    rc, gc_out, gc_err = _tool("gc", str(mb / "j_root"), "--max-bytes", str(cap), "--low-watermark", "1", "--json")
    gc_report = json.loads(gc_out) if gc_out.startswith("{") else {}
    on_export = sum(paths[i].exists() for i in hot)
    fresh = Node("fresh", mounted(nfs_guest.EXPORT, "j3_fresh", V3) / "j_root", deadline_s=LONE_ROOT_DEADLINE_S,
                 io_loop=io_loop(1))
    fresh_loads = Counter(fresh.load(i, seed) for i in hot)
    out = {"pages": J_PAGES, "hot": J_HOT, "stored": stored, "cached_old_on_gc_client": cached,
           "hot_loads": dict(outcomes), "local_hits": local_hits, "stamped": stamped,
           "stamp_wait_s": round(time.monotonic() - stamped_at, 2),
           "gc": {"rc": rc, "cap": cap, "evicted": gc_report.get("evicted"),
                  "skipped_recent": gc_report.get("skipped_recent"), "tail": (gc_out + gc_err)[-300:]},
           "hot_on_export_after_gc": on_export, "fresh_node_loads": dict(fresh_loads),
           "nodes": {n.name: n.summary() for n in (hot_node, fresh)}}
    for n in (hot_node, fresh):
        n.close()
    return out


K_PAGES, K_HOT, K_SKEW_S = 20, 5, -86400.0  # scenario k: pages, the hot set, the node's clock (a day behind)
K_DIR = Path("/var/tmp/nfs_kernel_skewed")  # go/done files and the skewed node's report


class SkewedProcess:
    """Scenario k's node, in a process whose wall clock is ``K_SKEW_S`` off (``faketime``:
    every clock call of the process, monotonic ones excepted): ``node.py --skewed SEED``.
    Started with the control process (its imports overlap the first scenarios); ``run`` lets
    it store and touch, and returns its report."""

    def __init__(self, seed: int, stderr: Path) -> None:
        shutil.rmtree(K_DIR, ignore_errors=True)
        K_DIR.mkdir(parents=True)
        argv = [sys.executable, str(Path(__file__).resolve()), "--results", str(K_DIR), "--skewed", str(seed)]
        with open(stderr, "ab") as err:
            self.proc = subprocess.Popen(nfs_guest.clock_offset_command(K_SKEW_S, argv), stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=err)

    def run(self, timeout_s: float = 300.0) -> dict[str, Any]:
        (K_DIR / "go").touch()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        return json.loads((K_DIR / "report.json").read_text()) | {"rc": self.proc.returncode}


def skewed_main(seed: int) -> int:
    """The skewed node (``SkewedProcess``): a fleet chain on the v3 mount whose local tier holds
    every page; on ``go`` it stores ``K_PAGES`` pages, then hits the last ``K_HOT`` from its
    local tier, round after round (each hit stamps the shared copy); its report says what its
    own clock read."""
    import select

    # libfaketime 0.9.10 turns Python 3.11's time.sleep (an absolute clock_nanosleep on the
    # monotonic clock) into EINVAL: sleeps wait in select instead; every clock stays faketime's
    time.sleep = lambda seconds: select.select([], [], [], max(0.0, seconds)) and None
    deadline = time.monotonic() + 3600
    while not (K_DIR / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    ma = mounted(nfs_guest.EXPORT, "a3_default", V3)
    node = Node("skewed", ma / "k_root", Path("/var/tmp/nfs_kernel_local/k_skewed"), local_pages=K_PAGES + 2,
                io_loop=io_loop(0))
    clock_at_start = time.time()
    stored = sum(node.store(i, seed)[0] for i in range(K_PAGES))
    node.store_.flush(60)
    time.sleep(1.5)  # the hot pages' stamps come later than every store, by the server's clock too
    hits: Counter[str] = Counter()
    for _ in range(3):
        for i in range(K_PAGES - K_HOT, K_PAGES):
            hits[node.load(i, seed)] += 1
        time.sleep(0.6)  # past the touch interval (0.5 s)
    time.sleep(3.0)  # the stamps are background utimes
    summary = node.summary()
    node.close()
    (K_DIR / "report.json").write_text(json.dumps({"stored": stored, "hot_loads": dict(hits),
                                                   "own_clock_at_start": clock_at_start,
                                                   "local_hits": summary["tiers"].get("local", {}).get("hits", 0),
                                                   "node": summary}))
    return 0


def scenario_k(results: Path, skewed: SkewedProcess) -> dict[str, Any]:
    """A writer and a toucher whose clock is a day behind (one process under faketime): the
    page files' times are the server's (a store's file time and each hit's stamp), so gc, on a
    node with the right clock, evicts the cold pages and keeps the ones the skewed node hit."""
    started = time.time()  # this process's clock is the guest's, the server's
    report = skewed.run()
    ma = mounted(nfs_guest.EXPORT, "a3_default", V3)
    mapper = FileMapper(_server_path(ma / "k_root", ma), namespace().digest, 0, 0)
    seed = PAGE_SEEDS["k"]
    mtimes = [os.stat(mapper.final_path(key(i, seed))).st_mtime for i in range(K_PAGES)]
    hot, cold = mtimes[K_PAGES - K_HOT:], mtimes[:K_PAGES - K_HOT]
    now = time.time()
    paths = [Path(mapper.final_path(key(i, seed))) for i in range(K_PAGES)]
    cap = sum(p.stat().st_size for p in paths) // 2
    rc, gc_out, gc_err = _tool("gc", str(ma / "k_root"), "--max-bytes", str(cap), "--low-watermark", "1", "--json")
    gc_report = json.loads(gc_out) if gc_out.startswith("{") else {}
    return {"pages": K_PAGES, "hot": K_HOT, "skew_s": K_SKEW_S,
            "skewed": {k: v for k, v in report.items() if k != "node"},
            "skewed_clock_behind_s": round(started - report["own_clock_at_start"], 1),
            "mtimes_within_run": sum(started - 5 <= t <= now + 5 for t in mtimes),
            "hot_newer_than_every_cold": min(hot) > max(cold),
            "gc": {"rc": rc, "cap": cap, "evicted": gc_report.get("evicted"), "tail": (gc_out + gc_err)[-300:]},
            "survived_gc": {"hot": sum(paths[i].exists() for i in range(K_PAGES - K_HOT, K_PAGES)),
                            "cold": sum(paths[i].exists() for i in range(K_PAGES - K_HOT))},
            "nodes": {"skewed": report["node"]}}


def scenario_g(results: Path) -> dict[str, Any]:
    """Issue item 5: what the page index's refreshes cost the file server. ``G_PAGES`` page
    files (empty: the index lists names) made on the server's side; per client (v3 with default
    caching, v3 ``actimeo=0``: every stat reaches the server, as after an expired attribute
    cache, and v4.2), each on a fresh mount, the nfsd operations per refresh of an unchanged
    index under the current rule (a directory listed again only when its mtime changed, and
    every FULL_RELIST_EVERY-th refresh) and the old one (every refresh lists all 256)."""
    ns = namespace()
    server = FileMapper(Path(nfs_guest.EXPORT) / "g_root", ns.digest, 0, 0)
    started = time.monotonic()
    server.make_fanout_dirs()
    for i in range(G_PAGES):
        os.close(os.open(server.final_path(key(i, PAGE_SEEDS["g"])), os.O_CREAT | os.O_WRONLY, 0o600))
    created_s = round(time.monotonic() - started, 1)
    time.sleep(page_index.SETTLED_S + 0.5)  # the directories' mtimes are settled: the index may trust them
    clients = {"v3": ("v3", V3), "v3_actimeo0": ("v3", f"{V3},actimeo=0"), "v42": ("v42", V42)}
    out: dict[str, Any] = {"pages": G_PAGES, "created_s": created_s, "full_relist_every": page_index.FULL_RELIST_EVERY,
                           "clients": {}}
    for name, (version, options) in clients.items():
        out["clients"][name] = _index_refreshes(mounted(nfs_guest.EXPORT, f"g_{name}", options), version)
    return out


def scenario_h(results: Path) -> dict[str, Any]:
    """Quotas: an ext4 export with a user quota (``nfs_guest.quota_export``) and nodes on a v3
    and a v4.2 mount: a store past the quota fails typed (``enospc``, errno EDQUOT), the pages
    already there still verify on both nodes; `tierstore gc` over the quota makes room with
    nobody deleting anything, and both nodes store again. Reports ``skipped`` (why) where the guest cannot
    make such an export."""
    seed, pages = PAGE_SEEDS["h"], 8
    try:
        device = nfs_guest.quota_export()
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or ""
        return {"skipped": f"no ext4 quota export in the guest: {exc} {detail}".strip()[:600]}
    ma = mounted(nfs_guest.QUOTA_EXPORT, "q3", V3)
    mb = mounted(nfs_guest.QUOTA_EXPORT, "q42", V42)
    a = Node("a", ma / "h_root", deadline_s=LONE_ROOT_DEADLINE_S, io_loop=io_loop(1))
    b = Node("b", mb / "h_root", deadline_s=LONE_ROOT_DEADLINE_S, io_loop=io_loop(0))
    stored = sum(a.store(i, seed)[0] for i in range(pages))
    used = nfs_guest.user_quota_used(device)
    limit = used  # not one more block: gc's lease cannot be written either
    nfs_guest.set_user_quota(device, limit)
    past = {n.name: Counter(n.store(100 * (k + 1) + i, seed)[1] or "ok" for i in range(4))
            for k, n in enumerate((a, b))}
    loads = {n.name: Counter(n.load(i, seed) for i in range(pages)) for n in (a, b)}
    used_after = nfs_guest.user_quota_used(device)
    at_quota = {n.name: n.summary() for n in (a, b)}  # what the stores past the quota met
    # nobody deletes anything: `tierstore gc` on node A's mount (as the quota's user: the export
    # squashes every request to it), the cap half the pages
    page_bytes = page_file_size(namespace(), 0) * pages
    gc_rc, gc_out, gc_err = _tool("gc", str(ma / "h_root"), "--max-bytes", str(page_bytes // 2), "--json")
    gc_docs = [json.loads(line) for line in gc_out.splitlines() if line.startswith("{")]
    after, stores_again_s = _stores_again((a, b), seed)
    out = {"pages": pages, "stored_before": stored, "quota_used_before": used, "quota_limit": limit,
           "quota_used_after": used_after, "quota_used_after_gc": nfs_guest.user_quota_used(device),
           "stores_past_quota": {k: dict(v) for k, v in past.items()},
           "loads_past_quota": {k: dict(v) for k, v in loads.items()},
           "gc": {"rc": gc_rc, "report": gc_docs[-1] if gc_docs else None, "stderr": gc_err[-600:],
                  "cap": page_bytes // 2},
           "stores_after_freeing": {k: dict(v) for k, v in after.items()},
           "stores_again_after_freeing_s": stores_again_s,
           "nodes": at_quota, "nodes_after_gc": {n.name: n.summary() for n in (a, b)}}
    for n in (a, b):
        n.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--results", required=True, type=Path)
    ap.add_argument("--only", default="a,b,c,d,e,f,g,h,i,j,k", help="comma-separated scenario letters")
    ap.add_argument("--outage", type=float, default=120.0, help="seconds the server stays stopped (c)")
    ap.add_argument("--control", type=int, default=None, help="run scenario c's control process (its seed)")
    ap.add_argument("--skewed", type=int, default=None, help="run scenario k's skewed node (its seed)")
    args = ap.parse_args()
    if args.control is not None:
        return control_main(args.control)
    if args.skewed is not None:
        return skewed_main(args.skewed)
    scenarios: dict[str, Callable[[], dict[str, Any]]] = {
        "a": lambda: scenario_a(args.results), "b": lambda: scenario_b(args.results),
        "c": lambda: scenario_c(args.results, args.outage, control), "d": lambda: scenario_d(args.results),
        "e": lambda: scenario_e(args.results), "f": lambda: scenario_f(args.results),
        "g": lambda: scenario_g(args.results), "h": lambda: scenario_h(args.results),
        "i": lambda: scenario_i(args.results), "j": lambda: scenario_j(args.results),
        "k": lambda: scenario_k(args.results, skewed)}
    (args.results / "imported_s").write_text(f"{time.monotonic():.2f}\n")
    # the native lane's kernels, compiled here before any node starts: an engine made while they
    # compile runs its first jobs on the Python threads (the lane starts at a job once they are)
    from tierstore.native import loader as native

    started = time.monotonic()
    ready = native.start(wait=True)
    (args.results / "native.json").write_text(json.dumps(
        {"ready": ready, "failure": native.failure(), "compile_s": round(time.monotonic() - started, 1)}))
    # scenario c's control: started now, so its imports overlap the scenarios before c
    control = ControlProcess(PAGE_SEEDS["c"], args.results / "control.stderr") if "c" in args.only else None
    skewed = SkewedProcess(PAGE_SEEDS["k"], args.results / "skewed.stderr") if "k" in args.only else None
    for name in args.only.split(","):
        started = time.monotonic()
        capture = LogCapture()
        logging.getLogger("tierstore").addHandler(capture)
        try:
            out = scenarios[name]()
        except Exception:  # one scenario's crash is its result; the others still run
            out = {"crashed": traceback.format_exc()}
        logging.getLogger("tierstore").removeHandler(capture)
        out["log"] = {"warnings": capture.count, "shared_down": capture.shared_down,
                      "shared_back": capture.shared_back, "first": capture.lines}
        out["seconds"] = round(time.monotonic() - started, 1)
        (args.results / f"{name}.json").write_text(json.dumps(out, indent=1, default=str))
        print(f"scenario {name}: {out['seconds']} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
