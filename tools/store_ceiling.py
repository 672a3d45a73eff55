"""Issue 16's ceilings, measured piece by piece on one machine (the lent GPU host; run by
``tools/device_scaling.sh ceiling``): what a store of large pages costs beyond a raw write, and
what raw file I/O and PCIe reach when they run at the same time on the same memory, which is
what the GPU path does.

    python tools/store_ceiling.py membw
    python tools/store_ceiling.py store --root /dev/shm/c --threads 16 --page-mib 16 --total-mib 4096
    python tools/store_ceiling.py composed --root /dev/shm/c --threads 16 --page-mib 2,16 --total-mib 2048

``store``: the steps of tierstore's native store, added one at a time, every variant over the
same source pages, alternated in rounds (one table row per variant: median GB/s, and its ratio
to ``raw_trunc``, the baseline of ``tierstore bench io``):
  raw_trunc          Python os.open(O_TRUNC) of files written in the round before, os.write
  raw_new            the same into new files (the old ones unlinked before the clock starts)
  native_new         the native writer (``native.kernels.write_file``): temp, pwrite, rename
  native_overwrite   the same, renamed over the files of the round before (freed under the clock)
  native_hash_new    one XXH3 pass over the page, then native_new: tierstore's store minus headers
  hash_only          the XXH3 pass alone
  sections_K         XXH3 of every K KiB piece (as a page's sections), then one write: hashed like
                     a store whose sections are K KiB (with ``--chunks K,...``)
  in_cache_K         each K KiB piece hashed right before it is written (pwrite per piece, in
                     order): the page read from memory once, the write reading it from cache

``composed`` (CUDA): per thread and page, a device->pinned copy on the thread's own stream then a
raw write of the pinned page (stores), or a raw read into a pinned page then the copy to the
device (loads); against PCIe alone and file I/O alone from the same pinned pages at the same
thread count. ``ratio`` = composed / min(PCIe, file), the denominator of issue 16's target.

Threading: plain ThreadPoolExecutors; every timed call releases the GIL (os I/O, numba nogil
kernels, CUDA synchronisation). Not a test: prints tables, asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

GB = 1e9
MIB = 1 << 20


CPU: dict[str, list[tuple[float, float]]] = {}  # variant -> (user, system) CPU seconds per round


def timed(fn: Callable[[], Any], name: str = "") -> float:
    """Wall seconds of ``fn()``; with ``name``, its process CPU time (user, system) goes to CPU."""
    c0, t0 = os.times(), time.perf_counter()
    fn()
    wall, c1 = time.perf_counter() - t0, os.times()
    if name:
        CPU.setdefault(name, []).append((c1.user - c0.user, c1.system - c0.system))
    return wall


def membw(threads: int) -> None:
    """A large in-memory copy with torch's CPU threads: bytes copied per second."""
    import torch

    torch.set_num_threads(threads)
    src = torch.empty(2 << 30, dtype=torch.uint8).random_(0, 256)
    dst = torch.empty_like(src)
    dst.copy_(src)
    runs = [timed(lambda: dst.copy_(src)) for _ in range(5)]
    print(f"memory copy, {threads} threads: {src.numel() / statistics.median(runs) / GB:.1f} GB/s copied "
          f"(read + write: twice that of DRAM traffic)")


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        view = view[os.write(fd, view):]


class StoreVariants:
    """The variants of ``store`` over ``n`` pages of ``page`` bytes from a slab of ``slots``."""

    def __init__(self, root: Path, threads: int, page: int, n: int, source: str = "numpy") -> None:
        from tierstore.native import loader as native

        if not native.start(wait=True):
            raise SystemExit(f"the native path is not ready: {native.failure()}")
        from tierstore.native import kernels as native_kernels

        self.k = native_kernels
        self.root, self.threads, self.page, self.n = root, threads, page, n
        slots = 2 * threads + 2
        self.slab = _source_slab(source, slots, page)
        self.views = [memoryview(self.slab[i]) for i in range(slots)]
        self.addrs = [int(self.slab[i].ctypes.data) for i in range(slots)]
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        self.dir_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        self.names = [np.frombuffer(f"t{i}.tmp\0f{i}\0".encode(), dtype=np.uint8) for i in range(n)]
        self.final_at = [len(f"t{i}.tmp") + 1 for i in range(n)]
        self.sums = [np.empty(1, dtype=np.uint64) for _ in range(threads)]
        self.chunk_sums = [np.empty(page // 4096 + 1, dtype=np.uint64) for _ in range(threads)]
        self.pool = ThreadPoolExecutor(threads)

    def _slot(self, i: int) -> int:
        return i % len(self.views)

    def _unlink_all(self) -> None:
        for p in self.root.iterdir():
            p.unlink()

    def _map(self, fn: Callable[[int], None]) -> float:
        return timed(lambda: list(self.pool.map(fn, range(self.n))), fn.__qualname__)

    def raw(self, new: bool) -> float:
        if new:
            self._unlink_all()

        def one(i: int) -> None:
            fd = os.open(self.root / f"f{i}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                _write_all(fd, self.views[self._slot(i)])
            finally:
                os.close(fd)
        return self._map(one)

    def native(self, new: bool, hashed: bool) -> float:
        if new:
            self._unlink_all()
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC

        def one(i: int) -> None:
            addr = self.addrs[self._slot(i)]
            if hashed:
                self.k.hash_strided(addr, 1, self.page, self.page, self.sums[i % self.threads])
            names = self.names[i]
            base = int(names.ctypes.data)
            rc = self.k.write_file(self.dir_fd, base, base + self.final_at[i], flags, 0o644, addr, self.page,
                                   self.page, 0)
            if rc != 0:
                raise OSError(f"write_file failed for page {i}")
        return self._map(one)

    def chunked(self, chunk: int, in_cache: bool) -> float:
        self._unlink_all()
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        kernel = _chunked_writer()

        starts = np.arange(0, self.page, chunk, dtype=np.int64)
        spans = np.stack([starts, np.minimum(starts + chunk, self.page)], axis=1)
        spans.setflags(write=False)  # the kernels' signatures take read-only index arrays

        def one(i: int) -> None:
            names = self.names[i]
            base = int(names.ctypes.data)
            sums = self.chunk_sums[i % self.threads]
            if kernel(self.dir_fd, base, base + self.final_at[i], flags, 0o644, self.addrs[self._slot(i)], self.page,
                      chunk, spans, sums, int(in_cache)) != 0:
                raise OSError(f"the chunked writer failed for page {i}")
        return self._map(one)

    def hash_only(self) -> float:
        def one(i: int) -> None:
            self.k.hash_strided(self.addrs[self._slot(i)], 1, self.page, self.page, self.sums[i % self.threads])
        return self._map(one)

    def close(self) -> None:
        self.pool.shutdown()
        os.close(self.dir_fd)
        shutil.rmtree(self.root, ignore_errors=True)


_CHUNKED: Any = None


def _chunked_writer() -> Any:
    """A numba kernel (nogil, compiled once) made of the engine's own store steps: a new temp
    file whose K KiB sections are each hashed right before their piece is written
    (in_cache=1, ``native.kernels.write_hashed_in_pieces``, a store's buffered path) or all
    hashed before one write (0), then published under its final name (``publish_temp``).
    Returns 0, or nonzero with the temp removed."""
    global _CHUNKED
    if _CHUNKED is None:
        import numba

        from tierstore.native.kernels import (
            hash_spans,
            openat,
            publish_temp,
            write_hashed_in_pieces,
            write_range,
        )

        @numba.njit(nogil=True)
        def write_chunked(d: int, tmp: int, final: int, flags: int, mode: int, buf: int, length: int, chunk: int,
                          spans: Any, sums: Any, in_cache: int) -> int:
            f = openat(d, tmp, flags, mode)
            if f < 0:
                return -1
            if in_cache != 0:
                ok = write_hashed_in_pieces(f, buf, 0, length, chunk, spans, sums)
            else:
                hash_spans(buf, spans, 0, spans.shape[0], sums)
                ok = write_range(f, buf, 0, length)
            return publish_temp(d, f, tmp, final, length, length, 0, ok)
        _CHUNKED = write_chunked
    return _CHUNKED


def _source_slab(source: str, slots: int, page: int) -> np.ndarray:
    """The pages the store variants write: ``numpy`` (pageable, as the malloc gives it),
    ``thp`` (pageable, advised onto transparent huge pages: the engine's slots without CUDA),
    ``pinned`` (CUDA host memory: the engine's slots on a GPU machine)."""
    data = np.random.default_rng(0).integers(0, 256, size=(slots, page), dtype=np.uint8)
    if source == "numpy":
        return data
    import torch

    if source == "pinned":
        t = torch.empty((slots, page), dtype=torch.uint8, pin_memory=True)
    else:
        from tierstore.fs.directio import advise_huge_pages

        t = torch.empty((slots, page), dtype=torch.uint8)
        advise_huge_pages(t.data_ptr(), t.numel())
    arr = t.numpy()
    arr[:] = data
    return arr


def store(root: Path, threads: int, page_mib: int, total_mib: int, rounds: int, chunks: tuple[int, ...] = (),
          source: str = "numpy") -> None:
    n = total_mib // page_mib
    v = StoreVariants(root, threads, page_mib * MIB, n, source)
    variants: dict[str, Callable[[], float]] = {
        "raw_trunc": lambda: v.raw(new=False),
        "raw_new": lambda: v.raw(new=True),
        "native_new": lambda: v.native(new=True, hashed=False),
        "native_overwrite": lambda: v.native(new=False, hashed=False),
        "native_hash_new": lambda: v.native(new=True, hashed=True),
        "hash_only": v.hash_only,
    }
    for kib in chunks:
        variants[f"sections_{kib}"] = lambda kib=kib: v.chunked(kib << 10, in_cache=False)
        variants[f"in_cache_{kib}"] = lambda kib=kib: v.chunked(kib << 10, in_cache=True)
    v.raw(new=True)  # files for the first raw_trunc; warms the kernels and the page allocator
    times: dict[str, list[float]] = {name: [] for name in variants}
    cpu: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    for r in range(rounds):
        order = list(variants) if r % 2 == 0 else list(reversed(variants))
        for name in order:
            if name == "native_overwrite":
                v.native(new=True, hashed=False)  # final names to rename over (untimed)
            CPU.clear()
            times[name].append(variants[name]())
            cpu[name].append(next(iter(CPU.values()))[-1])
    v.close()
    total = n * page_mib * MIB
    base = total / statistics.median(times["raw_trunc"]) / GB
    print(f"\nstore steps: {page_mib} MiB pages x {n}, {threads} threads, {rounds} rounds, {root}, "
          f"source pages: {source}")
    print("| variant | GB/s (median) | min-max | vs raw_trunc | user CPU s/GB | system CPU s/GB |\n"
          "|---|---|---|---|---|---|")
    for name, ts in times.items():
        g = [total / t / GB for t in ts]
        med = total / statistics.median(ts) / GB
        user, system = (statistics.median(c[k] for c in cpu[name]) / (total / GB) for k in (0, 1))
        print(f"| {name} | {med:.1f} | {min(g):.1f}-{max(g):.1f} | {med / base:.2f} | {user:.3f} | {system:.3f} |")


def composed(root: Path, threads: int, page_mib: int, total_mib: int, rounds: int) -> None:
    """Raw file I/O and PCIe, apart and together, on the same pinned pages."""
    import torch

    page = page_mib * MIB
    n = total_mib // page_mib
    slots = 2 * threads + 2
    pinned = torch.empty(slots, page, dtype=torch.uint8, pin_memory=True)
    pinned.random_(0, 256)
    views = [memoryview(pinned[i].numpy()) for i in range(slots)]
    dev = torch.empty(n, page, dtype=torch.uint8, device="cuda").random_(0, 256)
    streams = [torch.cuda.Stream() for _ in range(threads)]
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    paths = [str(root / f"p{i}") for i in range(n)]
    pool = ThreadPoolExecutor(threads)
    tid: dict[int, int] = {}

    def stream() -> torch.cuda.Stream:
        import threading

        me = threading.get_ident()
        if me not in tid:
            tid[me] = len(tid)
        return streams[tid[me] % threads]

    def write(i: int) -> None:
        fd = os.open(paths[i], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _write_all(fd, views[i % slots])
        finally:
            os.close(fd)

    def read(i: int) -> None:
        fd = os.open(paths[i], os.O_RDONLY)
        try:
            got = 0
            while got < page:
                got += os.preadv(fd, [views[i % slots][got:]], got)
        finally:
            os.close(fd)

    def d2h(i: int) -> None:
        s = stream()
        with torch.cuda.stream(s):
            pinned[i % slots].copy_(dev[i], non_blocking=True)
        s.synchronize()

    def h2d(i: int) -> None:
        s = stream()
        with torch.cuda.stream(s):
            dev[i].copy_(pinned[i % slots], non_blocking=True)
        s.synchronize()

    steps: dict[str, Callable[[int], None]] = {
        "pcie_d2h": d2h, "file_write": write, "store_composed": lambda i: (d2h(i), write(i)),
        "pcie_h2d": h2d, "file_read_warm": read, "load_composed": lambda i: (read(i), h2d(i)),
    }
    list(pool.map(write, range(n)))  # the files and the streams exist before the clock starts
    list(pool.map(d2h, range(n)))
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for r in range(rounds):
        for name in (steps if r % 2 == 0 else reversed(list(steps))):
            times[name].append(timed(lambda name=name: list(pool.map(steps[name], range(n)))))
    pool.shutdown()
    shutil.rmtree(root, ignore_errors=True)
    total = n * page
    g = {name: total / statistics.median(ts) / GB for name, ts in times.items()}
    print(f"\ncomposed: {page_mib} MiB pages x {n}, {threads} threads, {rounds} rounds, {root}")
    print("| direction | PCIe alone | file alone | min | composed | ratio |\n|---|---|---|---|---|---|")
    for d, (p, f, c) in {"store": ("pcie_d2h", "file_write", "store_composed"),
                         "load": ("pcie_h2d", "file_read_warm", "load_composed")}.items():
        lo = min(g[p], g[f])
        print(f"| {d} | {g[p]:.1f} | {g[f]:.1f} | {lo:.1f} | {g[c]:.1f} | {g[c] / lo:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("membw", "store", "composed"))
    ap.add_argument("--root", type=Path, default=Path("/dev/shm/tierstore-ceiling"))
    ap.add_argument("--threads", default="16", help="a comma list sweeps")
    ap.add_argument("--page-mib", default="16", help="a comma list sweeps")
    ap.add_argument("--total-mib", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--chunks", default="", help="store: also the sections_K and in_cache_K variants, K in KiB "
                                                 "(a comma list, e.g. 256,1024)")
    ap.add_argument("--source", default="numpy", help="store: the memory the pages are written from, a comma "
                                                      "list of numpy, thp, pinned (CUDA host memory)")
    a = ap.parse_args()
    for t in (int(x) for x in a.threads.split(",")):
        if a.what == "membw":
            membw(t)
            continue
        for p in (int(x) for x in a.page_mib.split(",")):
            if a.what == "store":
                for source in a.source.split(","):
                    store(a.root, t, p, a.total_mib, a.rounds, tuple(int(k) for k in a.chunks.split(",") if k), source)
            else:
                composed(a.root, t, p, a.total_mib, a.rounds)


if __name__ == "__main__":
    main()
