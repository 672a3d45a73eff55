"""``tierstore bench io``: page store/load throughput of the IOEngine against baselines.

In one run, for each page size (default 2 MiB and 16 MiB), the same page bytes are stored and
loaded by three systems with the same number of threads:

- ``raw``: plain Python file I/O (``os.open`` + ``os.write`` loop; ``os.readv`` into a buffer),
  one file per page, no header, no checksum, no temp/rename. Raw *loads* read the tierstore
  files (whole, unverified): same bytes, same disk blocks, same page-cache pages;
- ``tierstore``: ``IOEngine`` (header, xxh3 per section, temp + rename, verification on load);
- ``vllm_fs``: vLLM's fs-tier functions ``batch_store_block`` / ``batch_load_block`` (its C
  extension when built), with O_DIRECT when vLLM's own probe says it works, as vLLM runs them
  (the three are in io_systems.py).

Phases per system (systems rotate order every repeat; the median of repeats is reported):
``store`` = write every page and make it durable (each file fsynced at the end: the rate a disk
tier sustains), ``store_buffered`` = until the last write returned (page-cache rate; O_DIRECT
writers are already durable there), ``load`` = cold read after the page cache was dropped
(``/proc/sys/vm/drop_caches`` as root, else ``posix_fadvise(DONTNEED)`` per file), ``load_warm``
= the same read with every page in the page cache (for all systems, brought in the same way:
a buffered read after a cache drop; ``--warm-passes`` reads of every page per measurement).
Cold loads are measured ``--cold-rounds`` times per repeat, the order reversed each round.
Baseline loads land in as many page buffers as the engine has staging slots, used in turn
(``--load-buffers``): the same memory footprint as the engine, which must keep every in-flight
page in its own slot. Ratios are GB/s over GB/s (higher is better), the median of *paired*
ratios (tierstore and baseline measured back to back in one repeat or round), so a drift in the
machine's background load cancels; ``ratio_range`` is their spread (the run's noise), and
``ratios_of_medians`` the older statistic. Headline ratios are the worse page size. The JSON
also has CPU seconds per GB per system and phase (and their ratios,
``cpu_efficiency_vs_baseline``, steadier than GB/s on a shared machine), and the header
overhead per page.

Run: ``python -m tierstore.bench.io --root DIR --json`` (or ``tierstore bench io``).
Threading: the benchmark drives its own threads; nothing here is used by the library.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from tierstore.bench.io_systems import TierstoreSystem, import_vllm_io, open_systems
from tierstore.bench.page_cache import CacheDropper, prime
from tierstore.config import TierStoreConfig
from tierstore.format.identity import Namespace
from tierstore.native import loader as native
from tierstore.testing.pages import simple_namespace

MIB = 1 << 20
SYSTEMS = ("raw", "tierstore", "vllm_fs")


def bench_namespace(page_bytes: int, *, layers: int = 16, heads: int = 8, head_size: int = 128,
                    dtype: str = "bfloat16", model: str = "tierstore-bench") -> Namespace:
    """One attention group whose pages hold ``page_bytes`` (a multiple of layers x 4 KiB)."""
    itemsize = 2 if dtype in ("bfloat16", "float16") else 4
    per_token = heads * 2 * head_size * itemsize
    tokens, rest = divmod(page_bytes, layers * per_token)
    if rest or tokens <= 0:
        raise ValueError(f"page size {page_bytes} is not a multiple of {layers} layers x {per_token} bytes/token")
    return simple_namespace(dtype, model=model, tokens_per_chunk=tokens, num_layers=layers, num_kv_heads=heads,
                            head_size=head_size)



def _fsync_all(paths: Sequence[Path], threads: int) -> None:
    def one(p: Path) -> None:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(one, paths))


_CPU: dict[str, float] = {"last": 0.0}


def _timed(fn: Callable[[], None]) -> float:
    """Wall seconds of ``fn``; its process CPU seconds (all threads) go to ``_CPU["last"]``."""
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    _CPU["last"] = time.process_time() - c0
    return dt


def _measure_repeat(impl: dict[str, Any], order: list[str], n: int, run: int, gb: float, args: argparse.Namespace,
                    dropper: CacheDropper, rates: dict[str, dict[str, list[float]]],
                    cpu: dict[str, dict[str, list[float]]]) -> None:
    """One repeat: store (to durable), cold loads, warm loads of every system; GB/s and CPU
    seconds per GB are appended to ``rates`` and ``cpu``."""
    for s in order:  # store, each to durable
        x = impl[s]
        if not isinstance(x, TierstoreSystem):
            x.drop_files()  # tierstore's stores go to new keys each repeat: so do the others'
        t_buf = _timed(lambda x=x, run=run: x.store(n, run))
        paths = x.paths() if isinstance(x, TierstoreSystem) else x.paths
        cpu_store = _CPU["last"]
        t_sync = _timed(lambda paths=paths: _fsync_all(paths, args.threads))
        rates[s].setdefault("store_buffered", []).append(gb / t_buf)
        rates[s].setdefault("store", []).append(gb / (t_buf + t_sync))
        cpu[s].setdefault("store", []).append((cpu_store + _CPU["last"]) / gb)
    all_paths = {s: (impl[s].paths() if s == "tierstore" else impl[s].paths) for s in order}
    # Raw reads the tierstore files (header + payload, no verification): the same bytes in
    # the same disk blocks and, warm, the same page-cache pages, so the ratio is the
    # engine's own cost (on a VM, where a page-cache page sits in host memory can change
    # copy speed by 40%).
    impl["raw"].load_paths = all_paths["raw"] = all_paths["tierstore"]
    # Cold: nothing of this system's pages in the page cache. Several short rounds, the
    # order reversed every round, each round's systems measured back to back (paired).
    for rnd in range(args.cold_rounds):
        for s in (order if rnd % 2 == 0 else order[::-1]):
            dropper.drop(all_paths[s])
            rates[s].setdefault("load", []).append(gb / _timed(impl[s].load))
            cpu[s].setdefault("load", []).append(_CPU["last"] / gb)
    # Warm: every system's pages brought into the page cache the same way, at one time.
    dropper.drop([p for s in order for p in all_paths[s]])
    for s in order:
        prime(all_paths[s], args.threads)
    passes = args.warm_passes  # a warm pass is short: repeat it to be measurable
    for s in order:
        x = impl[s]
        rates[s].setdefault("load_warm", []).append(
            passes * gb / _timed(lambda x=x, k=passes: [x.load() for _ in range(k)]))
        cpu[s].setdefault("load_warm", []).append(_CPU["last"] / (passes * gb))


def _engine_info(impl: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    engine = impl["tierstore"].engine
    st = engine.stats
    return {"io_mode": st["io_mode"], "odirect_reason": st["odirect_reason"], "codec": st["codec"],
            "threads": args.threads, "odirect_cold_loads": engine.direct_loads,
            "loads_read_with_odirect_last_run": st["loads_odirect"], "header_bytes": engine.header_len(32),
            "io_batch_pages": st["io_batch_pages"],
            "batched_job_share_last_run": round(st["jobs_in_batches"] / max(1, st["jobs_run"]), 3),
            "native_loop_share_last_run": round(st["jobs_native_loop"] / max(1, st["jobs_run"]), 3)}


def _bench_size(root: Path, page_mib: int, args: argparse.Namespace, dropper: CacheDropper,
                vio: Any | None, log: Callable[[str], None]) -> dict[str, Any]:
    page_bytes = page_mib * MIB
    n = max(args.total_mib // page_mib, 2 * args.threads)
    ns = bench_namespace(page_bytes)
    tag = f"{page_mib}m"
    g = torch.Generator().manual_seed(page_mib)
    # the engine's staging slots: its default for this thread count, or the vLLM worker's floor
    slots = 2 * args.threads + 2 if args.slots == "engine" else 4 * args.threads + 8
    # Baseline stores read their pages from as many buffers as the engine has slots (4 random
    # pages, repeated): the memory the engine's stores read. 4 reused 16 MiB sources (64 MiB)
    # stayed in a 300 MiB L3 while the engine's 72 slots (1.2 GiB) came from DRAM, and made
    # 16 MiB raw stores look 1.2-1.4x faster (docs/measurements/scaling.md).
    n_src = slots if args.store_sources == "slots" else 4
    seed = torch.randint(0, 256, (4, page_bytes), dtype=torch.uint8, generator=g)
    src_t = seed.repeat(-(-n_src // 4), 1)[:n_src].clone()
    sources = [memoryview(src_t[i].numpy()).cast("B") for i in range(n_src)]
    cfg = TierStoreConfig(root=str(root), io_threads=args.threads, odirect=args.odirect,
                          codec=args.codec, fsync=False, deadline_s=600.0,
                          **({} if args.io_batch_pages is None else {"io_batch_pages": args.io_batch_pages}),
                          **({} if args.io_loop is None else {"io_loop": args.io_loop}))
    systems = [s for s in SYSTEMS if s != "vllm_fs" or vio is not None]
    rates: dict[str, dict[str, list[float]]] = {s: {} for s in systems}
    cpu: dict[str, dict[str, list[float]]] = {s: {} for s in systems}  # CPU seconds per GB
    gb = n * page_bytes / 1e9
    engine_info: dict[str, Any] = {}
    vllm_info: dict[str, Any] = {}
    loadavgs: list[float] = []
    for run in range(args.repeat):
        work = root / f"{tag}-run{run}"
        order = systems[run % len(systems):] + systems[: run % len(systems)]
        impl: dict[str, Any] = {}
        try:
            open_systems(order, work, ns, sources, args, cfg, tag, slots, page_bytes, vio, impl)
            _measure_repeat(impl, order, n, run, gb, args, dropper, rates, cpu)
            if "tierstore" in impl:
                engine_info = _engine_info(impl, args)
            if "vllm_fs" in impl:
                vllm_info = {"o_direct": impl["vllm_fs"].use_o_direct}
            loadavgs.append(round(os.getloadavg()[0], 2))
            log(f"  {page_mib} MiB run {run}: " + ", ".join(
                f"{s} st {rates[s]['store'][-1]:.2f}/{rates[s]['store_buffered'][-1]:.2f} "
                f"ld {rates[s]['load'][-1]:.2f} warm {rates[s]['load_warm'][-1]:.2f}" for s in systems)
                + (f" (tierstore I/O threads busy: {impl['tierstore'].io_busy})" if "tierstore" in impl else ""))
        finally:
            if "tierstore" in impl:
                impl["tierstore"].close()
            shutil.rmtree(work, ignore_errors=True)
            shutil.rmtree(f"{work / 'vllm'}_r0", ignore_errors=True)
    out = _summary(page_bytes, n, gb, args.repeat, systems, rates, cpu, engine_info)
    if vllm_info:
        out["vllm_fs"] = vllm_info
    out["loadavg_per_repeat"] = loadavgs
    return out


def _summary(page_bytes: int, n: int, gb: float, repeats: int, systems: list[str],
             rates: dict[str, dict[str, list[float]]], cpu: dict[str, dict[str, list[float]]],
             engine_info: dict[str, Any]) -> dict[str, Any]:
    """One page size's report: medians, and the ratios of tierstore to each baseline."""
    med = {s: {ph: statistics.median(v) for ph, v in rates[s].items()} for s in systems}
    out: dict[str, Any] = {
        "page_bytes": page_bytes, "pages": n, "gigabytes": gb, "repeats": repeats,
        "gbps": med, "gbps_all_runs": rates,
        "cpu_seconds_per_gb": {s: {ph: statistics.median(v) for ph, v in cpu[s].items()} for s in systems},
        "header_bytes": engine_info.get("header_bytes"),
        "overhead_per_page": engine_info.get("header_bytes", 0) / page_bytes,
        "engine": engine_info,
    }
    # Ratios: the median of paired ratios (tierstore / baseline measured in the same repeat or
    # round, back to back), which cancels slow drifts of the machine's background load; the
    # range of those paired ratios is the noise of this run. Ratios of the medians are kept too.
    r = out["ratios"] = {}
    spread = out["ratio_range"] = {}
    of_medians = out["ratios_of_medians"] = {}
    cpu_ratio = out["cpu_efficiency_vs_baseline"] = {}  # baseline CPU s/GB / tierstore CPU s/GB
    for base in ("raw", "vllm_fs"):
        if base not in med:
            continue
        for ph in ("store", "store_buffered", "load", "load_warm"):
            name = f"{ph}_vs_{base}"
            paired = [a / b for a, b in zip(rates["tierstore"][ph], rates[base][ph], strict=True)]
            r[name] = statistics.median(paired)
            spread[name] = [min(paired), max(paired)]
            of_medians[name] = med["tierstore"][ph] / med[base][ph]
            if ph != "store_buffered":
                cpu_ratio[name] = out["cpu_seconds_per_gb"][base][ph] / out["cpu_seconds_per_gb"]["tierstore"][ph]
    out["samples_per_ratio"] = {ph: len(rates["tierstore"][ph]) for ph in ("store", "load", "load_warm")}
    return out


_SWEEP_PHASES = (("store", "store"), ("store_buffered", "store_buf"), ("load_warm", "load_warm"), ("load", "load_cold"))


def _sweep_row(mib: int, threads: int, size: dict[str, Any]) -> dict[str, Any]:
    """One row of a thread sweep: per phase tierstore GB/s, raw GB/s (same pages, same thread
    count), vllm_fs GB/s when measured, and the paired ratio to raw."""
    g, r = size["gbps"], size["ratios"]
    row: dict[str, Any] = {"page_mib": mib, "threads": threads}
    for ph, name in _SWEEP_PHASES:
        row[f"{name}_gbps"] = round(g["tierstore"][ph], 2)
        row[f"raw_{name}_gbps"] = round(g["raw"][ph], 2)
        row[f"{name}_vs_raw"] = round(r[f"{ph}_vs_raw"], 3)
        if "vllm_fs" in g:
            row[f"vllm_{name}_gbps"] = round(g["vllm_fs"][ph], 2)
            row[f"{name}_vs_vllm_fs"] = round(r[f"{ph}_vs_vllm_fs"], 3)
    return row


def _print_sweep(rows: list[dict[str, Any]], log: Callable[[str], None]) -> None:
    """The sweep as a markdown table (ratio = tierstore / raw parallel file I/O, paired)."""
    cols = [("MiB", "page_mib"), ("thr", "threads")]
    for _, name in _SWEEP_PHASES:
        cols += [(f"{name} ts", f"{name}_gbps"), (f"{name} raw", f"raw_{name}_gbps"), ("ratio", f"{name}_vs_raw")]
        if any(f"vllm_{name}_gbps" in r for r in rows):
            cols += [(f"{name} vllm", f"vllm_{name}_gbps"), ("vs vllm", f"{name}_vs_vllm_fs")]
    log("| " + " | ".join(c for c, _ in cols) + " |")
    log("|" + "---|" * len(cols))
    for r in rows:
        log("| " + " | ".join(str(r.get(k, "")) for _, k in cols) + " |")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--root", required=True, help="scratch directory on the disk to measure (files are removed)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--page-mib", default="2,16", help="page sizes in MiB, comma separated (default 2,16)")
    parser.add_argument("--total-mib", type=int, default=256, help="MiB per page size and system per run (default 256)")
    parser.add_argument("--threads", default="4",
                        help="I/O threads of every system; a comma list (1,4,8,16) sweeps them, one table row "
                             "per page size and thread count (default 4)")
    parser.add_argument("--repeat", type=int, default=5, help="runs per page size; medians are reported (default 5)")
    parser.add_argument("--warm-passes", type=int, default=4, help="reads of every page per warm measurement (default 4)")
    parser.add_argument("--cold-rounds", type=int, default=2,
                        help="cold-load measurements per repeat, order reversed each round (default 2)")
    parser.add_argument("--load-buffers", default="slots", choices=("slots", "per-thread"),
                        help="where baseline loads land: as many buffers as the engine has staging slots, "
                             "used in turn (default), or one reused buffer per thread")
    parser.add_argument("--store-sources", default="slots", choices=("slots", "4"),
                        help="where baseline stores read their pages: as many buffers as the engine has staging "
                             "slots (default), or 4 reused buffers (what earlier sessions measured; they stay "
                             "in the CPU cache)")
    parser.add_argument("--odirect", default="auto", choices=("auto", "on", "off"), help="tierstore odirect setting")
    parser.add_argument("--cold-loads", default="auto", choices=("auto", "buffered"),
                        help="tierstore cold loads: auto (O_DIRECT when it works) or buffered (experiment)")
    parser.add_argument("--codec", default="none", choices=("none", "zstd"), help="tierstore codec")
    parser.add_argument("--cache-drop", default="auto", choices=("auto", "fadvise"),
                        help="auto: drop_caches when root, else posix_fadvise per file; fadvise: always per file")
    parser.add_argument("--no-vllm", action="store_true", help="skip vLLM's fs tier even if importable")
    parser.add_argument("--io-batch-pages", type=int, default=None,
                        help="tierstore io_batch_pages (default: the setting's default; 1 = no batches)")
    parser.add_argument("--io-loop", default=None, choices=("native", "python"),
                        help="tierstore io_loop (default: the setting's default, native)")
    parser.add_argument("--slots", default="engine", choices=("engine", "worker"),
                        help="tierstore staging slots: the engine's default (2 x threads + 2) or the vLLM "
                             "worker's floor (4 x threads + 8)")


def run(args: argparse.Namespace) -> int:
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    quiet = bool(args.json)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr if quiet else sys.stdout, flush=True)

    dropper = CacheDropper(args.cache_drop)
    native.start(wait=True)  # measure the path the engine settles on, not its first second
    native_path = "on" if native.ready() else f"off ({native.failure() or 'TIERSTORE_NATIVE=0'})"
    log(f"native page path (one GIL release per page): {native_path}")
    vio, vinfo = (None, "skipped (--no-vllm)") if args.no_vllm else import_vllm_io()
    sizes = [int(x) for x in str(args.page_mib).split(",") if x.strip()]
    thread_counts = [int(x) for x in str(args.threads).split(",") if x.strip()]
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    per_size: dict[str, Any] = {}
    sweep: list[dict[str, Any]] = []
    for threads in thread_counts:
        args.threads = threads
        for mib in sizes:
            log(f"page size {mib} MiB, {threads} threads ...")
            per_size[f"{mib}MiB"] = _bench_size(root, mib, args, dropper, vio, log)
            sweep.append(_sweep_row(mib, threads, per_size[f"{mib}MiB"]))
    if len(thread_counts) > 1:
        _print_sweep(sweep, log)
    result: dict[str, Any] = {
        "benchmark": "tierstore bench io",
        "machine": {"cpus": os.cpu_count(), "kernel": platform.release(), "loadavg_before": load0,
                    "loadavg_after": os.getloadavg(), "python": platform.python_version()},
        "cache_drop": dropper.method,
        "native": native_path,
        "vllm_fs": vinfo,
        "seconds": time.perf_counter() - t0,
        "sizes": per_size,  # the last thread count's
        "sweep": sweep,
    }
    # Headline ratios: the worst page size (each is a median over repeats).
    for name in ("store_vs_raw", "store_buffered_vs_raw", "load_vs_raw", "load_warm_vs_raw",
                 "store_vs_vllm_fs", "store_buffered_vs_vllm_fs", "load_vs_vllm_fs", "load_warm_vs_vllm_fs"):
        vals = [s["ratios"][name] for s in per_size.values() if name in s["ratios"]]
        if vals:
            result[name] = min(vals)
    # Noise: per page size, the range of the paired per-repeat ratios behind each headline.
    result["ratio_range"] = {name: {k: v["ratio_range"][name] for k, v in per_size.items() if name in v["ratio_range"]}
                             for name in ("store_vs_raw", "load_vs_raw", "load_warm_vs_raw", "store_vs_vllm_fs",
                                          "load_vs_vllm_fs")}
    result["overhead_per_page"] = {k: v["overhead_per_page"] for k, v in per_size.items()}
    if args.json:
        print(json.dumps({"tierstore_bench_io": 1, **result}, indent=2))
    else:
        for k, v in per_size.items():
            log(f"{k}: " + json.dumps(v["gbps"]))
            log(f"{k}: ratios " + json.dumps({a: round(b, 3) for a, b in v["ratios"].items()}))
        for name in ("store_vs_raw", "load_vs_raw", "load_warm_vs_raw", "store_vs_vllm_fs", "load_vs_vllm_fs"):
            if name in result:
                log(f"{name}: {result[name]:.3f}")
    with contextlib.suppress(OSError):
        root.rmdir()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tierstore bench io", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
