"""The three systems ``tierstore bench io`` (io.py) measures, each with ``store(n, run)`` and
``load()`` over the same page bytes and the same number of threads:

- ``RawSystem``: plain Python file I/O (``os.open`` + ``os.write`` loop; ``os.readv`` into a
  buffer), one file per page, no header, no checksum, no temp/rename. Raw *loads* read the
  tierstore files (whole, unverified): same bytes, same disk blocks, same page-cache pages;
- ``TierstoreSystem``: ``IOEngine`` (header, xxh3 per section, temp + rename, verification on
  load);
- ``VllmFsSystem``: vLLM's fs-tier functions ``batch_store_block`` / ``batch_load_block`` (its
  C extension when built), with O_DIRECT when vLLM's own probe says it works, as vLLM runs them.

``open_systems`` builds them for one repeat; baseline loads land in a ``_DestPool``.
Threading: each system drives its own thread pool (or the engine's I/O threads) from the
benchmark's thread; nothing here is used by the library.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import xxhash

from tierstore.bench.transfer import IoBusy
from tierstore.config import TierStoreConfig
from tierstore.format.identity import Namespace
from tierstore.fs.mapper import fanout
from tierstore.rootstore.engine import ALIGN, IOEngine


def _key(size_tag: str, run: int, i: int) -> bytes:
    return f"{size_tag}-{run}-{i}".encode().ljust(32, b"\0")


def _unlink_all(paths: list[Any]) -> None:
    for p in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)


def _aligned_buffer(nbytes: int) -> tuple[torch.Tensor, memoryview]:
    base = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    skew = (-base.data_ptr()) % ALIGN
    t = base[skew : skew + nbytes]
    return t, memoryview(t.numpy()).cast("B")


class _DestPool:
    """Where baseline loads put their pages: ``count`` page buffers used in turn (page i goes to
    buffer i % count), or one buffer per thread (``count`` = 0).

    The engine must read every in-flight page into its own staging slot (the caller holds it
    until the page is consumed), so by default the baselines get as many buffers as the engine
    has slots: the same memory footprint and CPU-cache behaviour. One reused buffer per thread
    stays hot in the CPU cache and made 2 MiB page-cache copies ~30% cheaper (measured), a
    speed no caller that keeps its pages could have.
    """

    def __init__(self, nbytes: int, count: int) -> None:
        self.nbytes, self.count = nbytes, count
        self.bufs = [_aligned_buffer(nbytes)[1] for _ in range(count)]
        for b in self.bufs:  # touched once, like the engine's slots: no page faults while timed
            b[:] = bytes(nbytes)
        self._local = threading.local()

    def get(self, i: int) -> memoryview:
        if self.count:
            return self.bufs[i % self.count]
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = _aligned_buffer(self.nbytes)[1]
            buf[:] = bytes(self.nbytes)
        return buf


class RawSystem:
    """Plain file I/O of the same bytes: no header, no checksum, no temp file. Each repeat
    stores into new files (``drop_files`` unlinks the last repeat's before the clock), as
    tierstore does: rewriting a file frees its old pages under the clock, which made a repeat's
    raw stores 17-22% slower than the one before on tmpfs at 16 threads, so the ratio
    depended on the repeat (docs/measurements/scaling.md)."""

    def __init__(self, d: Path, sources: list[memoryview], threads: int, page_bytes: int,
                 dest_buffers: int = 0) -> None:
        self.dir, self.sources, self.threads, self.page_bytes = d, sources, threads, page_bytes
        self.paths: list[Path] = []
        self.load_paths: list[Path] = []
        # Room for a tierstore header as well (raw loads read the tierstore files).
        self.dest = _DestPool(page_bytes + 64 * 1024, dest_buffers)

    def store(self, n: int, run: int) -> None:
        # Same directory fan-out as tierstore's FileMapper: only format and publish differ.
        self.paths = [self.dir / fanout(k) / f"{k.hex()}.bin" for k in (_key("raw", run, i) for i in range(n))]

        def one(i: int) -> None:
            self.paths[i].parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.paths[i], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                view = self.sources[i % len(self.sources)]
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)

        with ThreadPoolExecutor(self.threads) as ex:
            list(ex.map(one, range(n)))

    def drop_files(self) -> None:
        """Unlink the last repeat's files (not timed)."""
        _unlink_all(self.paths)

    def load(self) -> None:
        """Read every file in ``load_paths`` (default: its own) whole, into ``dest`` buffers."""
        paths = self.load_paths or self.paths

        def one(i: int) -> None:
            buf = self.dest.get(i)
            fd = os.open(paths[i], os.O_RDONLY)
            try:
                got = 0
                while True:
                    n = os.readv(fd, [buf[got:]])
                    if n == 0:
                        break
                    got += n
                if got < self.page_bytes:
                    raise OSError("short read")
            finally:
                os.close(fd)

        with ThreadPoolExecutor(self.threads) as ex:
            list(ex.map(one, range(len(paths))))


class TierstoreSystem:
    def __init__(self, root: Path, ns: Namespace, sources: list[memoryview], threads: int,
                 config: TierStoreConfig, tag: str, slots: int = 0) -> None:
        self.engine = IOEngine(root, ns, 0, config=config, staging_slots=slots or 2 * threads + 2)
        # Fill every slot once with page bytes: a store then needs no copy (in vLLM the slot
        # is filled by the device->host gather, which the raw baseline does not do either).
        for s in self.engine.slots:
            s.view[:] = sources[s.index % len(sources)]
        self.tag = tag
        self.keys: list[bytes] = []
        self.io_busy: dict[str, float] = {}  # the I/O threads' busy share of the last store and load

    def store(self, n: int, run: int) -> None:
        eng = self.engine
        io = IoBusy(eng)
        self.keys = [_key(self.tag, run, i) for i in range(n)]
        ids = []
        for k in self.keys:
            slot = eng.acquire_slot(timeout=None)
            assert slot is not None
            ids.append(eng.submit_store(k, slot, 0))
        results = eng.wait(ids, timeout=600)
        bad = [r.error for r in results if not r.ok]
        if bad or len(results) != n:
            raise RuntimeError(f"tierstore store failed: {bad[:3]} ({len(results)}/{n} finished)")
        self.io_busy["store"] = io.done("store")["store_io_busy"]

    def paths(self) -> list[Path]:
        return [self.engine.mapper.path_for(k) for k in self.keys]

    def load(self) -> None:
        eng = self.engine
        io = IoBusy(eng)
        window = len(eng.slots)
        inflight: list[int] = []
        it = iter(self.keys)
        done = 0
        more = True
        while more or inflight:
            while more and len(inflight) < window:
                k = next(it, None)
                if k is None:
                    more = False
                    break
                inflight.append(eng.submit_load(k))
            # Like a scheduler step: collect what finished, refill (half a window per wake-up).
            results = eng.wait(inflight[: max(1, len(inflight) // 2)], timeout=600) + eng.poll()
            for r in results:
                if not r.ok:
                    raise RuntimeError(f"tierstore load failed: {r.error}")
                eng.release_slot(r.slot)  # type: ignore[arg-type]
                inflight.remove(r.job_id)
                done += 1
        self.io_busy["load"] = io.done("load")["load_io_busy"]

    def close(self) -> None:
        self.engine.close()


class VllmFsSystem:
    """vLLM's fs tier functions, called the way its manager does (one batch per task)."""

    def __init__(self, d: Path, sources: list[memoryview], threads: int, page_bytes: int,
                 io_mod: Any, dest_buffers: int = 0) -> None:
        self.io = io_mod
        self.dir, self.threads, self.page_bytes = d, threads, page_bytes
        self.dir.mkdir(parents=True, exist_ok=True)
        self.use_o_direct = bool(io_mod.probe_o_direct(str(self.dir)))
        # One aligned source buffer holding the distinct pages (O_DIRECT needs alignment).
        self.src_t, self.src = _aligned_buffer(page_bytes * len(sources))
        for i, s in enumerate(sources):
            self.src[i * page_bytes : (i + 1) * page_bytes] = s
        self.nsrc = len(sources)
        self.paths: list[str] = []
        self.dest = _DestPool(page_bytes, dest_buffers)

    def store(self, n: int, run: int) -> None:
        # vLLM's fs-tier naming: <base>_r<rank>/<hhh>/<hh>_g<group>/<hash hex>.bin; new files
        # each repeat, as RawSystem's (its temp-file rename over an old file frees it under the clock)
        self.paths = []
        for i in range(n):
            h = xxhash.xxh3_128_hexdigest(_key("vllm", run, i))
            self.paths.append(f"{self.dir}_r0/{h[:3]}/{h[3:5]}_g0/{h}.bin")

        def one(i: int) -> None:
            self.io.batch_store_block([self.paths[i]], self.src, [(i % self.nsrc) * self.page_bytes],
                                      self.page_bytes, self.use_o_direct)

        with ThreadPoolExecutor(self.threads) as ex:
            list(ex.map(one, range(n)))

    def drop_files(self) -> None:
        """Unlink the last repeat's files (not timed)."""
        _unlink_all(self.paths)

    def load(self) -> None:
        def one(i: int) -> None:
            self.io.batch_load_block([self.paths[i]], self.dest.get(i), [0], self.page_bytes, self.use_o_direct)

        with ThreadPoolExecutor(self.threads) as ex:
            list(ex.map(one, range(len(self.paths))))


def import_vllm_io() -> tuple[Any | None, str]:
    try:
        import vllm.v1.kv_offload.tiering.fs.io as vio  # noqa: PLC0415
    except Exception as exc:  # vllm absent or broken: the vllm columns are skipped
        return None, f"not importable: {exc!r}"[:200]
    return vio, "C extension" if getattr(vio, "_HAS_FSIO_C", False) else "pure Python"


def open_systems(order: list[str], work: Path, ns: Namespace, sources: list[memoryview], args: argparse.Namespace,
                  cfg: TierStoreConfig, tag: str, slots: int, page_bytes: int, vio: Any | None,
                  impl: dict[str, Any]) -> None:
    """Build each system's writer/reader under ``work`` into ``impl`` (filled as they open, so
    the caller's cleanup closes what did open)."""
    dest = slots if args.load_buffers == "slots" else 0
    for s in order:
        if s == "raw":
            impl[s] = RawSystem(work / "raw", sources, args.threads, page_bytes, dest)
        elif s == "tierstore":
            impl[s] = TierstoreSystem(work / "ts", ns, sources, args.threads, cfg, tag, slots)
            if args.cold_loads == "buffered":
                impl[s].engine.direct_loads = False
        else:
            impl[s] = VllmFsSystem(work / "vllm", sources, args.threads, page_bytes, vio, dest)
