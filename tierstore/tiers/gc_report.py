"""What one shared-root gc pass found and did (``GcReport``), and how a pass notes an entry it
refused to follow or touch (``note_unsafe``). The pass itself is ``tiers/gc.py``.

Every byte count is file bytes (``st_size``), the meaning every tierstore command's bytes have.
An unsafe entry (a symlinked directory, a planted FIFO, a page replaced since the scan) is
listed in ``unsafe`` (the first ``UNSAFE_LISTED``) and logged at debug only: the caller says it
once (the CLI prints it, ``GcDaemon`` warns when it changes).
Threading: a report is filled by one thread (the evictor threads fill their own, merged on
the pass's thread).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from tierstore.fs.display import escape

# gc's one logger, whichever of its modules speaks: the name a deployment configures.
GC_LOG = logging.getLogger("tierstore.tiers.gc")
UNSAFE_LISTED = 100  # entries kept in ``GcReport.unsafe``; the rest are only logged


@dataclass
class GcReport:
    busy: bool = False  # another node holds the lease: nothing was done
    lease_lost: bool = False
    pages: int = 0
    page_bytes: int = 0
    temp_bytes: int = 0
    other_bytes: int = 0  # foreign, hard-linked or unexpected files (warned about)
    metadata_bytes: int = 0  # tierstore's own metadata (namespace manifests): neither pages nor foreign
    trash_bytes: int = 0  # still in the trash (grace period) after the run
    total_before: int = 0
    total_after: int = 0
    evicted: int = 0
    evicted_bytes: int = 0
    skipped_recent: int = 0  # victims hit (re-stamped) since the scan
    vanished: int = 0  # victims another evictor or fsck removed first
    temps_removed: int = 0
    trash_removed: int = 0
    lease_problem: str | None = None  # the lease path is not a lease file (see lease.py)
    room_evicted: int = 0  # of ``evicted``: taken without the lease, the export full (``gc._make_room``)
    room_bytes: int = 0
    refused: str | None = None  # not a cache directory: nothing done
    dry_run: bool = False  # the counts below are what a real pass would do
    unsafe: list[str] = field(default_factory=list)  # entries gc refused to follow or touch
    seconds: float = 0.0
    started: float = 0.0  # wall clock (Unix seconds) when this node held the lease
    finished: float = 0.0


def note_unsafe(rep: GcReport, where: str, what: str) -> None:
    """List the entry ``where`` (a path under the root) that gc refused, and why (``what``)."""
    if len(rep.unsafe) < UNSAFE_LISTED:
        rep.unsafe.append(f"{escape(where)}: {what}")
    # at debug: the caller says it (the CLI's "refused" lines, the daemon's warning), once
    GC_LOG.debug("tierstore gc: %s: %s; not followed, not touched", escape(where), what)
