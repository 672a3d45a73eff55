"""The kernel-NFS scenarios, run inside the QEMU guest (tierstore/testing/nfs_guest.py) by
tests/nfs_kernel/test_kernel_nfs.py: one process, so torch (the engine's staging memory, 30-80 s
to import under emulation) is imported once for all of them.

Each "node" is a TierChain on its own kernel NFS mount of one export: node A on an NFSv3 mount
(``nosharecache``: its own superblock, so its own attribute, lookup and page caches), node B on an
NFSv4.2 mount. Two mounts are two NFS clients as far as caching goes, whichever process uses them.
Every loaded page is compared with the bytes it must have; each scenario writes
RESULTS/<scenario>.json with its counts and timings (the test asserts on them).

    python tests/nfs_kernel/node.py --results DIR [--only a_concurrent,b_rmtree,...]
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
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared node helpers

from nfs_node_worker import namespace  # noqa: E402  (the sshfs stand-in's node namespace)
from tiers_helpers import expected, key  # noqa: E402

from tierstore.config import TierStoreConfig  # noqa: E402
from tierstore.errors import BAD_CONTENT_KINDS  # noqa: E402
from tierstore.metrics import MetricsRegistry  # noqa: E402
from tierstore.testing import nfs_guest  # noqa: E402
from tierstore.tiers import TierChain  # noqa: E402
from tierstore.tiers.chain import page_file_size  # noqa: E402

V3 = "vers=3,nosharecache,nolock"
V42 = "vers=4.2,nosharecache"
# variants of scenario a: the caching options under test, added to both nodes' mounts
CACHING = {"default": "", "lookupcache_positive": "lookupcache=positive", "actimeo0": "actimeo=0"}
DEADLINE_S = 2.0  # deadline_s of scenario c's engines (shared_deadline_s: they have a local tier)
# the other scenarios' lone roots: the default deadline_s. Opening a lone root on a fresh export
# (256 fan-out mkdirs over NFS) takes more than 2 s under emulation, and a lone root that does not
# open within its deadline refuses to start.
LONE_ROOT_DEADLINE_S = 10.0
WAIT_S = 120.0  # how long a caller waits for one result: far past any deadline, to see overruns
RECOVERY_LIMIT_S = 45.0  # scenario d: how long stores may stay off once the export has space again
PAGE_SEEDS = {"a": 10, "b": 20, "c": 30, "d": 40}  # disjoint key sets per scenario


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
                 deadline_s: float = DEADLINE_S) -> None:
        self.name, self.root = name, root
        root.mkdir(parents=True, exist_ok=True)
        self.deadline_s = deadline_s
        cfg: dict[str, Any] = {"root": str(root), "deadline_s": deadline_s}
        if local is not None:
            local.mkdir(parents=True, exist_ok=True)
            cfg.update(local_root=str(local), local_max_bytes=local_pages * page_file_size(namespace(), 0),
                       shared_deadline_s=deadline_s, shared_touch_interval_s=0.5)
        self.metrics = MetricsRegistry()
        started = time.monotonic()
        self.store_ = TierChain(TierStoreConfig.from_dict(cfg), namespace(), 0, metrics=self.metrics)
        self.open_s = time.monotonic() - started
        self.lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.failures: Counter[str] = Counter()  # "load:kind" / "store:kind"
        self.errnos: Counter[str] = Counter()  # errno names of failures (ESTALE among them)
        self.longest_s = {"load": 0.0, "store": 0.0}
        self.late: list[dict[str, Any]] = []  # calls that returned past deadline + 1 s

    def _note(self, op: str, started: float, ok: bool, error: Any) -> float:
        took = time.monotonic() - started
        with self.lock:
            self.longest_s[op] = max(self.longest_s[op], took)
            if took > self.deadline_s + 1.0:
                self.late.append({"op": op, "seconds": round(took, 2), "ok": ok,
                                  "kind": None if error is None else error.kind})
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
        res = st.wait([st.submit_store(k, slot, 64)], WAIT_S)
        r = res[0] if res else None
        self._note("store", started, bool(r and r.ok), r.error if r else None)
        with self.lock:
            self.counts["stores"] += 1
            self.counts["stores_ok" if r and r.ok else "stores_failed"] += 1
        if r is None:
            return False, "no_result"
        return r.ok, None if r.ok else r.error.kind

    def load(self, i: int, seed: int) -> str:
        """Load page ``key(i, seed)``: "hit", "wrong" (bytes differ: must never happen), "miss"
        or the failure's kind ("no_result" when nothing came back within WAIT_S)."""
        st, k = self.store_, key(i, seed)
        started = time.monotonic()
        res = st.wait([st.submit_load(k)], WAIT_S)
        r = res[0] if res else None
        self._note("load", started, bool(r and r.ok), r.error if r and not r.ok else None)
        if r is None:
            outcome = "no_result"
        elif r.ok:
            good = bytes(r.slot.view) == expected(st, k)
            st.release_slot(r.slot)
            outcome = "hit" if good else "wrong"
        else:
            outcome = "miss" if r.error.kind == "missing" else r.error.kind
        with self.lock:
            self.counts["loads"] += 1
            self.counts[outcome] += 1
        return outcome

    def summary(self) -> dict[str, Any]:
        tiers = {t: {k: v for k, v in m.items() if not k.endswith("_seconds")}
                 for t, m in self.metrics.snapshot().items()}
        with self.lock:
            rejected = sum(v for k, v in self.failures.items() if k.split(":")[1] in BAD_CONTENT_KINDS)
            return {"counts": dict(self.counts), "failures": dict(self.failures), "errnos": dict(self.errnos),
                    "estale": self.errnos.get("ESTALE", 0), "bad_content_rejected": rejected,
                    "longest_s": {k: round(v, 3) for k, v in self.longest_s.items()}, "late": self.late[:20],
                    "late_count": len(self.late), "open_s": round(self.open_s, 2), "tiers": tiers}

    def close(self) -> None:
        self.store_.flush(60)
        self.store_.close(60)


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
    torch). Its JSON pass reports are collected by a reader thread."""

    def __init__(self, root: Path, cap: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tierstore", "gc", str(root), "--max-bytes", str(cap),
             "--loop", "0.3", "--json", "--lease-ttl", "5"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.passes: list[dict[str, Any]] = []
        self.first_pass = threading.Event()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.passes.append(json.loads(line))
                self.first_pass.set()

    def stop(self) -> dict[str, Any]:
        self.proc.terminate()  # the gc this scenario started
        _out, err = self.proc.communicate(timeout=60)
        self.reader.join(10)
        active = [p for p in self.passes if not p.get("busy") and "error" not in p]
        return {"passes": len(self.passes), "active": len(active), "rc": self.proc.returncode,
                "evicted": sum(p.get("evicted", 0) for p in active),
                "vanished": sum(p.get("vanished", 0) for p in active),
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
        nodes[variant] = (Node("a", ma / f"a_{variant}", deadline_s=LONE_ROOT_DEADLINE_S),
                          Node("b", mb / f"a_{variant}", deadline_s=LONE_ROOT_DEADLINE_S))
    page = page_file_size(namespace(), 0)
    n_keys, cap, seconds = 48, 12 * page, 30.0  # the cap: a quarter of the key set
    a, b = nodes["default"]
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
    a = Node("a", ma / "b_root", deadline_s=LONE_ROOT_DEADLINE_S)
    b = Node("b", mb / "b_root", deadline_s=LONE_ROOT_DEADLINE_S)
    stored = sum(a.store(i, seed)[0] for i in range(pages))
    before_ok, before = _all_hit(b, pages, seed)
    removed = [p.name for p in b.root.iterdir() if p.is_dir() and not p.name.startswith(".")]
    for name in removed:
        shutil.rmtree(b.root / name)  # node B's client: the operator's rm -rf
    b_new = Node("b_new", mb / "b_root", deadline_s=LONE_ROOT_DEADLINE_S)
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
           "nodes": {n.name: n.summary() for n in (a, b, b_new)}}
    for n in (a, b, b_new):
        n.close()
    return out


def scenario_c(results: Path, outage_s: float) -> dict[str, Any]:
    """The server stopped for ``outage_s`` under load: node A on a soft v3 mount, node B on a hard
    v4.2 mount, each a fleet chain (local + shared tier). No call may return later than its
    deadline + 1 s; failures typed; recovery time once the server is back."""
    seed, own = PAGE_SEEDS["c"], 16
    ma = mounted(nfs_guest.EXPORT, "a3_soft", f"{V3},soft,timeo=10,retrans=1")
    mb = mounted(nfs_guest.EXPORT, "b42_hard", f"{V42},hard")
    local = Path("/var/tmp/nfs_kernel_local")
    a = Node("a", ma / "c_root", local / "a")
    b = Node("b", mb / "c_root", local / "b")
    for i in range(own):
        a.store(i, seed)
        b.store(own + i, seed)
    timeline: dict[str, float] = {}
    events: dict[str, list[tuple[float, str, str]]] = {"a": [], "b": []}
    stop = threading.Event()
    t0 = time.monotonic()

    def loads(node: Node, other: range) -> None:
        rng = random.Random(node.name)
        while not stop.is_set():
            outcome = node.load(rng.choice(other), seed)
            events[node.name].append((time.monotonic() - t0, "load", outcome))
            time.sleep(0.05)

    def stores(node: Node, base: int) -> None:
        i = base
        while not stop.is_set():
            ok, kind = node.store(i, seed)
            events[node.name].append((time.monotonic() - t0, "store", "ok" if ok else str(kind)))
            i += 1
            time.sleep(0.2)

    threads = [threading.Thread(target=loads, args=(a, range(own, 2 * own))),
               threading.Thread(target=loads, args=(b, range(own))),
               threading.Thread(target=stores, args=(a, 1000)),
               threading.Thread(target=stores, args=(b, 2000))]
    for t in threads:
        t.start()
    time.sleep(5)
    timeline["stopped"] = time.monotonic() - t0
    nfs_guest.server_stop()
    time.sleep(outage_s)
    timeline["restarted"] = time.monotonic() - t0
    nfs_guest.server_start()
    recovered: dict[str, dict[str, float | None]] = {}
    limit = timeline["restarted"] + 60.0
    while time.monotonic() - t0 < limit:
        recovered = {n: {op: next((round(t - timeline["restarted"], 2) for t, o, what in events[n]
                                   if t > timeline["restarted"] and o == op and what in ("hit", "ok")), None)
                         for op in ("load", "store")} for n in events}
        if all(v is not None for r in recovered.values() for v in r.values()):
            break
        time.sleep(0.5)
    stop.set()
    for t in threads:
        t.join(WAIT_S)
    during = {n: dict(Counter(f"{op}:{what}" for t, op, what in ev
                              if timeline["stopped"] <= t <= timeline["restarted"])) for n, ev in events.items()}
    out = {"outage_s": outage_s, "deadline_s": DEADLINE_S, "timeline": {k: round(v, 2) for k, v in timeline.items()},
           "outcomes_during_outage": during, "recovered_after_restart_s": recovered,
           "threads_stuck": sum(t.is_alive() for t in threads),
           "nodes": {n.name: n.summary() for n in (a, b)},
           "shared_up_at_end": {n.name: n.store_.stats.get("shared_up") for n in (a, b)},
           # down/up changes of each shared tier: 2 per outage when its probe tells the truth
           "health_transitions": {n.name: n.store_.shared.health.transitions for n in (a, b)}}
    for n in (a, b):
        n.close()
    return out


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


def scenario_d(results: Path) -> dict[str, Any]:
    """A full export (a size-capped tmpfs): stores must fail typed `enospc`, loads of existing
    pages still verify, nothing wrong is served; what the engine reports; recovery once freed."""
    seed, pages = PAGE_SEEDS["d"], 16
    ma = mounted(nfs_guest.SMALL_EXPORT, "sa3", V3)
    mb = mounted(nfs_guest.SMALL_EXPORT, "sb42", V42)
    capture = LogCapture()
    logging.getLogger("tierstore").addHandler(capture)
    a = Node("a", ma / "d_root", deadline_s=LONE_ROOT_DEADLINE_S)
    b = Node("b", mb / "d_root", deadline_s=LONE_ROOT_DEADLINE_S)
    stored = sum(a.store(i, seed)[0] for i in range(pages))
    filler = Path(nfs_guest.SMALL_EXPORT) / "filler"
    filled = _fill(filler)
    full_stores = {n.name: Counter(n.store(100 * (k + 1) + i, seed)[1] or "ok" for i in range(8))
                   for k, n in enumerate((a, b))}
    loads_full = {n.name: Counter(n.load(i, seed) for i in range(pages)) for n in (a, b)}
    filler.unlink()
    freed = time.monotonic()
    # once space is freed: a store per node every second until one succeeds (a back-off after
    # ENOSPC may hold stores off for a while; how long is the figure)
    after: dict[str, Counter[str]] = {n.name: Counter() for n in (a, b)}
    stores_again_s: dict[str, float | None] = {n.name: None for n in (a, b)}
    i = 0
    while time.monotonic() - freed < RECOVERY_LIMIT_S and None in stores_again_s.values():
        for k, n in enumerate((a, b)):
            if stores_again_s[n.name] is None:
                ok, kind = n.store(1000 * (k + 1) + i, seed)
                after[n.name][kind or "ok"] += 1
                if ok:
                    stores_again_s[n.name] = round(time.monotonic() - freed, 2)
        i += 1
        time.sleep(1.0)
    logging.getLogger("tierstore").removeHandler(capture)
    out = {"pages": pages, "stored_before": stored, "filler_bytes": filled,
           "stores_while_full": {k: dict(v) for k, v in full_stores.items()},
           "loads_while_full": {k: dict(v) for k, v in loads_full.items()},
           "stores_after_freeing": {k: dict(v) for k, v in after.items()},
           "stores_again_after_freeing_s": stores_again_s, "recovery_limit_s": RECOVERY_LIMIT_S,
           "log_lines": capture.lines, "nodes": {n.name: n.summary() for n in (a, b)}}
    for n in (a, b):
        n.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--results", required=True, type=Path)
    ap.add_argument("--only", default="a,b,c,d", help="comma-separated scenario letters")
    ap.add_argument("--outage", type=float, default=30.0, help="seconds the server stays stopped (c)")
    args = ap.parse_args()
    scenarios: dict[str, Callable[[], dict[str, Any]]] = {
        "a": lambda: scenario_a(args.results), "b": lambda: scenario_b(args.results),
        "c": lambda: scenario_c(args.results, args.outage), "d": lambda: scenario_d(args.results)}
    (args.results / "imported_s").write_text(f"{time.monotonic():.2f}\n")
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
