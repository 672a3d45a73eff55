"""``tierstore gc ROOT --max-bytes N``: the command line of shared-tier gc (tiers/gc.py holds the logic).

Contract: ``add_arguments(parser)`` and ``run(args) -> int`` (the exit status of the shared
table in cli.py: 0 done, also when another node holds the lease; 2 a bad value; 8 ROOT
missing, not a cache directory, or a bad lease path). One pass by default; ``--loop SECONDS``
runs a pass every SECONDS until SIGTERM (exit 0) or SIGINT (32), which stop it after the pass
in progress (admin/loop_stop.py; ``one_pass`` is the unit a metrics exporter hooks into). Output: text on stdout, sizes human-readable; ``--json`` prints one JSON document per
pass (JSON lines with ``--loop``) with the schema key ``tierstore_gc``, exact bytes (file
bytes, ``st_size``, the same meaning as ``tierstore stats``), times as ISO 8601 UTC
(``started_at``, ``finished_at``) and durations in seconds. Errors go to stderr and say what to
do. ``--progress`` (default: when stderr is a terminal) draws a bar over the scan's
directories with rate and ETA, then over the eviction batches.

Failure policy: operational errors (OSError, TierStoreError) propagate to cli.main, which
prints them on stderr and exits 8, except that ``--loop`` outlives a pass that fails on the file
system (OSError: EIO from a soft NFS mount, ESTALE, a server restart): it is said on stderr (with
``--json`` also as ``{"error", "retry_in_s"}`` on stdout), counted as an error pass
(``tierstore_gc_runs_total{result="error"}``) and tried again after the interval. A refusal (not
a cache, a newer layout, a bad lease path) still ends the loop: it will not pass by itself.
Threading: runs on the main thread; ``collect`` evicts on its own pool.
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tierstore.admin import metrics_export
from tierstore.admin.loop_stop import LoopStop
from tierstore.admin.progress import progress_bar
from tierstore.admin.render import human_bytes
from tierstore.config import is_object_url
from tierstore.fs.display import escape, iso_utc, parse_size
from tierstore.fs.lease import LEASE_NAME, Lease
from tierstore.fs.mapper import NAMESPACE_DIR_RE
from tierstore.tiers.gc import EVICT_THREADS, DryLease, collect
from tierstore.tiers.gc_report import GcReport
from tierstore.tiers.gc_scan import TRASH_DIR

EXIT_USAGE = 2
EXIT_OPERATIONAL = 8
# 2: bytes are st_size (1: allocated blocks); epoch floats dropped for *_at. A field added
# since (metadata_bytes) keeps the version: readers of 2 ignore keys they do not know.
SCHEMA_VERSION = 2


def report_json(rep: GcReport) -> dict[str, Any]:
    """A pass's report as ``--json`` prints it: the schema key first, the report's counts
    (exact bytes), ``seconds`` (its duration), and its start and end as ISO 8601 UTC."""
    def iso(t: float) -> str | None:
        return iso_utc(t, "milliseconds")

    fields = asdict(rep)
    fields.pop("started")
    fields.pop("finished")
    return {"tierstore_gc": SCHEMA_VERSION, **fields, "started_at": iso(rep.started),
            "finished_at": iso(rep.finished)}


def parse_bytes(text: str) -> int:
    """``--max-bytes``: ``fs.display.parse_size``'s forms, as an argparse type."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("root", help="the shared cache root (the directory given as \"root\")")
    parser.add_argument("--max-bytes", type=parse_bytes, required=True,
                        help="cap for the pages, temps and trash under ROOT in file bytes (e.g. 500G); "
                        "gc evicts when above it")
    parser.add_argument("--low-watermark", type=float, default=0.9,
                        help="evict down to this fraction of --max-bytes (default 0.9)")
    parser.add_argument("--trash-grace", type=float, default=0.0, metavar="SECONDS",
                        help=f"keep evicted files in ROOT/{TRASH_DIR} this long before unlinking "
                        "(helps NFSv3 readers that already opened them; default 0)")
    parser.add_argument("--temp-max-age", type=float, default=3600.0, metavar="SECONDS",
                        help="remove temp files older than this (abandoned writes; default 3600)")
    parser.add_argument("--lease-ttl", type=float, default=60.0, metavar="SECONDS",
                        help=f"expiry of the evictor lease {LEASE_NAME} (default 60)")
    parser.add_argument("--loop", type=float, default=0.0, metavar="SECONDS",
                        help="keep running, one pass every SECONDS (background mode); default: one pass")
    parser.add_argument("--evict-threads", type=int, default=EVICT_THREADS, metavar="N",
                        help=f"unlinks in flight while evicting (default {EVICT_THREADS}; each waits on the file "
                        "system: a round trip on NFS, a discard on ext4 mounted with -o discard)")
    parser.add_argument("--dry-run", action="store_true",
                        help="change nothing under ROOT; report what a real pass would evict and remove")
    parser.add_argument("--json", action="store_true",
                        help="print each pass's report as one JSON document (schema key tierstore_gc)")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="progress bar on stderr with rate and ETA (default: only when stderr is a terminal)")
    metrics_export.add_arguments(parser)


def count_scan_dirs(root: Path) -> int:
    """The directories gc's scan visits (the root, namespaces, groups, ranks, fan-outs), from
    three levels of listing (a few hundred readdirs at most): the progress bar's total.
    Never follows a symlink; an unreadable directory counts as one."""
    total = 1
    level = [root]
    for depth in range(4):
        nxt = []
        for d in level:
            try:
                with os.scandir(d) as it:
                    for e in it:
                        if e.is_dir(follow_symlinks=False) and (depth or NAMESPACE_DIR_RE.match(e.name)):
                            total += 1
                            if depth < 3:
                                nxt.append(Path(e.path))
            except OSError:
                continue
        level = nxt
    return total


class _ProgressLease:
    """A lease (the real one, or a dry run's ``DryLease``), ticking a progress bar at each
    renewal check: gc checks once per directory it scans and once per eviction batch, so the
    bar follows the pass without a hook in the gc logic. Threading: gc's calling thread."""

    def __init__(self, lease: Lease | DryLease, bar: Any, scan_dirs: int) -> None:
        self.lease, self.bar, self.scan_dirs, self.ticks = lease, bar, scan_dirs, 0

    @property
    def problem(self) -> str | None:
        return self.lease.problem

    def acquire(self) -> bool:
        return self.lease.acquire()

    def release(self) -> None:
        self.lease.release()

    def renew_if_due(self) -> bool:
        self.ticks += 1
        if self.ticks == self.scan_dirs + 1:  # the scan is done: what follows are eviction batches
            self.bar.set_description_str("gc evict (batches)")
            self.bar.reset(total=None)
        self.bar.update(1)
        return self.lease.renew_if_due()


def one_pass(args: argparse.Namespace, root: Path, lease: Lease) -> GcReport:
    """One gc pass as the command line asked (with its progress bar)."""
    # A dry run takes no lease: the bar ticks on a lease that writes nothing (tiers.gc.DryLease).
    bar = progress_bar("gc scan (dirs)", unit="dir", enabled=args.progress)
    try:
        used: Any = DryLease() if args.dry_run else lease
        if not bar.disable:
            scan_dirs = count_scan_dirs(root)
            bar.reset(total=scan_dirs)
            used = _ProgressLease(used, bar, scan_dirs)
        return collect(root, args.max_bytes, low_watermark=args.low_watermark, trash_grace_s=args.trash_grace,
                       temp_max_age_s=args.temp_max_age, lease=used, dry_run=args.dry_run,
                       evict_threads=args.evict_threads)
    finally:
        bar.close()


def format_report(rep: GcReport, args: argparse.Namespace, root: Path) -> list[str]:
    """The text lines of a pass (stdout): sizes human-readable, exact bytes in ``--json``."""
    if rep.busy:
        return [f"tierstore gc: another node holds the gc lease ({escape(root / LEASE_NAME)}); nothing done"]
    cap = human_bytes(args.max_bytes)
    if args.dry_run:
        lines = [f"tierstore gc: {rep.pages} pages, {human_bytes(rep.total_before)} (cap {cap}); a real pass would "
                 f"evict {rep.evicted} pages / {human_bytes(rep.evicted_bytes)} (leaving "
                 f"{human_bytes(rep.total_after)}), remove {rep.temps_removed} stale temps and {rep.trash_removed} "
                 "trash entries [dry run: nothing changed]"]
    else:
        lines = [f"tierstore gc: {rep.pages} pages, {human_bytes(rep.total_before)} before, "
                 f"{human_bytes(rep.total_after)} after (cap {cap}); evicted {rep.evicted} pages / "
                 f"{human_bytes(rep.evicted_bytes)}, removed {rep.temps_removed} stale temps, {rep.trash_removed} "
                 f"trash entries in {rep.seconds:.2f} s"]
    if rep.room_evicted:
        lines.append(f"tierstore gc: the export was full (the lease could not be written): {rep.room_evicted} of "
                     f"the evicted pages / {human_bytes(rep.room_bytes)} were unlinked without the lease to make room")
    lines += [f"tierstore gc: refused {line}" for line in rep.unsafe]
    return lines


def _say_error(args: argparse.Namespace, message: str, **fields: object) -> None:
    """An error on stderr, and with --json also as a document on stdout (with ``fields``)."""
    print(f"tierstore gc: {message}", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps({"tierstore_gc": SCHEMA_VERSION, "error": message, **fields}), flush=True)


def _error(args: argparse.Namespace, message: str) -> int:
    """An operational error: said (``_say_error``); the exit status."""
    _say_error(args, message, exit_code=EXIT_OPERATIONAL)
    return EXIT_OPERATIONAL


def _pass_failed(args: argparse.Namespace, exc: OSError, exporter: metrics_export.GcMetrics | None) -> None:
    """A ``--loop`` pass that failed on the file system: said, counted; the loop goes on."""
    _say_error(args, f"a pass failed: {escape(str(exc))}; nothing evicted, trying again in {args.loop:g} s",
               retry_in_s=args.loop)
    if exporter is not None:
        exporter.failed()


def run(args: argparse.Namespace) -> int:
    """Run gc as the command line asked; the exit status (see the module docstring)."""
    root = Path(args.root)
    if not 0 < args.low_watermark <= 1:
        print(f"tierstore gc: --low-watermark must be in (0, 1], got {args.low_watermark}", file=sys.stderr)
        return EXIT_USAGE
    if is_object_url(args.root):  # a bucket prefix: admin/object_gc_command.py, with this module's renderers
        from tierstore.admin import object_gc_command

        return object_gc_command.run(args, report_json, format_report)
    try:
        is_dir = stat.S_ISDIR(os.stat(root).st_mode)
    except OSError as exc:
        is_dir, why = False, exc.strerror
    else:
        why = "not a directory"
    if not is_dir:  # as fsck, ls and stats: an operational error
        return _error(args, f"ROOT {escape(root)} is not accessible: {why} (pass the cache root given as \"root\")")
    lease = Lease(root, ttl_s=args.lease_ttl)
    exporter = metrics_export.start(args, root, args.max_bytes)
    with LoopStop("gc") as stop:
        return _loop(args, root, lease, exporter, stop)


def _loop(args: argparse.Namespace, root: Path, lease: Lease, exporter: Any, stop: LoopStop) -> int:
    """One pass, or passes every ``args.loop`` seconds until a stop signal (``LoopStop``)."""
    while True:
        try:
            rep = one_pass(args, root, lease)
        except OSError as exc:
            if args.loop <= 0:
                raise
            _pass_failed(args, exc, exporter)
            if stop.wait(args.loop):
                return stop.exit_status()
            continue
        if exporter is not None:
            exporter.update(rep)
        if rep.refused:
            return _error(args, f"refusing {escape(root)}: {rep.refused}")
        if rep.lease_problem:
            done = (f"only {rep.room_evicted} pages unlinked to make room on the full export" if rep.room_evicted
                    else "nothing done")
            print(f"tierstore gc: {escape(rep.lease_problem)}; {done}", file=sys.stderr, flush=True)
        if args.json:
            print(json.dumps(report_json(rep)), flush=True)
        elif not rep.lease_problem:
            print("\n".join(format_report(rep, args, root)), flush=True)
        if args.loop <= 0:
            return EXIT_OPERATIONAL if rep.lease_problem else 0
        if stop.wait(args.loop):
            return stop.exit_status()
