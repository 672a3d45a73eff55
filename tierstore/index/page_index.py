"""PageIndex: which pages one (root, namespace, group, rank) holds, answered from memory.

Contract:
- A page is known by its 64-bit fingerprint ``xxh3_64(key)``, whose top byte is the key's
  fan-out directory (``mapper.fanout``). Per fan-out directory the index keeps a sorted
  ``numpy.uint64`` array (the last listing), read through a ``memoryview`` of format "Q", with
  a bucket directory (``uint32`` starts of 2^k buckets picked by the bits below the directory
  byte, 2^k <= pages of the directory): a lookup bisects one or two entries, so it touches two
  cache lines instead of bisecting the whole array; and a small delta dict (this process's
  changes since that listing started). For lookups of many keys at once (``found_many``,
  the scheduler's prefix lookups) it also keeps a copy of the arrays concatenated per *shard*
  of 16 directories (fingerprints' top 4 bits): one ``numpy.searchsorted`` per shard instead
  of one Python bisect per key. About 18 bytes per page in all (measured with
  tracemalloc by ``tierstore bench lookup``).
- ``contains(key)`` -> True / False, or None while that directory has never been listed (the
  caller asks the file system off its thread, or says "retry"). It never touches the file
  system. A fingerprint collision (about n / 2^64) is a stale positive: the load finds no
  file and the request recomputes, as for a page deleted behind our back.
- ``found_many(indexes, fps)`` -> per fingerprint, True where some index surely has the page
  (what ``contains_any`` answers True), False where it is absent *or undecided* (a shard with
  an unlisted directory): a shortcut for positives; the caller asks ``contains_any`` for the
  rest.
- ``load_dir(d)`` lists one fan-out directory (one ``readdir``; no ``stat`` per page) and
  replaces its array and its shard's copy. A directory whose ``stat`` (inode, mtime, ctime) is
  what it was at its last listing, when that mtime was already ``SETTLED_S`` old, is not listed
  again (a create, rename or unlink in it changes its mtime, on NFS too), except every
  ``FULL_RELIST_EVERY``-th time: a change in the same clock tick as the listing can leave the
  mtime as it was, and would then be missed (a miss, never a wrong page) for at most that many
  refreshes. At 10^6 pages a refresh of an unchanged index is 256 ``stat``s instead of 256
  ``readdir``s of ~4,000 entries each. Changes made with ``add`` / ``discard`` after the listing started are
  kept on top of it, so a page this process stored is never forgotten by a refresh that
  raced with the store (no stale negative for our own pages).
- ``on_removal`` (optional) is called after any change that can turn a True answer into
  False: a ``discard`` (with its key), or a listing that lacks a page the index answered True
  for (with None: which keys is unknown). Additions never call it; a cache of True answers
  (``IndexedLookup``, the manager) relies on that.
- The module keeps a registry of live indexes by directory (``FileMapper.base``):
  ``note_stored(base, key)`` / ``note_removed(base, key)`` update every index of that
  directory in this process; the store, eviction and gc paths call them (no-ops when no index
  exists, e.g. in a worker process without a scheduler).

Threading: ``contains`` and ``found_many`` are lock-free (reads of list slots, and dict
lookups and a dict-keys intersection done in C under the GIL) and may be called from any
thread; ``add``, ``discard`` and ``load_dir`` take a short lock and may be called from any
thread. ``load_dir`` does the listing outside the lock; publishing (the directory's array and
its shard's copy, built from the arrays being published) is serialised per index, so a shard
is never built from an array that is no longer current.
"""

from __future__ import annotations

import bisect
import errno
import itertools
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np
import xxhash

from tierstore.fs.mapper import FANOUT_DIRS, PAGE_SUFFIX, locate
from tierstore.native import loader as native

_SUFFIX_LEN = len(PAGE_SUFFIX)
_DIRS = len(FANOUT_DIRS)
_SHARD_SHIFT = 60  # a shard: the 16 fan-out directories of one top hex digit
_SHARDS = 1 << (64 - _SHARD_SHIFT)
_DIRS_PER_SHARD = _DIRS // _SHARDS
_SHARD_EDGES = np.arange(_SHARDS + 1, dtype=np.uint64)
SETTLED_S = 2.0  # a directory's mtime at least this old (by our clock) when it was listed can be trusted
FULL_RELIST_EVERY = 10  # an unchanged directory is listed anyway every this many refreshes


def fingerprint(key: bytes) -> int:
    """The 64-bit fingerprint of a page key; its top byte is the fan-out directory index."""
    return xxhash.xxh3_64_intdigest(key)


def list_fingerprints(directory: str | os.PathLike[str], fanout_index: int) -> memoryview:
    """Sorted fingerprints of the page files in one fan-out directory (one readdir, no stat).

    Temp files, foreign names and pages filed under the wrong directory are skipped (a load
    would never look for them there). A missing directory is empty; so is one that stays
    ESTALE on a second try (NFS: removed by another node, e.g. ``rm -rf`` of the namespace; the
    retry is a fresh lookup of the path, which finds a directory made again). Other ``OSError``
    raise."""
    for attempt in range(2):
        try:
            return _list_once(directory, fanout_index)
        except FileNotFoundError:
            break
        except OSError as exc:
            if exc.errno != errno.ESTALE:
                raise
            if attempt:
                break
    return memoryview(np.zeros(0, dtype=np.uint64)).cast("B").cast("Q")


def _list_once(directory: str | os.PathLike[str], fanout_index: int) -> memoryview:
    """``list_fingerprints`` without the rule for a vanished directory (raises its OSError)."""
    with os.scandir(directory) as entries:
        return names_fingerprints((entry.name for entry in entries), fanout_index)


def names_fingerprints(names: Iterable[str], fanout_index: int) -> memoryview:
    """Sorted fingerprints of the page file names among ``names`` that belong in fan-out
    directory ``fanout_index`` (temps, foreign names and misfiled pages skipped): a directory's
    listing, or an object tier's keys under it."""
    fps: list[int] = []
    append = fps.append
    fromhex = bytes.fromhex
    digest = xxhash.xxh3_64_intdigest
    for name in names:
        if not name.endswith(PAGE_SUFFIX) or name[0] == ".":
            continue
        try:
            fp = digest(fromhex(name[:-_SUFFIX_LEN]))
        except ValueError:
            continue
        if fp >> 56 == fanout_index:
            append(fp)
    arr = np.array(fps, dtype=np.uint64)
    arr.sort()
    return memoryview(arr).cast("B").cast("Q")  # keeps the array alive


class PageIndex:
    """In-memory page set of one (root, namespace, group, rank); see the module docstring."""

    def __init__(self, base: str | os.PathLike[str]) -> None:
        self.base = Path(base)
        self._dirs = [str(self.base / name) for name in FANOUT_DIRS]
        self._arrays: list[memoryview | None] = [None] * _DIRS  # sorted uint64 fingerprints
        # Per directory what ``contains_fp`` reads, one tuple (a consistent snapshot without a
        # lock): the array, its bucket starts and the bucket's shift and mask (``_buckets``).
        self._search: list[tuple[memoryview, memoryview, int, int] | None] = [None] * _DIRS
        # fingerprint -> (present, sequence number of the change); per fan-out directory
        self._delta: list[dict[int, tuple[bool, int]]] = [{} for _ in range(_DIRS)]
        self._delta_all: dict[int, bool] = {}  # the same changes in one dict (``found_many``)
        # Per shard: the sorted arrays of its directories concatenated (None until all listed).
        self._shards: list[np.ndarray | None] = [None] * _SHARDS
        self._publish = threading.Lock()  # one directory published (and its shard built) at a time
        self._seq = itertools.count(1)
        self._lock = threading.Lock()
        self._loaded = 0  # directories listed at least once
        self.listings = 0
        self.listings_skipped = 0  # refreshes answered by a stat: the directory had not changed
        self.list_errors = 0
        # per directory: (inode, mtime_ns, ctime_ns) at its last listing if that mtime was
        # settled then, and refreshes skipped since (``load_dir``)
        self._unchanged: list[tuple[tuple[int, int, int] | None, int]] = [(None, 0)] * _DIRS
        # Called (on the changing thread) after a page may have left the index: with its key
        # after a ``discard``, with None after a listing that lacks a page the index had.
        # Additions never call it, so a cache of positive answers stays valid until it is
        # called (``IndexedLookup``).
        self.on_removal: Callable[[bytes | None], None] | None = None
        _register(self)

    # ------------------------------------------------------------ queries (any thread)
    @property
    def loaded(self) -> bool:
        """Every fan-out directory has been listed at least once."""
        return self._loaded == _DIRS

    def contains(self, key: bytes) -> bool | None:
        """Whether the page is here as far as this process knows; None if its directory has not
        been listed yet. No file-system access."""
        return self.contains_fp(xxhash.xxh3_64_intdigest(key))

    def contains_fp(self, fp: int) -> bool | None:
        """``contains`` for a key whose ``fingerprint`` the caller has (one hash per key when
        several indexes are asked: tiers, ranks)."""
        d = fp >> 56
        change = self._delta[d].get(fp)
        if change is not None:
            return change[0]
        search = self._search[d]
        if search is None:
            return None
        arr, starts, shift, mask = search
        b = (fp >> shift) & mask
        lo, hi = starts[b], starts[b + 1]
        i = bisect.bisect_left(arr, fp, lo, hi)
        return i < hi and arr[i] == fp

    def __len__(self) -> int:
        """Pages known (listed directories plus this process's changes; approximate while a
        listing races with changes)."""
        n = 0
        for arr, delta in zip(self._arrays, self._delta, strict=True):
            base = 0 if arr is None else len(arr)
            n += base
            for fp, (present, _seq) in list(delta.items()):
                inside = arr is not None and _in_sorted(arr, fp)
                n += int(present and not inside) - int(not present and inside)
        return n

    def nbytes(self) -> int:
        """Bytes held by the fingerprint arrays, bucket starts and shard copies (the delta dicts
        are small and not counted)."""
        shards = sum(a.nbytes for a in self._shards if a is not None)
        return shards + sum(a.nbytes + starts.nbytes for a, starts, _s, _m in filter(None, self._search))

    # ------------------------------------------------------------ changes (any thread)
    def add(self, key: bytes) -> None:
        """This process published (or saw) the page ``key``."""
        self._change(key, True)

    def discard(self, key: bytes) -> None:
        """This process removed the page ``key`` (eviction, gc, a failed load proving it gone)."""
        self._change(key, False)

    def _change(self, key: bytes, present: bool) -> None:
        fp = xxhash.xxh3_64_intdigest(key)
        with self._lock:
            self._delta[fp >> 56][fp] = (present, next(self._seq))
            self._delta_all[fp] = present
        if not present and self.on_removal is not None:
            self.on_removal(key)

    # ------------------------------------------------------------ listing (background thread)
    def load_dir(self, fanout_index: int) -> None:
        """List one fan-out directory and make it the base of that directory's answers, unless
        it has not changed since its last listing (module docstring). Raises ``OSError`` from
        the listing (the directory keeps its previous state)."""
        signature, skipped = self._unchanged[fanout_index]
        now = dir_signature(self._dirs[fanout_index])
        if (signature is not None and now == signature and skipped + 1 < FULL_RELIST_EVERY
                and self._arrays[fanout_index] is not None):
            self._unchanged[fanout_index] = (signature, skipped + 1)
            self.listings_skipped += 1
            return
        started = self.begin_listing()
        listed_at = time.time()
        try:
            arr = list_fingerprints(self._dirs[fanout_index], fanout_index)
        except OSError:
            self.list_errors += 1
            raise
        settled = now is not None and listed_at - now[1] / 1e9 >= SETTLED_S
        self._unchanged[fanout_index] = (now if settled else None, 0)
        self.publish_listing(fanout_index, arr, started)

    def begin_listing(self) -> int:
        """The mark of a listing about to start (``publish_listing``: changes made after it stay
        on top of what it finds)."""
        with self._lock:
            return next(self._seq)

    def publish_listing(self, fanout_index: int, arr: memoryview, started: int) -> None:
        """Make ``arr`` (sorted fingerprints, ``names_fingerprints``) the base of directory
        ``fanout_index``'s answers: the end of ``load_dir``, and of a listing made elsewhere (an
        object tier lists every directory of a rank in one request stream) begun at
        ``started`` (``begin_listing``)."""
        search = _buckets(arr)
        with self._publish:
            shard = self._build_shard(fanout_index, arr)
            with self._lock:
                delta = self._delta[fanout_index]
                # Changes older than the listing are in it; newer ones stay on top.
                kept = {fp: c for fp, c in delta.items() if c[1] > started}
                self._delta[fanout_index] = kept
                for fp in delta.keys() - kept.keys():
                    del self._delta_all[fp]
                old = self._arrays[fanout_index]
                if old is None:
                    self._loaded += 1
                self._arrays[fanout_index] = arr
                self._search[fanout_index] = search
                self._shards[fanout_index // _DIRS_PER_SHARD] = shard
                self.listings += 1
                dropped = [fp for fp, (present, seq) in delta.items() if present and seq <= started]
        if self.on_removal is not None and (_lost(old, arr) or not all(_in_sorted(arr, fp) for fp in dropped)):
            self.on_removal(None)

    def _build_shard(self, fanout_index: int, arr: memoryview) -> np.ndarray | None:
        """The shard of ``fanout_index`` with ``arr`` as that directory's array (None while a
        directory of it is unlisted). Copies 1/16 of the index: at 10^6 pages 0.5 MB per
        listing, on the listing thread."""
        first = fanout_index - fanout_index % _DIRS_PER_SHARD
        parts = [arr if d == fanout_index else self._arrays[d] for d in range(first, first + _DIRS_PER_SHARD)]
        if any(p is None for p in parts):
            return None
        return np.concatenate([np.frombuffer(p, dtype=np.uint64) for p in parts])  # type: ignore[arg-type]

    def load_all(self) -> None:
        """List every fan-out directory (tests and tools; the manager paces its own listing)."""
        for d in range(_DIRS):
            self.load_dir(d)

    def __repr__(self) -> str:
        return f"PageIndex({self.base}, {self._loaded}/{_DIRS} directories listed)"


def dir_signature(directory: str) -> tuple[int, int, int] | None:
    """(inode, mtime_ns, ctime_ns) of a fan-out directory; None when it cannot be read (the
    listing then says why, or finds it empty).

    Read on an fd opened for it, not by ``stat``: an NFS client answers a ``stat`` from its
    attribute cache (acdirmin 30 s, up to 60 s), so another node's new page stayed invisible to
    the refresh for up to ``index_refresh_s`` + 60 s; an open revalidates the attributes with
    the server (close-to-open: one GETATTR, no READDIR)."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    finally:
        os.close(fd)
    return st.st_ino, st.st_mtime_ns, st.st_ctime_ns


def contains_any(indexes: list[PageIndex], fp: int) -> bool | None:
    """Whether some of ``indexes`` has the page of fingerprint ``fp``: True at the first that
    has it, None if none has it and some has not listed its directory, else False. The hot
    path of the scheduler's lookups (``PageIndex.contains_fp`` inlined: one call a key)."""
    d = fp >> 56
    unknown = False
    for index in indexes:
        change = index._delta[d].get(fp)
        if change is not None:
            if change[0]:
                return True
            continue
        search = index._search[d]
        if search is None:
            unknown = True
            continue
        arr, starts, shift, mask = search
        b = (fp >> shift) & mask
        hi = starts[b + 1]
        i = bisect.bisect_left(arr, fp, starts[b], hi)
        if i < hi and arr[i] == fp:
            return True
    return None if unknown else False


def fingerprints(keys: Sequence[bytes], suffix_len: int = 0) -> np.ndarray:
    """``fingerprint`` of each of ``keys`` without its last ``suffix_len`` bytes (vLLM's offload
    keys end with their group index), as uint64. When the keys have one length and the native
    path is compiled (``native.record_sums``): one join and one GIL-free call, about 15 ns a
    key; else one slice and one hash per key, about 100 ns.

    "One length" is checked by the joined length only (a per-key check costs as much as the
    hashing saves): keys of mixed lengths that add up to n equal ones would be hashed
    misaligned, giving fingerprints of no page: misses, or with odds of about n / 2^64 a stale
    positive that the load corrects, never another page's bytes. vLLM's keys of one engine
    all have its block hash's length."""
    if keys and native.ready():
        width = len(keys[0])
        joined = b"".join(keys)
        if width > suffix_len and len(joined) == width * len(keys):
            return native.record_sums(joined, width, width - suffix_len)  # type: ignore[no-any-return]
    if suffix_len:
        keys = [key[:-suffix_len] for key in keys]
    return np.fromiter(map(xxhash.xxh3_64_intdigest, keys), dtype=np.uint64, count=len(keys))


def found_many(indexes: list[PageIndex], fps: np.ndarray) -> np.ndarray:
    """Per fingerprint of ``fps`` (uint64), whether some of ``indexes`` surely has its page:
    True exactly where ``contains_any`` answers True, except for pages in a shard not fully
    listed yet (False there: undecided, the caller asks ``contains_any``). One sort and one
    ``searchsorted`` per shard and index: about 0.1 µs a key at 4,096 keys, against about 1 µs
    for ``contains_any`` called per key (``tierstore bench lookup``)."""
    order = np.argsort(fps, kind="stable")
    ordered = fps[order]
    found = np.zeros(len(fps), dtype=bool)
    if not len(fps):
        return found
    edges = np.searchsorted(ordered >> np.uint64(_SHARD_SHIFT), _SHARD_EDGES).tolist()
    wanted: set[int] | None = None
    for index in indexes:
        # This process's changes since the listings override them. Read before the shards
        # (as ``contains_fp`` reads the delta first): a listing published in between can then
        # only turn a positive into a False (undecided), never revive a page we removed.
        changes: dict[int, bool] = {}
        if index._delta_all:
            if wanted is None:
                wanted = set(ordered.tolist())
            delta = index._delta_all
            changes = {fp: present for fp in delta.keys() & wanted
                       if (present := delta.get(fp)) is not None}
        have = np.zeros(len(fps), dtype=bool)
        for s, arr in enumerate(index._shards):
            lo, hi = edges[s], edges[s + 1]
            if lo == hi or arr is None or not len(arr):
                continue
            part = ordered[lo:hi]
            have[lo:hi] = arr.take(np.searchsorted(arr, part), mode="clip") == part
        if changes:
            for present in (True, False):
                fps_changed = np.array([fp for fp, p in changes.items() if p is present], dtype=np.uint64)
                if len(fps_changed):
                    have[np.isin(ordered, fps_changed)] = present
        found |= have
    out = np.empty_like(found)
    out[order] = found
    return out


def _buckets(arr: memoryview) -> tuple[memoryview, memoryview, int, int]:
    """``arr`` (sorted fingerprints of one directory) with a bucket directory: the bits below
    the directory byte pick one of 2^k buckets (2^k <= len(arr), so one or two fingerprints
    per bucket, 4 to 8 bytes per page), ``starts[b]:starts[b + 1]`` its slice of ``arr``. A
    lookup reads two cache lines instead of bisecting the whole array (~12 lines at 4,000
    pages a directory, most of them cache misses once the index outgrows the CPU caches)."""
    k = max(len(arr).bit_length() - 1, 0)
    shift, mask = 56 - k, (1 << k) - 1
    fps = np.frombuffer(arr, dtype=np.uint64)
    bucket = (fps >> np.uint64(shift)) & np.uint64(mask)
    starts = np.searchsorted(bucket, np.arange(mask + 2, dtype=np.uint64)).astype(np.uint32)
    return arr, memoryview(starts).cast("B").cast("I"), shift, mask


def _lost(old: memoryview | None, new: memoryview) -> bool:
    """Whether some fingerprint of the sorted ``old`` is not in the sorted ``new``."""
    if old is None or len(old) == 0:
        return False
    if len(new) == 0:
        return True
    before, after = np.frombuffer(old, dtype=np.uint64), np.frombuffer(new, dtype=np.uint64)
    at = np.minimum(np.searchsorted(after, before), len(after) - 1)
    return bool((after[at] != before).any())


def _in_sorted(arr: memoryview, fp: int) -> bool:
    i = bisect.bisect_left(arr, fp)
    return i < len(arr) and arr[i] == fp


# ---------------------------------------------------------------- registry of live indexes
_registry: dict[str, weakref.WeakSet[PageIndex]] = {}
_registry_lock = threading.Lock()


def _register(index: PageIndex) -> None:
    with _registry_lock:
        _registry.setdefault(os.path.abspath(index.base), weakref.WeakSet()).add(index)


def _indexes(base: str | os.PathLike[str]) -> list[PageIndex]:
    found = _registry.get(os.path.abspath(base))
    if not found:
        return []
    with _registry_lock:
        return list(found)


def note_stored(base: str | os.PathLike[str], key: bytes) -> None:
    """Hook for the store path: the page ``key`` was published under ``base`` (a
    ``FileMapper.base``). Updates every index of that directory in this process; cheap no-op
    without one."""
    for index in _indexes(base):
        index.add(key)


def note_removed(base: str | os.PathLike[str], key: bytes) -> None:
    """Hook for eviction, gc and the removal of a damaged page under ``base``."""
    for index in _indexes(base):
        index.discard(key)


def note_removed_file(root: str | os.PathLike[str], relpath: str) -> None:
    """Hook for evictions that know a page by its path under ``root`` (the local tier's
    LocalIndex, gc): drops the page from every index of its directory; other paths are ignored."""
    loc = locate(root, os.path.join(root, relpath))
    if loc is not None:
        note_removed(os.path.join(root, loc.directory), loc.key)
