"""``python -m tierstore.bench.fsck``: fsck throughput (pages/s) and reads in flight.

Makes (once, in ``--work``) a root of ``--pages`` small pages (``testing.pages.write_page``, one
simple 4 KiB attention namespace) and runs ``fsck.run_fsck`` on it with each ``--jobs`` value,
printing pages/s, the most reads in flight and the peak of page-buffer bytes. With
``--latency-s D`` the root is reached through the FUSE passthrough of tools/latency_fs.py
(every operation delayed by D seconds: a stand-in for a slow NFS mount); use a smaller
``--pages`` there (each page costs several delayed operations).

Run: ``python -m tierstore.bench.fsck --work DIR [--pages N] [--jobs 1,8,64,auto] [--paths python,native,cli]
[--latency-s 0.01] [--json]`` (``auto``: fsck's default, 64 threads behind ``adaptive_gate.AdaptiveGate``;
``python``/``native``: the per-page path and the batched native one (fsck_batch), in this process,
each row's ratio against the python row of the same jobs; ``cli``: a fresh ``tierstore fsck``
process with default settings, its compile included).
Threading: the benchmark drives its own threads and processes; nothing here is used by the
library.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tierstore.admin.fsck import FsckOptions, run_fsck

REPO = Path(__file__).resolve().parents[2]


def make_tree(root: Path, pages: int) -> None:
    """``pages`` valid pages under ``root`` (skipped when a previous run made them)."""
    from tierstore.format.identity import write_manifest
    from tierstore.testing.pages import page_bytes, page_key, simple_namespace, write_page

    done = root.with_name(root.name + ".done")  # beside the root: fsck would call it foreign
    if done.exists() and int(done.read_text()) == pages:
        return
    ns = simple_namespace()
    root.mkdir(parents=True, exist_ok=True)
    write_manifest(root, ns)
    data = page_bytes(ns.groups[0].layout, b"bench")
    for i in range(pages):
        write_page(root, ns, 0, page_key(i), data=data)
    done.write_text(str(pages))


@contextlib.contextmanager
def latency_mount(export: Path, mnt: Path, delay_ms: float) -> Iterator[Path]:
    mnt.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, str(REPO / "tools" / "latency_fs.py"), str(export), str(mnt),
                             "--delay-ms", str(delay_ms)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not os.path.ismount(mnt):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the latency FUSE mount did not come up (is /dev/fuse usable?)")
            time.sleep(0.1)
        yield mnt
    finally:
        subprocess.run(["fusermount3", "-u", str(mnt)], check=False)
        proc.wait(timeout=30)


def measure(root: Path, jobs: int | None, path: str) -> dict[str, Any]:
    """One fsck of ``root`` with ``jobs`` threads (None: fsck's default, the adaptive gate) on
    one page path: ``native`` (the batched fast path, compiled before) or ``python`` (per page)."""
    from tierstore.admin.fsck_batch import NativeBatch

    ready = NativeBatch.__dict__["ready"]  # the staticmethod itself, to put back as it was
    if path == "python":
        NativeBatch.ready = staticmethod(lambda: False)  # type: ignore[method-assign]
    try:
        start = time.perf_counter()
        rep = run_fsck(FsckOptions(root, jobs=jobs, progress=False))
        seconds = time.perf_counter() - start
    finally:
        NativeBatch.ready = ready
    if rep.error or rep.problems:
        raise RuntimeError(f"fsck found problems in the bench tree: {rep.error or rep.problems[:3]}")
    return {"path": path, "jobs": "auto" if jobs is None else jobs, "pages": rep.pages_ok,
            "seconds": round(seconds, 3), "pages_per_s": round(rep.pages_ok / seconds), **rep.reads}


def measure_cli(root: Path) -> dict[str, Any]:
    """``python -m tierstore fsck ROOT --json`` as an operator runs it: a fresh process, default
    settings (the native path compiled in the background once the root proves large)."""
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "tierstore", "fsck", str(root), "--json"], capture_output=True,
                         text=True, check=False)
    seconds = time.perf_counter() - start
    rep = json.loads(out.stdout)
    pages = rep["counts"]["pages_ok"]
    return {"path": "cli", "jobs": "auto", "pages": pages, "seconds": round(seconds, 3),
            "pages_per_s": round(pages / seconds), **rep["reads"]}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--work", type=Path, required=True, help="directory for the page tree (reused)")
    p.add_argument("--pages", type=int, default=100_000)
    p.add_argument("--jobs", default="1,8,64,auto",
                   help="comma-separated thread counts; auto: fsck's default (64 threads behind an adaptive gate)")
    p.add_argument("--paths", default="python,native",
                   help="page paths, each with every --jobs: python (per page), native (fsck_batch), "
                        "cli (a fresh `python -m tierstore fsck` process, default settings)")
    p.add_argument("--latency-s", type=float, default=0.0, metavar="SECONDS",
                   help="reach the root through latency_fs.py, every operation delayed this long")
    p.add_argument("--latency-ms", type=float, default=None, help=argparse.SUPPRESS)  # the old name
    p.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    if args.latency_ms is not None:  # one unit for durations: seconds
        print("tierstore bench fsck: --latency-ms is deprecated; use --latency-s (seconds)", file=sys.stderr)
        args.latency_s = args.latency_ms / 1000.0
    export = args.work / f"pages-{args.pages}"
    t0 = time.perf_counter()
    make_tree(export, args.pages)
    made = time.perf_counter() - t0
    with contextlib.ExitStack() as stack:
        root = export
        if args.latency_s:
            root = stack.enter_context(latency_mount(export, args.work / "mnt", args.latency_s * 1000.0))
        paths = args.paths.split(",")
        compile_s = _compile_native() if "native" in paths else None
        rows: list[dict[str, Any]] = []
        for path in paths:
            if path == "cli":
                rows.append(measure_cli(root))
                continue
            rows += [measure(root, None if j == "auto" else int(j), path) for j in args.jobs.split(",")]
    base = {r["jobs"]: r["pages_per_s"] for r in rows if r["path"] == "python"}
    for r in rows:  # against the per-page path at the same --jobs, measured in this run
        b = base.get(r["jobs"])
        r["vs_python"] = round(r["pages_per_s"] / b, 2) if b else None
    out = {"tierstore_bench_fsck": 1, "target": f"latency {args.latency_s:g} s" if args.latency_s else "local", "tree_seconds": round(made, 1),
           "cpus": os.cpu_count(), "native_compile_s": compile_s, "rows": rows}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"fsck on {out['target']}, {args.pages} pages of 4 KiB, {out['cpus']} CPUs; native compile "
              f"{compile_s} s (once per process, not in the rows)")
        print(f"{'path':>7} {'jobs':>5} {'seconds':>8} {'pages/s':>8} {'vs python':>9} {'native pages':>12} "
              f"{'max reads in flight':>20} {'gate limit final/max':>21}")
        for r in rows:
            print(f"{r['path']:>7} {r['jobs']:>5} {r['seconds']:>8} {r['pages_per_s']:>8} {r['vs_python'] or '':>9} "
                  f"{r.get('native_pages', ''):>12} {r['max_in_flight']:>20} {r['limit_final']:>10}/{r['limit_max']}")
    return 0


def _compile_native() -> float | None:
    """Compile the native kernels now (seconds), or None when they are not available here."""
    from tierstore.admin.fsck_batch import NativeBatch
    from tierstore.native import loader as native

    start = time.perf_counter()
    native.start(wait=True)
    if not NativeBatch.ready():
        raise SystemExit(f"the native path is not available: {native.failure() or 'TIERSTORE_NATIVE=0 or not x86-64'}"
                         "; run with --paths python")
    return round(time.perf_counter() - start, 2)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tierstore bench fsck", description=__doc__.split("\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
