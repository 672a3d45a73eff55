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

Page keys are vLLM's block hashes (the offload key without its 4-byte group suffix); the
group is part of the path. Threading: called from the scheduler thread only.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Collection, Sequence
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


class TierStoreManager(OffloadingManager):
    def __init__(self, mappers: Sequence[FileMapper], group_of: dict[int, int],
                 tokens_per_chunk: Sequence[int], state_groups: Sequence[bool],
                 retry_after_s: float = 30.0, local_mappers: Sequence[FileMapper] | None = None) -> None:
        self.mappers = list(mappers)
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

    def _paths(self, key: OffloadKey) -> list[os.PathLike[str]]:
        """The page's path in every disk tier, fastest first."""
        g = self.group_of[get_offload_group_idx(key)]
        h = get_offload_block_hash(key)
        return [m.path_for(h) for m in (*([self.local_mappers[g]] if self.local_mappers else []), self.mappers[g])]

    def _identity(self, key: OffloadKey) -> tuple[int, int, int] | None:
        for path in self._paths(key):
            ident = _file_identity(path)
            if ident is not None:
                return ident
        return None

    def _exists(self, key: OffloadKey) -> bool:
        return any(os.path.exists(p) for p in self._paths(key))

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
            if key in self._storing or (key not in self._failed and os.path.exists(self._path(key))):
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
