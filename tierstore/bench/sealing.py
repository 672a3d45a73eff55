"""``tierstore bench sealing``: what ``encryption_key_file`` costs an IOEngine.

The same pages are stored, then loaded, by an engine without a key (the baseline) and by one
with a key (sealed pages), on the same directory (``--work``: tmpfs shows the CPU cost, a disk
hides it), at ``--threads`` I/O threads, after the native kernels have compiled (the baseline
uses them; sealed pages run on the Python I/O threads). Prints GB/s of each and the ratio sealed / plain, and
the single-core GB/s of the primitives (AES-256-GCM seal and open of one page, xxh3 of it).

Threading: the benchmark's thread drives the engines; their I/O threads do the work.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import xxhash

from tierstore.config import TierStoreConfig
from tierstore.format.sealing import TRAILER_LEN, PageSealer
from tierstore.native import loader as native
from tierstore.rootstore.engine import IOEngine
from tierstore.testing.pages import page_bytes, page_key, simple_namespace


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--work", type=Path, default=Path("/dev/shm/tierstore-bench-sealing"),
                   help="directory for the pages (removed first and after)")
    p.add_argument("--pages", type=int, default=64)
    p.add_argument("--threads", type=int, default=2, help="I/O threads per engine")
    p.add_argument("--layers", type=int, default=32, help="page size: layers x 8 heads x 16 tokens x 128 x bf16 x 2")
    p.add_argument("--repeats", type=int, default=3, help="rounds per engine; the best one counts")
    p.add_argument("--json", action="store_true")


def _round(eng: IOEngine, data: list[bytes], keys: list[bytes]) -> tuple[float, float]:
    """Seconds to store every page, then to load every page back (checked)."""
    t0 = time.perf_counter()
    jobs = []
    for k, d in zip(keys, data, strict=True):
        slot = eng.acquire_slot(30.0)
        assert slot is not None, "no staging slot"
        slot.view[:] = d
        jobs.append(eng.submit_store(k, slot, 16))
        if len(jobs) >= eng.config.io_threads * 2:
            assert all(r.ok for r in eng.wait(jobs, 60.0)), "a store failed"
            jobs = []
    assert all(r.ok for r in eng.wait(jobs, 60.0)), "a store failed"
    t1 = time.perf_counter()
    for start in range(0, len(keys), eng.config.io_threads * 2):
        batch = keys[start:start + eng.config.io_threads * 2]
        for r, k in zip(eng.wait([eng.submit_load(k) for k in batch], 60.0), batch, strict=True):
            assert r.ok and r.slot is not None, r.error
            assert bytes(r.slot.view) == data[keys.index(k)], "a page came back different"
            eng.release_slot(r.slot)
    return t1 - t0, time.perf_counter() - t1


def _engine_rates(work: Path, key_file: Path | None, args: argparse.Namespace) -> dict[str, float]:
    ns = simple_namespace("bfloat16", tokens_per_chunk=16, num_layers=args.layers, num_kv_heads=8, head_size=128)
    layout = ns.groups[0].layout
    keys = [page_key(i) for i in range(args.pages)]
    data = [page_bytes(layout, k) for k in keys]
    best_store = best_load = float("inf")
    for _ in range(args.repeats):
        shutil.rmtree(work, ignore_errors=True)
        cfg = {"root": str(work), "io_threads": args.threads, "odirect": "off"}
        if key_file is not None:
            cfg["encryption_key_file"] = str(key_file)
        eng = IOEngine(work, ns, 0, config=TierStoreConfig.from_dict(cfg))
        try:
            s, ld = _round(eng, data, keys)
        finally:
            eng.close()
        best_store, best_load = min(best_store, s), min(best_load, ld)
    total = layout.nbytes * args.pages
    return {"page_bytes": layout.nbytes, "store_gbps": total / best_store / 1e9, "load_gbps": total / best_load / 1e9}


def _primitives(page: int) -> dict[str, float]:
    """Single-core GB/s of seal, open and xxh3 over one page (best of 20)."""
    sealer = PageSealer(os.urandom(32))
    plain = memoryview(bytearray(os.urandom(page)))
    sealed = memoryview(bytearray(page + TRAILER_LEN))
    out = memoryview(bytearray(page))
    aad = bytes(4096)
    ops = {"seal_gbps": lambda: sealer.seal(aad, plain, sealed),
           "open_gbps": lambda: sealer.open(aad, sealed, out),
           "xxh3_gbps": lambda: xxhash.xxh3_64_intdigest(plain)}
    rates = {}
    for name, fn in ops.items():
        best = float("inf")
        for _ in range(20):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        rates[name] = page / best / 1e9
    return rates


def run(args: argparse.Namespace) -> int:
    native.start(wait=True)  # the baseline's native kernels compiled before anything is timed
    key_file = args.work.with_name(args.work.name + ".key")
    key_file.write_bytes(os.urandom(32))
    key_file.chmod(0o600)
    try:
        plain = _engine_rates(args.work, None, args)
        sealed = _engine_rates(args.work, key_file, args)
    finally:
        shutil.rmtree(args.work, ignore_errors=True)
        key_file.unlink()
    out: dict[str, Any] = {
        "pages": args.pages, "threads": args.threads, "page_bytes": plain["page_bytes"],
        "plain": plain, "sealed": sealed,
        "store_ratio": sealed["store_gbps"] / plain["store_gbps"],
        "load_ratio": sealed["load_gbps"] / plain["load_gbps"],
        "primitives": _primitives(plain["page_bytes"]),
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    mib = plain["page_bytes"] / (1 << 20)
    print(f"{args.pages} pages of {mib:.1f} MiB, {args.threads} I/O threads, {args.work}")
    print(f"  store: plain {plain['store_gbps']:.2f} GB/s, sealed {sealed['store_gbps']:.2f} GB/s, "
          f"ratio {out['store_ratio']:.2f}")
    print(f"  load:  plain {plain['load_gbps']:.2f} GB/s, sealed {sealed['load_gbps']:.2f} GB/s, "
          f"ratio {out['load_ratio']:.2f}")
    p = out["primitives"]
    print(f"  one core: seal {p['seal_gbps']:.1f} GB/s, open {p['open_gbps']:.1f} GB/s, xxh3 {p['xxh3_gbps']:.1f} GB/s")
    return 0
