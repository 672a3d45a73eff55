"""``tierstore bench lookup``: scheduler-thread cost of page lookups at 10^6 indexed pages.

In one run, on each target file system (``local``: a local directory; ``sshfs``: the sshfs
stand-in of tests/nfs_standin.py over the same directory; ``lat1`` / ``lat10``: the FUSE
passthrough of tools/latency_fs.py at 1 ms / 10 ms per operation; ``hung``: that passthrough at
10 ms, stopped with SIGSTOP once the index is loaded, so the shared tier goes down), the same
keys (half stored pages, half absent) are looked up from the calling thread, as vLLM's
scheduler does:

- ``index-1st``: ``TierStoreManager.lookup`` answering from its loaded ``PageIndex``, each key
  seen for the first time (``reset_cache`` before; the full path: hash, index, bookkeeping);
- ``index-again``: the same keys again (a key answered HIT is a set hit until a page leaves an
  index; absent keys take the full path again);
- ``stat``: a plain ``os.stat`` loop over the page paths (the floor of any stat-based lookup);
- ``old_sync``: the previous manager's path, one ``stat`` through a 2-thread pool waited for
  under the deadline (``shared_deadline_s``).

Per way: median and p99 of the per-call time (each call timed alone), lookups/s (a loop timed
as a whole), and 4,096 lookups at that rate. Ratios are baseline over ``index-1st`` (higher:
the index is better). Per target also the index's first load time (background; engine start
does not wait for it).

The 32k-token request (16-token pages, two KV-cache groups: 2 x 2,048 keys, every page stored)
is driven through the scheduler's prefix loop, events off, and then ``prepare_load`` of its
4,096 keys: vLLM's own loop (``OffloadingConnectorScheduler._maximal_prefix_lookup``, one
``lookup`` per key) with a manager that answers HIT at once (vLLM's share: its loop and the
calls) and with ours, and the loop the connector uses (``TierStoreConnectorScheduler``: one
``lookup_prefix`` per group), on first sight and again (wall clock and the scheduler thread's
CPU time, robust to other processes on a loaded machine). Memory of the index (tracemalloc, bytes per page)
once, on the local directory.

The page tree (empty files under the real names: lookups only see names) is made once in
``--work`` and reused. Run: ``tierstore bench lookup --work DIR [--pages N] [--json]``.
Threading: the benchmark drives its own threads and processes; nothing here is used by the
library.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tierstore.fs.mapper import FileMapper
from tierstore.index.index_prober import file_identity
from tierstore.index.page_index import PageIndex

NS = "bench-lookup"
REQUEST_LOOKUPS = 4096  # a 32k-token prompt, 16-token pages, two KV-cache groups
REPO = Path(__file__).resolve().parents[2]


def page_key(i: int) -> bytes:
    return i.to_bytes(8, "big") * 4  # 32 bytes, like vLLM's block hashes


def make_tree(export: Path, pages: int) -> FileMapper:
    """``pages`` empty page files under ``export`` (made once; a marker records the count)."""
    mapper = FileMapper(export, NS, 0)
    marker = export / f".bench-lookup-{pages}"
    if marker.exists():
        return mapper
    mapper.make_fanout_dirs()
    for i in range(pages):
        os.close(os.open(mapper.path_for(page_key(i)), os.O_WRONLY | os.O_CREAT, 0o644))
    marker.touch()
    return mapper


def _percentile(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))]


def measure(fn: Callable[[Any], object], items: list[Any], reset: Callable[[], None] | None = None) -> dict[str, float]:
    """Per-call median / p99 (µs), calls per second, and 4,096 calls at that rate (ms).
    ``reset`` runs before each pass (the rate loop sees what the timed calls saw)."""
    per_call = []
    clock = time.perf_counter_ns
    if reset is not None:
        reset()
    for item in items:
        t0 = clock()
        fn(item)
        per_call.append((clock() - t0) / 1000.0)
    if reset is not None:
        reset()
    t0 = time.perf_counter()
    for item in items:
        fn(item)
    rate = len(items) / (time.perf_counter() - t0)
    return {"median_us": statistics.median(per_call), "p99_us": _percentile(per_call, 0.99),
            "lookups_per_s": rate, "request_32k_ms": REQUEST_LOOKUPS / rate * 1000.0}


REQUEST_GROUPS = 2  # vLLM groups of the 32k request (both map to the tree's tierstore group)
SHORT_PREFIX = 16  # stored pages per group of the "short prefix" request (the rest are new)


def bench_target(name: str, root: Path, pages: int, n_keys: int, n_slow: int,
                 freeze: Callable[[], None] | None = None, kv_heads: int = 0) -> dict[str, Any]:
    """One target: index lookups (first sight, again), the 32k request, and (unless ``freeze``
    hangs the mount: ``hung``) the stat baselines. ``kv_heads`` > 0: the group is stored as
    head slices of that many KV heads (the default layout of attention models: the tree's
    ``r0`` plus every other TP's slice directory, here empty), read at TP=1."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key

    from tierstore.format.head_slices import HeadRange, slice_mappers, tp_slices
    from tierstore.index.indexed_lookup import SliceGroup
    from tierstore.vllm.manager import TierStoreManager

    mapper = FileMapper(root, NS, 0)
    mappers: list[Any] = [mapper]
    slices = None
    if kv_heads:
        have = tuple(tp_slices(kv_heads))
        mappers = [slice_mappers(root, NS, 0, kv_heads)]
        slices = [SliceGroup(have, (HeadRange(0, kv_heads),))]
    t0 = time.perf_counter()
    manager = TierStoreManager(mappers, {g: 0 for g in range(REQUEST_GROUPS)}, [16], [False], index_refresh_s=0,
                               shared_deadline_s=1.0 if freeze else 30.0, slices=slices)
    ready_s = time.perf_counter() - t0  # what engine start waits for
    while not manager.pages.loaded:
        time.sleep(0.01)
    load_s = time.perf_counter() - t0
    ctx = ReqContext("bench")
    if freeze is not None:
        freeze()  # the server stops answering: a failed load's probe passes the deadline, the tier goes down
        manager.mark_failed(make_offload_key(page_key(1), 0), "timeout")
        manager.on_schedule_end(None)
        while manager.pages.shared_up:
            time.sleep(0.01)
    half = n_keys // 2
    keys = [page_key(i * (pages // half)) for i in range(half)] + [page_key(pages + i) for i in range(half)]
    offload_keys = [make_offload_key(k, 0) for k in keys]
    manager.reset_cache()
    first = measure(lambda k: manager.lookup(k, ctx), offload_keys, reset=manager.reset_cache)
    again = measure(lambda k: manager.lookup(k, ctx), offload_keys)
    hits = sum(manager.lookup(k, ctx) is LookupResult.HIT for k in offload_keys)
    request = request_cost(manager, pages, ctx)
    out: dict[str, Any] = {"target": name, "pages": pages, "index_ready_s": ready_s, "index_load_s": load_s,
                           "hits": hits, "keys": len(keys), "index-1st": first, "index-again": again,
                           "request_32k": request, "shared_up": manager.pages.shared_up}
    manager.shutdown()
    if freeze is None and not kv_heads:
        out["refresh"] = refresh_cost(mapper.base)
    ways = []
    if freeze is None:
        slow = keys[: n_slow // 2] + keys[half : half + n_slow // 2]
        paths = [mapper.path_for(k) for k in slow]
        out["stat"] = measure(_stat, paths)
        pool = ThreadPoolExecutor(max_workers=2)
        out["old_sync"] = measure(lambda k: pool.submit(file_identity, mapper.path_for(k)).result(timeout=30.0), slow)
        pool.shutdown()
        out["baseline_keys"] = len(slow)
        ways += ["stat", "old_sync"]
    out["ratios"] = {f"{base}_over_index": {
        "median": out[base]["median_us"] / first["median_us"],
        "lookups_per_s": first["lookups_per_s"] / out[base]["lookups_per_s"]} for base in ways}
    return out


class _Events:
    """vLLM's events tracker with KV events off (the default): ``record_lookup`` returns."""

    def __init__(self) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (
            OffloadingEventsTracker,
        )
        from vllm.v1.kv_offload.base import OffloadingKVEventsConfig

        self.tracker = OffloadingEventsTracker(OffloadingKVEventsConfig(False, False))


class _AlwaysHit:
    """A manager that answers HIT at once: what vLLM's loop costs by itself."""

    def __init__(self) -> None:
        from vllm.v1.kv_offload.base import LookupResult

        self.hit = LookupResult.HIT

    def lookup(self, key: bytes, req_context: object) -> object:
        return self.hit

    def prepare_load(self, keys: object, req_context: object) -> None:
        return None

    def reset_cache(self) -> None:
        return None


def request_cost(manager: Any, pages: int, ctx: Any, repeats: int = 15) -> dict[str, float]:
    """Scheduler time (ms, median of ``repeats``) of a 32k-token request whose pages are all
    stored: the prefix loop per group, then ``prepare_load`` of every key. Loops: vLLM's own
    (``OffloadingConnectorScheduler``, one ``lookup`` per key) with a manager that answers HIT
    at once (vLLM's share) and with ours, and tierstore's (``TierStoreConnectorScheduler``:
    one ``lookup_prefix`` per group), each on first sight and again. Also a request whose
    first ``SHORT_PREFIX`` pages per group are stored and the rest are new (a shared system
    prompt, then a new document: the common first sight), on first sight, both loops."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
        OffloadingConnectorScheduler,
    )
    from vllm.v1.kv_offload.base import make_offload_key

    from tierstore.vllm.scheduler import TierStoreConnectorScheduler

    per_group = REQUEST_LOOKUPS // REQUEST_GROUPS
    hashes = [page_key(i * (pages // per_group) + 1) for i in range(per_group)]
    groups = [[make_offload_key(h, g) for h in hashes] for g in range(REQUEST_GROUPS)]
    new_doc = [page_key(pages + 1_000_000 + i) for i in range(per_group - SHORT_PREFIX)]
    short = [[make_offload_key(h, g) for h in hashes[:SHORT_PREFIX] + new_doc] for g in range(REQUEST_GROUPS)]
    # The methods' ``self``: the parts of a scheduler they read.
    loop = SimpleNamespace(_events_tracker=_Events().tracker, manager=None)

    def one(prefix: Callable[..., int | None], mgr: Any, fresh: bool,
            request: list[list[bytes]]) -> tuple[float, float, float]:
        if fresh:
            mgr.reset_cache()
        loop.manager = mgr
        c0, w0 = time.thread_time(), time.perf_counter()
        found = sum(prefix(loop, keys, ctx, None, None, 0) or 0 for keys in request)
        w1, c1 = time.perf_counter(), time.thread_time()
        mgr.prepare_load([k for keys in request for k in (keys if request is groups else keys[:SHORT_PREFIX])], ctx)
        w2 = time.perf_counter()
        want = REQUEST_LOOKUPS if request is groups else REQUEST_GROUPS * SHORT_PREFIX
        if found != want and mgr is manager and manager.pages.shared_up:
            raise RuntimeError(f"the 32k request found {found} of {want} pages")
        return (w1 - w0) * 1000.0, (c1 - c0) * 1000.0, (w2 - w1) * 1000.0

    def median_of(prefix: Callable[..., int | None], mgr: Any, fresh: bool,
                  request: list[list[bytes]] = groups) -> tuple[float, float, float]:
        runs = [one(prefix, mgr, fresh, request) for _ in range(repeats)]
        return tuple(statistics.median(r[i] for r in runs) for i in range(3))  # type: ignore[return-value]

    vllm_loop = OffloadingConnectorScheduler._maximal_prefix_lookup
    ours = TierStoreConnectorScheduler._maximal_prefix_lookup
    out: dict[str, float] = {}
    out["vllm_loop_ms"], out["vllm_loop_cpu_ms"], _ = median_of(vllm_loop, _AlwaysHit(), False)
    for name, prefix in (("perkey", vllm_loop), ("batched", ours)):
        out[f"{name}_first_ms"], out[f"{name}_first_cpu_ms"], load_ms = median_of(prefix, manager, True)
        out[f"{name}_again_ms"], out[f"{name}_again_cpu_ms"], _ = median_of(prefix, manager, False)
        out["prepare_load_ms"] = load_ms
        out[f"{name}_short_ms"], out[f"{name}_short_cpu_ms"], _ = median_of(prefix, manager, True, short)
    return out


def _stat(path: Path) -> None:
    with contextlib.suppress(OSError):
        os.stat(path)


def refresh_cost(base: Path, refresh_s: float = 30.0) -> dict[str, float]:
    """The index's metadata load on the file server when nothing changed: a refresh that lists
    every fan-out directory (``FULL_RELIST_EVERY`` 1: the code before the unchanged-directory
    rule) against one that stats them and lists only those that changed. Per refresh, averaged
    over ``FULL_RELIST_EVERY`` refreshes (so the periodic full listing is in): readdirs,
    directory entries read, stats, and the median seconds; per minute at ``index_refresh_s`` =
    ``refresh_s``."""
    from tierstore.index import page_index

    counts = {"readdir": 0, "entries": 0, "stat": 0}
    real_list, real_sig = page_index.list_fingerprints, page_index.dir_signature

    def counted_list(directory: Any, fanout_index: int) -> memoryview:
        counts["readdir"] += 1
        out = real_list(directory, fanout_index)
        counts["entries"] += len(out)
        return out

    def counted_sig(directory: str) -> Any:
        counts["stat"] += 1
        return real_sig(directory)

    out: dict[str, float] = {}
    page_index.list_fingerprints, page_index.dir_signature = counted_list, counted_sig  # type: ignore[assignment]
    every = rounds = page_index.FULL_RELIST_EVERY
    try:
        for way, relist_every in (("list_all", 1), ("changed_only", every)):
            page_index.FULL_RELIST_EVERY = relist_every
            index = PageIndex(base)
            index.load_all()  # the first listing (engine start), not counted
            times = []
            for k in counts:
                counts[k] = 0
            for _ in range(rounds):
                t0 = time.perf_counter()
                index.load_all()
                times.append(time.perf_counter() - t0)
            per = {k: v / rounds for k, v in counts.items()}
            out.update({f"{way}_{k}": v for k, v in per.items()})
            out[f"{way}_s"] = statistics.median(times)
            # the code before the rule listed every directory and stat'ed none
            ops = per["readdir"] + (per["stat"] if way == "changed_only" else 0)
            out[f"{way}_ops_per_min"] = ops * 60 / refresh_s
            out[f"{way}_entries_per_min"] = per["entries"] * 60 / refresh_s
    finally:
        page_index.list_fingerprints, page_index.dir_signature = real_list, real_sig  # type: ignore[assignment]
        page_index.FULL_RELIST_EVERY = every
    return out


def index_memory(root: Path) -> dict[str, float]:
    """Bytes the loaded index holds per page (tracemalloc: arrays and Python objects)."""
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    index = PageIndex(FileMapper(root, NS, 0).base)
    t0 = time.perf_counter()
    index.load_all()
    seconds = time.perf_counter() - t0
    after = tracemalloc.take_snapshot()
    _cur, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    held = sum(s.size_diff for s in after.compare_to(before, "filename"))
    n = len(index)
    return {"pages": n, "bytes_per_page": held / max(n, 1), "peak_bytes_per_page": peak / max(n, 1),
            "load_s_traced": seconds}


@contextlib.contextmanager
def mounted(target: str, work: Path) -> Iterator[tuple[Path, Callable[[], None] | None]]:
    """The target's root and, for ``hung``, a function that stops its server (SIGSTOP; it is
    resumed before the unmount)."""
    export = work / "export"
    if target == "local":
        yield export, None
        return
    if target == "sshfs":
        sys.path.insert(0, str(REPO / "tests"))
        from nfs_standin import TwoNodeMount  # type: ignore[import-not-found]

        with TwoNodeMount(work) as fs:
            yield fs.a, None
        return
    delay_ms = 10.0 if target == "hung" else float(target.removeprefix("lat"))
    mnt = work / f"mnt-{target}"
    mnt.mkdir(exist_ok=True)
    proc = subprocess.Popen([sys.executable, str(REPO / "tools" / "latency_fs.py"), str(export), str(mnt),
                             "--delay-ms", str(delay_ms)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not os.path.ismount(mnt):
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"the latency stand-in did not mount at {mnt} (needs /dev/fuse and mfusepy)")
            time.sleep(0.05)
        yield mnt, (lambda: proc.send_signal(signal.SIGSTOP)) if target == "hung" else None
    finally:
        proc.send_signal(signal.SIGCONT)
        for _ in range(100):  # calls stuck in the stopped server finish first
            if subprocess.run(["fusermount3", "-u", str(mnt)], check=False, stderr=subprocess.DEVNULL).returncode == 0:
                break
            time.sleep(0.1)
        else:
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], check=False)
        proc.wait(timeout=30)


WAYS = ("index-1st", "index-again", "stat", "old_sync")


def print_table(results: list[dict[str, Any]], memory: dict[str, float] | None) -> None:
    print(f"{'target':8} {'way':11} {'median µs':>10} {'p99 µs':>10} {'lookups/s':>12} {'4096 ms':>9} "
          f"{'x median':>9} {'x rate':>8}")
    for r in results:
        for way in WAYS:
            if way not in r:
                continue
            m = r[way]
            ratio = r["ratios"].get(f"{way}_over_index")
            vs = f"{ratio['median']:9.1f} {ratio['lookups_per_s']:8.1f}" if ratio else ""
            print(f"{r['target']:8} {way:11} {m['median_us']:10.2f} {m['p99_us']:10.2f} {m['lookups_per_s']:12,.0f} "
                  f"{m['request_32k_ms']:9.2f} {vs}".rstrip())
        q = r["request_32k"]
        print(f"{r['target']:8} 32k request (2x2048 keys), ms, wall / scheduler-thread CPU: vLLM's loop alone "
              f"{q['vllm_loop_ms']:.2f} / {q['vllm_loop_cpu_ms']:.2f}; prepare_load {q['prepare_load_ms']:.2f}")
        for name, label in (("perkey", "vLLM's loop + tierstore lookup"), ("batched", "tierstore lookup_prefix")):
            print(f"{r['target']:8}   {label:31} first sight {q[f'{name}_first_ms']:6.2f} / "
                  f"{q[f'{name}_first_cpu_ms']:6.2f}, again {q[f'{name}_again_ms']:5.2f} / "
                  f"{q[f'{name}_again_cpu_ms']:5.2f}")
        print(f"{r['target']:8}   first sight per-key / batched: {q['perkey_first_ms'] / q['batched_first_ms']:.1f}x "
              f"(wall), {q['perkey_first_cpu_ms'] / max(q['batched_first_cpu_ms'], 1e-6):.1f}x (CPU)")
        print(f"{r['target']:8}   {SHORT_PREFIX} stored pages then a new document, first sight, ms (wall / CPU): "
              f"per-key {q['perkey_short_ms']:.3f} / {q['perkey_short_cpu_ms']:.3f}, batched "
              f"{q['batched_short_ms']:.3f} / {q['batched_short_cpu_ms']:.3f}")
        f = r.get("refresh")
        if f:
            print(f"{r['target']:8} index refresh of an unchanged tree (per refresh; per minute at 30 s): list all "
                  f"{f['list_all_readdir']:.0f} readdirs, {f['list_all_entries']:,.0f} "
                  f"entries, {f['list_all_s'] * 1000:.1f} ms ({f['list_all_ops_per_min']:.0f} ops/min); changed only "
                  f"{f['changed_only_readdir']:.0f} readdirs + {f['changed_only_stat']:.0f} stats, "
                  f"{f['changed_only_entries']:,.0f} entries, {f['changed_only_s'] * 1000:.1f} ms "
                  f"({f['changed_only_ops_per_min']:.0f} ops/min)")
        down = "" if r["shared_up"] else "; shared tier down (MISS at once)"
        print(f"{r['target']:8} index ready (constructor) {r['index_ready_s'] * 1000:.1f} ms, first load "
              f"{r['index_load_s']:.2f} s at {r['pages']:,} pages; hits {r['hits']}/{r['keys']}{down}")
    if memory:
        print(f"index memory: {memory['bytes_per_page']:.1f} bytes/page held, {memory['peak_bytes_per_page']:.1f} "
              f"peak during load ({memory['pages']:,} pages, tracemalloc)")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--work", type=Path, required=True, help="scratch directory (the page tree is kept there)")
    ap.add_argument("--pages", type=int, default=1_000_000)
    ap.add_argument("--keys", type=int, default=20_000, help="keys looked up through the index")
    ap.add_argument("--baseline-keys", type=int, default=2_000,
                    help="keys for the stat baselines on local/sshfs (latency targets: 200 at 1 ms, 40 at 10 ms)")
    ap.add_argument("--targets", default="local,sshfs,lat1,lat10,hung")
    ap.add_argument("--no-memory", action="store_true", help="skip the tracemalloc measurement")
    ap.add_argument("--kv-heads", type=int, default=0,
                    help="look up a head-sliced group of this many KV heads (attention models' default "
                         "layout: one index per slice directory any TP writes); 0: one directory")
    ap.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    args.work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    make_tree(args.work / "export", args.pages)
    print(f"page tree: {args.pages:,} pages ready in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    memory = None if args.no_memory else index_memory(args.work / "export")
    results = []
    print(f"load: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f} "
          f"(1/5/15 min) on {os.cpu_count()} CPUs", file=sys.stderr)
    for target in args.targets.split(","):
        n_slow = {"lat1": 200, "lat10": 40}.get(target, args.baseline_keys)
        with mounted(target, args.work) as (root, freeze):
            results.append(bench_target(target, root, args.pages, args.keys, n_slow, freeze, args.kv_heads))
    if args.json:
        print(json.dumps({"tierstore_bench_lookup": 1, "memory": memory, "results": results}, indent=2))
    else:
        print_table(results, memory)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tierstore bench lookup", description=__doc__.splitlines()[0])
    add_arguments(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
