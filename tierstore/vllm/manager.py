"""Scheduler side of the tierstore offloading spec: which chunks are on disk.

``TierStoreManager`` implements vLLM's ``OffloadingManager``. A lookup is one ``stat`` of the
page's path (``FileMapper``) per disk tier, the local tier (``local_root``) first, then
``root``: no reads, no locks, no state change, so vLLM may call it as often as it likes. (The
host tier lives in the worker process and is always backed by the local or shared tier.) vLLM's offloading scheduler turns per-group answers into the hybrid hit (full
attention: a prefix run; sliding window: the window ending at the hit; Mamba: the state at the
boundary; the minimum across groups).

Failed loads: the worker reports the keys whose load failed; ``mark_failed`` remembers them
with the file's identity (inode, size, mtime) so the retried lookup misses and those tokens are
recomputed, until the file is replaced (content errors) or ``retry_after_s`` passes (timeouts
and I/O errors). Store bookkeeping: keys being written are not offered twice.

Deadlines: ``root`` may be a shared NFS export, where a hung server blocks ``stat`` for minutes.
Every ``stat`` under ``root`` runs on a small thread pool and is waited for at most
``shared_deadline_s``; a timeout marks the shared root down (``tiers.deadline.Health``): from
then on its lookups answer MISS at once, and a background probe brings it back when the mount
answers again. The scheduler thread is never blocked past the deadline. (The local tier is a
local disk: plain ``stat``.)

Page keys are vLLM's block hashes (the offload key without its 4-byte group suffix); the
group is part of the path. Threading: called from the scheduler thread only.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    LookupResult,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    get_offload_block_hash,
    get_offload_group_idx,
)

from tierstore.mapper import FileMapper
from tierstore.tiers.deadline import Health

logger = logging.getLogger("tierstore.vllm")

# Errors that say the file's bytes are wrong: skip it until it is replaced.
CONTENT_ERRORS = frozenset({"checksum", "truncated", "format", "foreign", "key_mismatch"})
MAX_FAILED_KEYS = 100_000


@dataclass
class TierStoreFileSpec(LoadStoreSpec):
    """Pages of one transfer: per page the tierstore group, the key and its token count."""

    groups: list[int] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)
    token_counts: list[int] = field(default_factory=list)

    def __repr__(self) -> str:
        return f"TierStoreFileSpec({len(self.keys)} pages)"


def _file_identity(path: os.PathLike[str] | str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


class _DeadlineStat:
    """``_file_identity`` under a root that may hang, bounded by a deadline (see module doc)."""

    def __init__(self, root: os.PathLike[str] | str, deadline_s: float) -> None:
        self.deadline_s = deadline_s
        # Threads stuck in a hung syscall stay stuck; while the root is down nothing new is
        # submitted, so two workers are enough and never pile up.
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tierstore-lookup")
        self.health = Health("shared root (scheduler lookups)", probe=lambda: os.stat(root),
                             deadline_s=deadline_s)
        self.timeouts = 0

    def __call__(self, path: os.PathLike[str]) -> tuple[int, int, int] | None:
        if not self.health.up:
            return None
        fut = self._pool.submit(_file_identity, path)
        try:
            return fut.result(timeout=self.deadline_s)
        except FutureTimeout:
            self.timeouts += 1
            self.health.mark_down(f"a lookup took longer than {self.deadline_s:.3f} s (shared_deadline_ms)")
            return None


class TierStoreManager(OffloadingManager):
    def __init__(self, mappers: Sequence[FileMapper], group_of: dict[int, int],
                 tokens_per_chunk: Sequence[int], state_groups: Sequence[bool],
                 retry_after_s: float = 30.0, local_mappers: Sequence[FileMapper] | None = None,
                 shared_deadline_s: float = 5.0) -> None:
        self.mappers = list(mappers)
        self._shared_stat = _DeadlineStat(self.mappers[0].root, shared_deadline_s)
        self.local_mappers = list(local_mappers) if local_mappers else []
        self.group_of = dict(group_of)  # vLLM group id -> tierstore group index
        self.tokens_per_chunk = list(tokens_per_chunk)
        self.state_groups = list(state_groups)  # True: a page is a state after its end token
        self.retry_after_s = retry_after_s
        self._storing: set[OffloadKey] = set()
        # key -> (file identity when it failed, kind, monotonic time of failure)
        self._failed: dict[OffloadKey, tuple[tuple[int, int, int] | None, str, float]] = {}
        self.counters: dict[str, int] = {"lookups": 0, "lookup_hits": 0, "skipped_failed": 0}

    def _path(self, key: OffloadKey) -> os.PathLike[str]:
        g = self.group_of[get_offload_group_idx(key)]
        return self.mappers[g].path_for(get_offload_block_hash(key))

    def _identity(self, key: OffloadKey) -> tuple[int, int, int] | None:
        """Identity of the page's file in the first disk tier that has it (local, then root)."""
        g = self.group_of[get_offload_group_idx(key)]
        h = get_offload_block_hash(key)
        if self.local_mappers:
            ident = _file_identity(self.local_mappers[g].path_for(h))
            if ident is not None:
                return ident
        return self._shared_stat(self.mappers[g].path_for(h))

    def _exists(self, key: OffloadKey) -> bool:
        return self._identity(key) is not None

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        self.counters["lookups"] += 1
        if key in self._failed:
            ident = self._identity(key)
            seen, kind, when = self._failed[key]
            if ident is None:
                del self._failed[key]
                return LookupResult.MISS
            expired = kind not in CONTENT_ERRORS and time.monotonic() - when > self.retry_after_s
            if ident == seen and not expired:
                self.counters["skipped_failed"] += 1
                return LookupResult.MISS
            del self._failed[key]  # replaced (or retry time passed): try it again
            self.counters["lookup_hits"] += 1
            return LookupResult.HIT
        if self._exists(key):
            self.counters["lookup_hits"] += 1
            return LookupResult.HIT
        return LookupResult.MISS

    def mark_failed(self, key: OffloadKey, kind: str) -> None:
        """Remember that loading ``key`` failed with error ``kind``."""
        if len(self._failed) >= MAX_FAILED_KEYS:
            self._failed.pop(next(iter(self._failed)))
        try:
            ident = self._identity(key)
        except (KeyError, ValueError):
            return
        self._failed[key] = (ident, kind, time.monotonic())

    def _spec(self, keys: Collection[OffloadKey], req_context: ReqContext) -> TierStoreFileSpec:
        spec = TierStoreFileSpec()
        for key in keys:
            g = self.group_of[get_offload_group_idx(key)]
            end = req_context.get_offload_key_position(key)
            spec.groups.append(g)
            spec.keys.append(get_offload_block_hash(key))
            # An attention page holds one chunk's tokens; a Mamba page the state after ``end``.
            state = self.state_groups[g] and end is not None
            spec.token_counts.append(end if state else self.tokens_per_chunk[g])
        return spec

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        return self._spec(keys, req_context)

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        todo = []
        for key in keys:
            if key in self._storing or (key not in self._failed and self._shared_stat(self._path(key)) is not None):
                continue
            todo.append(key)
        self._storing.update(todo)
        return PrepareStoreOutput(keys_to_store=todo, store_spec=self._spec(todo, req_context), evicted_keys=[])

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        self._storing.difference_update(keys)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def reset_cache(self) -> None:
        self._failed.clear()
