"""Issue 16: does a busy Python thread beside the I/O threads explain the GPU path's gap?

In ``tierstore bench kernels`` the pipeline's I/O threads take 20-35% longer per page than the
same engine's threads with nothing else running (``store_ms_per_job`` against
``engine_only_store_ms_per_job``), while the driver thread is busy 0.85-0.93 of the time. This
runs the engine alone (``bench.transfer.engine_only``: stores from its slots, section sums
handed in as in the GPU pipeline, then warm loads) and the raw file baseline, each with and
without a stand-in for the driver, alternated in rounds:

  alone        nothing else runs
  spin87       a Python thread computing 3.5 ms, sleeping 0.5 ms (busy 0.875, like the driver)
  spin100      a Python thread that never sleeps
  dma          (CUDA) a thread copying device->pinned host at ~20 GB/s, GIL released (the DMA
               of the pipeline's stores, without its Python)

    python tools/gil_contention.py --root /dev/shm/gc --threads 16 --page-mib 8 --total-mib 4096 \
        --beside alone,spin87 --batches 1:16,8:16,8:128

``--batches``: the engine's ``io_batch_pages`` and its cap in MiB (``rootstore.engine.IO_BATCH_BYTES``),
each run beside each stand-in. ``--direct 1,32``: also the stores without the job queue, from
plain threads calling ``PageFiles.store_many`` with that many pages per call (what an I/O
loop with no Python per page would reach).

Threading: the engine's I/O threads, one stand-in thread, the main thread waiting. Not a
test: prints a table, asserts nothing.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import torch

from tierstore.bench.io import bench_namespace
from tierstore.bench.transfer import engine_only, raw_files
from tierstore.config import TierStoreConfig
from tierstore.rootstore import engine as engine_mod
from tierstore.rootstore.engine import IOEngine

MIB = 1 << 20


def _spin(stop: threading.Event, busy_s: float, idle_s: float) -> None:
    while not stop.is_set():
        end = time.perf_counter() + busy_s
        x = 0
        while time.perf_counter() < end:
            x += 1
        if idle_s:
            time.sleep(idle_s)


def _dma(stop: threading.Event, gbps: float) -> None:
    src = torch.empty(64 * MIB, dtype=torch.uint8, device="cuda")
    dst = torch.empty(64 * MIB, dtype=torch.uint8, pin_memory=True)
    period = 64 * MIB / (gbps * 1e9)
    while not stop.is_set():
        t0 = time.perf_counter()
        dst.copy_(src)
        left = period - (time.perf_counter() - t0)
        if left > 0:
            time.sleep(left)


@contextmanager
def beside(kind: str) -> Iterator[None]:
    """Run the stand-in ``kind`` in a thread for the duration of the block."""
    if kind == "alone":
        yield
        return
    stop = threading.Event()
    target: Callable[[], None] = {
        "spin87": lambda: _spin(stop, 0.0035, 0.0005),
        "spin100": lambda: _spin(stop, 0.0035, 0.0),
        "dma": lambda: _dma(stop, 20.0),
    }[kind]
    t = threading.Thread(target=target, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()


def direct_stores(eng: IOEngine, keys: list[bytes], per_call: int, threads: int) -> float:
    """GB/s of ``keys`` stored by ``threads`` plain threads calling ``PageFiles.store_many``
    with ``per_call`` pages at a time, from the engine's slots (reused; content does not
    matter), sums handed in: the I/O without the job queue, one return to Python per call."""
    slots = eng._slots
    sums = tuple([0] * len(eng.layout.sections))
    share = -(-len(keys) // threads)

    def one(t: int) -> None:
        mine = keys[t * share:(t + 1) * share]
        for c in range(0, len(mine), per_call):
            items = [(k, slots[(t * share + c + j) % len(slots)], 16, sums) for j, k in enumerate(mine[c:c + per_call])]
            for got in eng.files.store_many(items):
                if not isinstance(got, tuple):
                    raise RuntimeError(f"direct store failed: {got}")

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(one, range(threads)))
    return round(len(keys) * eng.layout.nbytes / (time.perf_counter() - t0) / 1e9, 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=Path("/dev/shm/tierstore-gil"))
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--page-mib", type=int, default=8)
    ap.add_argument("--total-mib", type=int, default=4096)
    ap.add_argument("--slots", type=int, default=72, help="the engine's staging slots (the worker's floor at 16 threads)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--beside", default="alone,spin87,spin100,dma", help="the stand-ins, a comma list")
    ap.add_argument("--batches", default="8:16", help="io_batch_pages:cap MiB pairs, a comma list")
    ap.add_argument("--io-loops", default="native", help="the engine's io_loop settings, a comma list")
    ap.add_argument("--direct", default="", help="also: pages per store_many call from plain threads, a comma list")
    a = ap.parse_args()
    page, n = a.page_mib * MIB, a.total_mib // a.page_mib
    kinds = [k for k in a.beside.split(",") if k != "dma" or torch.cuda.is_available()]
    batches = [tuple(int(x) for x in b.split(":")) for b in a.batches.split(",")]
    runs = [(k, b, loop) for k in kinds for b in batches for loop in a.io_loops.split(",")]
    ns = bench_namespace(page)
    slab = torch.randint(0, 256, (n, page), dtype=torch.uint8)
    bufs = [memoryview(slab[i].numpy()) for i in range(n)]
    rows: dict[str, dict[str, list[float]]] = {f"{k} batch {b[0]}/{b[1]} MiB {loop}": {} for k, b, loop in runs}
    for r in range(a.rounds):
        for kind, (batch, cap), loop in runs if r % 2 == 0 else list(reversed(runs)):
            shutil.rmtree(a.root, ignore_errors=True)
            engine_mod.IO_BATCH_BYTES = cap * MIB
            cfg = TierStoreConfig(root=str(a.root / "ts"), io_threads=a.threads, odirect="off", io_batch_pages=batch,
                                  io_loop=loop)
            with IOEngine(a.root / "ts", ns, 0, config=cfg, staging_slots=a.slots,
                          pin=torch.cuda.is_available()) as eng:
                for s in eng._slots:
                    s.view[:] = bufs[s.index % n]
                with beside(kind):
                    got = engine_only(eng, [f"{r}-{i}".encode().ljust(16, b".") for i in range(n)], 16, cold=False,
                                      hash_on_cpu=False)
                    raw = raw_files(a.root, bufs, a.threads, cold=False)
                    direct = {f"direct {k}": direct_stores(eng, [f"d{k}-{r}-{i}".encode().ljust(16, b".") for i in range(n)],
                                                           int(k), a.threads)
                              for k in a.direct.split(",") if k}
            row = rows[f"{kind} batch {batch}/{cap} MiB {loop}"]
            for k, v in {"engine store": got["engine_only_store_gbps"], "ms/job": got["engine_only_store_ms_per_job"],
                         "busy": got["engine_only_store_io_busy"],
                         "engine load": got["engine_only_load_warm_gbps"],
                         "raw write": raw["write_gbps"], "raw read": raw["read_warm_gbps"], **direct}.items():
                row.setdefault(k, []).append(v)
            print(f"round {r} {kind} batch {batch}/{cap} MiB {loop}: {got} raw {raw} io_batch_pages "
                  f"{eng.stats['io_batch_pages']}", flush=True)
    shutil.rmtree(a.root, ignore_errors=True)
    cols = list(next(iter(rows.values())))
    print(f"\n{a.page_mib} MiB pages x {n}, {a.threads} I/O threads, {a.slots} slots, medians of {a.rounds} rounds")
    print("| beside | " + " | ".join(cols) + " |\n|" + "---|" * (len(cols) + 1))
    for kind, row in rows.items():
        print(f"| {kind} | " + " | ".join(f"{statistics.median(row[c]):.3g}" for c in cols) + " |")


if __name__ == "__main__":
    main()
