"""What a shared-root gc pass finds under the root (``scan``) and the sweeps it makes on the way:
the trash (``sweep_trash``), stale temps and probe/lease leftovers. The pass is ``tiers/gc.py``.

The scan walks every namespace under ROOT (and the root's own probe and lease leftovers):
page files (LRU stamp = mtime, which readers refresh with a rate-limited ``utime`` on hit),
temp files (those older than ``temp_max_age_s`` were abandoned by a dead writer and are
removed), tierstore's own metadata (a namespace's ``manifest.json``, the name fsck's walk
accepts there: ``metadata_bytes``) and anything else (``.nfs*``, ``.fuse_hidden*``, foreign
files: ``other_bytes``); both counted, never touched, not toward the cap: fsck owns them. The
trash sweep unlinks entries of ``ROOT/.tierstore-trash`` older than the grace period. A dry
run (``GcReport.dry_run``) removes nothing and counts what it would remove.

Scale (docs/measurements/fsck.md): the scan keeps about 70 bytes per page in packed arrays
(``ScanTable``; a list of objects took about 450).

Hostile roots (anything under ROOT is untrusted input): the walk is ``safefs.walk`` (every
directory opened with ``O_NOFOLLOW`` relative to its parent's fd, iterative, with the layout's
depth) and every unlink is an ``*at`` call on the checked fd after re-checking the entry's
identity. A symlinked trash, namespace or fan-out directory is noted unsafe
(``gc_report.note_unsafe``), never followed. Only regular, single-link pages at their place
are pages; a hard-linked page is counted in ``other_bytes``.
Threading: one thread (the pass's).
"""

from __future__ import annotations

import os
import stat
import time
from array import array
from collections.abc import Iterator

from tierstore.errors import GONE_ERRNOS
from tierstore.format.identity import MANIFEST_NAME
from tierstore.fs import safefs
from tierstore.fs.lease import Lease
from tierstore.fs.mapper import (
    FORMAT_MARKER_TEMP_RE,
    NAMESPACE_DIR_RE,
    PAGE_SUFFIX,
    PROBE_LEFTOVER_RE,
    fanout,
    parse_index_dir,
    parse_page_name,
    parse_rank_dir,
)
from tierstore.fs.stale_temps import TempWriter, temp_writer, writer_gone
from tierstore.index import eviction
from tierstore.tiers.gc_report import GcReport, note_unsafe

TRASH_DIR = ".tierstore-trash"
_PAGE_DEPTH = 4  # namespace / g<group> / r<rank> / <fan-out> / page


class ScanTable:
    """The pages the scan found, packed in arrays (about 70 bytes a page): directory index,
    key bytes, (device, inode), file size, mtime stamp. Threading: one thread."""

    def __init__(self) -> None:
        self.dirs: list[tuple[str, ...]] = []  # directory parts under the root
        self._dir_ids: dict[tuple[str, ...], int] = {}
        self.dir_of = array("I")
        self.stamp = array("q")  # mtime in ns: the LRU stamp
        self.size = array("q")  # file bytes (st_size): what evicting it frees
        self.dev = array("Q")
        self.ino = array("Q")
        self._key_off = array("Q")
        self._key_len = array("B")
        self._keys = bytearray()

    def __len__(self) -> int:
        return len(self.stamp)

    def add(self, parts: tuple[str, ...], key: bytes, st: os.stat_result) -> None:
        d = self._dir_ids.get(parts)
        if d is None:
            d = self._dir_ids[parts] = len(self.dirs)
            self.dirs.append(parts)
        self.dir_of.append(d)
        self.stamp.append(st.st_mtime_ns)
        self.size.append(_file_bytes(st))
        self.dev.append(st.st_dev)
        self.ino.append(st.st_ino)
        self._key_off.append(len(self._keys))
        self._key_len.append(len(key))
        self._keys += key

    def name(self, i: int) -> str:
        o = self._key_off[i]
        return self._keys[o:o + self._key_len[i]].hex() + PAGE_SUFFIX

    def lru_order(self) -> Iterator[int]:
        """Page indexes in the eviction policy's order (``index.eviction``: least recently
        stamped first, ties in scan order)."""
        return eviction.lru_order(self.stamp)


def _file_bytes(st: os.stat_result) -> int:
    """A file's bytes as every tierstore command counts them: ``st_size`` (what ``stat`` and
    ``ls -l`` report, and what ``tierstore stats`` sums), not its allocated blocks, which
    depend on the file system (4 KiB rounding on ext4, compression on ZFS, the server on NFS)."""
    return st.st_size


def _page_key(parts: tuple[str, ...], name: str) -> bytes | None:
    """The key of a page at its place (``ns/g<group>/<rank dir>/<fan-out>/<key>.kvp``), else None."""
    if len(parts) != _PAGE_DEPTH or not NAMESPACE_DIR_RE.match(parts[0]):
        return None
    key = parse_page_name(name)
    if (key is not None and parse_index_dir(parts[1], "g") is not None
            and parse_rank_dir(parts[2]) is not None and fanout(key) == parts[3]):  # r<rank> or h<s>-<c>
        return key
    return None


def _named_eviction_ns(name: str) -> int:
    """The eviction time a trash entry's name starts with (the evicting node's clock, ns); 0
    for a name that does not start with one."""
    born_text = name.split(".", 1)[0]
    return int(born_text) if born_text.isascii() and born_text.isdigit() and len(born_text) <= 20 else 0


def sweep_trash(trash_fd: int, grace_s: float, rep: GcReport, server_now: float | None = None) -> None:
    """Unlink the trash entries evicted at least ``grace_s`` ago; count the others' bytes in
    ``rep.trash_bytes``. With the file server's clock (``server_now``, ``fs.lease.server_now``)
    an entry's eviction time is its ctime, which the server set when the page was renamed into
    the trash: one clock, whoever evicted it. Without it, the time its name starts with (the
    evicting node's clock, in ns) against this node's: a node whose clock lags another's by more
    than the grace would sweep the other's fresh evictions at once."""
    dry = rep.dry_run
    now = time.time_ns() if server_now is None else int(server_now * 1e9)
    for name, st in safefs.list_dir(trash_fd):
        if not stat.S_ISREG(st.st_mode):
            note_unsafe(rep, f"{TRASH_DIR}/{name}", "not a regular file in the trash")
            continue
        born = st.st_ctime_ns if server_now is not None else _named_eviction_ns(name)
        size = _file_bytes(st)
        if now - born >= grace_s * 1e9:
            try:
                if not dry:
                    safefs.unlink_at(name, trash_fd, safefs.identity(st))
                rep.trash_removed += 1
            except OSError as exc:
                if exc.errno not in GONE_ERRNOS:
                    rep.trash_bytes += size
        else:
            rep.trash_bytes += size


def scan(root_fd: int, temp_max_age_s: float, rep: GcReport, lease: Lease) -> ScanTable:
    """Walk the namespaces under the root and the root's own files: the pages at their place, in
    a ``ScanTable``; stale temps and leftovers removed; every other byte counted in ``rep``.
    Renews ``lease`` as it goes."""
    pages = ScanTable()
    now = time.time()

    def descend(parts: tuple[str, ...]) -> bool:
        return NAMESPACE_DIR_RE.match(parts[0]) is not None

    def on_error(parts: tuple[str, ...], exc: BaseException) -> None:
        if isinstance(exc, safefs.UnsafeEntry):
            note_unsafe(rep, "/".join(parts), exc.reason)

    for d in safefs.walk(root_fd, max_depth=_PAGE_DEPTH, descend=descend, on_error=on_error):
        lease.renew_if_due()
        if not d.parts:  # the root: its files are the lease, the marker...: only the marker's temps are gc's
            for name, st in d.entries:
                if FORMAT_MARKER_TEMP_RE.match(name) and stat.S_ISREG(st.st_mode):
                    _sweep_temp(d.fd, name, st, temp_writer(name), temp_max_age_s, now, rep)
                elif PROBE_LEFTOVER_RE.match(name) and stat.S_ISREG(st.st_mode):
                    _sweep_leftover(d.fd, name, st, temp_max_age_s, now, rep)
            continue
        for name, st in d.entries:
            where = "/".join((*d.parts, name))
            if stat.S_ISDIR(st.st_mode):
                if len(d.parts) >= _PAGE_DEPTH:
                    note_unsafe(rep, where, "a directory deeper than the layout")
                continue
            if stat.S_ISLNK(st.st_mode):
                note_unsafe(rep, where, "a symlink")
                continue
            if not stat.S_ISREG(st.st_mode):
                note_unsafe(rep, where, "not a regular file")
                continue
            key = _page_key(d.parts, name)
            if key is not None:
                if st.st_nlink != 1:
                    note_unsafe(rep, where, f"a page with {st.st_nlink} links (counted as foreign)")
                    rep.other_bytes += _file_bytes(st)
                    continue
                pages.add(d.parts, key, st)
                rep.page_bytes += _file_bytes(st)
            elif (writer := temp_writer(name)) is not None:
                _sweep_temp(d.fd, name, st, writer, temp_max_age_s, now, rep)
            elif PROBE_LEFTOVER_RE.match(name):
                _sweep_leftover(d.fd, name, st, temp_max_age_s, now, rep)
            elif len(d.parts) == 1 and name == MANIFEST_NAME:  # fsck's rule (admin/walk.fan_dirs): ours
                rep.metadata_bytes += _file_bytes(st)
            else:
                rep.other_bytes += _file_bytes(st)
    rep.pages = len(pages)
    return pages


def _sweep_leftover(dir_fd: int, name: str, st: os.stat_result, temp_max_age_s: float, now: float,
                    rep: GcReport) -> None:
    """A probe or lease file left behind (``mapper.PROBE_LEFTOVER_RE``: its writer unlinks it
    within a call): removed once older than ``temp_max_age_s`` (``_remove_or_count``)."""
    _remove_or_count(dir_fd, name, st, now - st.st_mtime > temp_max_age_s, rep)


def _sweep_temp(dir_fd: int, name: str, st: os.stat_result, writer: TempWriter | None, temp_max_age_s: float,
                now: float, rep: GcReport) -> None:
    """The temp ``name``: removed if its ``writer`` (``temp_writer``'s parse of the name) is gone
    (``writer_gone``; ``_remove_or_count``)."""
    stale = writer is not None and writer_gone(writer, st.st_mtime, grace_s=temp_max_age_s, now=now)[0]
    _remove_or_count(dir_fd, name, st, stale, rep)


def _remove_or_count(dir_fd: int, name: str, st: os.stat_result, stale: bool, rep: GcReport) -> None:
    """Unlink a ``stale`` temp (not in a dry run) and count it removed; count any other's bytes
    as temp bytes. Failure policy: one that cannot be removed is counted as kept."""
    if stale:
        try:
            if not rep.dry_run:
                safefs.unlink_at(name, dir_fd, safefs.identity(st))
            rep.temps_removed += 1
            return
        except OSError:
            pass
    rep.temp_bytes += _file_bytes(st)


def open_trash(root_fd: int, rep: GcReport) -> int | None:
    """The trash directory's fd (created unless a dry run); -1 a dry run's absent trash; None
    unsafe (reported: gc does nothing)."""
    try:
        return safefs.open_dir_path(root_fd, (TRASH_DIR,), create=not rep.dry_run)
    except safefs.UnsafeEntry as exc:
        note_unsafe(rep, TRASH_DIR, f"{exc.reason}: gc neither sweeps nor evicts; remove it")
        return None
    except FileNotFoundError:
        if rep.dry_run:
            return -1
        raise
