"""Scale figures of the whole-root tools (issue 11 item 5): time and memory against page count.

Writes N synthetic small pages (``tierstore.testing.pages.write_page``, codec none) into a
fresh root for each N given, then times, each in a child process (so peak RSS is that
command's own, from ``resource.getrusage`` in the child):

- ``PageIndex`` load of every fan-out directory, and its memory per page;
- ``tierstore stats`` (from the listing) and ``stats --exact``; ``ls``;
- ``tierstore fsck --json`` (pages/s);
- ``tierstore gc --max-bytes`` (half the root's bytes: evicts about half);
- opening a ``LocalIndex`` over the root (a fresh index: its reconcile runs in the background)
  and the time until that reconcile ends.

Then extrapolates each time linearly to 10^6 and 10^7 pages from the two largest N (least
squares through the measured points), and says so in the table. Usage:

    python tools/scale_figures.py --pages 100000 200000 [--dir /tmp/scale] [--jobs 8]
    python tools/scale_figures.py --existing ROOT --pages N   # a root written before (see
        --write-only); it is consumed: gc evicts half of it, the LocalIndex runs in place
    python tools/scale_figures.py --write-only ROOT --pages N
    python tools/scale_figures.py --standin --pages N1 N2 [--dir D]   # the sshfs stand-in for NFS:
        for each N, N pages written into an export locally, then every figure measured through a mount of it
        (tests/nfs_standin.py, profile "nfs"; needs sshfs and /dev/fuse)

Writing 10^6 pages takes about 7 minutes on this machine (2 shared cores), so a root of that
size is written once (``--write-only``) and measured with ``--existing``.

Threading: single-threaded driver; the commands run in child processes one at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_CHILD_PAGE_INDEX = """
import sys, time, tracemalloc
from tierstore.index.page_index import PageIndex
from tierstore.fs.mapper import FANOUT_DIRS
base = sys.argv[1]
tracemalloc.start()
t0 = time.perf_counter()
idx = PageIndex(base)
idx.load_all()
dt = time.perf_counter() - t0
cur, _ = tracemalloc.get_traced_memory()
print(dt, cur, len(idx))
"""

# RUSAGE_CHILDREN's peak is the largest child so far: the gc child reports its own peak, and
# its peak after importing gc (before 2026-11-26 the tiers package loaded torch: about 225 MiB
# before any page; now it imports neither torch nor the engine).
_CHILD_OWN_RSS = """
import resource, sys
import tierstore.tiers.gc
from tierstore.admin.cli import main
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
rc = main(sys.argv[1:])
print(base, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
sys.exit(rc)
"""

_CHILD_LOCAL_INDEX = """
import sys, time
from tierstore.index.local_index import LocalIndex
t0 = time.perf_counter()
idx = LocalIndex(sys.argv[1], None)
opened = time.perf_counter() - t0
idx.wait_reconciled(3600)
done = time.perf_counter() - t0
print(opened, done, idx.count())
idx.close()
"""


def write_root(root: Path, n: int, procs: int = 1) -> int:
    """N pages of one simple namespace, written by ``procs`` processes (each a stride of the
    keys); returns the bytes written."""
    from tierstore.format.identity import write_manifest
    from tierstore.testing.pages import simple_namespace

    write_manifest(root, simple_namespace())
    if procs <= 1:
        return _write_pages(root, 0, n, 1)
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(procs) as pool:
        return sum(pool.map(_write_pages, [root] * procs, range(procs), [n] * procs, [procs] * procs))


def _write_pages(root: Path, first: int, n: int, step: int) -> int:
    from tierstore.testing.pages import page_key, simple_namespace, write_page

    ns = simple_namespace()
    return sum(write_page(root, ns, 0, page_key(i)).path.stat().st_size for i in range(first, n, step))


def run_child(argv: list[str]) -> tuple[float, float, str]:
    """(wall seconds, peak RSS MiB of the child, stdout) of one child process."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
    wall = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    if proc.returncode not in (0, 1, 4):
        raise RuntimeError(f"{argv} exited {proc.returncode}: {proc.stderr[-2000:]}")
    # ru_maxrss of RUSAGE_CHILDREN is the largest child so far: measure in increasing order
    return wall, max(peak, before) / 1024, proc.stdout


def measure(root: Path, n: int, jobs: int | None, copy_for_local_index: bool = True) -> dict[str, float]:
    py = sys.executable
    cli = [py, "-m", "tierstore"]
    j = ["-j", str(jobs)] if jobs else []
    out: dict[str, float] = {}
    ns_dir = next(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    base = ns_dir / "g0" / "r0"
    _, _, text = run_child([py, "-c", _CHILD_PAGE_INDEX, str(base)])
    dt, mem, count = text.split()
    out["page_index_load_s"] = float(dt)
    out["page_index_bytes_per_page"] = float(mem) / max(int(count), 1)
    out["stats_listing_s"], _, _ = run_child([*cli, "stats", str(root), "--json", *j])
    out["stats_exact_s"], _, _ = run_child([*cli, "stats", str(root), "--json", "--exact", *j])
    out["ls_s"], _, _ = run_child([*cli, "ls", str(root), "--json", *j])
    t, _, _ = run_child([*cli, "fsck", str(root), "--json", *j])
    out["fsck_s"], out["fsck_pages_per_s"] = t, n / t
    local = root.parent / (root.name + "-local") if copy_for_local_index else root
    if copy_for_local_index:
        shutil.copytree(root, local, symlinks=True)
    _, _, text = run_child([py, "-c", _CHILD_LOCAL_INDEX, str(local)])
    opened, done, _ = text.split()
    out["local_index_open_s"], out["local_index_reconciled_s"] = float(opened), float(done)
    if copy_for_local_index:
        shutil.rmtree(local)
    else:
        shutil.rmtree(root / ".tierstore", ignore_errors=True)  # the index it made in place
    size = sum(e.stat().st_size for d in base.iterdir() for e in os.scandir(d))
    t, _, text = run_child([py, "-c", _CHILD_OWN_RSS, "gc", str(root), "--max-bytes", str(size // 2)])
    base_rss, peak_rss = (float(v) / 1024 for v in text.split()[-2:])
    out["gc_s"], out["gc_peak_rss_mib"], out["gc_rss_over_import_mib"] = t, peak_rss, peak_rss - base_rss
    return out


def measure_on_standin(ns: list[int], jobs: int | None, procs: int, where: Path | None) -> int:
    """For each N: write N pages into a fresh export (local writes: the figures are of reading
    and maintaining a shared root, not of filling it), mount it through the sshfs stand-in and
    measure every figure through the mount."""
    sys.path.insert(0, str(REPO / "tests"))
    from nfs_standin import TwoNodeMount, unavailable_reason

    reason = unavailable_reason()
    if reason:
        print(f"the NFS stand-in is unavailable here: {reason}", file=sys.stderr)
        return 2
    rows = {}
    for n in ns:
        work = Path(tempfile.mkdtemp(prefix="tierstore-scale-nfs-", dir=where))
        try:
            with TwoNodeMount(work, "nfs", "nfs") as fs:
                t0 = time.perf_counter()
                nbytes = write_root(fs.export / "root", n, procs)
                print(f"wrote {n} pages ({nbytes / n:.0f} B each) into the export in {time.perf_counter() - t0:.0f} s",
                      file=sys.stderr)
                rows[n] = measure(fs.a / "root", n, jobs, copy_for_local_index=False)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    print_table(rows)
    return 0


def extrapolate(ns: list[int], values: list[float], target: int) -> float:
    """Least-squares line through (n, value), evaluated at ``target``."""
    if len(ns) == 1:
        return values[0] * target / ns[0]
    mx, my = sum(ns) / len(ns), sum(values) / len(values)
    slope = sum((x - mx) * (y - my) for x, y in zip(ns, values, strict=True)) / sum((x - mx) ** 2 for x in ns)
    return my + slope * (target - mx)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", type=int, nargs="+", default=[100_000, 200_000])
    ap.add_argument("--dir", type=Path, default=None, help="where to write the roots (default: a temp dir)")
    ap.add_argument("--jobs", type=int, default=None, help="-j of stats, ls and fsck (default: each command's own)")
    ap.add_argument("--existing", type=Path, default=None,
                    help="measure this root of --pages N pages, written before (consumed: gc evicts half)")
    ap.add_argument("--write-only", type=Path, default=None, help="write --pages N pages into this new root and stop")
    ap.add_argument("--procs", type=int, default=1, help="processes writing pages (--write-only, --standin)")
    ap.add_argument("--standin", action="store_true",
                    help="measure through the sshfs stand-in for NFS (pages written into its export locally)")
    args = ap.parse_args()
    if args.standin:
        return measure_on_standin(sorted(args.pages), args.jobs, args.procs, args.dir)
    if args.write_only is not None:
        t0 = time.perf_counter()
        nbytes = write_root(args.write_only, args.pages[0], args.procs)
        print(f"wrote {args.pages[0]} pages, {nbytes} bytes in {time.perf_counter() - t0:.0f} s")
        return 0
    if args.existing is not None:
        rows = {args.pages[0]: measure(args.existing, args.pages[0], args.jobs, copy_for_local_index=False)}
        print_table(rows)
        return 0
    work = Path(tempfile.mkdtemp(prefix="tierstore-scale-", dir=args.dir))
    rows = {}
    try:
        for n in sorted(args.pages):
            root = work / f"root{n}"
            t0 = time.perf_counter()
            nbytes = write_root(root, n)
            print(f"wrote {n} pages ({nbytes / n:.0f} B each) in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
            rows[n] = measure(root, n, args.jobs)
            shutil.rmtree(root)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print_table(rows)
    return 0


def print_table(rows: dict[int, dict[str, float]]) -> None:
    """The figures per N, and lines through them at 10^6 and 10^7 (JSON of the rows on stderr)."""
    ns = sorted(rows)
    keys = list(rows[ns[0]])
    header = ["figure", *(f"{n:,}" for n in ns), "1,000,000 (extrap.)", "10,000,000 (extrap.)"]
    table = []
    for k in keys:
        vals = [rows[n][k] for n in ns]
        if k.endswith("_per_page") or k.endswith("_per_s"):
            ext = [vals[-1], vals[-1]]  # per-page figures: constant, not a line through zero
        else:
            ext = [extrapolate(ns, vals, 10 ** 6), extrapolate(ns, vals, 10 ** 7)]
        table.append([k, *(f"{v:,.2f}" for v in vals), *(f"~{v:,.1f}" for v in ext)])
    widths = [max(len(r[i]) for r in [header, *table]) for i in range(len(header))]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in table:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |")
    print(json.dumps({str(n): v for n, v in rows.items()}), file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
