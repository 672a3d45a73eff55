"""``tierstore fsck s3://BUCKET/PREFIX``: verify every page object of an object tier; ``--repair``
deletes the damaged and misfiled ones.

Contract:

- ``run_object_fsck(FsckOptions)`` lists the prefix (``object_walk.ObjectWalk``: namespaces,
  manifests read with the directory fsck's code, orphans, misplaced pages, foreign objects),
  GETs every page object at its proper place and verifies it as the directory fsck verifies a
  file (``fsck_read``'s order of checks: the size against the manifest's layout before any
  buffer, the header, ``check_expectation``: namespace digest = its prefix, key = its name,
  group and rank = its prefixes, layout = the manifest's group (a head slice's), group kind;
  then ``page_read.read_page_body`` (``read_page_fd`` on an in-memory file), as the object tier
  reads: checksums, exact size, gaps, zstd, MAC, sealed pages; ``--deep`` as
  ``fsck_read.deep_check_page``). Without a usable manifest a page is checked against what its
  header and its place say. Findings use the directory fsck's categories and kinds
  (``findings``) and its report, ``fsck.FsckReport``: the same text, ``--json`` keys
  (``tierstore_fsck``, ``counts``, ``problems``, ``reads``, ``namespaces``) and exit statuses.
- Concurrency and memory: ``jobs`` threads (default ``READS_IN_FLIGHT``, 32) each GET one
  object at a time (obstore releases the GIL); at most ``2 * jobs`` objects are queued, so the
  walk's memory does not grow with the bucket. Before its GET an object reserves, from one
  ``BufferPool`` of ``budget_bytes``, its listed size three times (the body, the in-memory
  file, a zstd payload) plus its page buffer, released after; an object whose reservation is
  over the whole budget is not read (``UNREADABLE``/``too_large``, never deleted), and one
  larger than any page of its manifest's layout is not read either (``FOREIGN``/``unsafe``).
- ``--repair`` deletes damaged page objects (``BAD_PAGE``, misplaced ones included) and
  misfiled ones (``ORPHAN``), and nothing else: foreign objects, manifests and unreadable
  objects are left (a bucket has no quarantine), a damaged sealed page read without its key
  is kept, and a page not verifiable with ``--mac-key-file`` (category ``unverifiable``) is kept
  unless ``--remove-unverifiable`` (the directory fsck's rules). Before the delete each object
  is checked with a HEAD: a changed ETag (republished since the scan) or a vanished object is
  not deleted (RGW ignores a conditional DELETE; an object republished between the HEAD and the
  DELETE is lost, which costs a recompute, never a wrong page). Deletes go out as
  ``DeleteObjects`` of at most 1,000 keys (``ObjectClient.delete_many``).
- Flags (``tierstore fsck`` on a URL): ``--repair``, ``--namespace``, ``--jobs``, ``--json``,
  ``--progress``, ``--deep``, ``--mac-key-file``, ``--encryption-key-file`` and
  ``--remove-unverifiable`` as on a directory (``--deep``'s count of non-canonical pages in
  namespaces of an older format included). Ignored: ``--tmp-age`` (an object is published by
  one PUT: there are no temp files) and ``--group-access`` (objects have no modes; access is
  the bucket's policy). Refused (exit 2, ``refusal``): ``--quarantine-bad`` (a bucket has no
  quarantine; deleting instead would undo what the flag asks for).
- Operational errors (exit 8): a URL that is not ``s3://BUCKET[/PREFIX]``, a client that cannot
  be built, a LIST that fails (endpoint down, no bucket, denied). A page GET that fails is an
  ``UNREADABLE``/``io`` finding (maybe transient: never deleted).

Threading: ``run_object_fsck`` is called from one thread; it uses a private pool for GETs.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from tierstore.admin.buffer_pool import BufferPool
from tierstore.admin.fan_dir_walk import PageVerdict
from tierstore.admin.findings import (
    BAD_PAGE,
    FOREIGN,
    MANIFEST,
    ORPHAN,
    UNREADABLE,
    UNVERIFIABLE,
    Finding,
)
from tierstore.admin.fsck import FsckOptions, FsckReport, timed_report
from tierstore.admin.fsck_read import MAX_UNMANIFESTED_PAGE_BYTES, deep_check_page
from tierstore.admin.object_walk import (
    ObjectPage,
    ObjectProgress,
    ObjectWalk,
    open_client,
    resolve_namespace,
    stats_dict,
)
from tierstore.admin.tally import GroupTally, Inventory
from tierstore.errors import (
    UNVERIFIABLE_KINDS,
    ConfigError,
    PageError,
    PageIOError,
    PageMissing,
    PageSealedCorrupt,
    PageTimeout,
    PageUnsafe,
)
from tierstore.format.header import (
    FORMAT_VERSION,
    HEADER_ALIGN,
    MAX_HEADER_LEN,
    MAX_PAGE_BYTES,
    Codec,
    PageExpectation,
    check_expectation,
    check_payload_bound,
    decode_header,
    decode_header_any_version,
    header_len_of,
    max_file_size,
)
from tierstore.format.identity import MANIFEST_NAME
from tierstore.format.mac import PageMac
from tierstore.format.page import check_stored_gaps
from tierstore.format.sealing import KeyRing, PageSealer
from tierstore.objstore.client import DELETE_BATCH, ObjectClient, ObjectInfo
from tierstore.rootstore.page_read import read_page_body

READS_IN_FLIGHT = 32  # default --jobs: GETs in flight (latency-bound; obstore releases the GIL)
_DELETABLE = frozenset({BAD_PAGE, ORPHAN})


def refusal(options: FsckOptions) -> str | None:
    """Why ``options`` cannot be honoured on objects (a usage error, exit 2), or None."""
    if options.quarantine_bad:
        return ("--quarantine-bad: a bucket has no quarantine; `tierstore fsck --repair s3://...` deletes damaged "
                "page objects (copy them elsewhere first to keep them)")
    return None


def _key_ring(files: str | os.PathLike[str] | list[str] | None) -> KeyRing | None:
    paths = [files] if isinstance(files, str | os.PathLike) else list(files or ())
    if not paths:
        return None
    first, *rest = paths
    return KeyRing(PageSealer.from_key_file(first), {f"#{i}": PageSealer.from_key_file(p) for i, p in enumerate(rest)})


class ObjectVerifier:
    """GETs and verifies page objects on a pool (module docstring); ``submit`` is the walk's
    ``on_page`` and records verdicts into the walk's inventory on the calling thread."""

    def __init__(self, client: ObjectClient, options: FsckOptions, progress: ObjectProgress) -> None:
        self.client = client
        self.jobs = options.jobs or READS_IN_FLIGHT
        self.deep = options.deep
        self.mac = PageMac.from_key_file(options.mac_key_file) if options.mac_key_file is not None else None
        self.sealer = _key_ring(options.encryption_key_file)
        self.budget = BufferPool(options.budget_bytes)
        self.max_page_bytes = min(MAX_UNMANIFESTED_PAGE_BYTES, MAX_PAGE_BYTES)
        self.progress = progress
        self.sources: dict[str, tuple[str, str]] = {}  # finding path -> (object key, ETag read)
        self.reads_in_flight = 0
        self.max_reads_in_flight = 0
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=self.jobs, thread_name_prefix="tierstore-object-fsck")
        self._pending: dict[Future[tuple[PageVerdict, str]], ObjectPage] = {}

    # ------------------------------------------------------------------ on the walk's thread
    def submit(self, page: ObjectPage, inv: Inventory) -> None:
        while len(self._pending) >= 2 * self.jobs:
            self._drain(inv, FIRST_COMPLETED)
        self._pending[self._pool.submit(self.check, page)] = page

    def finish(self, inv: Inventory) -> None:
        while self._pending:
            self._drain(inv, FIRST_COMPLETED)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _drain(self, inv: Inventory, how: str) -> None:
        done, _ = wait(list(self._pending), return_when=how)
        for fut in done:
            page = self._pending.pop(fut)
            verdict, etag = fut.result()
            self.progress.advance(1, page.size, int(verdict.problem is not None))
            if verdict.vanished:
                inv.vanished += 1
            elif verdict.problem is not None:
                inv.findings.append(verdict.problem)
                self.sources[page.path] = (page.key, etag or page.etag)
            else:
                tokens = verdict.token_count or 0
                inv.tallies.setdefault((page.ns.name, page.group_index, page.rank), GroupTally()).add(
                    page.size, page.mtime, tokens, True)

    # ------------------------------------------------------------------ on the pool's threads
    def check(self, page: ObjectPage) -> tuple[PageVerdict, str]:
        """(verdict, ETag read) of one page object; every exception is a finding about it."""
        etag = [""]
        try:
            return self._verify(page, etag), etag[0]
        except PageMissing:
            return PageVerdict(vanished=True), etag[0]
        except PageUnsafe as exc:
            return PageVerdict(problem=_finding(page, FOREIGN, "unsafe", exc.message)), etag[0]
        except (PageIOError, PageTimeout) as exc:  # maybe transient: never deleted
            return PageVerdict(problem=_finding(page, UNREADABLE, "io", f"cannot read the object: {exc.message}")), ""
        except PageError as exc:
            if exc.kind in UNVERIFIABLE_KINDS:
                return PageVerdict(problem=_finding(page, UNVERIFIABLE, exc.kind,
                                                    f"not verifiable with this key: {exc.message}")), etag[0]
            return PageVerdict(problem=_finding(page, BAD_PAGE, exc.kind, exc.message)), etag[0]
        except OSError as exc:
            return PageVerdict(problem=_finding(page, UNREADABLE, "io", f"cannot verify: {exc.strerror or exc}")), ""
        except Exception as exc:  # noqa: BLE001 - one page never ends the walk
            return PageVerdict(problem=_finding(page, UNREADABLE, "error",
                                                f"verifying failed: {type(exc).__name__}: {exc}")), ""

    def _reading(self, delta: int) -> None:
        with self._lock:
            self.reads_in_flight += delta
            self.max_reads_in_flight = max(self.max_reads_in_flight, self.reads_in_flight)

    def _verify(self, page: ObjectPage, etag: list[str]) -> PageVerdict:
        ns_bytes = page.ns.digest_bytes
        layout = page.group.layout if page.group is not None and ns_bytes is not None else None
        if layout is not None and page.size > max_file_size(layout, MAX_HEADER_LEN):
            raise PageUnsafe(f"object has {page.size} bytes, more than any page of the manifest's layout; not read",
                             path=page.path)
        held = _Reservation(self.budget)
        first = 3 * page.size + (layout.nbytes if layout is not None else page.size)
        if not held.ensure(first):
            return _too_large(page, first, self.budget.budget)
        self._reading(+1)
        try:
            body, etag[0] = self.client.get(page.key)
            need = 3 * len(body) + (layout.nbytes if layout is not None else len(body))
            if not held.ensure(need):  # grown since the listing
                return _too_large(page, need, self.budget.budget)
            return self._verify_body(page, body, ns_bytes, held)
        finally:
            self._reading(-1)
            held.release()

    def _verify_body(self, page: ObjectPage, body: memoryview, ns_bytes: bytes | None,
                     held: _Reservation) -> PageVerdict:
        """``fsck_read``'s checks of one page file, on the object's body (module docstring)."""
        layout = page.group.layout if page.group is not None and ns_bytes is not None else None
        hl = header_len_of(body[:HEADER_ALIGN], path=page.path)
        if layout is not None and len(body) > max_file_size(layout, hl):
            raise PageUnsafe(f"object has {len(body)} bytes, more than any page of the manifest's layout; not read",
                             path=page.path)
        header = decode_header(bytes(body[:hl]), path=page.path)
        check_payload_bound(header, path=page.path)
        expect: PageExpectation | None
        if layout is not None and page.group is not None and ns_bytes is not None:
            expect = PageExpectation(ns_bytes, page.page_key, page.group_index, page.rank, page.group.layout)
            check_expectation(header, expect, path=page.path)
            if header.meta.group_kind != page.group.kind:
                return PageVerdict(problem=_finding(
                    page, BAD_PAGE, "format", f"page says group kind {header.meta.group_kind.name.lower()}, the "
                    f"manifest's group {page.group_index} is {page.group.kind.name.lower()}"))
            nbytes = page.group.layout.nbytes
        else:
            if header.layout.nbytes > self.max_page_bytes:
                return PageVerdict(problem=_finding(
                    page, BAD_PAGE, "format", f"page declares {header.layout.nbytes} bytes, more than fsck verifies "
                    f"without a manifest ({self.max_page_bytes}); not verified"))
            check_expectation(header, PageExpectation(ns_bytes or header.meta.namespace, page.page_key,
                                                      page.group_index, page.rank), path=page.path)
            expect, nbytes = None, header.layout.nbytes
            need = 3 * len(body) + nbytes + (header.payload_len if header.codec != Codec.NONE else 0)
            if not held.ensure(need):
                return _too_large(page, need, self.budget.budget)
        out = bytearray(nbytes)
        header = read_page_body(body, page.path, expect, memoryview(out), mac=self.mac, sealer=self.sealer,
                                keyless=self.sealer is None)
        if self.deep and not (header.sealed and self.sealer is None):  # ciphertext has no values to check
            bad = deep_check_page(header, memoryview(out))
            if bad is not None:
                return PageVerdict(problem=_finding(page, BAD_PAGE, *bad))
        return PageVerdict(token_count=header.meta.token_count)

    # ------------------------------------------------------------------ --deep on older formats
    def old_tree_findings(self, walk: ObjectWalk) -> list[Finding]:
        """``fsck.old_tree_findings`` on objects: per namespace of an older page format, a finding
        counting its pages whose gap bytes are not zero (GETs; nothing changed)."""
        out = []
        for nsd in walk.inv.namespaces:
            infos = walk.old_pages.get(nsd.name, [])
            infos = [i for i in infos if i.key.endswith(".kvp")]
            if nsd.walk or nsd.namespace is None or nsd.namespace.format_version >= FORMAT_VERSION or not infos:
                continue
            bad = sum(not ok for ok in self._pool.map(self._old_page_is_canonical, infos))
            if bad:
                where = f"s3://{walk.location.bucket}/{walk.location.key(f'{nsd.name}/{MANIFEST_NAME}')}"
                out.append(Finding(where, MANIFEST, "noncanonical",
                                   f"page format {nsd.namespace.format_version}: {bad} of {len(infos)} page(s) have "
                                   f"non-zero alignment-gap bytes (written before format {FORMAT_VERSION} zeroed "
                                   "them; such bytes may come from earlier pages); never served here, left as is"))
        return out

    def _old_page_is_canonical(self, info: ObjectInfo) -> bool:
        if info.size > min(MAX_UNMANIFESTED_PAGE_BYTES, self.budget.budget):
            return True  # not this check's business (as an unreadable file)
        self.budget.hold(info.size)
        try:
            body, _ = self.client.get(info.key)
            _, header = decode_header_any_version(body, path=info.key)
            check_stored_gaps(header, body[header.header_len:header.header_len + header.payload_len])
        except PageError as exc:
            return "non-zero" not in exc.message
        finally:
            self.budget.unhold(info.size)
        return True


class _Reservation:
    """Bytes one object's check holds in the verifier's budget. Grown by releasing and reserving
    again, never by holding some while waiting for more: threads cannot deadlock on the budget."""

    def __init__(self, pool: BufferPool) -> None:
        self.pool = pool
        self.held = 0

    def ensure(self, nbytes: int) -> bool:
        """Hold at least ``nbytes`` (waiting for room); False if that is over the whole budget."""
        if nbytes <= self.held:
            return True
        self.release()
        if nbytes > self.pool.budget:
            return False
        self.pool.hold(nbytes)
        self.held = nbytes
        return True

    def release(self) -> None:
        if self.held:
            self.pool.unhold(self.held)
            self.held = 0


def _finding(page: ObjectPage, category: str, kind: str, message: str) -> Finding:
    return Finding(page.path, category, kind, message, size=page.size, mtime=page.mtime)


def _too_large(page: ObjectPage, nbytes: int, budget: int) -> PageVerdict:
    return PageVerdict(problem=_finding(
        page, UNREADABLE, "too_large", f"not verified: reading it takes {nbytes} bytes, more than fsck's memory "
        f"budget ({budget}); its size comes from its listing or its manifest, which anyone who can write the "
        "bucket can plant"))


def repair_objects(client: ObjectClient, report: FsckReport, sources: dict[str, tuple[str, str]],
                   remove_unverifiable: bool, jobs: int) -> None:
    """Delete the damaged and misfiled page objects of ``report`` (module docstring), each only
    if a HEAD still shows the object that was read; mark every finding with what was done."""
    candidates: list[tuple[Finding, str, str]] = []
    for p in (*report.problems, *(report.unverifiable if remove_unverifiable else ())):
        if p.kind == PageSealedCorrupt.kind:
            p.repair_error = ("damage found in an encrypted page without its key: kept (nothing is removed that "
                              "this fsck cannot authenticate); run fsck --repair with --encryption-key-file to "
                              "remove it")
        elif (p.category in _DELETABLE or p.category == UNVERIFIABLE) and p.path in sources:
            candidates.append((p, *sources[p.path]))
        elif p.category == FOREIGN:
            p.repair_error = "not a page: left as is (a bucket has no quarantine; check it, then delete it yourself)"
        else:
            p.repair_error = "needs a human (see the message)"
    with ThreadPoolExecutor(max_workers=max(1, min(jobs, 16)), thread_name_prefix="tierstore-object-head") as pool:
        heads = list(pool.map(lambda c: _head(client, c[1]), candidates))
    confirmed: list[tuple[Finding, str]] = []
    for (p, key, etag), now in zip(candidates, heads, strict=True):
        if isinstance(now, PageError):
            p.repair_error = str(now)
        elif now is None:
            p.action = "vanished"  # gone already (the tier removed it, another fsck)
        elif etag and now.etag != etag:
            p.repair_error = "the object changed since the scan (republished); run fsck again"
        else:
            confirmed.append((p, key))
    for at in range(0, len(confirmed), DELETE_BATCH):
        batch = confirmed[at:at + DELETE_BATCH]
        try:
            client.delete_many([key for _, key in batch])
        except PageError as exc:
            for p, _ in batch:
                p.repair_error = str(exc)
            continue
        for p, _ in batch:
            p.action = "deleted"


def _head(client: ObjectClient, key: str) -> ObjectInfo | None | PageError:
    try:
        return client.head(key)
    except PageError as exc:
        return exc


def run_object_fsck(options: FsckOptions) -> FsckReport:
    """Check (and with ``repair``, fix) an object tier's prefix; never raises for problems in
    it. The report's times cover the whole run, an error's too."""
    return timed_report(options, _run)


def _run(options: FsckOptions, report: FsckReport) -> None:
    progress = ObjectProgress("fsck", options.progress)
    verifier: ObjectVerifier | None = None
    try:
        client = open_client(str(options.root))
        report.root = client.location.url
        verifier = ObjectVerifier(client, options, progress)
        walk = ObjectWalk(client, namespace=resolve_namespace(client, options.namespace), on_page=verifier.submit,
                           keep_old=options.deep)
        inv = walk.run()
        verifier.finish(inv)
        old = verifier.old_tree_findings(walk) if options.deep else []
    except (PageError, ConfigError, OSError) as exc:
        report.error = exc.message if isinstance(exc, PageError) else str(exc)
        return
    except Exception as exc:  # noqa: BLE001 - a report with exit 8, never a traceback
        report.error = f"the walk stopped: {type(exc).__name__}: {exc} (a tierstore bug: please report it)"
        return
    finally:
        progress.close()
        if verifier is not None:
            verifier.close()
    inv.findings.sort(key=lambda f: (f.path, f.category))
    report.problems = [f for f in inv.findings if f.category != UNVERIFIABLE] + old
    report.unverifiable = [f for f in inv.findings if f.category == UNVERIFIABLE]
    report.vanished = inv.vanished
    report.namespaces = len(inv.namespaces)
    report.pages_ok = sum(t.files for t in inv.tallies.values())
    report.bytes_ok = sum(t.bytes for t in inv.tallies.values())
    report.stats = stats_dict(inv, report.root)
    report.reads = {"threads": verifier.jobs, "max_in_flight": verifier.max_reads_in_flight,
                    "peak_buffer_bytes": verifier.budget.peak, "adaptive": False, "limit_final": verifier.jobs,
                    "limit_max": verifier.jobs, "native_pages": 0}
    if options.repair and (report.problems or (options.remove_unverifiable and report.unverifiable)):
        try:
            repair_objects(client, report, {**walk.sources, **verifier.sources}, options.remove_unverifiable,
                           verifier.jobs)
        except PageError as exc:
            report.error = f"repair failed: {exc.message}"
