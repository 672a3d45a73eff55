"""``tierstore bench gil``: the engine's stores and loads against raw files, alone and beside a busy
Python thread (the GPU pipeline's driver), for each I/O batch setting and io_loop.

Each run makes a fresh ``IOEngine`` and measures, with a stand-in thread running beside it:
the engine alone (``bench.transfer.engine_only``: stores from its slots, section sums handed in
as in the GPU pipeline, then warm loads) and the baseline, plain file I/O of the same bytes from
the same number of threads (``bench.transfer.raw_files``: one file per page, no header, no
checksum, no rename). Stand-ins (``--beside``):

  alone        nothing else runs
  spin87       a Python thread computing 3.5 ms, sleeping 0.5 ms (busy 0.875, like the driver)
  spin100      a Python thread that never sleeps
  dma          (CUDA only; skipped, said on stderr, without it) a thread copying device->pinned
               host at ~20 GB/s, GIL released (the DMA of the pipeline's stores, without its Python)

``--batches``: the engine's ``io_batch_pages`` and its cap in MiB (``rootstore.engine.IO_BATCH_BYTES``),
each run beside each stand-in. ``--io-loops``: the engine's ``io_loop`` settings (``native``
needs the compiled lane; where it is unavailable that variant is skipped and the reason
printed). ``--direct 1,32``: also the stores without the job queue, from plain threads calling
``PageFiles.store_many`` with that many pages per call (what an I/O loop with no Python per page
would reach).

Runs alternate in rounds (the order reversed every other round); each figure is the median over
``--rounds``. Ratios are engine GB/s over raw GB/s of the same round (store over raw write, load
over raw read, direct over raw write; higher: closer to plain file I/O), their median.
Run: ``tierstore bench gil --root /dev/shm/tsg --threads 16 --page-mib 8 --total-mib 4096
--beside alone,spin87,spin100 --io-loops native,python [--json]``; ``--root`` is scratch space:
its ``ts/`` and ``raw/`` are replaced.
Threading: the engine's I/O threads, the baseline's thread pool, one stand-in thread and the
main thread submitting and waiting; nothing here is used by the library.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from tierstore.admin.cli import positive_int
from tierstore.bench.io import bench_namespace
from tierstore.bench.transfer import engine_only, raw_files
from tierstore.config import TierStoreConfig
from tierstore.errors import TierStoreError
from tierstore.format.identity import Namespace
from tierstore.native import loader as native
from tierstore.rootstore import engine as engine_mod
from tierstore.rootstore.engine import IOEngine

MIB = 1 << 20
KINDS = ("alone", "spin87", "spin100", "dma")
IO_LOOPS = ("native", "python")


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
    t = threading.Thread(target=target, name=f"tierstore-bench-{kind}", daemon=True)
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
    slots = eng.slots
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


def native_unavailable() -> str | None:
    """Why the engine's native I/O loop cannot run here, or None when it can."""
    if not native.enabled_by_env():
        return "TIERSTORE_NATIVE=0"
    native.start(wait=True)  # compiled before any run: no run measures the Python loop by mistake
    if native.lane_kernels() is None:
        return native.failure() or "the compiled lane needs x86-64 Linux"
    return None


def _csv(choices: tuple[str, ...] | None = None) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        items = [x for x in text.split(",") if x]
        bad = [x for x in items if choices is not None and x not in choices]
        if not items or bad:
            raise argparse.ArgumentTypeError(f"expected a comma list of {', '.join(choices or ('values',))}, "
                                             f"got {text!r}")
        return items
    return parse


def _positive_ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x]
    except ValueError:
        values = []
    if any(v <= 0 for v in values):
        values = []
    if text and not values:
        raise argparse.ArgumentTypeError(f"expected a comma list of positive integers, got {text!r}")
    return values


def _batches(text: str) -> list[tuple[int, int]]:
    out = []
    for pair in text.split(","):
        pages, _, cap = pair.partition(":")
        try:
            b = (int(pages), int(cap))
        except ValueError:
            b = (0, 0)
        if min(b) <= 0:
            raise argparse.ArgumentTypeError(f"expected io_batch_pages:cap_MiB pairs, a comma list, got {text!r}")
        out.append(b)
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--root", type=Path, default=Path("/dev/shm/tierstore-gil"),
                   help="scratch directory (its ts/ and raw/ are replaced; default /dev/shm/tierstore-gil)")
    p.add_argument("--threads", type=positive_int, default=16, help="the engine's I/O threads and the baseline's")
    p.add_argument("--page-mib", type=positive_int, default=8, help="page size in MiB")
    p.add_argument("--total-mib", type=positive_int, default=4096, help="MiB stored and loaded per run")
    p.add_argument("--slots", type=positive_int, default=72,
                   help="the engine's staging slots (the worker's floor at 16 threads)")
    p.add_argument("--rounds", type=positive_int, default=3)
    p.add_argument("--beside", type=_csv(KINDS), default=list(KINDS),
                   help=f"the stand-ins, a comma list of {','.join(KINDS)} (default: all)")
    p.add_argument("--batches", type=_batches, default=[(8, 16)],
                   help="io_batch_pages:cap MiB pairs, a comma list (default 8:16)")
    p.add_argument("--io-loops", type=_csv(IO_LOOPS), default=["native"],
                   help="the engine's io_loop settings, a comma list of native,python (default native)")
    p.add_argument("--direct", type=_positive_ints, default=[],
                   help="also: pages per store_many call from plain threads, a comma list")
    p.add_argument("--json", action="store_true", help="print a machine-readable JSON report on stdout")


def _key(tag: str, i: int) -> bytes:
    return f"{tag}-{i}".encode().ljust(16, b".")


RunId = tuple[str, tuple[int, int], str]  # (stand-in, (io_batch_pages, cap MiB), io_loop)


def _runnable(args: argparse.Namespace) -> tuple[list[str], list[str], list[dict[str, str]]]:
    """The stand-ins and io_loops that can run here, and the skipped variants with why (each
    said on stderr). Raises ``TierStoreError`` when nothing is left."""
    skipped: list[dict[str, str]] = []
    kinds: list[str] = list(dict.fromkeys(args.beside))
    if "dma" in kinds and not torch.cuda.is_available():
        kinds.remove("dma")
        skipped.append({"what": "beside dma", "why": "CUDA is not available"})
    loops: list[str] = list(dict.fromkeys(args.io_loops))
    why = native_unavailable() if "native" in loops else None
    if why:
        loops.remove("native")
        skipped.append({"what": "io_loop native", "why": f"the native I/O loop is unavailable: {why}"})
    for s in skipped:
        print(f"tierstore bench gil: skipping {s['what']}: {s['why']}", file=sys.stderr)
    if not kinds or not loops:
        raise TierStoreError("nothing left to run (see the skipped variants above)")
    return kinds, loops, skipped


def _measure_run(args: argparse.Namespace, r: int, run_id: RunId, ns: Namespace,
                 bufs: list[memoryview]) -> tuple[dict[str, float], int]:
    """Round ``r`` of one variant on a fresh engine: its figures, and the io_batch_pages the
    engine used. Sets ``engine.IO_BATCH_BYTES`` (the caller restores it)."""
    kind, (batch, cap), loop = run_id
    n = len(bufs)
    shutil.rmtree(args.root / "ts", ignore_errors=True)
    engine_mod.IO_BATCH_BYTES = cap * MIB
    cfg = TierStoreConfig(root=str(args.root / "ts"), io_threads=args.threads, odirect="off",
                          io_batch_pages=batch, io_loop=loop)
    with IOEngine(args.root / "ts", ns, 0, config=cfg, staging_slots=args.slots,
                  pin=torch.cuda.is_available()) as eng:
        for s in eng.slots:
            s.view[:] = bufs[s.index % n]
        with beside(kind):
            got = engine_only(eng, [_key(str(r), i) for i in range(n)], 16, cold=False, hash_on_cpu=False)
            raw = raw_files(args.root, bufs, args.threads, cold=False)
            direct = {k: direct_stores(eng, [_key(f"d{k}-{r}", i) for i in range(n)], k, args.threads)
                      for k in args.direct}
        batch_used = eng.stats["io_batch_pages"]
    values = {"engine_store_gbps": got["engine_only_store_gbps"],
              "engine_store_s_per_job": got["engine_only_store_ms_per_job"] / 1000,
              "engine_store_io_busy": got["engine_only_store_io_busy"],
              "engine_load_warm_gbps": got["engine_only_load_warm_gbps"],
              "raw_write_gbps": raw["write_gbps"], "raw_read_warm_gbps": raw["read_warm_gbps"],
              "store_vs_raw": got["engine_only_store_gbps"] / raw["write_gbps"],
              "load_vs_raw": got["engine_only_load_warm_gbps"] / raw["read_warm_gbps"]}
    for k, v in direct.items():
        values[f"direct_{k}_gbps"] = v
        values[f"direct_{k}_vs_raw"] = v / raw["write_gbps"]
    print(f"round {r} {kind} batch {batch}/{cap} MiB {loop}: {got} raw {raw} direct {direct} "
          f"io_batch_pages {batch_used}", file=sys.stderr, flush=True)
    return values, batch_used


def _print_table(args: argparse.Namespace, rows: list[dict[str, Any]], n: int, skipped: list[dict[str, str]]) -> None:
    """The report as text: a header line, the skipped variants, a markdown table of the rows."""
    cols = {"engine store": "engine_store_gbps", "ms/job": "engine_store_s_per_job", "busy": "engine_store_io_busy",
            "engine load": "engine_load_warm_gbps", "raw write": "raw_write_gbps", "raw read": "raw_read_warm_gbps",
            "store/raw": "store_vs_raw", "load/raw": "load_vs_raw"}
    for k in args.direct:
        cols.update({f"direct {k}": f"direct_{k}_gbps", f"direct {k}/raw": f"direct_{k}_vs_raw"})
    print(f"{args.page_mib} MiB pages x {n}, {args.threads} I/O threads, {args.slots} slots, {os.cpu_count()} CPUs, "
          f"medians of {args.rounds} rounds; GB/s, ratios engine over raw files of the same round")
    for s in skipped:
        print(f"skipped {s['what']}: {s['why']}")
    print("| beside | " + " | ".join(cols) + " |\n|" + "---|" * (len(cols) + 1))
    for row in rows:
        cells = [f"{row[c] * 1000:.3g}" if c == "engine_store_s_per_job" else f"{row[c]:.3g}" for c in cols.values()]
        print(f"| {row['beside']} batch {row['io_batch_pages']}/{row['io_batch_cap_mib']} MiB {row['io_loop']} | "
              + " | ".join(cells) + " |")


def run(args: argparse.Namespace) -> int:
    kinds, loops, skipped = _runnable(args)
    page, n = args.page_mib * MIB, args.total_mib // args.page_mib
    if n <= 0:
        raise TierStoreError(f"--total-mib {args.total_mib} is less than one page of {args.page_mib} MiB")
    runs: list[RunId] = [(k, b, loop) for k in kinds for b in args.batches for loop in loops]
    ns = bench_namespace(page)
    slab = torch.randint(0, 256, (n, page), dtype=torch.uint8)
    bufs = [memoryview(slab[i].numpy()) for i in range(n)]
    samples: dict[RunId, dict[str, list[float]]] = {r: {} for r in runs}
    batch_used: dict[RunId, int] = {}
    args.root.mkdir(parents=True, exist_ok=True)
    cap_before = engine_mod.IO_BATCH_BYTES
    try:
        for r in range(args.rounds):
            for run_id in runs if r % 2 == 0 else list(reversed(runs)):
                values, batch_used[run_id] = _measure_run(args, r, run_id, ns, bufs)
                for k, v in values.items():
                    samples[run_id].setdefault(k, []).append(v)
    finally:
        engine_mod.IO_BATCH_BYTES = cap_before
        shutil.rmtree(args.root / "ts", ignore_errors=True)
        shutil.rmtree(args.root / "raw", ignore_errors=True)
        if args.root.is_dir() and not any(args.root.iterdir()):
            args.root.rmdir()
    rows = [{"beside": kind, "io_batch_pages": batch, "io_batch_cap_mib": cap, "io_loop": loop,
             "io_batch_pages_used": batch_used[(kind, (batch, cap), loop)],
             **{k: float(f"{statistics.median(v):.4g}") for k, v in samples[(kind, (batch, cap), loop)].items()}}
            for kind, (batch, cap), loop in runs]
    if args.json:
        print(json.dumps({"tierstore_bench_gil": 1, "page_bytes": page, "pages": n, "threads": args.threads,
                          "slots": args.slots, "rounds": args.rounds, "cpus": os.cpu_count(), "skipped": skipped,
                          "rows": rows}, indent=2))
        return 0
    _print_table(args, rows, n, skipped)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tierstore bench gil", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
