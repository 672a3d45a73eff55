"""Shared-tier garbage collection: keep a shared root under ``max_bytes`` with many nodes.

Contract (``tierstore gc ROOT --max-bytes N``, and ``GcDaemon`` as the background mode):

1. Take the lease (``lease.py``); if another node holds it, do nothing (report ``busy``).
2. Sweep the trash dir ``ROOT/.tierstore-trash``: unlink entries older than ``trash_grace_s``.
3. Scan every namespace under ROOT: page files (LRU stamp = mtime, which readers refresh with
   a rate-limited ``utime`` on hit), temp files (those older than ``temp_max_age_s`` were
   abandoned by a dead writer and are removed), and anything else (``.nfs*``,
   ``.fuse_hidden*``, manifests: counted, never touched; fsck owns them).
4. If the bytes found exceed ``max_bytes``, evict least-recently-stamped pages until the total
   is at most ``low_watermark * max_bytes``. A victim is re-``stat``ed first (a page hit since
   the scan is skipped), then renamed into the trash (the name vanishes atomically: new
   readers get a clean miss; a reader that already has it open keeps reading the whole file,
   which it verifies), then unlinked after the grace period (at once with grace 0).
   ENOENT/ESTALE mean another evictor got there first.
5. Renew the lease while working; stop evicting as soon as it is lost. Release it.

No sqlite and no lock on the shared root: everything is files, renames and stats.
Threading: ``collect`` is a plain function; ``GcDaemon`` is one daemon thread per root.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import logging
import os
import re
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from tierstore.mapper import host_tag, locate, parse_temp_name
from tierstore.metrics import TierMetrics
from tierstore.tiers.lease import LEASE_NAME, Lease

log = logging.getLogger(__name__)

TRASH_DIR = ".tierstore-trash"
_NS_RE = re.compile(r"^[0-9a-f]{32}$")
GONE_ERRNOS = (errno.ENOENT, errno.ESTALE)  # the file is gone (ESTALE: removed by another NFS client)


@dataclass
class GcReport:
    busy: bool = False  # another node holds the lease: nothing was done
    lease_lost: bool = False
    pages: int = 0
    page_bytes: int = 0
    temp_bytes: int = 0
    other_bytes: int = 0
    trash_bytes: int = 0  # still in the trash (grace period) after the run
    total_before: int = 0
    total_after: int = 0
    evicted: int = 0
    evicted_bytes: int = 0
    skipped_recent: int = 0  # victims hit (re-stamped) since the scan
    vanished: int = 0  # victims another evictor or fsck removed first
    temps_removed: int = 0
    trash_removed: int = 0
    seconds: float = 0.0
    started: float = 0.0  # wall clock (Unix seconds) when this node held the lease
    finished: float = 0.0


@dataclass(frozen=True)
class _Page:
    path: str
    size: int
    stamp: int  # mtime in ns


def parse_bytes(text: str) -> int:
    """``"1048576"``, ``"512M"``, ``"10G"``, ``"1.5T"`` (binary units) -> bytes."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = 1
    for suffix, m in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30), ("T", 1 << 40)):
        if t.endswith(suffix):
            t, mult = t[:-1], m
            break
    try:
        n = int(float(t) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte count: {text!r} (examples: 1048576, 512M, 10G)") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"byte count must be positive: {text!r}")
    return n


def _sweep_trash(trash: Path, grace_s: float, rep: GcReport) -> None:
    now = time.time_ns()
    try:
        entries = list(os.scandir(trash))
    except FileNotFoundError:
        return
    for e in entries:
        try:
            born = int(e.name.split(".", 1)[0])  # names start with the eviction time in ns
        except ValueError:
            born = 0
        try:
            size = e.stat(follow_symlinks=False).st_size
        except OSError:
            continue
        if now - born >= grace_s * 1e9:
            try:
                os.unlink(e.path)
                rep.trash_removed += 1
            except OSError as exc:
                if exc.errno not in GONE_ERRNOS:
                    rep.trash_bytes += size
        else:
            rep.trash_bytes += size


def _scan(root: Path, temp_max_age_s: float, rep: GcReport, lease: Lease) -> list[_Page]:
    pages: list[_Page] = []
    now = time.time()
    try:
        top = [e for e in os.scandir(root) if e.is_dir(follow_symlinks=False) and _NS_RE.match(e.name)]
    except FileNotFoundError:
        return pages
    for ns in top:
        for dirpath, _dirnames, filenames in os.walk(ns.path):
            lease.renew_if_due()
            for name in filenames:
                full = os.path.join(dirpath, name)
                try:
                    st = os.stat(full, follow_symlinks=False)
                except OSError:
                    continue  # vanished under us (ENOENT / ESTALE): not ours to count
                if name.endswith(".kvp") and locate(root, full) is not None:
                    pages.append(_Page(full, st.st_size, st.st_mtime_ns))
                    rep.page_bytes += st.st_size
                elif parse_temp_name(name) is not None:
                    if now - st.st_mtime > temp_max_age_s:
                        with contextlib.suppress(OSError):
                            os.unlink(full)
                            rep.temps_removed += 1
                            continue
                    rep.temp_bytes += st.st_size
                else:
                    rep.other_bytes += st.st_size
    rep.pages = len(pages)
    return pages


def _evict(victim: _Page, trash: Path, grace_s: float, rep: GcReport) -> None:
    try:
        st = os.stat(victim.path)
    except OSError:
        rep.vanished += 1
        return
    if st.st_mtime_ns != victim.stamp:
        rep.skipped_recent += 1
        return
    dest = trash / f"{time.time_ns()}.{host_tag()}.{os.getpid()}.{uuid.uuid4().hex[:8]}.kvp"
    try:
        os.rename(victim.path, dest)
    except OSError as exc:
        if exc.errno in GONE_ERRNOS:
            rep.vanished += 1
            return
        raise
    rep.evicted += 1
    rep.evicted_bytes += victim.size
    if grace_s <= 0:
        with contextlib.suppress(OSError):
            os.unlink(dest)
    else:
        rep.trash_bytes += victim.size


def collect(
    root: str | os.PathLike[str],
    max_bytes: int,
    *,
    low_watermark: float = 0.9,
    trash_grace_s: float = 0.0,
    temp_max_age_s: float = 3600.0,
    lease: Lease | None = None,
    dry_run: bool = False,
    metrics: TierMetrics | None = None,
) -> GcReport:
    """One gc pass over ``root`` (see the module docstring)."""
    t0 = time.monotonic()
    root = Path(root)
    rep = GcReport()
    lease = lease or Lease(root)
    if not lease.acquire():
        rep.busy = True
        rep.seconds = time.monotonic() - t0
        return rep
    rep.started = time.time()
    try:
        trash = root / TRASH_DIR
        trash.mkdir(exist_ok=True)
        _sweep_trash(trash, trash_grace_s, rep)
        pages = _scan(root, temp_max_age_s, rep, lease)
        rep.total_before = rep.page_bytes + rep.temp_bytes + rep.other_bytes + rep.trash_bytes
        # Bytes outside the trash; evicted pages wait in the trash for the grace period and are
        # counted again by the next pass until they are unlinked.
        live = rep.total_before - rep.trash_bytes
        if rep.total_before > max_bytes and not dry_run:
            target = int(max_bytes * low_watermark)
            pages.sort(key=lambda p: p.stamp)
            for victim in pages:
                if live <= target:
                    break
                if not lease.renew_if_due():
                    rep.lease_lost = True
                    log.warning("tierstore gc %s: lease lost to another node; stopping", root)
                    break
                before = rep.evicted_bytes
                _evict(victim, trash, trash_grace_s, rep)
                live -= rep.evicted_bytes - before
        rep.total_after = live + rep.trash_bytes
    finally:
        rep.finished = time.time()
        lease.release()
    if metrics is not None:
        metrics.evicted(rep.evicted, rep.evicted_bytes)
        metrics.set_capacity(rep.total_after, max_bytes)
    rep.seconds = time.monotonic() - t0
    return rep


class GcDaemon:
    """Background mode: ``collect`` every ``interval_s`` in one daemon thread per process.

    A hung mount hangs only this thread (daemon: it never blocks shutdown); the lease makes
    nodes take turns.
    """

    _running: dict[str, GcDaemon] = {}
    _guard = threading.Lock()

    def __init__(self, root: str, max_bytes: int, interval_s: float, metrics: TierMetrics | None = None, **kw: object):
        self.root, self.max_bytes, self.interval_s, self.metrics, self.kw = root, max_bytes, interval_s, metrics, kw
        self.last: GcReport | None = None
        self.runs = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"tierstore-gc:{root}", daemon=True)

    @classmethod
    def ensure(cls, root: str, max_bytes: int, interval_s: float, metrics: TierMetrics | None = None) -> GcDaemon:
        """The process's daemon for ``root``, started on first use."""
        with cls._guard:
            d = cls._running.get(root)
            if d is None or not d._thread.is_alive():
                d = cls._running[root] = cls(root, max_bytes, interval_s, metrics)
                d._thread.start()
            return d

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.last = collect(self.root, self.max_bytes, metrics=self.metrics, **self.kw)  # type: ignore[arg-type]
                self.runs += 1
            except Exception:  # a gc pass must never take the engine down
                log.exception("tierstore background gc of %s failed; retrying in %.0f s", self.root, self.interval_s)

    def stop(self) -> None:
        self._stop.set()
        with GcDaemon._guard:
            if GcDaemon._running.get(self.root) is self:
                del GcDaemon._running[self.root]


# ---------------------------------------------------------------------------- CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("root", help="the shared cache root (the directory given as \"root\")")
    parser.add_argument("--max-bytes", type=parse_bytes, required=True,
                        help="cap for everything under ROOT (e.g. 500G); gc evicts when above it")
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
    parser.add_argument("--dry-run", action="store_true", help="scan and report; evict nothing")
    parser.add_argument("--json", action="store_true", help="print each pass's report as JSON")


def run(args: argparse.Namespace) -> int:
    """Run gc as the CLI asked; 0 on success (also when another node holds the lease)."""
    root = Path(args.root)
    if not root.is_dir():
        print(f"tierstore gc: {root} is not a directory (pass the cache root given as \"root\")")
        return 2
    if not 0 < args.low_watermark <= 1:
        print("tierstore gc: --low-watermark must be in (0, 1]")
        return 2
    lease = Lease(root, ttl_s=args.lease_ttl)
    while True:
        rep = collect(root, args.max_bytes, low_watermark=args.low_watermark,
                      trash_grace_s=args.trash_grace, temp_max_age_s=args.temp_max_age,
                      lease=lease, dry_run=args.dry_run)
        if args.json:
            print(json.dumps(asdict(rep)), flush=True)
        elif rep.busy:
            print(f"tierstore gc: another node holds the gc lease ({root / LEASE_NAME}); nothing done")
        else:
            print(f"tierstore gc: {rep.pages} pages, {rep.total_before} bytes before, {rep.total_after} after "
                  f"(cap {args.max_bytes}); evicted {rep.evicted} pages / {rep.evicted_bytes} bytes, "
                  f"removed {rep.temps_removed} stale temps, {rep.trash_removed} trash entries in {rep.seconds:.2f} s"
                  + (" [dry run]" if args.dry_run else ""), flush=True)
        if args.loop <= 0:
            return 0
        time.sleep(args.loop)
