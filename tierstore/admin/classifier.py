"""What an entry under a tierstore root is when it is not a page at its proper place: names
the walk skips, listing and ``lstat`` failures, temp files (live or stale) and everything else
(symlinks, engine probe files, NFS/FUSE silly-rename leftovers, foreign entries).

Contract:

- Nothing here follows a symlink (``DirEntry.stat(follow_symlinks=False)``, ``os.readlink``)
  or opens a file. A listing or ``lstat`` that fails becomes an ``UNREADABLE`` finding; an
  entry that vanished is counted in ``Inventory.vanished`` (gc or a writer removed it).
- A temp file is stale only when its writer is provably gone (``fs.stale_temps``' one rule,
  ``--tmp-age`` as the grace); its pid is range-checked first (a name with an impossible pid
  is foreign). A live temp only counts in ``Inventory.temps_active``.
- Names skipped everywhere: ``.snapshot`` (NetApp snapshots) and names beginning with
  ``.tierstore`` (reserved for tierstore's own state, e.g. gc bookkeeping of the tiers
  package). Skipped at ROOT only: ``.quarantine`` (fsck's quarantine) and ``lost+found``.

Threading: a ``Classifier`` holds only the walk's constants (now, the temp age, this host) and
is shared by the walk's pool threads; each call records into the caller's own ``Inventory``.
"""

from __future__ import annotations

import os
import re
import stat as _stat
from pathlib import Path

from tierstore.admin.findings import (
    FOREIGN,
    NFS_LEFTOVER,
    STALE_TEMP,
    SYMLINK,
    UNREADABLE,
    Finding,
    fingerprint,
)
from tierstore.admin.tally import Inventory
from tierstore.errors import GONE_ERRNOS
from tierstore.fs.mapper import RESERVED_PREFIX, SILLY_RENAME_PREFIXES, host_tag
from tierstore.fs.stale_temps import PID_LIMIT, TempWriter, pid_possible, writer_gone

SKIP_EVERYWHERE = (".snapshot",)
SKIP_AT_ROOT = (".quarantine", "lost+found")
QUARANTINE_DIR = ".quarantine"

# IOEngine's O_DIRECT probe file (engine.probe_odirect); removed by the engine unless killed.
_PROBE_RE = re.compile(r"^\.odirect-probe\.\d+\.\d+\.tmp$")


def is_skipped(name: str) -> bool:
    """Whether the walk passes over ``name`` at every level (snapshots, tierstore's own state)."""
    return name in SKIP_EVERYWHERE or name.startswith(RESERVED_PREFIX)


def scandir_sorted(path: Path, inv: Inventory) -> list[os.DirEntry[str]]:
    """The entries of ``path`` sorted by name; [] if it is gone, a finding if unreadable."""
    try:
        with os.scandir(path) as it:
            return sorted(it, key=lambda e: e.name)
    except OSError as exc:
        if exc.errno in GONE_ERRNOS:
            return []
        inv.findings.append(Finding(str(path), UNREADABLE, "io", f"cannot list directory: {exc.strerror}", is_dir=True))
        return []


def lstat_entry(entry: os.DirEntry[str], inv: Inventory) -> os.stat_result | None:
    """lstat; None (and counted) if the entry vanished or cannot be stat'ed."""
    try:
        return entry.stat(follow_symlinks=False)
    except OSError as exc:
        if exc.errno in GONE_ERRNOS:
            inv.vanished += 1
        else:
            inv.findings.append(Finding(entry.path, UNREADABLE, "io", f"cannot stat: {exc.strerror}"))
        return None


class Classifier:
    """What an entry that is not a page at its proper place is: rules that do not depend on
    where in the tree the entry is."""

    def __init__(self, now: float, tmp_age: float):
        self.now = now
        self.tmp_age = tmp_age
        self.host = host_tag()

    def temp_is_stale(self, host: str, pid: int, mtime: float) -> tuple[bool, str]:
        """``stale_temps``' one rule: stale only when its writer is provably gone (``host`` ""
        when the name does not say; then by age against ``--tmp-age``)."""
        return writer_gone(TempWriter(host or None, pid), mtime, grace_s=self.tmp_age, now=self.now,
                           this_host=self.host, stuck_after_s=self.tmp_age)

    def other(self, entry: os.DirEntry[str], inv: Inventory, expected: str) -> None:
        """Record what an entry that is not what its level holds is (symlink, probe, NFS
        leftover, foreign)."""
        st = lstat_entry(entry, inv)
        if st is None:
            return
        f = Finding(entry.path, FOREIGN, "", "", size=st.st_size, mtime=st.st_mtime, fingerprint=fingerprint(st))
        if _stat.S_ISLNK(st.st_mode):
            f.category, f.kind = SYMLINK, "symlink"
            try:
                target = os.readlink(entry.path)
            except OSError:
                target = "?"
            f.message = f"symbolic link to {target!r} (never followed)"
        elif _PROBE_RE.match(entry.name) and _stat.S_ISREG(st.st_mode):
            stale, why = self.temp_is_stale("", 0, st.st_mtime)
            if not stale:
                inv.temps_active += 1
                return
            f.category, f.kind, f.message = STALE_TEMP, "temp", f"O_DIRECT probe file of an engine; {why}"
        elif entry.name.startswith(SILLY_RENAME_PREFIXES):
            stale, why = self.temp_is_stale("", 0, st.st_mtime)
            if not stale:
                inv.temps_active += 1
                return
            f.category, f.kind = NFS_LEFTOVER, "silly_rename"
            f.message = f"NFS/FUSE silly-rename leftover of a deleted open file; {why}"
        else:
            f.is_dir = _stat.S_ISDIR(st.st_mode)
            f.kind = "dir" if f.is_dir else ("file" if _stat.S_ISREG(st.st_mode) else "special")
            f.message = f"not written by tierstore (expected {expected})"
        inv.findings.append(f)

    def temp(self, e: os.DirEntry[str], inv: Inventory, host: str, pid: int) -> None:
        """Record a temp file of a writer: active, or stale once the writer is provably gone."""
        if not pid_possible(pid):
            self.other(e, inv, f"temp files named with a pid of at most {PID_LIMIT}")
            return
        st = lstat_entry(e, inv)
        if st is None:
            return
        stale, why = self.temp_is_stale(host, pid, st.st_mtime)
        if stale:
            inv.findings.append(Finding(e.path, STALE_TEMP, "temp", why, size=st.st_size, mtime=st.st_mtime, fingerprint=fingerprint(st)))
        else:
            inv.temps_active += 1
