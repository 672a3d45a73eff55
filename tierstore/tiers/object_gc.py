"""Object-tier garbage collection: keep a bucket prefix under ``max_bytes`` with many nodes.

Contract (``tierstore gc s3://BUCKET/PREFIX --max-bytes N``; the directory pass is gc.py and
this pass reports in the same ``GcReport`` fields): one pass is ``collect_object``:

1. Take the lease (``objstore/lease.py``: an object, conditional PUTs, expiry by the server's
   clock); if another node holds it, do nothing (``busy``, ``lease_holder``).
2. List the prefix (1,000 keys a request). Page objects (``<ns>/g<g>/r<r>|h<s>-<c>/<aa>/<key>.kvp``)
   count toward the cap (``page_bytes``, ``pages``); ``PREFIX/.tierstore/`` (lease, clock,
   probes, access journals) and namespace manifests are ``metadata_bytes``; anything else is
   ``other_bytes`` (warned about, never touched, not toward the cap). A prefix holding objects
   other than tierstore's own and none a page or a namespace is refused (``refused``), as a
   directory that is not a cache is.
3. Merge the access journals (``objstore/access_journal.py``; ``journals``): a page's stamp is
   its newest access, or its ``LastModified`` (creation) when no journal names it
   (``hot_pages``: pages ranked by a hit).
4. If the page bytes exceed ``max_bytes``, delete pages least recently stamped first
   (``index/eviction.py``'s policy) until at most ``low_watermark * max_bytes`` is left, in
   ``DeleteObjects`` batches of at most 1,000 keys, renewing the lease before each batch and
   stopping as soon as it is lost (``lease_lost``).
5. Write the merged accesses of the pages left as one summary journal, delete the journals
   merged (those listed in 2; journals written since are the next pass's). Release the lease.

``dry_run`` makes no mutating request at all (no lease, no clock object, no DELETE, no summary):
it lists, reads the journals and reports what a real pass would evict in the same fields.
``started``/``finished``: this node's wall clock while it held the lease (as the directory
pass); ``lease_from``/``lease_to``: the server's clock of the acquiring and releasing writes
(whole seconds, ISO 8601).

Failure policy: a failed request (``PageError``) propagates to the caller (the CLI exits 8,
``--loop`` tries again) after the lease was released (best effort); a journal that is garbage
or too large is skipped and counted in ``journals_skipped``.
Threading: ``collect_object`` is a plain function on the caller's thread.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field

from tierstore.config import ObjectLocation
from tierstore.errors import PageError, PageMissing
from tierstore.fs.display import iso_utc
from tierstore.fs.mapper import (
    NAMESPACE_DIR_RE,
    RESERVED_PREFIX,
    is_fanout_name,
    parse_index_dir,
    parse_page_name,
    parse_rank_dir,
)
from tierstore.index.eviction import lru_order, victims_until
from tierstore.objstore.access_journal import (
    MAX_JOURNAL_BYTES,
    journal_prefix,
    read_accesses,
    summary_body,
    writer_name,
)
from tierstore.objstore.client import DELETE_BATCH, ObjectClient, ObjectInfo
from tierstore.objstore.lease import ObjectLease
from tierstore.tiers.gc import DryLease
from tierstore.tiers.gc_report import GC_LOG, GcReport

MANIFEST_NAME = "manifest.json"
Tick = Callable[[str, int], None]  # (phase "list" | "evict", count done in this step)


@dataclass
class ObjectGcReport(GcReport):
    """``GcReport`` plus what only an object pass has."""

    journals: int = 0  # access journals merged
    journals_skipped: int = 0  # garbage or larger than MAX_JOURNAL_BYTES
    hot_pages: int = 0  # pages ranked by a hit from a journal rather than their creation
    lease_holder: str | None = None  # busy: the owner holding the lease
    lease_taken_over: str | None = None  # the owner of an expired lease this pass took over
    lease_from: str | None = None  # server clock of the acquiring write (ISO 8601 UTC)
    lease_to: str | None = None  # server clock of the releasing write
    keys_listed: int = 0
    delete_requests: int = 0


@dataclass
class Listing:
    """What one listing of the prefix found: pages (key, size, stamp in ns) and journals."""

    keys: list[str] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    stamps: array = field(default_factory=lambda: array("q"))
    journals: list[ObjectInfo] = field(default_factory=list)
    namespaces: int = 0
    others: int = 0  # objects neither pages nor tierstore's own


def kind_of(rel: str) -> str:
    """``page``, ``meta`` (tierstore's own), ``namespace`` (a manifest) or ``other``, for a
    key relative to the prefix."""
    parts = rel.split("/")
    if parts[0] == RESERVED_PREFIX:
        return "meta"
    if not NAMESPACE_DIR_RE.match(parts[0]):
        return "other"
    if len(parts) == 2 and parts[1] == MANIFEST_NAME:
        return "namespace"
    if (len(parts) == 5 and parse_index_dir(parts[1], "g") is not None and parse_rank_dir(parts[2]) is not None
            and is_fanout_name(parts[3]) and parse_page_name(parts[4]) is not None):
        return "page"
    return "other"


def list_prefix(client: ObjectClient, rep: ObjectGcReport, lease: ObjectLease | DryLease,
                tick: Tick | None) -> Listing:
    """One listing of the prefix, classified (module docstring, step 2); renews the lease."""
    loc = client.location
    cut = len(loc.prefix) + 1 if loc.prefix else 0
    jprefix = journal_prefix(loc)
    out = Listing()
    namespaces: set[str] = set()
    for n, info in enumerate(client.list_keys(loc.prefix), 1):
        kind = kind_of(info.key[cut:])
        if kind == "page":
            out.keys.append(info.key)
            out.sizes.append(info.size)
            out.stamps.append(int(info.last_modified.timestamp() * 1e9))
            rep.pages += 1
            rep.page_bytes += info.size
            namespaces.add(info.key[cut:cut + 32])
        elif kind == "other":
            rep.other_bytes += info.size
            out.others += 1
        else:
            rep.metadata_bytes += info.size
            if kind == "namespace":
                namespaces.add(info.key[cut:cut + 32])
            if info.key.startswith(jprefix) and info.key.endswith(".json"):
                out.journals.append(info)
        if n % DELETE_BATCH == 0:
            lease.renew_if_due()
            if tick is not None:
                tick("list", DELETE_BATCH)
        rep.keys_listed = n
    out.namespaces = len(namespaces)
    return out


def merge_journals(client: ObjectClient, listing: Listing, rep: ObjectGcReport,
                   lease: ObjectLease | DryLease) -> dict[str, float]:
    """Newest access per object key over every journal listed (server Unix seconds); renews
    the lease on the way."""
    merged: dict[str, float] = {}
    for n, info in enumerate(listing.journals):
        if n % 100 == 99:
            lease.renew_if_due()
        if info.size > MAX_JOURNAL_BYTES:
            rep.journals_skipped += 1
            continue
        try:
            body, _ = client.get(info.key)
        except PageMissing:  # another pass merged and deleted it (a lease lost): nothing to add
            continue
        got = read_accesses(body, info.last_modified.timestamp(), client.location)
        if got is None:
            rep.journals_skipped += 1
            continue
        rep.journals += 1
        for key, t in got.items():
            if t > merged.get(key, 0.0):
                merged[key] = t
    return merged


def apply_accesses(listing: Listing, merged: dict[str, float], rep: ObjectGcReport) -> None:
    """Raise each page's stamp to its newest access (module docstring, step 3)."""
    for i, key in enumerate(listing.keys):
        t = merged.get(key)
        if t is not None and int(t * 1e9) > listing.stamps[i]:
            listing.stamps[i] = int(t * 1e9)
            rep.hot_pages += 1


def evict(client: ObjectClient, listing: Listing, target: int, lease: ObjectLease | DryLease, dry_run: bool,
          rep: ObjectGcReport, tick: Tick | None) -> set[int]:
    """Delete (or, dry, count) the LRU prefix down to ``target`` page bytes; the indexes evicted."""
    victims = list(victims_until(lru_order(listing.stamps), listing.sizes, rep.page_bytes, target))
    done: set[int] = set()
    for at in range(0, len(victims), DELETE_BATCH):
        batch = victims[at:at + DELETE_BATCH]
        if not lease.renew_if_due():
            rep.lease_lost = True
            GC_LOG.warning("tierstore gc %s: the lease was lost: eviction stopped after %d pages",
                           client.location.url, rep.evicted)
            break
        if not dry_run:
            client.delete_many(listing.keys[i] for i in batch)
            rep.delete_requests += 1
        done.update(batch)
        rep.evicted += len(batch)
        rep.evicted_bytes += sum(listing.sizes[i] for i in batch)
        if tick is not None:
            tick("evict", len(batch))
    return done


def compact_journals(client: ObjectClient, listing: Listing, merged: dict[str, float], evicted: set[int],
                     lease: ObjectLease, rep: ObjectGcReport) -> None:
    """Write the accesses of the pages left as one summary journal, then delete the journals
    merged (module docstring, step 5); nothing when the lease is lost."""
    if not listing.journals or not lease.renew_if_due():
        return
    kept = {key: merged[key] for i, key in enumerate(listing.keys)
            if i not in evicted and key in merged and int(merged[key] * 1e9) >= listing.stamps[i]}
    if kept:
        client.put(f"{journal_prefix(client.location)}gc-summary-{writer_name()}.json",
                   summary_body(kept, client.location))
    if lease.renew_if_due():
        client.delete_many(info.key for info in listing.journals)
        rep.delete_requests += 1


def not_a_cache(listing: Listing, rep: ObjectGcReport) -> str | None:
    """Why the prefix is not a cache (objects, none a page or a namespace; tierstore's own
    ``.tierstore/`` say nothing, as in a directory), or None."""
    if listing.others and not (listing.keys or listing.namespaces):
        return (f"it holds {listing.others} objects and no namespace: probably not a cache prefix; pass the "
                "prefix given as \"object_url\"")
    return None


def collect_object(location: ObjectLocation | str, max_bytes: int, *, low_watermark: float = 0.9,
                   client: ObjectClient | None = None, lease: ObjectLease | None = None, dry_run: bool = False,
                   deadline_s: float = 20.0, tick: Tick | None = None) -> ObjectGcReport:
    """One gc pass over the object prefix ``location`` (see the module docstring)."""
    t0 = time.monotonic()
    loc = ObjectLocation.parse(location, "ROOT") if isinstance(location, str) else location
    client = client or ObjectClient(loc, deadline_s)
    rep = ObjectGcReport(dry_run=dry_run)
    used: ObjectLease | DryLease = DryLease() if dry_run else (lease or ObjectLease(client))
    if not used.acquire():
        rep.busy = True
        rep.lease_holder = getattr(used, "holder", None)
        rep.seconds = time.monotonic() - t0
        return rep
    rep.started = time.time()
    try:
        pass_locked(client, max_bytes, low_watermark, used, dry_run, rep, tick)
    finally:
        rep.finished = time.time()
        if not used.release() and not dry_run:
            rep.lease_lost = True
        if isinstance(used, ObjectLease):
            rep.lease_taken_over = used.taken_over
            rep.lease_from = iso_utc(used.acquired_server)
            rep.lease_to = iso_utc(used.released_server)
    if rep.other_bytes and not rep.refused:
        GC_LOG.warning("tierstore gc %s: %d bytes are objects that are not pages gc can free; they do not count "
                       "toward the cap and are left alone", loc.url, rep.other_bytes)
    rep.seconds = time.monotonic() - t0
    return rep


def pass_locked(client: ObjectClient, max_bytes: int, low_watermark: float, lease: ObjectLease | DryLease,
                dry_run: bool, rep: ObjectGcReport, tick: Tick | None) -> None:
    """Steps 2 to 5 of the module docstring, the lease held."""
    listing = list_prefix(client, rep, lease, tick)
    rep.refused = not_a_cache(listing, rep)
    if rep.refused:
        GC_LOG.debug("tierstore gc %s: refused: %s", client.location.url, rep.refused)
        return
    merged = merge_journals(client, listing, rep, lease)
    apply_accesses(listing, merged, rep)
    rep.total_before = rep.page_bytes
    evicted: set[int] = set()
    if rep.page_bytes > max_bytes:
        evicted = evict(client, listing, int(max_bytes * low_watermark), lease, dry_run, rep, tick)
    rep.total_after = rep.page_bytes - rep.evicted_bytes
    if not dry_run and not rep.lease_lost and isinstance(lease, ObjectLease):
        try:
            compact_journals(client, listing, merged, evicted, lease, rep)
        except PageError as exc:  # the journals stay; the next pass merges them again
            GC_LOG.warning("tierstore gc %s: compacting the access journals failed: %s", client.location.url, exc)
