"""The walk of one fan-out directory ``<ns>/g<group>/<r<rank>|h<start>-<count>>/<aa>``: every
entry classified, every page file at its proper place handed to a ``PageVisitor`` (or, in a
listing, only counted), the result an ``Inventory`` of that directory.

Contract:

- The walk never opens a page file: a visitor does (fsck verifies it completely, ``stats
  --exact`` reads only its header, ``ls --exact`` reads nothing). A page is at its proper place
  when its name is a page name of this fan-out directory in a group and rank (or head slice)
  the namespace's manifest knows; a page elsewhere is an orphan, a name in the wrong fan-out
  directory a misplaced bad page. Everything else goes to the ``Classifier``.
- A visitor may offer ``visit_batch`` (``BatchVisitor``): the page names of ``GATE_BATCH``
  entries at once, each answered with (ref, verdict) or None for the per-page path.
- ``listing``: page names are counted per (namespace, group, rank) without a ``stat`` or a
  read per page (one ``readdir`` and one ``stat`` of the directory); bytes are the layout's
  uncompressed page size x count, token coverage ``tokens_per_chunk`` x count, "newest" the
  directory's last change; a page name in the wrong fan-out directory is counted (fsck finds it).
- Untrusted input: an exception from one entry becomes a finding about it and the walk goes
  on; a visitor's own failure is a bug and stops the walk (``stop`` is set for every worker).

Threading: ``FanDirWalker.fan_dir`` runs on the walk's pool threads, one directory each; the
visitor is called from those threads and must be thread-safe; the pages seen per directory are
told to ``Progress`` once per directory (a thread-local count, not a lock per page).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tierstore.admin.adaptive_gate import AdaptiveGate
from tierstore.admin.classifier import Classifier, is_skipped, lstat_entry, scandir_sorted
from tierstore.admin.findings import BAD_PAGE, ORPHAN, UNREADABLE, Finding, Fingerprint, fingerprint
from tierstore.admin.namespace_dirs import NamespaceDir, estimated_page_bytes, sliced_group_spec
from tierstore.admin.progress import Progress
from tierstore.admin.tally import GroupTally, Inventory
from tierstore.errors import GONE_ERRNOS
from tierstore.format.identity import GroupSpec
from tierstore.fs.mapper import (
    PAGE_NAME_RE,
    PAGE_SUFFIX,
    fanout,
    parse_page_name,
    parse_slice_dir,
    parse_temp_name,
)


@dataclass(frozen=True)
class PageRef:
    """A page file found at a proper place, handed to the visitor."""

    path: str
    ns: NamespaceDir
    group_index: int
    rank: int
    key: bytes
    size: int
    mtime: float
    fingerprint: Fingerprint
    group: GroupSpec | None  # None when the manifest is missing or unreadable


@dataclass
class PageVerdict:
    """What a visitor found: the page's token count, or a problem, or that it vanished."""

    token_count: int | None = None
    problem: Finding | None = None
    vanished: bool = False


PageVisitor = Callable[[PageRef], PageVerdict]
# A visitor's optional ``visit_batch(nsd, group_index, rank, group, directory, [(name, key)])``:
# pages of one fan-out directory at once, each answered with (ref, verdict) or None for the
# per-page path (fsck_read.PageVerifier.visit_batch).
BatchVisitor = Callable[[NamespaceDir, int, int, GroupSpec, str, list[tuple[str, bytes]]],
                        list[tuple[PageRef, PageVerdict] | None]]


class _OpenGate:
    """The gate of a walk without an ``AdaptiveGate``: every thread at once."""

    def acquire(self) -> None:
        return None

    def progress(self, done: int) -> None:
        return None

    def release(self, done: int = 1) -> None:
        return None


_NO_GATE = _OpenGate()
GATE_BATCH = 32  # entries of a fan-out directory between two progress reports to the walk's gate


@dataclass
class _Seen:
    """Pages a walk thread found in its current directory, told to ``Progress`` once per directory."""

    count: int = 0
    nbytes: int = 0


class FanDirWalker:
    """Walks fan-out directories of one root for one visitor (see the module docstring);
    ``stop`` ends every worker at its next chunk of entries."""

    def __init__(self, root: Path, visitor: PageVisitor | None, classifier: Classifier, progress: Progress | None,
                 listing: bool = False, gate: AdaptiveGate | None = None):
        self._local = threading.local()
        self.gate: AdaptiveGate | _OpenGate = gate if gate is not None else _NO_GATE
        self.root = root
        self.visitor = visitor
        self.listing = listing and visitor is None
        self.cls = classifier
        self.progress = progress
        self.stop = threading.Event()

    def fan_dir(self, nsd: NamespaceDir, aa: Path, g: int, r: int, orphan: bool) -> Inventory:
        """Walk one ``<aa>`` directory (runs on a pool thread)."""
        try:
            return self._fan_dir(nsd, aa, g, r, orphan)
        except BaseException:
            # Stop the other workers now, not when the caller gets round to this future: under
            # load it may take a while, and every queued directory would fail the same way.
            self.stop.set()
            raise

    def _fan_dir(self, nsd: NamespaceDir, aa: Path, g: int, r: int, orphan: bool) -> Inventory:
        inv = Inventory(self.root)
        if self.stop.is_set():
            return inv
        group = nsd.group(g)
        heads = parse_slice_dir(aa.parent.name)
        if heads is not None and group is not None and not orphan:
            group = sliced_group_spec(group, heads)  # its pages hold those heads: the slice's layout
        if self.listing and not orphan:
            return self._fan_dir_listed(inv, nsd, aa, g, r, group)
        fan = aa.name
        batch = getattr(self.visitor, "visit_batch", None) if group is not None and not orphan else None
        gate = self.gate
        gate.acquire()  # one pass per directory: a pass through the gate may be a thread switch
        try:
            entries = scandir_sorted(aa, inv)
            for at in range(0, len(entries), GATE_BATCH):
                if self.stop.is_set():
                    break
                chunk = [e for e in entries[at:at + GATE_BATCH] if not is_skipped(e.name)]
                rest = chunk if batch is None else self._visit_batch(batch, chunk, inv, nsd, g, r, group, str(aa))
                for e in rest:
                    self._entry_guarded(e, inv, nsd, g, r, orphan, group, fan)
                gate.progress(len(chunk))
        finally:
            gate.release(0)
        if self.progress and self._seen.count:  # once per directory: the lock is not taken per page
            self.progress.advance(files=self._seen.count, nbytes=self._seen.nbytes)
            self._seen.count = self._seen.nbytes = 0
        return inv

    @property
    def _seen(self) -> _Seen:
        """This thread's pages of its current directory not yet told to ``progress``."""
        seen = getattr(self._local, "seen", None)
        if seen is None:
            seen = self._local.seen = _Seen()
        return seen

    def _entry_guarded(self, e: os.DirEntry[str], inv: Inventory, nsd: NamespaceDir, g: int, r: int,
                       orphan: bool, group: GroupSpec | None, fan: str) -> None:
        """``_leaf_entry``; an exception from this one entry is a finding about it."""
        try:
            ref = self._leaf_entry(e, inv, nsd, g, r, orphan, group, fan)
        except Exception as exc:  # noqa: BLE001 - untrusted input: one entry never ends the walk
            inv.findings.append(Finding(e.path, UNREADABLE, "error",
                                        f"could not classify: {type(exc).__name__}: {str(exc)[:200]}"))
            return
        if ref is not None:
            self._visit(ref, inv)  # a visitor's own failure is a bug: it stops the walk

    def _visit_batch(self, batch: BatchVisitor, chunk: list[os.DirEntry[str]], inv: Inventory, nsd: NamespaceDir,
                     g: int, r: int, group: GroupSpec, directory: str) -> list[os.DirEntry[str]]:
        """Hand the chunk's page names at their proper place to the visitor's batch (no stat
        here: the batch's own open and fstat tell size and identity); the entries it leaves
        (and every other entry) go back for the per-entry path."""
        fan = os.path.basename(directory)
        pages: list[tuple[os.DirEntry[str], bytes]] = []
        rest: list[os.DirEntry[str]] = []
        for e in chunk:
            name = e.name
            key = parse_page_name(name) if name.endswith(PAGE_SUFFIX) else None
            if key is not None and fanout(key) == fan and e.is_file(follow_symlinks=False):
                pages.append((e, key))
            else:
                rest.append(e)
        if not pages:
            return rest
        results = batch(nsd, g, r, group, directory, [(e.name, key) for e, key in pages])
        seen = self._seen if self.progress else None
        for (e, _), got in zip(pages, results, strict=True):
            if got is None:
                rest.append(e)
                continue
            ref, verdict = got
            inv.pages_seen += 1
            if seen is not None:
                seen.count += 1
                seen.nbytes += ref.size
            self._record(ref, verdict, inv)
        return rest

    def _fan_dir_listed(self, inv: Inventory, nsd: NamespaceDir, aa: Path, g: int, r: int,
                        group: GroupSpec | None) -> Inventory:
        """Count page names without a stat per page (``listing``); classify the rest as usual."""
        count = 0
        key_len = 0
        others: list[os.DirEntry[str]] = []
        try:
            dir_mtime: float | None = os.stat(aa, follow_symlinks=False).st_mtime
            with os.scandir(aa) as it:
                for e in it:
                    name = e.name
                    if name.endswith(".kvp") and PAGE_NAME_RE.match(name) and e.is_file(follow_symlinks=False):
                        count += 1
                        key_len = (len(name) - 4) // 2
                    elif not is_skipped(name):
                        others.append(e)
        except OSError as exc:
            if exc.errno not in GONE_ERRNOS:
                inv.findings.append(Finding(str(aa), UNREADABLE, "io", f"cannot list directory: {exc.strerror}",
                                            is_dir=True))
            return inv
        for e in sorted(others, key=lambda x: x.name):
            self._entry_guarded(e, inv, nsd, g, r, False, group, aa.name)
        if self.progress and self._seen.count:
            self.progress.advance(files=self._seen.count, nbytes=self._seen.nbytes)
            self._seen.count = self._seen.nbytes = 0
        if count:
            inv.pages_seen += count
            if self.progress:
                self.progress.advance(files=count)
            page_bytes = (estimated_page_bytes(nsd.namespace, g, r, key_len, group.layout if group else None)
                          if nsd.namespace else 0)
            tokens = group.tokens_per_chunk if group is not None else 0
            inv.tallies.setdefault((nsd.name, g, r), GroupTally()).add_listed(count, page_bytes, tokens, dir_mtime)
        return inv

    def _leaf_entry(self, e: os.DirEntry[str], inv: Inventory, nsd: NamespaceDir, g: int, r: int,
                    orphan: bool, group: GroupSpec | None, fan: str) -> PageRef | None:
        """Classify one entry of the fan-out directory ``fan``; the page to visit, if it is one.

        The hot path of fsck (one call per page): the walk already parsed the namespace, group
        and rank directories, so a page's place is checked by its fan-out name alone (what
        ``mapper.locate`` would re-derive from the whole path)."""
        if not e.is_file(follow_symlinks=False):
            self.cls.other(e, inv, "page files")
            return None
        name = e.name
        key = parse_page_name(name) if name.endswith(PAGE_SUFFIX) else None  # a page is never a temp name
        if key is None:
            tmp = parse_temp_name(name)
            if tmp is not None:
                self.cls.temp(e, inv, tmp.host, tmp.pid)
            else:
                self.cls.other(e, inv, "page files")
            return None
        st = lstat_entry(e, inv)
        if st is None:
            return None
        if self.progress:
            seen = self._seen
            seen.count += 1
            seen.nbytes += st.st_size
        fp = fingerprint(st)
        if orphan:
            why = (f"group {g} is not in the namespace's manifest" if nsd.group(g) is None
                   else f"head slice {e.path.split(os.sep)[-3]} is not one of the group's KV heads"
                   if parse_slice_dir(e.path.split(os.sep)[-3]) is not None
                   else f"rank {r} is outside the manifest's parallel layout ({nsd.world_size} ranks)")
            inv.findings.append(Finding(e.path, ORPHAN, "orphan", why, size=st.st_size, mtime=st.st_mtime,
                                        fingerprint=fp))
            return None
        if fanout(key) != fan:
            inv.findings.append(Finding(e.path, BAD_PAGE, "misplaced", "page name does not belong in this fan-out "
                                        "directory", size=st.st_size, mtime=st.st_mtime, fingerprint=fp))
            return None
        inv.pages_seen += 1
        return PageRef(e.path, nsd, g, r, key, st.st_size, st.st_mtime, fp, group)

    def _visit(self, ref: PageRef, inv: Inventory) -> None:
        self._record(ref, self.visitor(ref) if self.visitor else PageVerdict(), inv)

    def _record(self, ref: PageRef, verdict: PageVerdict, inv: Inventory) -> None:
        if verdict.vanished:
            inv.vanished += 1
            return
        if verdict.problem is not None:
            if self.progress:
                self.progress.advance(problems=1)
            inv.findings.append(verdict.problem)
            return
        tokens = verdict.token_count
        from_header = tokens is not None
        if tokens is None:
            tokens = ref.group.tokens_per_chunk if ref.group is not None else 0
        inv.tallies.setdefault((ref.ns.name, ref.group_index, ref.rank), GroupTally()).add(
            ref.size, ref.mtime, tokens, from_header)
