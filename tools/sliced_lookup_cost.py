"""Scheduler-thread cost of one lookup answer for a head-sliced group (the default layout of
attention models: every TP's slice directories are indexed), by reader TP.

    PYTHONPATH=. .venv/bin/python tools/sliced_lookup_cost.py [ROOT] [PAGES]

An 8-KV-head group (15 slice directories: r0 and h<start>-<count> for counts 1, 2, 4); PAGES
pages (default 20,000) written at TP=1 (``r0``), as many keys never written. Prints the median
of 3 passes, in µs per answer, for hits and misses at reader TP 1 (its own slice: ``r0``) and 2
(a TP change: assembled from ``r0``).
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import time
from pathlib import Path

from tierstore.format.head_slices import HeadRange, slice_mappers, tp_slices
from tierstore.index.indexed_lookup import IndexedLookup, SliceGroup

HEADS = 8


def per_answer_us(lookup: IndexedLookup, keys: list[bytes]) -> float:
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        for k in keys:
            lookup.answer(0, k)
        times.append((time.perf_counter() - t0) / len(keys) * 1e6)
    return statistics.median(times)


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/sliced-lookup")
    pages = int(sys.argv[2]) if len(sys.argv) > 2 else 20_000
    shutil.rmtree(root, ignore_errors=True)
    have = tuple(tp_slices(HEADS))
    mappers = slice_mappers(root, "ns", 0, HEADS)
    for m in mappers:
        m.make_fanout_dirs()
    keys = [i.to_bytes(8, "big") * 4 for i in range(2 * pages)]
    r0 = mappers[have.index(HeadRange(0, HEADS))]
    for k in keys[:pages]:
        os.close(os.open(r0.path_for(k), os.O_WRONLY | os.O_CREAT, 0o644))
    try:
        for tp in (1, 2):
            need = tuple(HeadRange(r * HEADS // tp, HEADS // tp) for r in range(tp))
            lookup = IndexedLookup([mappers], slices=[SliceGroup(have, need)], refresh_s=0).start()
            while not lookup.loaded:
                time.sleep(0.05)
            time.sleep(0.2)  # the loader rebuilds its lists right after the listing
            print(f"reader TP={tp}: {len(have)} slice dirs, {pages} pages: hit "
                  f"{per_answer_us(lookup, keys[:pages]):.2f} us, miss {per_answer_us(lookup, keys[pages:]):.2f} us")
            lookup.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
