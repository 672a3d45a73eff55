"""``tierstore bench scale``: time and memory of the whole-root tools against page count.

Writes N synthetic small pages (``testing.pages.write_page``, codec none, one simple namespace)
into a fresh root for each ``--pages`` N, then times, each in a child process (so a peak RSS is
that command's own, from ``resource.getrusage`` in the child): ``PageIndex`` load of every
fan-out directory and its memory per page (tracemalloc); ``tierstore stats`` (from the listing)
and ``stats --exact``; ``ls``; ``fsck --json`` (pages/s); ``gc --max-bytes`` half the root's
bytes (evicts about half; its peak RSS and the RSS it adds over its imports); opening a
``LocalIndex`` over the root (a fresh index, reconciling in the background) and the time until
that reconcile ends (pages written less than ``local_scan._SETTLE_S``, 5 s, before are indexed
after that wait: at small N the figure is about 5 s).

Baseline, measured in the same run on the same tree before the tools: plain single-threaded
Python walks, each a child process like the tools (interpreter start included): ``walk_list``
(``os.scandir`` of every directory, names only), ``walk_stat`` (that and ``stat`` of every
file), ``walk_read`` (that and a read of every file); and, inside the ``PageIndex`` child, a
scandir of the same fan-out directories (``scandir_base``). Ratios are walk seconds over tool
seconds (higher: the tool is faster than the plain walk): stats and ls against ``walk_list``,
``stats --exact`` and gc against ``walk_stat``, fsck against ``walk_read``, the index load
against ``scandir_base``, the LocalIndex reconcile against ``walk_list``.

Each time is extrapolated linearly to 10^6 and 10^7 pages (least squares through the measured
points; per-page figures and ratios are carried over from the largest N), and the table says so.

Run: ``tierstore bench scale --pages 100000 200000 [--dir D] [--jobs J] [--json]``;
``--write-only ROOT --pages N`` writes a root once (10^6 pages take minutes) and
``--existing ROOT --pages N`` measures it (consumed: gc evicts half, the LocalIndex is made in
place); ``--standin --pages N1 N2``: for each N the pages are written into an export locally,
then every figure is measured through the sshfs stand-in for NFS (tests/nfs_standin.py, profile
"nfs"; a source checkout with sshfs and /dev/fuse).
Threading: a single-threaded driver; the commands run in child processes one at a time (and
``--procs`` writer processes).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import tierstore
from tierstore.admin.cli import positive_int
from tierstore.errors import TierStoreError

REPO = Path(__file__).resolve().parents[2]
PACKAGE_PARENT = Path(tierstore.__file__).resolve().parents[1]  # on the children's PYTHONPATH

_CHILD_PAGE_INDEX = """
import os, sys, time, tracemalloc
from tierstore.index.page_index import PageIndex
base = sys.argv[1]
t0 = time.perf_counter()
names = 0
for d in os.scandir(base):
    if d.is_dir(follow_symlinks=False):
        names += len({e.name for e in os.scandir(d.path)})
walk = time.perf_counter() - t0
tracemalloc.start()
t0 = time.perf_counter()
idx = PageIndex(base)
idx.load_all()
dt = time.perf_counter() - t0
cur, _ = tracemalloc.get_traced_memory()
print(dt, cur, len(idx), walk, names)
"""

# The baseline walks: one child each, plain Python, no tierstore import.
_CHILD_WALK = """
import os, sys
mode, root = sys.argv[1], sys.argv[2]
files = 0
stack = [root]
while stack:
    with os.scandir(stack.pop()) as it:
        for e in it:
            if e.is_dir(follow_symlinks=False):
                stack.append(e.path)
                continue
            files += 1
            if mode == "stat":
                os.stat(e.path, follow_symlinks=False)
            elif mode == "read":
                with open(e.path, "rb", buffering=0) as f:
                    while f.read(1 << 20):
                        pass
print(files)
"""

# RUSAGE_CHILDREN's peak is the largest child so far: the gc child reports its own peak, and
# its peak after importing gc (which imports neither torch nor the engine).
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

# ratio name -> (baseline figure, tool figure): baseline seconds over tool seconds
RATIOS: dict[str, tuple[str, str]] = {
    "page_index_load_vs_scandir": ("scandir_base_s", "page_index_load_s"),
    "stats_listing_vs_walk_list": ("walk_list_s", "stats_listing_s"),
    "ls_vs_walk_list": ("walk_list_s", "ls_s"),
    "stats_exact_vs_walk_stat": ("walk_stat_s", "stats_exact_s"),
    "fsck_vs_walk_read": ("walk_read_s", "fsck_s"),
    "local_index_reconciled_vs_walk_list": ("walk_list_s", "local_index_reconciled_s"),
    "gc_vs_walk_stat": ("walk_stat_s", "gc_s"),
}


def write_root(root: Path, n: int, procs: int = 1) -> int:
    """N pages of one simple namespace, written by ``procs`` processes (each a stride of the
    keys); returns the bytes written."""
    from tierstore.format.identity import write_manifest
    from tierstore.testing.pages import simple_namespace

    root.mkdir(parents=True, exist_ok=True)
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


def run_child(argv: list[str]) -> tuple[float, str]:
    """(wall seconds, stdout) of one child process; raises unless it exits 0, 1 or 4."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(PACKAGE_PARENT), os.environ.get("PYTHONPATH", "")) if p))
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
    wall = time.perf_counter() - t0
    if proc.returncode not in (0, 1, 4):
        raise TierStoreError(f"{' '.join(argv[:4])} ... exited {proc.returncode}: {proc.stderr[-2000:]}")
    return wall, proc.stdout


def measure(root: Path, n: int, jobs: int | None, copy_for_local_index: bool = True) -> dict[str, float]:
    """Every figure of one root of ``n`` pages, the baseline walks first (gc consumes the root)."""
    py = sys.executable
    cli = [py, "-m", "tierstore"]
    j = ["-j", str(jobs)] if jobs else []
    out: dict[str, float] = {}
    ns_dir = next(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    base = ns_dir / "g0" / "r0"
    for mode in ("list", "stat", "read"):
        t, text = run_child([py, "-c", _CHILD_WALK, mode, str(root)])
        out[f"walk_{mode}_s"] = t
        if int(text) < n:
            raise TierStoreError(f"the {mode} walk of {root} found {int(text)} files, fewer than its {n} pages")
    _, text = run_child([py, "-c", _CHILD_PAGE_INDEX, str(base)])
    dt, mem, count, walk, names = text.split()
    if int(count) != n or int(names) != n:
        raise TierStoreError(f"{base}: the PageIndex holds {count} pages and the fan-out directories {names} "
                             f"names, not the {n} asked for")
    out["scandir_base_s"] = float(walk)
    out["page_index_load_s"] = float(dt)
    out["page_index_bytes_per_page"] = float(mem) / max(int(count), 1)
    out["stats_listing_s"], _ = run_child([*cli, "stats", str(root), "--json", *j])
    out["stats_exact_s"], _ = run_child([*cli, "stats", str(root), "--json", "--exact", *j])
    out["ls_s"], _ = run_child([*cli, "ls", str(root), "--json", *j])
    t, text = run_child([*cli, "fsck", str(root), "--json", *j])
    pages_ok = json.loads(text)["counts"]["pages_ok"]
    if pages_ok != n:
        raise TierStoreError(f"fsck of {root} found {pages_ok} good pages, not the {n} asked for")
    out["fsck_s"], out["fsck_pages_per_s"] = t, n / t
    local = root.parent / (root.name + "-local") if copy_for_local_index else root
    if copy_for_local_index:
        shutil.copytree(root, local, symlinks=True)
    _, text = run_child([py, "-c", _CHILD_LOCAL_INDEX, str(local)])
    opened, done, _ = text.split()
    out["local_index_open_s"], out["local_index_reconciled_s"] = float(opened), float(done)
    if copy_for_local_index:
        shutil.rmtree(local)
    else:
        shutil.rmtree(root / ".tierstore", ignore_errors=True)  # the index it made in place
    size = sum(e.stat().st_size for d in base.iterdir() for e in os.scandir(d))
    t, text = run_child([py, "-c", _CHILD_OWN_RSS, "gc", str(root), "--max-bytes", str(size // 2)])
    base_rss, peak_rss = (float(v) / 1024 for v in text.split()[-2:])
    out["gc_s"], out["gc_peak_rss_mib"], out["gc_rss_over_import_mib"] = t, peak_rss, peak_rss - base_rss
    return out


def ratios(row: dict[str, float]) -> dict[str, float]:
    """Baseline seconds over tool seconds (higher: the tool beats the plain walk)."""
    return {name: round(row[b] / row[t], 3) for name, (b, t) in RATIOS.items() if row.get(t)}


def measure_on_standin(ns: list[int], jobs: int | None, procs: int, where: Path | None) -> dict[int, dict[str, float]]:
    """For each N: write N pages into a fresh export (local writes: the figures are of reading
    and maintaining a shared root, not of filling it), mount it through the sshfs stand-in and
    measure every figure through the mount."""
    if not (REPO / "tests" / "nfs_standin.py").is_file():
        raise TierStoreError("--standin needs a source checkout (tests/nfs_standin.py)")
    sys.path.insert(0, str(REPO / "tests"))
    from nfs_standin import TwoNodeMount, unavailable_reason

    reason = unavailable_reason()
    if reason:
        raise TierStoreError(f"the NFS stand-in is unavailable here: {reason}")
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
    return rows


def extrapolate(ns: list[int], values: list[float], target: int) -> float:
    """Least-squares line through (n, value), evaluated at ``target``."""
    if len(ns) == 1:
        return values[0] * target / ns[0]
    mx, my = sum(ns) / len(ns), sum(values) / len(values)
    slope = sum((x - mx) * (y - my) for x, y in zip(ns, values, strict=True)) / sum((x - mx) ** 2 for x in ns)
    return my + slope * (target - mx)


def _table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |")


def print_table(rows: dict[int, dict[str, float]]) -> None:
    """The figures per N with lines through them at 10^6 and 10^7, then the ratios per N."""
    ns = sorted(rows)
    header = ["figure", *(f"{n:,}" for n in ns), "1,000,000 (extrap.)", "10,000,000 (extrap.)"]
    table = []
    for k in rows[ns[0]]:
        vals = [rows[n][k] for n in ns]
        if k.endswith("_per_page") or k.endswith("_per_s"):
            ext = [vals[-1], vals[-1]]  # per-page figures: constant, not a line through zero
        else:
            ext = [extrapolate(ns, vals, 10 ** 6), extrapolate(ns, vals, 10 ** 7)]
        table.append([k, *(f"{v:,.2f}" for v in vals), *(f"~{v:,.1f}" for v in ext)])
    _table(header, table)
    print()
    per_n = {n: ratios(rows[n]) for n in ns}
    _table(["ratio (walk s / tool s; higher: faster than the walk)", *(f"{n:,}" for n in ns)],
           [[k, *(f"{per_n[n][k]:.2f}" for n in ns)] for k in per_n[ns[0]]])


def document(rows: dict[int, dict[str, float]], target: str, jobs: int | None) -> dict[str, Any]:
    """The ``--json`` document: figures and ratios per N, and the extrapolated seconds."""
    ns = sorted(rows)
    extrapolated = {str(t): {k: round(extrapolate(ns, [rows[n][k] for n in ns], t), 3)
                             for k in rows[ns[0]] if k.endswith("_s") and not k.endswith("_per_s")}
                    for t in (10 ** 6, 10 ** 7)}
    return {"tierstore_bench_scale": 1, "target": target, "jobs": jobs, "cpus": os.cpu_count(),
            "rows": [{"pages": n, **{k: round(v, 4) for k, v in rows[n].items()}, "ratios": ratios(rows[n])}
                     for n in ns],
            "extrapolated": extrapolated}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pages", type=positive_int, nargs="+", default=[100_000, 200_000], metavar="N",
                   help="page counts, one root each (default: 100000 200000); --existing/--write-only: the first")
    p.add_argument("--dir", type=Path, default=None, help="where to write the roots (default: a temp dir)")
    p.add_argument("--jobs", "-j", type=positive_int, default=None, metavar="J",
                   help="-j of stats, ls and fsck (default: each command's own)")
    p.add_argument("--existing", type=Path, default=None, metavar="ROOT",
                   help="measure this root of --pages N pages, written before (consumed: gc evicts half)")
    p.add_argument("--write-only", type=Path, default=None, metavar="ROOT",
                   help="write --pages N pages into this new root and stop")
    p.add_argument("--procs", type=positive_int, default=1, help="processes writing pages (--write-only, --standin)")
    p.add_argument("--standin", action="store_true",
                   help="measure through the sshfs stand-in for NFS (pages written into its export locally)")
    p.add_argument("--json", action="store_true", help="print a machine-readable JSON report on stdout")


def run(args: argparse.Namespace) -> int:
    if args.write_only is not None:
        t0 = time.perf_counter()
        nbytes = write_root(args.write_only, args.pages[0], args.procs)
        seconds = time.perf_counter() - t0
        if args.json:
            print(json.dumps({"tierstore_bench_scale": 1, "wrote": {
                "root": str(args.write_only), "pages": args.pages[0], "bytes": nbytes, "seconds": round(seconds, 1)}},
                indent=2))
        else:
            print(f"wrote {args.pages[0]} pages, {nbytes} bytes in {seconds:.0f} s")
        return 0
    if args.standin:
        target = "sshfs stand-in (profile nfs)"
        rows = measure_on_standin(sorted(args.pages), args.jobs, args.procs, args.dir)
    elif args.existing is not None:
        target = f"existing root {args.existing}"
        rows = {args.pages[0]: measure(args.existing, args.pages[0], args.jobs, copy_for_local_index=False)}
    else:
        target = "local"
        work = Path(tempfile.mkdtemp(prefix="tierstore-scale-", dir=args.dir))
        rows = {}
        try:
            for n in sorted(args.pages):
                root = work / f"root{n}"
                t0 = time.perf_counter()
                nbytes = write_root(root, n)
                print(f"wrote {n} pages ({nbytes / n:.0f} B each) in {time.perf_counter() - t0:.0f} s",
                      file=sys.stderr)
                rows[n] = measure(root, n, args.jobs)
                shutil.rmtree(root)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(document(rows, target, args.jobs), indent=2))
    else:
        print(f"whole-root tools on {target}, {os.cpu_count()} CPUs (the walks, stats, ls, fsck and gc: "
              "a child process each, its interpreter start included)")
        print_table(rows)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tierstore bench scale", description=__doc__.split("\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
