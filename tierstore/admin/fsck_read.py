"""fsck's page reader: every page verified through checked directory fds, in bounded memory.

Contract:

- ``PageVerifier(root, ...)`` is the walk's visitor (``fan_dir_walk.PageVisitor``) of ``tierstore fsck``. A page is
  reached through its fan-out directory opened from ROOT component by component with
  ``O_DIRECTORY|O_NOFOLLOW`` (safefs.open_dir_path) and opened with ``O_NOFOLLOW|O_NONBLOCK``
  relative to that fd (page_io.open_page): a directory swapped for a symlink after the
  listing is never followed, a page swapped for a FIFO is refused at once instead of blocking
  a thread, a page with more than one link is reported and never read. Every exception while
  reading one page becomes a finding about that page (never the end of the walk).
- Memory: a page buffer is taken only after the page's size and header match the manifest's
  layout (``HeaderTemplate`` fast path, or the decoded header checked against the expectation),
  from a ``BufferPool`` whose allocated bytes stay within ``budget_bytes`` (a single page larger
  than the budget is verified alone). A zstd page's compressed copy is counted in the same
  budget. Without a usable manifest, pages declaring more than ``max_page_bytes`` are reported,
  not read. A codec-none page larger than ``VERIFY_PIECE_BYTES``, with or without a manifest,
  is verified through one buffer of that size, a piece at a time, ``--deep`` and the MAC
  included (``page_read.verify_in_pieces``): a planted ``manifest.json`` declaring a huge page
  cannot make fsck allocate it.
- MAC (``mac``, ``tierstore fsck --mac-key-file``): every page must carry a tag that verifies
  under the fleet key (``format.mac``); one without, or with another key's, whose content
  checks pass, is a finding of category ``unverifiable`` (kind ``mac``: not verifiable with this
  key; not damage, ``errors.UNVERIFIABLE_KINDS``), one whose content is damaged a bad page of
  that damage's kind. The batched fast path is skipped then (it does not check tags).
- Modes: a page whose group/other mode bits go beyond the configured creation mode (0600, or
  0660 for a fleet sharing a group: ``group_access``, by default inferred per namespace from
  its directory's group bits, as the engine creates it with ``shared_group_access``) is
  recorded in ``mode_findings`` (the page itself still counts as verified).
- ``reads_in_flight`` / ``max_reads_in_flight``: files open for reading now / at most so far
  (the walk's ``jobs`` threads each read one page at a time).
- Two paths, one verdict: ``visit_batch`` takes a fan-out directory's page names 32 at a time
  to ``fsck_batch`` (the engine's own pages, checked in one GIL-free call, same flags and
  checks as here) once the native kernels are compiled (started after COMPILE_AFTER_PAGES
  pages of a large root); every page it does not find good comes back to ``__call__``, which
  reads it again and names the problem. ``native_pages`` counts the batch's pages.

Threading: the verifier is called from the walk's pool threads; each thread keeps its current
fan-out directory fd (closed by ``close``); the pool and counters are locked.
"""

from __future__ import annotations

import functools
import os
import stat
import threading
from dataclasses import dataclass, field

from tierstore.admin.buffer_pool import BufferPool
from tierstore.admin.fan_dir_walk import PageRef, PageVerdict
from tierstore.admin.findings import BAD_PAGE, FOREIGN, UNREADABLE, UNVERIFIABLE, Finding
from tierstore.admin.fsck_batch import NativeBatch
from tierstore.admin.namespace_dirs import NamespaceDir
from tierstore.errors import UNVERIFIABLE_KINDS, PageError, PageIOError, PageMissing, PageUnsafe
from tierstore.format.checksums import checksum
from tierstore.format.header import (
    HEADER_ALIGN,
    MAX_PAGE_BYTES,
    PREAMBLE_OFFSETS,
    Codec,
    PageExpectation,
    PageHeader,
    PageMeta,
    check_expectation,
    check_payload_bound,
    decode_header,
    header_len_of,
    max_file_size,
)
from tierstore.format.header_template import HeaderTemplate
from tierstore.format.identity import GroupSpec
from tierstore.format.mac import PageMac
from tierstore.format.page_layout import check_gaps, nonzero_gap
from tierstore.format.sealing import KeyRing
from tierstore.fs import safefs
from tierstore.fs.mapper import parse_slice_dir
from tierstore.native import loader as native
from tierstore.native import page_calls as native_page
from tierstore.rootstore.page_io import open_page, read_error, readinto_exact
from tierstore.rootstore.page_read import in_pieces_applies, read_page_fd, verify_in_pieces

MODE = "mode"  # finding category: a page readable or writable by more users than configured
MODE_PRIVATE, MODE_GROUP_SHARED = "private", "group_shared"  # its kinds: the mode it should have
DEFAULT_BUDGET_BYTES = 1 << 30  # page buffers of all fsck threads together
MAX_UNMANIFESTED_PAGE_BYTES = 4 << 30  # a page with no usable manifest declaring more is not read
# A page with no usable manifest larger than this is verified in pieces of this size (codec
# none, not --deep): three sparse 3 GiB pages took 3.0 GiB of memory read whole.
VERIFY_PIECE_BYTES = 8 << 20
_TOKEN_OFF = PREAMBLE_OFFSETS["token_count"]
# Pages verified on the Python path before the batched fast path is compiled. The compile
# (numba, once per process) takes ~4 s on 2 cores and holds the GIL much of that time, so
# the walk slows meanwhile: started after 20k pages, a cached 10^5-page root took 7.3-7.8 s
# instead of 3.5 s (2 cores). The batch then runs 2.2-3.6x the Python path's pages/s, which
# repays the compile from a few 10^5 pages on. A process that compiled already (an engine, a
# bench) uses it at once. docs/measurements/fsck.md.
COMPILE_AFTER_PAGES = 200_000


@dataclass
class _ThreadDir:
    """The fan-out directory a walk thread is in: its parts and checked fd."""

    parts: tuple[str, ...] = ()
    fd: int = -1
    error: BaseException | None = None


@dataclass
class _Templates:
    """HeaderTemplate per (namespace, group, rank, key length): the fast path's exact header."""

    by_key: dict[tuple[str, int, int, int], HeaderTemplate] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


class PageVerifier:
    """Visitor that verifies each page completely and safely; see the module docstring."""

    def __init__(self, root: str | os.PathLike[str], *, deep: bool = False, budget_bytes: int = DEFAULT_BUDGET_BYTES,
                 max_page_bytes: int = MAX_UNMANIFESTED_PAGE_BYTES, group_access: bool | None = None,
                 mac: PageMac | None = None, sealer: KeyRing | None = None) -> None:
        self.root = os.path.realpath(root)  # as walk.check_root: the walk's paths start with it
        self.deep = deep
        self.mac = mac  # the fleet key: every page must carry a valid tag (kind "mac" otherwise)
        self.sealer = sealer  # sealed pages: decrypted with it; without it, their ciphertext sums only
        self.pool = BufferPool(budget_bytes)
        self.max_page_bytes = min(max_page_bytes, MAX_PAGE_BYTES)
        self.group_access = group_access
        self.mode_findings: list[Finding] = []
        self.reads_in_flight = 0
        self.max_reads_in_flight = 0
        self.native_pages = 0  # pages found good by the batched fast path (fsck_batch)
        self._python_pages = 0
        self._root_fd = safefs.open_root(self.root)
        self._local = threading.local()
        self._dirs: list[_ThreadDir] = []
        self._templates = _Templates()
        self._batch = NativeBatch(self.pool)
        self._ns_group_bits: dict[str, bool] = {}
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            for d in self._dirs:
                if d.fd >= 0:
                    os.close(d.fd)
                    d.fd = -1
            if self._root_fd >= 0:
                os.close(self._root_fd)
                self._root_fd = -1

    # ------------------------------------------------------------------ the visitor
    def __call__(self, ref: PageRef) -> PageVerdict:
        self._python_pages += 1  # unlocked: a lost count only moves the compile a little
        if self._python_pages == COMPILE_AFTER_PAGES:
            native.start()  # a large root: the batched fast path pays for its compile (fsck_batch)
        try:
            return self._verify(ref)
        except PageMissing:
            return PageVerdict(vanished=True)
        except PageUnsafe as exc:
            return PageVerdict(problem=self._finding(ref, FOREIGN, "unsafe", exc.message))
        except safefs.UnsafeEntry as exc:
            return PageVerdict(problem=self._finding(ref, FOREIGN, "unsafe", f"not read: {exc}"))
        except PageIOError as exc:  # EIO, a soft NFS mount timing out...: maybe transient, never deleted
            return PageVerdict(problem=Finding(ref.path, UNREADABLE, "io", f"cannot read the page: {exc.message}",
                                               size=ref.size))
        except PageError as exc:
            if exc.kind in UNVERIFIABLE_KINDS:
                return PageVerdict(problem=self._finding(ref, UNVERIFIABLE, exc.kind,
                                                         f"not verifiable with this key: {exc.message}"))
            return PageVerdict(problem=self._finding(ref, BAD_PAGE, exc.kind, exc.message))
        except OSError as exc:
            return PageVerdict(problem=Finding(ref.path, UNREADABLE, "io", f"cannot read the page: {exc.strerror or exc}",
                                               size=ref.size))
        except Exception as exc:  # noqa: BLE001 - one page never ends the walk (issue 17)
            return PageVerdict(problem=Finding(ref.path, UNREADABLE, "error",
                                               f"verifying failed: {type(exc).__name__}: {exc}", size=ref.size))

    def visit_batch(self, nsd: NamespaceDir, group_index: int, rank: int, group: GroupSpec, directory: str,
                    pages: list[tuple[str, bytes]]) -> list[tuple[PageRef, PageVerdict] | None]:
        """Verify pages of one fan-out directory (``(name, key)``, each at its proper place) on
        the native fast path (``fsck_batch``): per page its ref and verdict, or None where the
        walk must take the per-page path (``__call__``): a page the fast path did not find
        good, or every page when it is not available (deep checks, no usable manifest, the
        kernels not compiled)."""
        ns_bytes = nsd.digest_bytes
        skip: list[tuple[PageRef, PageVerdict] | None] = [None] * len(pages)
        if self.deep or self.mac is not None or self.sealer is not None or ns_bytes is None or not pages or not self._batch.ready():
            return skip
        key_len, name_len = len(pages[0][1]), len(pages[0][0])
        if any(len(k) != key_len or len(n) != name_len for n, k in pages):
            return skip  # not the engine's names (it writes one key length per namespace)
        try:
            parts, _ = self._split(os.path.join(directory, pages[0][0]))
            dir_fd = self._dir_fd(parts)
        except OSError:
            return skip  # the per-page path reports the directory
        heads = parse_slice_dir(os.path.basename(os.path.dirname(directory)))
        tmpl = self._template_for(nsd, group_index, rank, group, key_len, ns_bytes, heads)
        self._reading(+1)
        try:
            got = self._batch.verify(dir_fd, tmpl, group.layout, [n for n, _ in pages], [k for _, k in pages])
        finally:
            self._reading(-1)
        if got is None:
            return skip
        codes, stats = got
        out, good = skip, 0
        for i, (name, key) in enumerate(pages):
            if codes[i] != 0:
                continue
            st = stats[i]
            size = int(st[native_page.ST_SIZE])
            mtime_ns = int(st[native_page.ST_MTIME]) * 1_000_000_000 + int(st[native_page.ST_MTIME_NS])
            ctime_ns = int(st[native_page.ST_CTIME]) * 1_000_000_000 + int(st[native_page.ST_CTIME_NS])
            ref = PageRef(os.path.join(directory, name), nsd, group_index, rank, key, size, mtime_ns / 1e9,
                          (int(st[native_page.ST_DEV]), int(st[native_page.ST_INO]), size, mtime_ns, ctime_ns), group)
            self._check_mode(ref, int(st[native_page.ST_MODE]) & 0xFFFFFFFF)
            out[i] = (ref, PageVerdict(token_count=int(st[native_page.VERIFY_TOKENS])))
            good += 1
        with self._lock:
            self.native_pages += good
        return out

    def _reading(self, delta: int) -> None:
        with self._lock:
            self.reads_in_flight += delta
            self.max_reads_in_flight = max(self.max_reads_in_flight, self.reads_in_flight)

    @staticmethod
    def _finding(ref: PageRef, category: str, kind: str, message: str) -> Finding:
        return Finding(ref.path, category, kind, message, size=ref.size, mtime=ref.mtime, fingerprint=ref.fingerprint)

    def _verify(self, ref: PageRef) -> PageVerdict:
        parts, name = self._split(ref.path)
        dir_fd = self._dir_fd(parts)
        fd, st = open_page(name, ref.key, dir_fd=dir_fd, where=ref.path)
        self._reading(+1)
        try:
            self._check_mode(ref, st.st_mode)
            try:
                return self._verify_fd(ref, fd, st)
            except OSError as exc:
                raise read_error(exc, "read", ref.path, ref.key) from exc
        finally:
            os.close(fd)
            self._reading(-1)

    def _split(self, path: str) -> tuple[tuple[str, ...], str]:
        directory, _, name = path.rpartition(os.sep)
        memo: tuple[str, tuple[str, ...]] | None = getattr(self._local, "split", None)
        if memo is not None and memo[0] == directory and name not in ("", ".", ".."):
            return memo[1], name  # the walk hands over a directory's pages one after another
        prefix = self.root.rstrip(os.sep) + os.sep
        parts = tuple(path[len(prefix):].split(os.sep)) if path.startswith(prefix) else ()
        if len(parts) < 2 or any(p in ("", ".", "..") for p in parts):
            raise safefs.UnsafeEntry("changed", path, "not a path under the root")
        self._local.split = (directory, parts[:-1])
        return parts[:-1], parts[-1]

    def _dir_fd(self, parts: tuple[str, ...]) -> int:
        """This thread's checked fd of the fan-out directory ``parts`` (reopened on a change)."""
        d: _ThreadDir | None = getattr(self._local, "dir", None)
        if d is None:
            d = self._local.dir = _ThreadDir()
            with self._lock:
                self._dirs.append(d)
        if d.parts != parts:
            if d.fd >= 0:
                os.close(d.fd)
            d.parts, d.fd, d.error = parts, -1, None
            try:
                d.fd = safefs.open_dir_path(self._root_fd, parts)
            except OSError as exc:
                d.error = exc
        if d.error is not None:
            raise d.error
        return d.fd

    def _check_mode(self, ref: PageRef, st_mode: int) -> None:
        shared = self._group_access(ref.ns)
        allowed = (safefs.GROUP_SHARED if shared else safefs.PRIVATE).file_mode
        extra = stat.S_IMODE(st_mode) & 0o077 & ~allowed
        if extra:
            f = self._finding(ref, MODE, MODE_GROUP_SHARED if shared else MODE_PRIVATE, f"mode {stat.S_IMODE(st_mode):04o}: group/other bits {extra:03o} "
                                                 f"beyond the configured {allowed:04o} (others can read the KV cache)")
            with self._lock:
                self.mode_findings.append(f)

    def _group_access(self, nsd: NamespaceDir) -> bool:
        if self.group_access is not None:
            return self.group_access
        bits = self._ns_group_bits.get(nsd.name)
        if bits is None:
            try:
                st = os.stat(nsd.name, dir_fd=self._root_fd, follow_symlinks=False)
                bits = bool(stat.S_IMODE(st.st_mode) & 0o070)
            except OSError:
                bits = False
            self._ns_group_bits[nsd.name] = bits
        return bits

    # ------------------------------------------------------------------ reading one open page
    def _verify_fd(self, ref: PageRef, fd: int, st: os.stat_result) -> PageVerdict:
        ns_bytes = ref.ns.digest_bytes
        if ref.group is None or ns_bytes is None:
            return self._verify_unmanifested(ref, fd, st, ns_bytes)
        layout = ref.group.layout
        tmpl = self._template(ref, ns_bytes)
        if (st.st_size == tmpl.header_len + layout.nbytes and self.mac is None and self.sealer is None
                and layout.nbytes <= VERIFY_PIECE_BYTES):
            verdict = self._fast(ref, fd, tmpl)
            if verdict is not None:
                return verdict
        # Another header (codec, head slice, MAC trailer) or a damaged one: decode it and check
        # it against the manifest before any buffer of the layout is taken.
        expect = PageExpectation(ns_bytes, ref.key, ref.group_index, ref.rank, layout)
        header, hbytes = _page_header(fd, st, ref.path, layout)
        check_expectation(header, expect, path=ref.path)
        if header.meta.group_kind != ref.group.kind:
            return PageVerdict(problem=self._finding(
                ref, BAD_PAGE, "format", f"page says group kind {header.meta.group_kind.name.lower()}, the "
                                         f"manifest's group {ref.group_index} is {ref.group.kind.name.lower()}"))
        verdict = _verify_in_pieces(self, ref, fd, st, header, hbytes)
        if verdict is not None:
            return verdict
        return self._read_into_pool(ref, fd, st, header, expect, layout.nbytes)

    def _template(self, ref: PageRef, ns_bytes: bytes) -> HeaderTemplate:
        # This thread's last template, matched by the group object's identity (the memo holds
        # it, so the identity cannot be reused): hashing a layout per page cost more than the
        # rest of this lookup.
        memo: tuple[GroupSpec | None, str, int, int, HeaderTemplate] | None = getattr(self._local, "tmpl", None)
        if (memo is not None and memo[0] is ref.group and memo[1] == ref.ns.name and memo[2] == ref.rank
                and memo[3] == len(ref.key)):
            return memo[4]
        assert ref.group is not None
        heads = parse_slice_dir(ref.path.split(os.sep)[-3])
        tmpl = self._template_for(ref.ns, ref.group_index, ref.rank, ref.group, len(ref.key), ns_bytes, heads)
        self._local.tmpl = (ref.group, ref.ns.name, ref.rank, len(ref.key), tmpl)
        return tmpl

    def _template_for(self, nsd: NamespaceDir, group_index: int, rank: int, group: GroupSpec, key_len: int,
                      ns_bytes: bytes, heads: tuple[int, int] | None) -> HeaderTemplate:
        """The exact header the engine writes for these pages (``heads``: the (start, count) of a
        head-slice directory's pages, which their headers carry)."""
        k = (nsd.name, group_index, rank, key_len, group.layout, heads)
        tmpl = self._templates.by_key.get(k)
        if tmpl is None:
            proto = PageMeta(ns_bytes, b"\0" * key_len, group_index, group.kind, 0, rank, *(heads or (0, 0)))
            tmpl = HeaderTemplate(proto, group.layout)
            with self._templates.lock:
                self._templates.by_key[k] = tmpl
        return tmpl

    def _fast(self, ref: PageRef, fd: int, tmpl: HeaderTemplate) -> PageVerdict | None:
        """The engine's own pages: the header byte for byte the template's; None otherwise."""
        assert ref.group is not None
        layout = ref.group.layout
        hl = tmpl.header_len
        head = os.pread(fd, hl, 0)
        sums = tmpl.parse(memoryview(head), ref.key) if len(head) == hl else None
        if sums is None:
            return None
        buf = self.pool.acquire(layout.nbytes)
        try:
            page = memoryview(buf)
            readinto_exact(fd, page, hl, ref.path)
            for i, (o, e) in enumerate(layout.spans):
                if checksum(page[o:e]) != sums[i]:
                    return PageVerdict(problem=self._finding(
                        ref, BAD_PAGE, "checksum", f"section {layout.sections[i].name!r} checksum mismatch"))
            check_gaps(layout, page, path=ref.path, key=ref.key)
            if self.deep:
                bad = deep_check_page(decode_header(head, path=ref.path), page)
                if bad is not None:
                    return PageVerdict(problem=self._finding(ref, BAD_PAGE, *bad))
        finally:
            self.pool.release(buf)
        return PageVerdict(token_count=int.from_bytes(head[_TOKEN_OFF:_TOKEN_OFF + 4], "little"))

    def _verify_unmanifested(self, ref: PageRef, fd: int, st: os.stat_result, ns_bytes: bytes | None) -> PageVerdict:
        """No usable manifest: verify what the page says about itself and its place."""
        header, hbytes = _page_header(fd, st, ref.path, None)
        if header.layout.nbytes > self.max_page_bytes:
            return PageVerdict(problem=self._finding(
                ref, BAD_PAGE, "format", f"page declares {header.layout.nbytes} bytes, more than fsck verifies "
                                         f"without a manifest ({self.max_page_bytes}); not verified"))
        expect = PageExpectation(ns_bytes or header.meta.namespace, ref.key, ref.group_index, ref.rank)
        check_expectation(header, expect, path=ref.path)
        verdict = _verify_in_pieces(self, ref, fd, st, header, hbytes)
        if verdict is not None:
            return verdict
        return self._read_into_pool(ref, fd, st, header, None, header.layout.nbytes)

    def _read_into_pool(self, ref: PageRef, fd: int, st: os.stat_result, header: PageHeader,
                        expect: PageExpectation | None, nbytes: int) -> PageVerdict:
        if (too_large := _beyond_budget(self, ref, header, nbytes)) is not None:
            return too_large
        extra = header.payload_len if header.codec != Codec.NONE else 0
        buf = self.pool.acquire(nbytes)
        self.pool.hold(extra)
        try:
            page = memoryview(buf)
            header = read_page_fd(fd, st, ref.path, expect, page, mac=self.mac, sealer=self.sealer,
                                  keyless=self.sealer is None)
            if self.deep and not (header.sealed and self.sealer is None):  # ciphertext has no values to check
                bad = deep_check_page(header, page)
                if bad is not None:
                    return PageVerdict(problem=self._finding(ref, BAD_PAGE, *bad))
        finally:
            self.pool.unhold(extra)
            self.pool.release(buf)
        return PageVerdict(token_count=header.meta.token_count)


def _beyond_budget(v: PageVerifier, ref: PageRef, header: PageHeader, nbytes: int) -> PageVerdict | None:
    """A page read whole (compressed, or sealed and decrypted) whose buffers need more than
    fsck's whole memory budget: its size comes from a manifest or header anyone who can write
    the root can plant, so it is reported unverified (kind ``too_large``: a human's call, never
    deleted) instead of read into a buffer of that size; None for any other page (a plain page
    over ``VERIFY_PIECE_BYTES`` is verified in pieces)."""
    extra = header.payload_len if header.codec != Codec.NONE else 0
    if not (header.codec != Codec.NONE or header.sealed) or nbytes + extra <= v.pool.budget:
        return None
    return PageVerdict(problem=Finding(
        ref.path, UNREADABLE, "too_large",
        f"not verified: reading it whole takes {nbytes + extra} bytes, more than fsck's memory budget "
        f"({v.pool.budget}); its size comes from its manifest, which anyone who can write the root can plant",
        size=ref.size))


def _verify_in_pieces(v: PageVerifier, ref: PageRef, fd: int, st: os.stat_result, header: PageHeader,
                      hbytes: bytes) -> PageVerdict | None:
    """A codec-none page larger than ``VERIFY_PIECE_BYTES``, verified through one buffer of
    that size (``--deep`` and the MAC included), whatever size its manifest or header
    declares; None where this does not apply (a smaller page, another codec): the caller
    reads it whole. Failure policy: as ``page_read.verify_in_pieces`` (a typed ``PageError``);
    a ``--deep`` finding is returned as the verdict's problem."""
    if header.layout.nbytes <= VERIFY_PIECE_BYTES or not in_pieces_applies(st, header):
        return None
    if header.sealed and v.sealer is not None:
        return None  # decrypted whole (bounded by the manifest's layout)
    check = functools.partial(deep_check_piece, header) if v.deep and not header.sealed else None
    buf = v.pool.acquire(VERIFY_PIECE_BYTES)
    try:
        bad = verify_in_pieces(fd, st, header, hbytes, ref.path, memoryview(buf), mac=v.mac, check_piece=check)
    finally:
        v.pool.release(buf)
    if bad is not None:
        return PageVerdict(problem=v._finding(ref, BAD_PAGE, *bad))
    return PageVerdict(token_count=header.meta.token_count)


def _page_header(fd: int, st: os.stat_result, path: str, layout: object | None) -> tuple[PageHeader, bytes]:
    """The page's decoded header and its raw bytes; with ``layout``, a file larger than any
    page of it is refused before the rest of the header is read."""
    first = os.pread(fd, HEADER_ALIGN, 0)
    hl = header_len_of(first, path=path)
    if layout is not None and st.st_size > max_file_size(layout, hl):  # type: ignore[arg-type]
        raise PageUnsafe(f"file has {st.st_size} bytes, more than any page of the manifest's layout; not read",
                         path=path)
    buf = first if hl <= len(first) else first + os.pread(fd, hl - len(first), len(first))
    header = decode_header(buf, path=path)
    check_payload_bound(header, path=path)
    return header, buf[:hl]


_NONFINITE: dict[str, tuple[str, int, int]] = {
    "bfloat16": ("<u2", 0x7F80, 0x7F80),
    "float16": ("<u2", 0x7C00, 0x7C00),
    "float32": ("<u4", 0x7F800000, 0x7F800000),
    "float64": ("<u8", 0x7FF0000000000000, 0x7FF0000000000000),
    "float8_e4m3fn": ("u1", 0x7F, 0x7F),
    "float8_e5m2": ("u1", 0x7C, 0x7C),
    "float8_e4m3fnuz": ("u1", 0xFF, 0x80),
    "float8_e5m2fnuz": ("u1", 0xFF, 0x80),
}


def deep_check_piece(header: PageHeader, index: int, part: memoryview) -> tuple[str, str] | None:
    """(kind, message) if bytes ``part`` of section ``index`` hold a NaN/Inf bit pattern (the
    ``--deep`` value check of ``deep_check_page``, one piece of a page verified in pieces);
    None otherwise. Pure function of its arguments."""
    import numpy as np  # here: plain fsck (and the CLI) must not import numpy (tests/admin/test_cli.py)

    spec = header.layout.sections[index]
    rule = _NONFINITE.get(spec.dtype)
    if rule is None or not len(part):
        return None
    words = np.frombuffer(part, dtype=rule[0])
    bad = int(np.count_nonzero((words & np.array(rule[1], dtype=rule[0])) == rule[2]))
    if bad:
        return "nonfinite", (f"section {spec.name!r} ({spec.dtype}) holds NaN/Inf value(s): a KV cache or state "
                             "that poisons every request loading it")
    return None


def deep_check_page(header: PageHeader, page: memoryview) -> tuple[str, str] | None:
    """(kind, message) of the first problem ``--deep`` finds in a verified page buffer, or None.

    Recomputes what the page's content determines beyond its checksums: alignment gaps zero
    (canonical bytes) and floating-point sections free of NaN/Inf bit patterns. Pure function
    of its arguments (safe from the read pool's threads)."""
    import numpy as np  # here: plain fsck (and the CLI) must not import numpy (tests/admin/test_cli.py)

    layout = header.layout
    gap = nonzero_gap(layout, page)
    if gap is not None:
        return "noncanonical", f"non-zero bytes in the alignment gap at page bytes {gap[0]}..{gap[1]}"
    for spec, (o, e) in zip(layout.sections, layout.spans, strict=True):
        rule = _NONFINITE.get(spec.dtype)
        if rule is None or e == o:
            continue
        words = np.frombuffer(page[o:e], dtype=rule[0])
        bad = int(np.count_nonzero((words & np.array(rule[1], dtype=rule[0])) == rule[2]))
        if bad:
            return "nonfinite", (f"section {spec.name!r} ({spec.dtype}) holds {bad} NaN/Inf value(s): a KV "
                                 "cache or state that poisons every request loading it")
    return None
