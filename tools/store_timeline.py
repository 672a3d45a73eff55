"""Where a store's time goes: per-call thread time of the store pipeline's file operations.

    python tools/store_timeline.py [--repeats 3] [--fresh-dirs]

Needs CUDA (it runs ``tierstore.bench.transfer.transfer_pipeline``: the vLLM worker's store
and load pipelines). For each transfer case it times, in every thread, ``os.open``,
``os.mkdir``, the page write (``pagefile.pwritev_all``), ``os.replace`` and ``os.close`` during
the pipeline's stores, and ``os.write`` of the raw-file baseline (one file per page in one
directory; its opens include the read-back), then prints calls per page, the median and the
total thread time of each, and the store ratio against the raw write of the same repeat.

``--fresh-dirs`` removes the engine's fan-out directories right after it made them, so every
store into an empty directory recreates it on ENOENT: what a tree whose directories are made
by stores costs (docs/DESIGN.md, "Where the store gap was"; the two-level tree of format 1
made one to three directories per store).

This wraps functions for timing (monkeypatching): a diagnostic, not a benchmark to compare
across machines.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from tierstore.bench import kernels as bk  # noqa: E402
from tierstore.bench import transfer as bt  # noqa: E402
from tierstore.rootstore import engine as engine_mod  # noqa: E402
from tierstore.rootstore import pageops as pagefile  # noqa: E402

_calls: dict[str, list[float]] = defaultdict(list)
_lock = threading.Lock()
# "raw" and "store" are recorded; "armed": the next store starts the "store" phase; "off"
_phase = ["off"]


def _timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _phase[0] not in ("raw", "store"):
            return fn(*args, **kwargs)
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            with _lock:
                _calls[f"{_phase[0]}:{name}"].append(time.perf_counter() - t0)

    return wrapper


def _install(fresh_dirs: bool) -> None:
    for name in ("open", "mkdir", "replace", "close", "write"):
        setattr(os, name, _timed(name, getattr(os, name)))
    pagefile.pwritev_all = _timed("pwritev", pagefile.pwritev_all)
    submit_store = engine_mod.IOEngine.submit_store
    submit_load = engine_mod.IOEngine.submit_load
    init = engine_mod.IOEngine.__init__

    def store(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _phase[0] == "armed":  # the pipeline's first store (not the engine-alone run later)
            _phase[0] = "store"
        return submit_store(self, *args, **kwargs)

    def load(self: Any, *args: Any, **kwargs: Any) -> Any:
        _phase[0] = "off"  # the pipeline's loads, and the engine-alone run after them
        return submit_load(self, *args, **kwargs)

    def start(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        if fresh_dirs:
            for d in self.mapper.base.iterdir():
                shutil.rmtree(d)

    engine_mod.IOEngine.submit_store = store  # type: ignore[method-assign]
    engine_mod.IOEngine.submit_load = load  # type: ignore[method-assign]
    engine_mod.IOEngine.__init__ = start  # type: ignore[method-assign]
    raw_files = bt.raw_files

    def raw(*args: Any, **kwargs: Any) -> dict[str, float]:
        _phase[0] = "raw"
        try:
            return raw_files(*args, **kwargs)
        finally:
            _phase[0] = "armed"

    bt.raw_files = raw


def _report(phase: str, pages: int) -> str:
    parts = []
    for key in sorted(k for k in _calls if k.startswith(phase + ":")):
        v = _calls[key]
        parts.append(f"{key.split(':')[1]} {len(v) / pages:.2f}/page median {statistics.median(v) * 1e6:.0f} us "
                     f"total {sum(v) * 1e3:.1f} ms")
    return "; ".join(parts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mib", type=int, default=1024, help="bytes stored per case")
    parser.add_argument("--fresh-dirs", action="store_true", help="stores make their fan-out directories")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("store_timeline: needs a CUDA device", file=sys.stderr)
        return 2
    _install(args.fresh_dirs)
    tmp = Path(tempfile.mkdtemp(prefix="tierstore-timeline-"))
    try:
        for shape in bk.model_shapes():
            if isinstance(shape, bk.MambaShape) or shape.blocks_per_page not in (4, 17):
                continue
            per_page = shape.layers * shape.heads * shape.kernel_tokens * shape.blocks_per_page * 2 * shape.head_size * 2
            case = bk.build_attention(shape, "LBNHC", max(8, args.mib * 2**20 // per_page), "cuda")
            n, page = case.ids.shape[0], case.page_layout.nbytes
            slab = torch.randint(0, 256, (n * page,), dtype=torch.uint8).pin_memory()
            bufs = [memoryview(slab.numpy())[i * page : (i + 1) * page] for i in range(n)]
            for r in range(args.repeats):
                _calls.clear()
                raw = bt.raw_files(tmp, bufs, 4, cold=False)
                out = bt.transfer_pipeline(case, tmp, max(1, (64 << 20) // page), 4, cold=False)
                print(f"{case.label[:60]} repeat {r + 1}: store {out['store_gbps']} GB/s, raw write "
                      f"{raw['write_gbps']} GB/s, ratio {out['store_gbps'] / raw['write_gbps']:.3f}")
                print(f"    raw:   {_report('raw', n)}")
                print(f"    store: {_report('store', n)}", flush=True)
            del case, slab, bufs
            torch.cuda.empty_cache()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
