"""``tierstore bench lookup``: scheduler-thread cost of page lookups at 10^6 indexed pages.

In one run, on each target file system (``local``: a local directory; ``sshfs``: the sshfs
stand-in of tests/nfs_standin.py over the same directory; ``lat1`` / ``lat10``: the FUSE
passthrough of tools/latency_fs.py at 1 ms / 10 ms per operation), the same keys (half stored
pages, half absent) are looked up three ways from the calling thread, as vLLM's scheduler does:

- ``index``: ``TierStoreManager.lookup`` answering from its loaded ``PageIndex``;
- ``stat``: a plain ``os.stat`` loop over the page paths (the floor of any stat-based lookup);
- ``old_sync``: the previous manager's path, one ``stat`` through a 2-thread pool waited for
  under the deadline (``shared_deadline_ms``).

Per way: median and p99 of the per-call time (each call timed alone), lookups/s (a loop timed
as a whole), and the scheduler time of a 32k-token request (4,096 lookups: 16-token pages,
two KV-cache groups). Ratios are baseline over index (higher: the index is better). Per target
also the index's first load time (background; engine start does not wait for it). Memory of
the index (tracemalloc, bytes per page) once, on the local directory.

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
import statistics
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tierstore.mapper import FileMapper
from tierstore.page_index import PageIndex
from tierstore.tiers.indexed_lookup import file_identity

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


def measure(fn: Callable[[Any], object], items: list[Any]) -> dict[str, float]:
    """Per-call median / p99 (µs), calls per second, and a 32k-token request's time (ms)."""
    per_call = []
    clock = time.perf_counter_ns
    for item in items:
        t0 = clock()
        fn(item)
        per_call.append((clock() - t0) / 1000.0)
    t0 = time.perf_counter()
    for item in items:
        fn(item)
    rate = len(items) / (time.perf_counter() - t0)
    return {"median_us": statistics.median(per_call), "p99_us": _percentile(per_call, 0.99),
            "lookups_per_s": rate, "request_32k_ms": REQUEST_LOOKUPS / rate * 1000.0}


def bench_target(name: str, root: Path, pages: int, n_keys: int, n_slow: int) -> dict[str, Any]:
    from vllm.v1.kv_offload.base import ReqContext, make_offload_key

    from tierstore.vllm.manager import TierStoreManager

    mapper = FileMapper(root, NS, 0)
    t0 = time.perf_counter()
    manager = TierStoreManager([mapper], {0: 0}, [16], [False], index_refresh_s=0, shared_deadline_s=30.0)
    ready_s = time.perf_counter() - t0  # what engine start waits for
    while not manager.pages.loaded:
        time.sleep(0.01)
    load_s = time.perf_counter() - t0
    half = n_keys // 2
    keys = [page_key(i * (pages // half)) for i in range(half)] + [page_key(pages + i) for i in range(half)]
    ctx = ReqContext("bench")
    offload_keys = [make_offload_key(k, 0) for k in keys]
    index = measure(lambda k: manager.lookup(k, ctx), offload_keys)
    hits = sum(manager.lookup(k, ctx).name == "HIT" for k in offload_keys)
    manager.shutdown()
    slow = keys[: n_slow // 2] + keys[half : half + n_slow // 2]
    paths = [mapper.path_for(k) for k in slow]
    stat = measure(_stat, paths)
    pool = ThreadPoolExecutor(max_workers=2)
    old = measure(lambda k: pool.submit(file_identity, mapper.path_for(k)).result(timeout=30.0), slow)
    pool.shutdown()
    out: dict[str, Any] = {"target": name, "pages": pages, "index_ready_s": ready_s, "index_load_s": load_s,
                           "hits": hits, "keys": len(keys), "baseline_keys": len(slow),
                           "index": index, "stat": stat, "old_sync": old}
    out["ratios"] = {f"{base}_over_index": {
        "median": out[base]["median_us"] / index["median_us"],
        "lookups_per_s": index["lookups_per_s"] / out[base]["lookups_per_s"]} for base in ("stat", "old_sync")}
    return out


def _stat(path: Path) -> None:
    with contextlib.suppress(OSError):
        os.stat(path)


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
def mounted(target: str, work: Path) -> Iterator[Path]:
    export = work / "export"
    if target == "local":
        yield export
        return
    if target == "sshfs":
        sys.path.insert(0, str(REPO / "tests"))
        from nfs_standin import TwoNodeMount  # type: ignore[import-not-found]

        with TwoNodeMount(work) as fs:
            yield fs.a
        return
    delay_ms = float(target.removeprefix("lat"))
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
        yield mnt
    finally:
        subprocess.run(["fusermount3", "-u", str(mnt)], check=False)
        proc.wait(timeout=30)


def print_table(results: list[dict[str, Any]], memory: dict[str, float] | None) -> None:
    print(f"{'target':8} {'way':9} {'median µs':>10} {'p99 µs':>10} {'lookups/s':>12} {'32k req ms':>11} "
          f"{'x median':>9} {'x rate':>8}")
    for r in results:
        for way in ("index", "stat", "old_sync"):
            m = r[way]
            ratio = r["ratios"].get(f"{way}_over_index", {})
            print(f"{r['target']:8} {way:9} {m['median_us']:10.2f} {m['p99_us']:10.2f} {m['lookups_per_s']:12,.0f} "
                  f"{m['request_32k_ms']:11.2f} {ratio.get('median', 1.0):9.1f} {ratio.get('lookups_per_s', 1.0):8.1f}")
        print(f"{r['target']:8} index ready (constructor) {r['index_ready_s'] * 1000:.1f} ms, first load "
              f"{r['index_load_s']:.2f} s at {r['pages']:,} pages; hits {r['hits']}/{r['keys']}")
    if memory:
        print(f"index memory: {memory['bytes_per_page']:.1f} bytes/page held, {memory['peak_bytes_per_page']:.1f} "
              f"peak during load ({memory['pages']:,} pages, tracemalloc)")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--work", type=Path, required=True, help="scratch directory (the page tree is kept there)")
    ap.add_argument("--pages", type=int, default=1_000_000)
    ap.add_argument("--keys", type=int, default=20_000, help="keys looked up through the index")
    ap.add_argument("--baseline-keys", type=int, default=2_000,
                    help="keys for the stat baselines on local/sshfs (latency targets: 200 at 1 ms, 40 at 10 ms)")
    ap.add_argument("--targets", default="local,sshfs,lat1,lat10")
    ap.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    args.work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    make_tree(args.work / "export", args.pages)
    print(f"page tree: {args.pages:,} pages ready in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    memory = index_memory(args.work / "export")
    results = []
    for target in args.targets.split(","):
        n_slow = {"lat1": 200, "lat10": 40}.get(target, args.baseline_keys)
        with mounted(target, args.work) as root:
            results.append(bench_target(target, root, args.pages, args.keys, n_slow))
    if args.json:
        print(json.dumps({"memory": memory, "results": results}, indent=2))
    else:
        print_table(results, memory)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tierstore bench lookup", description=__doc__.splitlines()[0])
    add_arguments(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
