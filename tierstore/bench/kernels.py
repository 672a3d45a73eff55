"""``tierstore bench kernels``: canonical-page copy kernels and the GPU transfer path, against
baselines measured in the same run.

Needs a CUDA device. For page shapes of real models (a dense 8B-class model, a
Qwen3.5-0.8B-class hybrid with 544-token unified blocks, a Gemma3-class sliding-window group):

- ``kernels``: GroupCopier gather (cache -> device pages) and scatter (pages -> cache) GB/s,
  Triton and the torch reference, against ``torch.index_select`` / ``index_copy_`` moving the
  same bytes (whole physical block rows of every layer, no reordering) into/out of a dense
  buffer. Ratio = GroupCopier GB/s / baseline GB/s (target >= 0.9).
- ``transfer``: store = GPU cache -> gather -> pinned staging slot -> IOEngine page file,
  load = page file -> IOEngine slot -> GPU scratch -> scatter into the cache, pipelined in
  batches, against raw PCIe (one large pinned<->device copy) and raw file write/read (plain
  ``os.write`` / ``os.preadv`` of the same bytes, one file per page, the same thread count and
  cache state) measured in the same run. Ratio = pipeline GB/s / min(PCIe, raw file) GB/s
  (target >= 0.85). Loads are measured warm (page cache) and, when the page cache can be
  dropped (root), cold.

GB/s counts page payload bytes once (10^9 bytes/s). Timings: CUDA events / triton.testing
``do_bench`` medians for kernels; wall clock with a final synchronize for transfers.

Run: ``python -m tierstore.bench.kernels --json`` (or ``tierstore bench kernels``).
Threading: the benchmark drives its own threads; nothing here is used by the library.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

GB = 1e9
STALL_S = 60.0  # a pipeline with no progress for this long is a bug: raise, with its state


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- model shapes
@dataclass(frozen=True)
class AttnShape:
    name: str
    layers: int  # layers in the group
    heads: int
    head_size: int
    kernel_tokens: int  # tokens per kernel block
    blocks_per_page: int
    dtype: torch.dtype
    layouts: tuple[str, ...]


@dataclass(frozen=True)
class MambaShape:
    name: str
    layers: int
    conv_dim: int
    conv_len: int
    heads: int
    head_v: int
    head_k: int
    conv_dtype: torch.dtype
    ssm_dtype: torch.dtype
    page_padded: int  # bytes per block in the cache (the attention page it is padded to)


def model_shapes() -> list[AttnShape | MambaShape]:
    # Qwen3.5-0.8B-class hybrid: 6 attention layers (2 KV heads x 256) + 18 GDN layers
    # (16 k/v heads x 128, conv kernel 4, fp32 SSM state) -> Mamba page 1,085,440 B; attention
    # needs 2,048 B/token/layer -> unified block 544 tokens (1,114,112 B, Mamba padded to it).
    gdn_conv_dim = 2 * 128 * 16 + 128 * 16
    attn_token_bytes = 2 * 256 * 2 * 2
    return [
        AttnShape("dense-8B (32L, 8x128, 16-tok kernel blocks, 64-tok pages)", 32, 8, 128, 16, 4,
                  torch.bfloat16, ("LBHNC", "LBNHC", "SPLIT_NHD")),
        AttnShape("dense-8B (32L, 8x128, 16-tok pages)", 32, 8, 128, 16, 1, torch.bfloat16, ("LBNHC",)),
        AttnShape("hybrid-0.8B attention (6L, 2x256, 544-tok blocks)", 6, 2, 256, 544, 1, torch.bfloat16,
                  ("LBHNC", "LBNHC")),
        AttnShape("hybrid-0.8B attention (6L, 2x256, 544 = 17 x 32-tok kernel blocks)", 6, 2, 256, 32, 17,
                  torch.bfloat16, ("LBNHC",)),
        MambaShape("hybrid-0.8B GDN group (6L, conv 6144x3 bf16 SD, ssm 16x128x128 fp32)", 6, gdn_conv_dim, 3,
                   16, 128, 128, torch.bfloat16, torch.float32, 544 * attn_token_bytes),
        AttnShape("gemma3-12B sliding window (8L, 8x256, 16-tok kernel blocks, 64-tok pages)", 8, 8, 256, 16, 4,
                  torch.bfloat16, ("LBNHC",)),
    ]


# ---------------------------------------------------------------------------- case building
@dataclass
class Case:
    label: str
    layout_name: str
    copier_args: tuple[list[torch.Tensor], Any, int, list[int | None]]
    page_layout: Any
    ids: torch.Tensor  # [n_pages, bpp] on the device
    baseline_rows: list[tuple[torch.Tensor, torch.Tensor]]  # (src rows [nb, bytes], dense out [n, bytes])
    block_ids_flat: torch.Tensor


def build_attention(shape: AttnShape, layout: str, n_pages: int, device: str) -> Case:
    from tierstore.kernels.views import make_attention_caches
    from tierstore.layout import attention_layout

    bpp = shape.blocks_per_page
    nb = n_pages * bpp + 8
    backing, views = make_attention_caches(layout, shape.layers, nb, shape.heads, shape.kernel_tokens,
                                           shape.head_size, shape.dtype, device)
    torch.manual_seed(1)
    for b in backing:
        b.view(torch.uint8).random_(0, 256)  # random bits (never zeros: they hide unwritten bytes)
    gen = torch.Generator().manual_seed(1)
    dtype_name = str(shape.dtype).removeprefix("torch.")
    lay = attention_layout([f"layer.{i}" for i in range(shape.layers)], shape.heads, shape.kernel_tokens * bpp,
                           shape.head_size, dtype_name)
    ids = torch.randperm(nb, generator=gen)[: n_pages * bpp].view(n_pages, bpp).to(device)
    flat = ids.reshape(-1)
    # baseline: whole physical block rows of the same bytes
    base: list[tuple[torch.Tensor, torch.Tensor]] = []
    if layout.startswith("SPLIT_"):
        for b in backing:  # [2, nb, ...]: K plane and V plane rows
            rows = b.view(torch.uint8).view(2, nb, -1)
            for plane in rows:
                base.append((plane, torch.empty(flat.numel(), plane.shape[1], dtype=torch.uint8, device=device)))
    elif layout[0] == "L":
        for b in backing:  # one allocation [L, ...]: per layer rows
            per_layer = b.view(torch.uint8).view(shape.layers, -1)
            if layout[1] == "B":
                for li in range(shape.layers):
                    rows = per_layer[li].view(nb, -1)
                    base.append((rows, torch.empty(flat.numel(), rows.shape[1], dtype=torch.uint8, device=device)))
            else:
                raise ValueError(f"no baseline for {layout}")
    else:  # block-outer: one row per block holds every layer
        b = backing[0].view(torch.uint8).view(nb, -1)
        base.append((b, torch.empty(flat.numel(), b.shape[1], dtype=torch.uint8, device=device)))
    label = f"{shape.name} [{layout}]"
    return Case(label, layout, (views, lay, bpp, [1] * shape.layers), lay, ids, base, flat)


def build_mamba(shape: MambaShape, n_pages: int, device: str) -> Case:
    from tierstore.kernels.views import mamba_state_views
    from tierstore.layout import mamba_layout

    nb = n_pages + 8
    states = [("conv", (shape.conv_dim, shape.conv_len), shape.conv_dtype),
              ("temporal", (shape.heads, shape.head_v, shape.head_k), shape.ssm_dtype)]
    real = sum(torch.empty(s, dtype=t).nbytes for _, s, t in states)
    gen = torch.Generator().manual_seed(2)
    views: list[torch.Tensor] = []
    base: list[tuple[torch.Tensor, torch.Tensor]] = []
    for _ in range(shape.layers):
        raw = torch.empty(nb, shape.page_padded, dtype=torch.uint8, device=device).random_(0, 256)
        views.extend(mamba_state_views(raw, states, conv_state="conv", conv_layout="SD"))
        rows = raw[:, :real]
        base.append((rows, torch.empty(n_pages, real, dtype=torch.uint8, device=device)))
    lay = mamba_layout([f"gdn.{i}" for i in range(shape.layers)],
                       [(n, s, str(t).removeprefix("torch.")) for n, s, t in states])
    ids = torch.randperm(nb, generator=gen)[:n_pages].view(n_pages, 1).to(device)
    return Case(f"{shape.name} [raw int8 pages]", "mamba", (views, lay, 1, [None] * len(views)), lay, ids,
                base, ids.reshape(-1))


# ---------------------------------------------------------------------------- timing helpers
def _bench_ms(fn: Callable[[], Any], reps: int) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=max(20, reps), return_mode="median"))


def kernel_rows(case: Case, reps: int, configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from tierstore.kernels import GroupCopier
    from tierstore.kernels.triton_kernels import TritonCopier

    views, lay, bpp, cds = case.copier_args
    n = case.ids.shape[0]
    data = lay.data_bytes * n
    pages = torch.empty(n, lay.nbytes, dtype=torch.uint8, device=views[0].device)
    ids = case.ids
    flat = case.block_ids_flat
    out: list[dict[str, Any]] = []

    def gbps(ms: float) -> float:
        return data / (ms / 1e3) / GB

    base_bytes = sum(o.numel() for _, o in case.baseline_rows)
    sel = _bench_ms(lambda: [torch.index_select(src, 0, flat, out=o) for src, o in case.baseline_rows], reps)
    cpy = _bench_ms(lambda: [src.index_copy_(0, flat, o) for src, o in case.baseline_rows], reps)
    sel_gbps = base_bytes / (sel / 1e3) / GB
    cpy_gbps = base_bytes / (cpy / 1e3) / GB
    ref = GroupCopier(views, lay, bpp, cds, backend="torch")
    results: list[tuple[str, float, float, dict[str, int]]] = []
    for cfg in configs:
        tri = TritonCopier(views, lay, bpp, cds, **cfg)
        g = _bench_ms(lambda t=tri: t.gather(ids, pages), reps)
        s = _bench_ms(lambda t=tri: t.scatter(pages, ids), reps)
        plan = tri.describe()
        results.append(("triton", g, s, {**cfg, "launches": len(plan), "vec": max(p["vec"] for p in plan)}))
    g = _bench_ms(lambda: ref.gather(ids, pages), reps)
    s = _bench_ms(lambda: ref.scatter(pages, ids), reps)
    results.append(("torch", g, s, {}))
    for backend, g, s, cfg in results:
        out.append({
            "case": case.label, "backend": backend, "config": cfg, "pages": n, "page_bytes": lay.nbytes,
            "bytes": data, "gather_gbps": round(gbps(g), 1), "scatter_gbps": round(gbps(s), 1),
            "index_select_gbps": round(sel_gbps, 1), "index_copy_gbps": round(cpy_gbps, 1),
            "gather_ratio": round(gbps(g) / sel_gbps, 3), "scatter_ratio": round(gbps(s) / cpy_gbps, 3),
        })
    return out


def host_direct_row(case: Case, reps: int, pcie: dict[str, float]) -> dict[str, Any]:
    """Triton gather/scatter straight between the cache and pinned host pages (over PCIe),
    against a plain pinned<->device copy of the same size."""
    from tierstore.kernels.triton_kernels import TritonCopier

    views, lay, bpp, cds = case.copier_args
    n = case.ids.shape[0]
    host = torch.empty(n, lay.nbytes, dtype=torch.uint8).pin_memory()
    tri = TritonCopier(views, lay, bpp, cds)
    g = _bench_ms(lambda: tri.gather(case.ids, host), reps)
    s = _bench_ms(lambda: tri.scatter(host, case.ids), reps)
    data = lay.data_bytes * n
    out = {"case": case.label, "pages": n, "gather_to_pinned_gbps": round(data / (g / 1e3) / GB, 2),
           "scatter_from_pinned_gbps": round(data / (s / 1e3) / GB, 2)}
    out["gather_vs_d2h"] = round(out["gather_to_pinned_gbps"] / pcie["d2h_gbps"], 3)
    out["scatter_vs_h2d"] = round(out["scatter_from_pinned_gbps"] / pcie["h2d_gbps"], 3)
    return out


# ---------------------------------------------------------------------------- raw baselines
def raw_pcie(nbytes: int, device: str, reps: int = 5) -> dict[str, float]:
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    res = {}
    for name, dst, src in (("d2h", host, dev), ("h2d", dev, host)):
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src, non_blocking=True)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        res[f"{name}_gbps"] = round(nbytes / statistics.median(times) / GB, 2)
    return res


def _drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def raw_files(root: Path, bufs: list[memoryview], threads: int, cold: bool) -> dict[str, float]:
    """Plain write (no header, no checksum, no rename) then read of one file per buffer."""
    d = root / "raw"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    paths = [d / f"p{i}" for i in range(len(bufs))]
    total = sum(len(b) for b in bufs)

    def write(i: int) -> None:
        fd = os.open(paths[i], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = bufs[i]
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)

    def read(i: int) -> None:
        fd = os.open(paths[i], os.O_RDONLY)
        try:
            pos = 0
            while pos < len(bufs[i]):
                n = os.preadv(fd, [bufs[i][pos:]], pos)
                if n <= 0:
                    raise OSError("short read")
                pos += n
        finally:
            os.close(fd)

    with ThreadPoolExecutor(threads) as ex:
        os.sync()  # no earlier writeback running under the measurement
        t0 = time.perf_counter()
        list(ex.map(write, range(len(bufs))))
        w = time.perf_counter() - t0
        t0 = time.perf_counter()
        list(ex.map(read, range(len(bufs))))
        r_warm = time.perf_counter() - t0
        r_cold = None
        if cold and _drop_caches():
            t0 = time.perf_counter()
            list(ex.map(read, range(len(bufs))))
            r_cold = time.perf_counter() - t0
    shutil.rmtree(d, ignore_errors=True)
    out = {"write_gbps": round(total / w / GB, 2), "read_warm_gbps": round(total / r_warm / GB, 2)}
    if r_cold is not None:
        out["read_cold_gbps"] = round(total / r_cold / GB, 2)
    return out


# ---------------------------------------------------------------------------- pipelines
def _idle(progressed: bool, last: float) -> tuple[float, bool]:
    """A pipeline loop's bookkeeping: (time of the last progress, stalled). Without progress it
    sleeps briefly; ``STALL_S`` without any is a stall (a hang is a bug: the caller raises)."""
    now = time.perf_counter()
    if progressed:
        return now, False
    if now - last > STALL_S:
        return last, True
    time.sleep(0.0005)
    return last, False


def transfer_pipeline(case: Case, root: Path, batch: int, threads: int, cold: bool, slots: int = 0) -> dict[str, Any]:
    from tierstore.config import TierStoreConfig
    from tierstore.engine import IOEngine
    from tierstore.format import GroupKind
    from tierstore.identity import GroupSpec, Namespace
    from tierstore.kernels import GroupCopier
    from tierstore.kernels.transfer import PageTransfer

    views, lay, bpp, cds = case.copier_args
    n = case.ids.shape[0]
    ids_cpu = case.ids.cpu()
    copier = GroupCopier(views, lay, bpp, cds)
    tokens = lay.sections[0].shape[1] if case.layout_name != "mamba" else 1
    kind = GroupKind.MAMBA if case.layout_name == "mamba" else GroupKind.ATTENTION
    group = GroupSpec(kind, tokens, tokens, tuple(s.name for s in lay.sections), lay)
    ns = Namespace(model=f"bench/{case.label}", dtype="bfloat16", groups=(group,), hash_algo="sha256")
    shutil.rmtree(root / "ts", ignore_errors=True)
    config = TierStoreConfig(root=str(root / "ts"), io_threads=threads, odirect="off")
    n_slots = slots or 3 * batch
    transfer = PageTransfer(copier, scratch_pages=2 * batch)
    transfer.warm_up()
    keys = [i.to_bytes(4, "little") * 4 for i in range(n)]
    total = lay.nbytes * n
    out: dict[str, Any] = {"case": case.label, "pages": n, "page_bytes": lay.nbytes, "batch": batch,
                           "io_threads": threads, "staging_slots": n_slots,
                           "checksums_on_gpu": transfer.checksums_on_gpu}
    verify_on_cpu = not transfer.checksums_on_gpu
    with IOEngine(root / "ts", ns, 0, config=config, staging_slots=n_slots, pin=True) as engine:
        out["slots_pinned"] = engine.pinned
        # warm-up (untimed): compiles the gather/scatter/checksum kernels of this shape for the
        # batch sizes Triton specializes differently (1, other, multiples of 16)
        for k in sorted({1, 2, min(batch, n), min(16, batch, n)}):
            wslots = [engine.acquire_slot() for _ in range(k)]
            wh = transfer.start_store(ids_cpu[:k], wslots)
            transfer.wait()
            transfer.start_load(wslots, ids_cpu[:k], expect=wh.sums if wh is not None else None)
            transfer.wait()
            for s in wslots:
                engine.release_slot(s)
        # ---- store: cache -> scratch -> pinned slot -> file
        os.sync()
        torch.cuda.synchronize()
        t0 = last = time.perf_counter()
        next_page = 0
        waiting: list[tuple[Any, int]] = []  # (handle, first page)
        stored = failed = batches = 0
        while stored + failed < n:
            progressed = False
            for h in transfer.poll():
                first = next(p for hh, p in waiting if hh is h)
                waiting = [(hh, p) for hh, p in waiting if hh is not h]
                sums = h.sums  # the GPU's section checksums (None: the engine hashes)
                for j, slot in enumerate(h.slots):
                    engine.submit_store(keys[first + j], slot, tokens, sums=sums[j] if sums else None)
                progressed = True
            free = engine.free_slots
            want = min(batch, n - next_page)
            # Start a full batch, or what is free once the engine is about to run dry: starting
            # each slot as it frees (a page per launch) pays a transfer's fixed cost per page.
            if next_page < n and free > 0 and (free >= want or (
                    not waiting and engine.stats["queued_stores"] < threads)):
                k = min(want, free)
                slots = [engine.acquire_slot() for _ in range(k)]
                h = transfer.start_store(ids_cpu[next_page : next_page + k], slots)
                if h is None:
                    for s in slots:
                        engine.release_slot(s)
                else:
                    waiting.append((h, next_page))
                    next_page += k
                    batches += 1
                    progressed = True
            for r in engine.poll():
                if r.ok:
                    stored += 1
                else:
                    failed += 1
                    out.setdefault("store_errors", str(r.error))
                progressed = True
            last, stalled = _idle(progressed, last)
            if stalled:
                raise RuntimeError(f"store pipeline stalled: {stored} stored, {failed} failed, next page {next_page}, "
                                   f"{len(waiting)} transfers waiting, engine {engine.stats}")
        out["store_s"] = time.perf_counter() - t0
        out["store_gbps"] = round(total / out["store_s"] / GB, 2)
        out["store_failed"] = failed
        out["store_pages_per_transfer"] = round(n / max(1, batches), 2)

        # ---- load: file -> slot -> scratch -> scatter (warm, then cold)
        def load_all() -> float:
            torch.cuda.synchronize()
            t0 = last = time.perf_counter()
            submitted = 0
            ready: list[tuple[Any, int, Any]] = []  # (slot, page, header sums to check or None)
            started: list[Any] = []
            failed: list[int] = []
            done_pages = 0
            job_page: dict[int, int] = {}
            while done_pages < n:
                progressed = False
                while submitted < n and engine.free_slots > 0 and len(job_page) < n_slots:
                    job_page[engine.submit_load(keys[submitted], verify=verify_on_cpu)] = submitted
                    submitted += 1
                    progressed = True
                for r in engine.poll():
                    page = job_page.pop(r.job_id)
                    if not r.ok:
                        raise RuntimeError(f"load failed: {r.error}")
                    ready.append((r.slot, page, None if r.verified else r.sums))
                    progressed = True
                if ready:  # start with what is there (up to a batch): keeps the engine's slots cycling
                    take = ready[:batch]
                    rows = torch.stack([ids_cpu[p] for _, p, _ in take])
                    expect = [c for _, _, c in take]
                    h = transfer.start_load([s for s, _, _ in take], rows,
                                            expect=expect if any(c is not None for c in expect) else None)
                    if h is not None:
                        ready = ready[len(take):]
                        started.append(h)
                        progressed = True
                still = []
                for h in started:
                    if h.slots_free():
                        for s in h.slots:
                            engine.release_slot(s)
                        done_pages += len(h.slots)
                    else:
                        still.append(h)
                started = still
                for h in transfer.poll():
                    failed.extend(h.failed)
                last, stalled = _idle(progressed, last)
                if stalled:
                    raise RuntimeError(f"load pipeline stalled: {done_pages} done, {submitted} submitted, "
                                       f"{len(ready)} ready, {len(started)} started, engine {engine.stats}")
            for h in transfer.wait():
                failed.extend(h.failed)
            torch.cuda.synchronize()
            if failed:
                raise RuntimeError(f"{len(failed)} pages failed the GPU checksum check")
            return time.perf_counter() - t0

        # check: poison the blocks, load, and compare with the pages gathered before
        ref = GroupCopier(views, lay, bpp, cds, backend="torch")
        want = torch.zeros(n, lay.nbytes, dtype=torch.uint8, device=views[0].device)
        got = torch.zeros_like(want)
        ref.gather(case.ids, want)

        def poison() -> None:
            for v in views:
                v[case.block_ids_flat] = 0

        poison()
        warm = load_all()
        ref.gather(case.ids, got)
        out["verified"] = bool(torch.equal(got, want))
        out["load_warm_gbps"] = round(total / warm / GB, 2)
        if cold and _drop_caches():
            poison()
            out["load_cold_gbps"] = round(total / load_all() / GB, 2)
            got.zero_()
            ref.gather(case.ids, got)
            out["verified"] = out["verified"] and bool(torch.equal(got, want))
        out["engine_io_mode"] = engine.stats["io_mode"]
        # the same engine without the GPU: how much of the gap to raw files is the engine's own
        eng = engine_only(engine, [b"E" + k[1:] for k in keys], tokens, cold, hash_on_cpu=verify_on_cpu)
        out.update(eng)
    shutil.rmtree(root / "ts", ignore_errors=True)
    return out


def engine_only(engine: Any, keys: list[bytes], tokens: int, cold: bool, hash_on_cpu: bool = True) -> dict[str, float]:
    """IOEngine store then load of the same number of pages from/to its slots, no GPU.

    ``hash_on_cpu=False``: the engine's work in the GPU-checksum pipeline (sums handed in,
    loads not verified by the engine), i.e. the engine's I/O alone."""
    n = len(keys)
    fake_sums = None if hash_on_cpu else [0] * len(engine.layout.sections)
    total = engine.layout.nbytes * n
    os.sync()
    t0 = time.perf_counter()
    submitted = done = 0
    while done < n:
        while submitted < n and engine.free_slots > 0:
            slot = engine.acquire_slot()  # holds the bytes of an earlier page: content does not matter
            engine.submit_store(keys[submitted], slot, tokens, sums=fake_sums)
            submitted += 1
        res = engine.poll()
        done += len(res)
        if not res:
            time.sleep(0.0005)
    store_s = time.perf_counter() - t0

    def load() -> float:
        t0 = time.perf_counter()
        submitted = done = 0
        while done < n:
            while submitted < n and engine.free_slots > 0:
                engine.submit_load(keys[submitted], verify=hash_on_cpu)
                submitted += 1
            res = engine.poll()
            for r in res:
                if not r.ok:
                    raise RuntimeError(f"engine-only load failed: {r.error}")
                engine.release_slot(r.slot)
            done += len(res)
            if not res:
                time.sleep(0.0005)
        return time.perf_counter() - t0

    out = {"engine_only_store_gbps": round(total / store_s / GB, 2), "engine_only_load_warm_gbps": round(total / load() / GB, 2)}
    if cold and _drop_caches():
        out["engine_only_load_cold_gbps"] = round(total / load() / GB, 2)
    return out


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One row for a case: every number is the median over the repeats (each ratio paired
    with the raw figures of its own repeat), with the per-repeat ratios kept for the spread."""
    out = dict(runs[-1])
    for key, val in runs[-1].items():
        if isinstance(val, float | int) and not isinstance(val, bool):
            out[key] = round(statistics.median(r[key] for r in runs if key in r), 3)
    out["raw_files"] = {k: round(statistics.median(r["raw_files"][k] for r in runs), 2) for k in runs[-1]["raw_files"]}
    out["verified"] = all(r.get("verified") for r in runs)
    out["repeats"] = len(runs)
    out["per_repeat"] = [{k: r[k] for k in ("store_ratio", "load_warm_ratio", "load_cold_ratio", "store_gbps",
                                            "load_warm_gbps", "engine_only_store_gbps", "engine_only_load_warm_gbps")
                          if k in r} | {"raw_files": r["raw_files"]} for r in runs]
    return out


# ---------------------------------------------------------------------------- driver
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--json-out", default=None, help="also write the JSON report to this file")
    parser.add_argument("--root", default=None, help="scratch directory for the transfer benchmark (default: a temp dir)")
    parser.add_argument("--mib", type=int, default=512, help="payload MiB per kernel measurement (default 512)")
    parser.add_argument("--transfer-mib", type=int, default=1024, help="payload MiB per transfer measurement (default 1024)")
    parser.add_argument("--batch", type=int, default=None,
                        help="pages per transfer batch (default: --batch-mib worth of pages)")
    parser.add_argument("--batch-mib", type=int, default=64,
                        help="payload per transfer batch when --batch is not given (default 64 MiB, the "
                             "vLLM worker's transfer_scratch_mib: it batches by bytes too)")
    parser.add_argument("--io-threads", type=int, default=4, help="IOEngine and raw-file threads (default 4)")
    parser.add_argument("--slots", type=int, default=0, help="IOEngine staging slots (default 3 x batch)")
    parser.add_argument("--skip-kernels", action="store_true", help="transfer path only")
    parser.add_argument("--reps", type=int, default=100, help="do_bench repetition time in ms (default 100)")
    parser.add_argument("--sweep", action="store_true", help="also try other Triton tile sizes / warps (first case)")
    parser.add_argument("--skip-transfer", action="store_true", help="kernels only")
    parser.add_argument("--no-cold", action="store_true", help="do not drop the page cache for cold loads")
    parser.add_argument("--repeats", type=int, default=3,
                        help="transfer: raw-then-pipeline pairs per case; medians reported (default 3)")


def _print(rep: dict[str, Any]) -> None:
    print(f"device: {rep['device']}  torch {rep['torch']}  triton {rep['triton']}")
    print("\nkernels (GB/s of page payload; ratio = vs index_select / index_copy_ on the same bytes)")
    print(f"{'case':<88} {'backend':<7} {'gather':>7} {'isel':>7} {'ratio':>6} {'scatter':>7} {'icopy':>7} {'ratio':>6}")
    for r in rep["kernels"]:
        c = r["config"]
        cfg = f"t{c['tile_words']}w{c['num_warps']}v{c['vec']}" if c else ""
        print(f"{r['case'][:72] + ' ' + cfg:<88} {r['backend']:<7} {r['gather_gbps']:>7} {r['index_select_gbps']:>7} "
              f"{r['gather_ratio']:>6} {r['scatter_gbps']:>7} {r['index_copy_gbps']:>7} {r['scatter_ratio']:>6}")
    if rep.get("host_direct"):
        print("\nTriton straight to/from pinned host pages (GB/s; ratio vs a plain pinned copy)")
        for r in rep["host_direct"]:
            print(f"{r['case'][:80]:<82} gather {r['gather_to_pinned_gbps']} (x{r['gather_vs_d2h']}) "
                  f"scatter {r['scatter_from_pinned_gbps']} (x{r['scatter_vs_h2d']})")
    if rep.get("transfer"):
        print(f"\nraw PCIe: {rep['raw_pcie']}  (ratio = pipeline / min(PCIe, raw file) of the same direction)")
        for t in rep["transfer"]:
            print(f"  raw files for the next case: {t['raw_files']}")
            spread = {k: (min(r[k] for r in t["per_repeat"]), max(r[k] for r in t["per_repeat"]))
                      for k in ("store_ratio", "load_warm_ratio", "load_cold_ratio") if k in t["per_repeat"][0]}
            print(f"{t['case'][:70]:<72} verified={t.get('verified')} gpu checksums={t.get('checksums_on_gpu')} "
                  f"medians of {t['repeats']}: store {t['store_gbps']} GB/s (x{t['store_ratio']}), "
                  f"load warm {t['load_warm_gbps']} (x{t['load_warm_ratio']})"
                  + (f", cold {t['load_cold_gbps']} (x{t.get('load_cold_ratio')})" if "load_cold_gbps" in t else "")
                  + "; per-repeat ratio ranges " + ", ".join(f"{k} {a}-{b}" for k, (a, b) in spread.items()))


def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("tierstore bench kernels: needs a CUDA device (the kernels' CPU path is the torch "
              "reference, measured by the tests only)", file=sys.stderr)
        return 2
    import triton

    device = "cuda"
    rep: dict[str, Any] = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "host": platform.node(), "kernels": [], "transfer": [],
    }
    configs: list[dict[str, Any]] = [{"tile_words": 4096, "num_warps": 4},
                                     {"tile_words": 4096, "num_warps": 4, "vector_hints": False}]
    sweep = configs + [{"tile_words": 2048, "num_warps": 4}, {"tile_words": 8192, "num_warps": 8},
                       {"tile_words": 16384, "num_warps": 8}]
    cases: list[Case] = []
    for shape in [] if args.skip_kernels else model_shapes():
        if isinstance(shape, MambaShape):
            per_page = shape.layers * (shape.conv_dim * shape.conv_len * 2 + shape.heads * shape.head_v * shape.head_k * 4)
            n = max(4, args.mib * 2**20 // per_page)
            cases.append(build_mamba(shape, n, device))
        else:
            per_page = shape.layers * shape.heads * shape.kernel_tokens * shape.blocks_per_page * 2 * shape.head_size * 2
            n = max(4, args.mib * 2**20 // per_page)
            for layout in shape.layouts:
                cases.append(build_attention(shape, layout, n, device))
    def save() -> None:
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(rep, indent=2) + "\n")

    for i, case in enumerate([] if args.skip_kernels else cases):
        _log(f"kernels: {case.label}")
        rep["kernels"].extend(kernel_rows(case, args.reps, sweep if i == 0 and args.sweep else configs))
        save()
    if cases:
        pcie = raw_pcie(256 * 2**20, device)
        rep["host_direct"] = [host_direct_row(c, args.reps, pcie) for c in cases
                              if c.layout_name in ("LBNHC", "mamba")]
        _log(f"host direct {rep['host_direct']}")
        save()
    if not args.skip_transfer:
        tmp = Path(args.root) if args.root else Path(tempfile.mkdtemp(prefix="tierstore-bench-"))
        tmp.mkdir(parents=True, exist_ok=True)
        faulthandler.dump_traceback_later(150, repeat=True)  # a hang shows where
        try:
            _log("raw PCIe")
            rep["raw_pcie"] = raw_pcie(args.transfer_mib * 2**20, device)
            _log(f"raw PCIe {rep['raw_pcie']}")
            transfer_cases = []
            for shape in model_shapes():
                if isinstance(shape, MambaShape):
                    per_page = shape.layers * (shape.conv_dim * shape.conv_len * 2 + shape.heads * shape.head_v * shape.head_k * 4)
                    transfer_cases.append(lambda s=shape, p=per_page: build_mamba(s, max(8, args.transfer_mib * 2**20 // p), device))
                elif shape.blocks_per_page in (4, 17):
                    per_page = shape.layers * shape.heads * shape.kernel_tokens * shape.blocks_per_page * 2 * shape.head_size * 2
                    transfer_cases.append(lambda s=shape, p=per_page: build_attention(
                        s, s.layouts[-1] if s.layouts[-1] != "SPLIT_NHD" else "LBNHC", max(8, args.transfer_mib * 2**20 // p), device))
            for make in transfer_cases:
                case = make()
                n = case.ids.shape[0]
                page = case.page_layout.nbytes
                slab = torch.empty(n * page, dtype=torch.uint8).pin_memory()
                slab.copy_(torch.randint(0, 256, (1 << 20,), dtype=torch.uint8).repeat(n * page >> 20)[: n * page]
                           if (n * page) % (1 << 20) == 0 else torch.randint(0, 256, (n * page,), dtype=torch.uint8))
                bufs = [memoryview(slab.numpy())[i * page : (i + 1) * page] for i in range(n)]
                pc = rep["raw_pcie"]
                runs: list[dict[str, Any]] = []
                for r in range(args.repeats):  # raw then pipeline, paired: drift hits both alike
                    _log(f"transfer: {case.label}: repeat {r + 1}/{args.repeats}: raw files")
                    raw = raw_files(tmp, bufs, args.io_threads, cold=not args.no_cold)
                    _log(f"raw files {raw}; pipeline")
                    batch = args.batch or max(1, (args.batch_mib << 20) // page)
                    t = transfer_pipeline(case, tmp, batch, args.io_threads, cold=not args.no_cold,
                                          slots=args.slots)
                    t["raw_files"] = raw
                    t["store_ratio"] = round(t["store_gbps"] / min(pc["d2h_gbps"], raw["write_gbps"]), 3)
                    t["load_warm_ratio"] = round(t["load_warm_gbps"] / min(pc["h2d_gbps"], raw["read_warm_gbps"]), 3)
                    t["store_vs_engine_only"] = round(t["store_gbps"] / t["engine_only_store_gbps"], 3)
                    t["load_warm_vs_engine_only"] = round(t["load_warm_gbps"] / t["engine_only_load_warm_gbps"], 3)
                    if "load_cold_gbps" in t and "read_cold_gbps" in raw:
                        t["load_cold_ratio"] = round(t["load_cold_gbps"] / min(pc["h2d_gbps"], raw["read_cold_gbps"]), 3)
                    runs.append(t)
                del bufs, slab
                t = _median_run(runs)
                rep["transfer"].append(t)
                _log(f"pipeline {t}")
                save()
                del case
                torch.cuda.empty_cache()
        finally:
            faulthandler.cancel_dump_traceback_later()
            if not args.root:
                shutil.rmtree(tmp, ignore_errors=True)
    save()
    if args.json:
        json.dump(rep, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        _print(rep)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tierstore bench kernels", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    threading.current_thread().name = "bench"
    sys.exit(main())
