"""What the walk of a tierstore root reports about an entry that is not a healthy page: the
finding categories, ``Finding`` and the ``fingerprint`` a repair re-checks.

Contract: a ``Finding`` keeps raw values (paths and messages as found; renderings escape them);
``to_json`` is the shape of fsck's JSON report. Every category except ``TEMP_ACTIVE`` is a
problem for fsck.

Threading: plain values; a ``Finding`` is built on one thread and handed over after.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

# Finding categories. Every one except TEMP_ACTIVE is a problem for fsck.
BAD_PAGE = "bad_page"  # a page file that fails verification (kind: the PageError kind)
STALE_TEMP = "stale_temp"  # a temp file whose writer is gone
TEMP_ACTIVE = "temp"  # a temp file that may still be written (not a problem)
ORPHAN = "orphan"  # a page in a group or rank its namespace's manifest does not know
FOREIGN = "foreign"  # anything tierstore does not write
NFS_LEFTOVER = "nfs_leftover"  # .nfsXXXX / .fuse_hiddenXXXX older than the temp age
SYMLINK = "symlink"  # a symbolic link (never followed)
MANIFEST = "manifest"  # a namespace directory without a valid manifest
UNREADABLE = "unreadable"  # a directory or file that could not be listed or stat'ed
# A page whose MAC tag does not verify with the key fsck was given (no tag, another key's, an
# algorithm not installed here) while its content checks pass: not damage, never deleted by
# --repair alone; fsck counts these apart from problems (their own exit status).
UNVERIFIABLE = "unverifiable"


Fingerprint = tuple[int, int, int, int, int]


def fingerprint(st: os.stat_result) -> Fingerprint:
    """What must not change between the scan and a repair: device, inode, size, mtime, ctime.

    The inode alone is not enough: a file deleted and re-created in between often gets the
    same inode number back.
    """
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


@dataclass
class Finding:
    """One entry that is not a healthy page (or a temp that may still be live)."""

    path: str
    category: str
    kind: str
    message: str
    size: int = 0
    mtime: float | None = None
    is_dir: bool = False
    fingerprint: Fingerprint | None = None  # identity at scan time; repair re-checks it
    action: str | None = None  # what repair did: "deleted", "quarantined", "unlinked"
    repair_error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "category": self.category,
            "kind": self.kind,
            "message": self.message,
            "size": self.size,
            "action": self.action,
            "repaired": self.action is not None,
            "repair_error": self.repair_error,
        }
