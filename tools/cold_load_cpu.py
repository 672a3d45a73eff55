"""CPU time per cold (O_DIRECT) 2 MiB load on this machine's disk: 200 pages stored, dropped
from the page cache (fsync + fadvise DONTNEED), loaded with 4 I/O threads, three times.

    PYTHONPATH=. .venv/bin/python tools/cold_load_cpu.py [ROOT]

Prints GB/s (bound by the disk) and process CPU microseconds per page (what a cold load costs
the host: the number the native cold path lowers). ROOT must be on a file system that takes
O_DIRECT (not tmpfs); default /tmp/coldb, removed afterwards.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

from tierstore.bench.io import _Tierstore, bench_namespace
from tierstore.bench.page_cache import CacheDropper
from tierstore.config import TierStoreConfig
from tierstore.native import loader as native

PAGE_BYTES = 2 << 20
PAGES = 200


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/coldb")
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    source = [memoryview(bytearray(os.urandom(PAGE_BYTES)))]
    store = _Tierstore(root, bench_namespace(PAGE_BYTES), source, 4, TierStoreConfig(root=str(root), io_threads=4), "c")
    native.start(wait=True)
    try:
        store.store(PAGES, 0)
        print("direct_loads", store.engine.direct_loads, "native", native.ready())
        for _ in range(3):
            CacheDropper("fadvise").drop(store.paths())
            cpu0, wall0 = time.process_time(), time.perf_counter()
            store.load()
            wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
            print(f"cold: {PAGES * PAGE_BYTES / wall / 1e9:.2f} GB/s, process CPU {cpu / PAGES * 1e6:.0f} us/page, "
                  f"loads_odirect {store.engine.stats['loads_odirect']}")
    finally:
        store.close()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
