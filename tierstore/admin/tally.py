"""What one walk of a tierstore root found, before it is turned into stats: ``GroupTally``
(healthy pages of one namespace, group and rank) and ``Inventory`` (the namespaces, findings
and tallies of a walk or of one fan-out directory of it).

Contract: tallies add pages that were stat'ed (``add``: exact bytes and times) or only seen by
name (``add_listed``: bytes from the layout, "newest" from the directory's last change,
"oldest" unknown); ``merge`` combines two tallies or two inventories without losing either.

Threading: not thread-safe; each pool thread of the walk fills its own ``Inventory`` and the
calling thread merges them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tierstore.admin.findings import Finding
from tierstore.admin.namespace_dirs import NamespaceDir


@dataclass
class GroupTally:
    """Healthy pages of one (namespace, group, rank)."""

    files: int = 0
    bytes: int = 0
    tokens: int = 0
    tokens_from_headers: int = 0  # files whose token count came from their header
    listed: int = 0  # files counted from the listing alone (bytes estimated from the layout)
    oldest: float | None = None
    newest: float | None = None

    def add(self, size: int, mtime: float, tokens: int, from_header: bool) -> None:
        self.files += 1
        self.bytes += size
        self.tokens += tokens
        self.tokens_from_headers += int(from_header)
        self.oldest = mtime if self.oldest is None else min(self.oldest, mtime)
        self.newest = mtime if self.newest is None else max(self.newest, mtime)

    def add_listed(self, count: int, page_bytes: int, tokens_per_page: int, dir_mtime: float | None) -> None:
        """``count`` pages seen only by name; ``dir_mtime`` is their directory's last change."""
        self.files += count
        self.listed += count
        self.bytes += count * page_bytes
        self.tokens += count * tokens_per_page
        if dir_mtime is not None and count:
            self.newest = dir_mtime if self.newest is None else max(self.newest, dir_mtime)

    def merge(self, other: GroupTally) -> None:
        self.files += other.files
        self.bytes += other.bytes
        self.tokens += other.tokens
        self.tokens_from_headers += other.tokens_from_headers
        self.listed += other.listed
        if other.oldest is not None:  # None in a listing: oldest unknown, newest from dir times
            self.oldest = other.oldest if self.oldest is None else min(self.oldest, other.oldest)
        if other.newest is not None:
            self.newest = other.newest if self.newest is None else max(self.newest, other.newest)


@dataclass
class Inventory:
    """The result of one walk."""

    root: Path
    namespaces: list[NamespaceDir] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    tallies: dict[tuple[str, int, int], GroupTally] = field(default_factory=dict)
    temps_active: int = 0
    pages_seen: int = 0  # page files handed to the visitor (healthy or not)
    vanished: int = 0  # files deleted under the walk (by gc or a writer); not problems

    def merge(self, other: Inventory) -> None:
        self.findings.extend(other.findings)
        for k, t in other.tallies.items():
            self.tallies.setdefault(k, GroupTally()).merge(t)
        self.temps_active += other.temps_active
        self.pages_seen += other.pages_seen
        self.vanished += other.vanished
