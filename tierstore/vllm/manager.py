"""Scheduler side of the tierstore offloading spec: which chunks are on disk, from memory.

``TierStoreManager`` implements vLLM's ``OffloadingManager``. vLLM schedules every request on
one thread, so nothing here touches the file system on that thread: not ``lookup``, not
``prepare_store``, not ``mark_failed``. Lookups are answered by ``IndexedLookup``: an
in-memory ``PageIndex`` per disk tier and group (the local tier first, then ``root``), loaded
by listing the fan-out directories on a background thread at start and refreshed every
``index_refresh_s``. (The host tier lives in the worker process and is always backed by the
local or shared tier.) vLLM's offloading scheduler turns per-group answers into the hybrid hit
(full attention: a prefix run; sliding window: the window ending at the hit; Mamba: the state
at the boundary; the minimum across groups).

Answers: HIT / MISS from the index; ``LookupResult.RETRY`` ("ask again next step"; vLLM's
``get_num_new_matched_tokens`` then returns ``(None, False)`` and the request waits while
others are scheduled) for a key whose fan-out directory has not been listed yet and for a key
whose store just completed and is being confirmed. Such keys are collected during the step
and handed to the prober as one batch in ``on_schedule_end`` (as vLLM's
``AsyncLookupManager``); its verdicts are applied on the scheduler thread at the next call.
While the shared tier is down its index is skipped: MISS at once.

Cost on the scheduler thread: vLLM 0.32 asks once per key, in prefix order, and again for the
same keys on every step a request waits and for every request sharing the prefix. A key
answered HIT is kept in a set (bounded) and answered from it until an event can turn a HIT
into something else (``IndexedLookup.on_removal``): its page left an index (an eviction, a
removed damaged page: that key is dropped), a refresh found some page gone or the shared tier
went down (the set is cleared), or its load failed (``mark_failed`` drops it).
Other keys take the full path (failed / probing bookkeeping, then the index: one xxh3 hash
and a bucket lookup per tier). ``TierStoreConnectorScheduler`` replaces vLLM's per-key prefix
loop with ``lookup_prefix``: the same answers, the first sight of a long prompt's keys decided
in one vectorized pass (a 32k-token prompt's 4,096 keys: about 1 ms instead of 5).
``docs/measurements/lookup-cpu.txt`` has the figures.

Freshness: pages this process stores are confirmed (a background ``stat``) when vLLM reports
the store complete and answered HIT from then on; when the worker runs in this process and
the store path calls ``page_index.note_stored`` they are in the index before that. Pages of
other nodes appear at the next refresh (``index_refresh_s``). A stale positive (gc or eviction
elsewhere) costs one failed load: the request is recomputed and the verdict corrected.

Failed loads: the worker reports the keys whose load failed; ``mark_failed`` remembers them
and has the prober record the file's identity (inode, size, mtime); the key misses (its tokens
are recomputed) until the file is replaced or gone (content errors; each lookup of it
schedules a background re-check) or ``retry_after_s`` passes (timeouts and I/O errors).
Store bookkeeping: keys being written are not offered twice; keys the shared index has are
not written again.

Tensor parallel: a group's mappers may be one per rank (each rank writes its own file of a
page). A key is a HIT only when every rank's file is indexed, and a failed load's identity is
that of every rank's file: when one rank's damaged file is removed (the others' stay) the key
misses at once, is recomputed and stored again by that rank (the others find their file and
skip), instead of hitting and failing to load on that rank forever.

Page keys are vLLM's block hashes (the offload key without its 4-byte group suffix); the
group is part of the path. With ``encryption_key_file`` or ``require_cache_salt`` a page key
is made by ``PageNames`` (the salt's key id and keyed name of the block hash), here and nowhere
else: every index question and transfer spec uses it, so the worker and the files never see a
block hash; a request that may not be cached misses and is never stored.

Threading: every public method is called from the scheduler thread only; ``IndexedLookup``
owns the background threads.
"""

from __future__ import annotations

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
    get_offload_group_idx,
)

from tierstore.errors import BAD_CONTENT_KINDS, UNVERIFIABLE_KINDS
from tierstore.fs.mapper import FileMapper
from tierstore.index.index_prober import PageIdentity
from tierstore.index.indexed_lookup import IndexedLookup, ListedTier, SliceGroup
from tierstore.native import loader as native
from tierstore.vllm.page_names import PageNames

_HIT = LookupResult.HIT
MAX_FAILED_KEYS = 100_000
MAX_CACHED_HITS = 1 << 18  # keys of HIT answers kept for repeated lookups (~25 MB at most)
# ``lookup_prefix``: this many keys go through ``lookup`` before a vectorized pass is tried
# (a prompt whose first keys miss never pays for one), and fewer undecided keys than
# MIN_BATCH_KEYS go one by one (below it a pass costs more than the calls).
LEAD_KEYS = 8
MIN_BATCH_KEYS = 32
_UNKNOWN = object()  # identity of a failed page not yet looked at by the prober


@dataclass
class TierStoreFileSpec(LoadStoreSpec):
    """Pages of one transfer: per page the tierstore group, the key and its token count."""

    groups: list[int] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)
    token_counts: list[int] = field(default_factory=list)

    def __repr__(self) -> str:
        return f"TierStoreFileSpec({len(self.keys)} pages)"


@dataclass
class _FailedLoad:
    kind: str
    when: float  # monotonic time of the failure
    seen: PageIdentity | None | object = _UNKNOWN  # the files' identity right after the failure


class TierStoreManager(OffloadingManager):
    def __init__(self, mappers: Sequence[FileMapper | Sequence[FileMapper]], group_of: dict[int, int],
                 tokens_per_chunk: Sequence[int], state_groups: Sequence[bool],
                 retry_after_s: float = 30.0,
                 local_mappers: Sequence[FileMapper | Sequence[FileMapper]] | None = None,
                 shared_deadline_s: float = 5.0, index_refresh_s: float = 30.0,
                 load_index: bool = True, slices: Sequence[SliceGroup | None] | None = None,
                 names: PageNames | None = None, listed: ListedTier | None = None) -> None:
        self.mappers = list(mappers)
        self.local_mappers = list(local_mappers) if local_mappers else []
        # ``slices``: groups stored as KV-head slices (their mappers: one per slice directory).
        self.pages = IndexedLookup(self.mappers, self.local_mappers or None, refresh_s=index_refresh_s,
                                   deadline_s=shared_deadline_s, slices=slices, listed=listed)
        self.pages.start(load=load_index)  # False: tests of a cold index
        native.start()  # ``lookup_prefix``'s compiled key hashing (``native.record_sums``), compiled off-thread
        self.group_of = dict(group_of)  # vLLM group id -> tierstore group index
        self.tokens_per_chunk = list(tokens_per_chunk)
        self.state_groups = list(state_groups)  # True: a page is a state after its end token
        self.retry_after_s = retry_after_s
        self.names = names if names is not None else PageNames()  # offload key -> page key
        self._storing: set[OffloadKey] = set()
        self._failed: dict[OffloadKey, _FailedLoad] = {}
        self._probing: set[OffloadKey] = set()  # handed to the prober, verdict not applied yet
        self._batch: list[tuple[OffloadKey, int, bytes]] = []  # this step's keys to probe
        # vLLM's 4-byte group suffix of an offload key -> tierstore group (no int per lookup).
        self._route = {gid.to_bytes(4, "big"): g for gid, g in self.group_of.items()}
        # Keys answered HIT since the last event that can turn a HIT into something else (a removal:
        # ``_forget_hits``; a failed load). Not failed, not being probed. Bounded: cleared when full.
        self._hits: set[OffloadKey] = set()
        self._suffixes: dict[int, list[bytes]] = {}  # tierstore group -> its vLLM key suffixes
        for suffix, g in self._route.items():
            self._suffixes.setdefault(g, []).append(suffix)
        self.pages.on_removal(self._forget_hits)
        self._cached_hits = 0  # lookups answered from ``_hits``
        self._index_lookups = 0  # the others
        self._index_hits = 0
        self._counts: dict[str, int] = {"skipped_failed": 0, "lookup_retries": 0, "lookup_probes": 0}

    @property
    def counters(self) -> dict[str, int]:
        """Lookup counters (a copy): lookups, lookup_hits, skipped_failed, lookup_retries,
        lookup_probes, pages_refused (``PageNames.refused``)."""
        return {"lookups": self._cached_hits + self._index_lookups, "lookup_hits": self._cached_hits + self._index_hits,
                **self._counts, "pages_refused": self.names.refused}

    # ------------------------------------------------------------ lookups
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        # The hot path (vLLM asks once per key, and again for every request sharing a
        # prefix, every step a request waits): a set hit.
        if key in self._hits:
            self._cached_hits += 1
            return _HIT
        return self._lookup_index(key, req_context)

    def lookup_prefix(self, keys: Sequence[OffloadKey], req_context: ReqContext) -> int | None:
        """vLLM's ``_maximal_prefix_lookup`` over ``lookup``: the number of leading HITs, or
        None when a key answered RETRY before the first MISS; the same answers and bookkeeping
        in fewer Python steps (``TierStoreConnectorScheduler`` calls it). ``keys``: one vLLM
        group's (one request state's).

        Order: the leading keys already answered HIT (the set); then up to ``LEAD_KEYS`` keys
        through ``lookup``, so that a prompt that misses early (most new prompts) stops before
        paying for a pass over all its keys; when those all hit, the leading index hits of
        the rest in one vectorized pass (``IndexedLookup.known_prefix``: about 50 µs plus
        55 ns a key, against 1.5 µs a key through ``lookup``), as far as ``_pass_end``
        expects the prefix to reach; then ``lookup`` per key from the first key nothing
        decided yet."""
        hits = self._hits
        i = 0
        for key in keys:
            if key not in hits:
                break
            i += 1
        self._cached_hits += i
        result: LookupResult | None = None  # the answer for keys[i], when already asked
        lead_end = min(len(keys), i + LEAD_KEYS)
        while i < lead_end:
            result = self.lookup(keys[i], req_context)
            if result is not _HIT:
                break
            i += 1
            result = None
        if result is None and len(keys) - i >= MIN_BATCH_KEYS:
            end = self._pass_end(keys, i, req_context)
            if end - i >= MIN_BATCH_KEYS:
                i += self._known_prefix(keys[i:end], req_context)
        count, deferred = i, False
        for key in keys[i:]:
            if result is None:
                result = self.lookup(key, req_context)
            if result is _HIT:
                count += 1
            elif result is LookupResult.RETRY:
                deferred = True  # keep going, as vLLM does: later keys get probed this step
            else:
                break
            result = None
        return None if deferred else count

    def _pass_end(self, keys: Sequence[OffloadKey], start: int, ctx: ReqContext) -> int:
        """Where a vectorized pass from ``start`` ends: at the first of the keys ``start`` +
        8, 16, 32, ... that the index does not surely hold (``IndexedLookup.answer``: no
        bookkeeping), or at the end. Keys chain the prefix and pages are stored in prefix
        order, so the prefix rarely reaches past such a key: a prompt with a short stored
        prefix pays for a pass over about that prefix, not over all its keys. Only the pass's
        length depends on it; the answer is decided by the pass and ``lookup`` after it."""
        group = self._route[keys[0][-4:]]
        step = LEAD_KEYS
        while start + step < len(keys):
            page_key = self.names.of(keys[start + step], ctx)
            if page_key is None or self.pages.answer(group, page_key) is not True:
                return start + step
            step *= 2
        return len(keys)

    def _known_prefix(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> int:
        """How many leading ``keys`` are index hits that ``_lookup_index`` would answer HIT;
        records them as it would (a key that is also in ``_hits`` counts as an index lookup
        rather than a cached one: ``counters`` only report the sums, which match)."""
        if self._probing and not self.pages.results.empty():
            self._apply_results()
        removals = self.pages.removals
        group = self._route[keys[0][-4:]]
        named, suffix_len = self.names.for_index(keys, ctx)
        m = self.pages.known_prefix(group, named, suffix_len=suffix_len) if named else 0
        if m and (self._failed or self._probing):
            for i, key in enumerate(keys[:m]):
                if key in self._failed or key in self._probing:  # MISS or RETRY: ``lookup`` decides
                    m = i
                    break
        self._index_lookups += m
        self._index_hits += m
        if m and removals == self.pages.removals:  # else these answers may predate a removal
            if len(self._hits) + m > MAX_CACHED_HITS:
                self._hits.clear()
            self._hits.update(keys[:m])
        return m

    def _lookup_index(self, key: OffloadKey, ctx: ReqContext | None = None) -> LookupResult:
        self._index_lookups += 1
        # (Verdicts come for probed keys only; on_schedule_end applies any left.)
        if self._probing and not self.pages.results.empty():
            self._apply_results()
        if self._failed:
            failed = self._failed.get(key)
            if failed is not None and self._skip_failed(key, failed):
                self._counts["skipped_failed"] += 1
                return LookupResult.MISS
        if self._probing and key in self._probing and self.pages.shared_up:
            self._counts["lookup_retries"] += 1
            return LookupResult.RETRY
        removals = self.pages.removals
        page_key = self.names.of(key, ctx)
        if page_key is None:
            return LookupResult.MISS  # a request that may not be cached (PageNames)
        found = self.pages.answer(self._route[key[-4:]], page_key)
        if found:
            self._index_hits += 1
            if removals == self.pages.removals:  # else this answer may predate a removal
                if len(self._hits) >= MAX_CACHED_HITS:
                    self._hits.clear()
                self._hits.add(key)
            return LookupResult.HIT
        if found is None:
            self._probe(key)
            self._counts["lookup_retries"] += 1
            return LookupResult.RETRY
        return LookupResult.MISS


    def _forget_hits(self, group: int | None, page_key: bytes | None) -> None:
        """``IndexedLookup`` removal listener (any thread): drop the cached HITs that may be
        stale, those of one page (an eviction, a removed damaged page) or all."""
        if group is None or page_key is None or not self.names.plain:  # a named key has no way back
            self._hits.clear()
            return
        for suffix in self._suffixes.get(group, ()):
            self._hits.discard(page_key + suffix)  # type: ignore[arg-type]

    def _skip_failed(self, key: OffloadKey, failed: _FailedLoad) -> bool:
        """Whether a key whose load failed still misses; forgets it when it may be tried again."""
        # A bad or unverifiable page misses until its file is replaced or removed; any other
        # failure (a timeout, an I/O error) is tried again after retry_after_s.
        if (failed.kind not in BAD_CONTENT_KINDS | UNVERIFIABLE_KINDS
                and time.monotonic() - failed.when > self.retry_after_s):
            del self._failed[key]
            return False
        if failed.seen is not _UNKNOWN:
            self._probe(key)  # has the file been replaced or removed since? (off this thread)
        return True

    def _probe(self, key: OffloadKey) -> None:
        page_key = self.names.of(key)
        if key not in self._probing and page_key is not None:
            self._probing.add(key)
            self._batch.append((key, self.group_of[get_offload_group_idx(key)], page_key))

    def _apply_results(self) -> None:
        while not self.pages.results.empty():
            for key, ident in self.pages.results.get_nowait():
                self._probing.discard(key)
                failed = self._failed.get(key)
                if failed is None:
                    continue
                if failed.seen is _UNKNOWN:
                    failed.seen = ident
                if ident is None or ident != failed.seen:
                    del self._failed[key]  # gone (miss from the index) or replaced (try it)

    def on_schedule_end(self, context: object) -> None:
        """Hand this step's unanswered keys to the prober as one batch."""
        self._apply_results()
        if self._batch:
            batch, self._batch = self._batch, []
            self._counts["lookup_probes"] += len(batch)
            self.pages.probe(batch)

    def has_pending_work(self) -> bool:
        return bool(self._probing)

    def mark_failed(self, key: OffloadKey, kind: str) -> None:
        """Remember that loading ``key`` failed with error ``kind`` (its identity is read by the
        prober, off this thread)."""
        key = self.names.vllm_key(key)  # type: ignore[assignment]
        if len(self._failed) >= MAX_FAILED_KEYS:
            self._failed.pop(next(iter(self._failed)))
        try:
            self.group_of[get_offload_group_idx(key)]
        except (KeyError, ValueError):
            return
        self._failed[key] = _FailedLoad(kind, time.monotonic())
        self._hits.discard(key)
        self._probing.discard(key)  # a verdict in flight predates the failure: probe again
        self._probe(key)

    # ------------------------------------------------------------ transfers
    def _spec(self, keys: Collection[OffloadKey], req_context: ReqContext) -> TierStoreFileSpec:
        spec = TierStoreFileSpec()
        route, state_groups, tokens = self._route, self.state_groups, self.tokens_per_chunk
        for key in keys:
            g = route[key[-4:]]
            spec.groups.append(g)
            spec.keys.append(self.names.of(key, req_context))  # type: ignore[arg-type]  # never None: looked up
            # An attention page holds one chunk's tokens; a Mamba page the state after ``end``.
            end = req_context.get_offload_key_position(key) if state_groups[g] else None
            spec.token_counts.append(tokens[g] if end is None else end)
        return spec

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        spec = self._spec(keys, req_context)
        self.names.remember_loads(list(keys), spec.keys)
        return spec

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        todo = []
        for key in keys:
            if key in self._storing:
                continue
            page_key = self.names.of(key, req_context)
            if page_key is None:
                continue  # a request that may not be cached
            if key not in self._failed and self.pages.answer_tier(
                    "shared", self.group_of[get_offload_group_idx(key)], page_key):
                continue  # the shared tier has it (an unlisted directory: store; the engine skips)
            todo.append(key)
        self._storing.update(todo)
        return PrepareStoreOutput(keys_to_store=todo, store_spec=self._spec(todo, req_context), evicted_keys=[])

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        self._storing.difference_update(keys)
        if not success:
            return
        for key in keys:
            # vLLM reports the job, not each page (a page may have been dropped): confirm the
            # pages the index does not have yet; they answer RETRY meanwhile, never a false MISS.
            page_key = self.names.of(key, req_context)
            if page_key is not None and not self.pages.answer(self.group_of[get_offload_group_idx(key)], page_key):
                self._probe(key)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def reset_cache(self) -> None:
        self._failed.clear()
        self._hits.clear()

    def shutdown(self) -> None:
        self.pages.close()

    # ------------------------------------------------------------ tests and benchmarks
    def settle(self, timeout: float = 10.0) -> bool:
        """Flush this step's probes and wait until every verdict is applied (tests and
        benchmarks only: it blocks the calling thread). False if ``timeout`` passed."""
        deadline = time.monotonic() + timeout
        self.on_schedule_end(None)
        while self._probing and time.monotonic() < deadline:
            time.sleep(0.002)
            self._apply_results()
        return not self._probing
