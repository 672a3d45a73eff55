"""PageFiles: the file operations of one (root, namespace, group, rank) directory, in the exact
format of one ``IOEngine`` (its header, codec, MAC trailer and O_DIRECT choice).

The flat functions of one page file (page_io.py, publish.py, own_read.py, page_read.py,
rank_dir.py) are bound here to one rank directory and one page shape; this class caches what
every page of that shape shares (the header template per key length, the warm read plan). ``IOEngine`` decides when an operation
runs and what its result means (queue, slots, stats, settle); this module only does it.

- ``store``: an existing final file (regular, one link) counts as stored (``stored=False``)
  before anything is hashed (a file with two links is looked at again first,
  ``page_io.past_link_window``: another writer's link(2) publish); anything else under the
  name (a planted FIFO, directory, symlink or hard link, which no load serves) is moved aside
  and the page stored, nothing deleted (``publish.move_planted_aside``). The page is published
  create-only (``publish.publish``, with this root's ``create_only`` memo): a writer that loses
  a race for the name gets ``stored=False``, exactly one gets True, and no published page is
  ever replaced. Codec none: the header (``HeaderTemplate.fill``, the caller's section sums or ours)
  is written into the slot's frame right before the page, the gaps between sections zeroed
  (``format.zero_gaps``), and the file goes out as one buffer (O_DIRECT: padded to 4096, then
  truncated). Codec zstd: ``format.encode_page``. With a MAC the tag is appended. Failures are
  ``PageStoreError`` (or ``PageUnsafe`` for a directory that is not ours).
- ``load``: a file of exactly our size is read into the slot's frame
  (``own_read.read_own_page``): a page whose first block is cached is copied piece by piece
  (about ``warm_piece_bytes``), each piece hashed while in the CPU cache; an uncached one is
  read with O_DIRECT in one request when ``direct_loads``. A header that is not byte for byte
  ours (another codec or header length, damage) goes through ``page_read.read_page_fd``, which
  names the error. Once the native kernels have compiled, the common case (a plain file of exactly
  our size and header, cached or read with O_DIRECT) is opened, checked, read, hashed and
  closed in one GIL-free call (``native.load``, ``native_page.load_page``; one GIL hand-off
  per page instead of ~8), header, checksum and gap checks included; anything else falls back
  to the path above. The identity of the file read is left in ``slot.source`` (for
  ``remove_damaged``); errors are ``PageError``s, never served bytes.
- ``load_many``: ``load`` of an I/O thread's batch, the result or the ``PageError`` of each;
  the common case of every page in one GIL-free call (``native_page.load_pages``, keys of one
  length, one ``verify``, slots of one staging slab), the rest one by one as ``load`` does.
- ``remove_damaged``: removes the file a load read, and only that one
  (``rank_dir.remove_damaged_at`` compares file identity): a file republished under the name
  meanwhile stays, and so does one that was never identified.

The native half (one GIL-free call per page or batch) is ``native``, a
``page_files_native.NativeFileCalls`` built with this object: it reads this object's settings
and shares its header templates and read plans. Every file is reached through ``rank_dir``
(a ``rank_dir.RankDir``: directory fds, no symlink followed) and opened
``O_NOFOLLOW|O_NONBLOCK``. Counters the owner keeps (``loads_odirect``,
``loads_general_reader``, ``bad_pages_discarded``) are reported through the ``count`` callback.

Threading: ``store``, ``load`` and ``remove_damaged`` may run on several threads at once
(I/O threads); they hold no lock while doing file I/O. zstd compressors and cachestat(2)
arguments are per thread; the template and plan caches are filled idempotently (a race builds
the same value twice). ``count`` is called with no lock of this class held.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from collections.abc import Callable
from typing import Any

import zstandard

from tierstore.config import TierStoreConfig
from tierstore.errors import PageError, PageStoreError
from tierstore.format.checksums import section_checksums, section_sums
from tierstore.format.header import (
    FLAG_MAC,
    FLAG_SEALED,
    MAC_TRAILER_LEN,
    SEALED_TRAILER_LEN,
    Codec,
    PageExpectation,
    PageMeta,
)
from tierstore.format.header_template import HeaderTemplate
from tierstore.format.identity import MANIFEST_NAME, Namespace, write_manifest
from tierstore.format.mac import PageMac
from tierstore.format.page import encode_page
from tierstore.format.page_layout import PageLayout, zero_gaps
from tierstore.format.sealing import KeyRing
from tierstore.fs import safefs
from tierstore.fs.directio import CachestatArgs, FrameGeometry, cachestat_pages
from tierstore.fs.mapper import (
    FORMAT_MARKER_NAME,
    MAX_KEY_BYTES,
    FileMapper,
    fanout,
    write_format_marker,
)
from tierstore.index import page_index
from tierstore.rootstore import own_read
from tierstore.rootstore.own_read import WARM_PIECE_BYTES, ReadPlan, check_section_sums
from tierstore.rootstore.page_files_native import NativeFileCalls
from tierstore.rootstore.page_io import open_page, past_link_window, read_error
from tierstore.rootstore.page_read import authenticate, read_page_fd
from tierstore.rootstore.publish import CreateOnly, move_planted_aside, publish
from tierstore.rootstore.rank_dir import FileIdentity, RankDir, directory_error, file_identity
from tierstore.rootstore.sealed_pages import SealedPages
from tierstore.rootstore.staging import StagingSlot

__all__ = ["PageFiles", "mark_root_soon", "restore_root_metadata_soon", "settle_format_marker"]

logger = logging.getLogger("tierstore.engine")  # the engine's log: what operators filter on


_MARKER_WRITES: dict[str, threading.Thread] = {}  # root -> the thread that writes (wrote) its marker
_MARKED_LOCK = threading.Lock()
MARKER_SETTLE_S = 2.0  # the longest close() waits for a marker write (a hung mount must not stall it)


def mark_root_soon(root: str | os.PathLike[str], perms: safefs.Perms) -> None:
    """Leave ``ROOT/.tierstore-format`` (``mapper.write_format_marker``) once per root and
    process, on a thread of its own: the caller may hold the I/O queue's lock, and a hung mount
    must not stall it. Failure policy: a marker that cannot be written is logged once and
    never fails a store (tools then treat the root as an older writer's)."""
    where = os.path.abspath(root)

    def write() -> None:
        try:
            write_format_marker(where, perms=perms)
        except OSError as exc:
            logger.warning("tierstore: cannot write the format marker %s (%s); stores go on, but older "
                           "tierstore tools cannot tell which layouts this root holds",
                           os.path.join(where, FORMAT_MARKER_NAME), exc.strerror or exc)

    with _MARKED_LOCK:
        if where in _MARKER_WRITES:
            return
        thread = _MARKER_WRITES[where] = threading.Thread(target=write, name="tierstore-format-marker", daemon=True)
        thread.start()


def restore_root_metadata_soon(root: str | os.PathLike[str], namespace: Namespace, perms: safefs.Perms) -> None:
    """A rank directory was found removed and made again (``rm -rf ROOT/*`` with engines
    running): write the namespace's manifest and the root's format marker again, on a thread of
    its own (the caller is an I/O thread), so fsck and gc see a whole cache again without an
    engine restart. Failure policy: logged, never raised (the next reopen tries again)."""
    where = os.path.abspath(root)

    def write() -> None:
        for what, make in ((MANIFEST_NAME, lambda: write_manifest(where, namespace, perms=perms)),
                           (FORMAT_MARKER_NAME, lambda: write_format_marker(where, perms=perms))):
            try:
                make()
            except OSError as exc:
                logger.warning("tierstore: cannot write %s again under %s (%s)", what, where, exc.strerror or exc)

    threading.Thread(target=write, name="tierstore-root-metadata", daemon=True).start()


def settle_format_marker(root: str | os.PathLike[str], timeout: float = MARKER_SETTLE_S) -> bool:
    """Wait up to ``timeout`` for this process's marker write of ``root`` (``mark_root_soon``):
    True when none is running, so the write's temp is renamed or removed. A process that exits
    with the write unfinished (a daemon thread) would leave the temp for the stale-temp sweep."""
    with _MARKED_LOCK:
        thread = _MARKER_WRITES.get(os.path.abspath(root))
    if thread is not None:
        thread.join(timeout)
        return not thread.is_alive()
    return True


def _entry_at(dir_fd: int, name: str, final: str, key: bytes) -> os.stat_result | None:
    """The lstat of what has the page's ``name`` in ``dir_fd`` (a file with two links looked at
    again first, ``past_link_window``: another writer's link(2) publish), or None when nothing
    has it. Failure policy: any other failed stat is a ``PageStoreError``."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        return past_link_window(st, lambda: os.stat(name, dir_fd=dir_fd, follow_symlinks=False))
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise PageStoreError(f"cannot stat the page: {exc.strerror}", errno=exc.errno, path=final, key=key) from exc


class _ThreadState(threading.local):
    """Per I/O thread: the zstd compressor and cachestat(2) arguments (allocated once)."""

    def __init__(self) -> None:
        self.compressor: zstandard.ZstdCompressor | None = None
        self.cachestat = CachestatArgs()


class PageFiles:
    """Stores, loads and removes the page files of one rank directory (module docstring)."""

    def __init__(self, mapper: FileMapper, namespace: Namespace, group_index: int, rank: int, *, head_start: int,
                 head_count: int, config: TierStoreConfig, codec: Codec, perms: safefs.Perms, mac: PageMac | None,
                 odirect: bool, direct_loads: bool, count: Callable[[str], None],
                 layout: PageLayout | None = None, sealer: KeyRing | None = None) -> None:
        self.mapper = mapper
        self.namespace, self.group_index, self.rank = namespace, group_index, rank
        self.group = namespace.groups[group_index]
        # A head slice's layout comes from the caller; the group's (one rank's) otherwise.
        self.layout: PageLayout = layout if layout is not None else self.group.layout
        self.head_start, self.head_count = head_start, head_count
        self.codec, self.perms = codec, perms
        self.fsync, self.zstd_level = config.fsync, config.zstd_level
        self.odirect = odirect  # stores write with O_DIRECT (codec none, no MAC)
        self.direct_loads = direct_loads  # cold loads read with O_DIRECT (odirect + cachestat)
        self.warm_piece_bytes = WARM_PIECE_BYTES
        self._count = count
        self._nbytes = self.layout.nbytes
        # With a key, pages are sealed (codec none, TierStoreConfig checks) and carry no MAC:
        # the GCM tag authenticates them.
        self.sealer = sealer
        self.mac = mac if sealer is None else None
        self._flags = FLAG_SEALED if sealer is not None else FLAG_MAC if mac is not None else 0
        self._trailer = SEALED_TRAILER_LEN if sealer is not None else MAC_TRAILER_LEN if mac is not None else 0
        self.sealed_pages = SealedPages(sealer, self.layout) if sealer is not None else None
        # Native calls (the lane, GIL-free batches) neither tag nor seal: such pages run in Python.
        self.python_only = self.mac is not None or sealer is not None
        self._templates: dict[int, HeaderTemplate] = {}  # key length -> header of our pages
        self._plans: dict[tuple[int, int], ReadPlan] = {}
        self._local = _ThreadState()
        self._marked = False  # the root's format marker asked for (first store)
        self._dirs = RankDir(mapper.root, mapper.dir_parts, perms, on_reopen=self._reopened)
        # Header room of a staging frame: the longest header of this layout (keys up to MAX_KEY_BYTES).
        self.geometry = FrameGeometry(self.header_len(MAX_KEY_BYTES), self._nbytes)
        # renameat2 or link(2) under this root (publish.py), shared with the native calls
        self.create_only = CreateOnly(str(mapper.root))
        self.native = NativeFileCalls(self, self._dirs, count)

    @property
    def rank_dir(self) -> RankDir:
        """The rank directory every file is reached through (held fds; do not close them)."""
        return self._dirs

    def _reopened(self) -> None:
        """The rank directory was removed and made again: count it, restore the root's metadata."""
        self._count("rank_dir_reopens")
        restore_root_metadata_soon(self.mapper.root, self.namespace, self.perms)

    def close(self) -> None:
        """Close the directory fds (only once no I/O thread can still use them) after the root's
        format marker, if this rank directory asked for it, is written (up to MARKER_SETTLE_S)."""
        if self._marked:
            settle_format_marker(self.mapper.root)
        self._dirs.close()

    # ----------------------------------------------------------------- store
    def store(self, key: bytes, slot: StagingSlot, token_count: int, sums: tuple[int, ...] | None) -> tuple[bool, int]:
        """Publish ``slot``'s page under ``key``: (stored, payload bytes); ``stored`` is False
        when a page of that name exists already. Failure policy: ``PageStoreError`` (a failed
        stat, write or publish), ``PageUnsafe`` (a planted entry that cannot be moved aside)."""
        final = self.mapper.final_path(key)
        name = os.path.basename(final)
        done = self.native.store(key, name, final, slot, token_count, sums)
        if done is not None:
            return done
        try:
            dir_fd = self._dirs.fanout(fanout(key), create=True, where=final, key=key)
        except OSError as exc:
            raise PageStoreError(directory_error(exc, final), errno=exc.errno, path=final, key=key) from exc
        try:
            result = self._store_in(dir_fd, name, final, key, slot, token_count, sums)
        finally:
            os.close(dir_fd)
        self.note_stored(key)
        return result

    def _store_in(self, dir_fd: int, name: str, final: str, key: bytes, slot: StagingSlot, token_count: int,
                  sums: tuple[int, ...] | None) -> tuple[bool, int]:
        """``store`` in the checked fan-out directory ``dir_fd``; stored False: a page has the name
        (found first, or the create-only publish lost). Failure policy: ``store``'s errors."""
        st = _entry_at(dir_fd, name, final, key)
        if st is not None:
            if stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
                return False, self._nbytes  # names are content addresses
            if move_planted_aside(dir_fd, name, st, final, key):
                self._count("planted_replaced")
        tmp = os.path.basename(self.mapper.temp_path(key, final))
        direct = self.odirect and self.sealer is None and self.codec == Codec.NONE  # aligned frames only
        pieces = self.page_pieces(key, slot, token_count, sums, padded=direct)
        exact = self.header_len(len(key)) + self._nbytes if direct else 0
        stored = publish(name, tmp, pieces, key=key, fsync=self.fsync, direct=direct, exact_len=exact,
                         dir_fd=dir_fd, mode=self.perms.file_mode, where=final, memo=self.create_only)
        return stored, self._nbytes

    def note_stored(self, key: bytes) -> None:
        """The one place a store tells the page index (this process's own pages: never a stale
        miss), whichever path wrote it (Python, a native call, the lane); the first store also
        leaves the root's format marker (``mark_root_soon``)."""
        page_index.note_stored(self.mapper.base, key)
        if not self._marked:
            self._marked = True
            mark_root_soon(self.mapper.root, self.perms)

    def store_many(self, items: list[tuple[bytes, StagingSlot, int, tuple[int, ...] | None]],
                   ) -> list[tuple[bool, int] | PageError]:
        """``store`` of each (key, slot, token count, sums), the result or the ``PageError`` of
        each: the common case of every page in ONE GIL-free call (``native_page.store_pages``),
        where the keys have one length, the slots one staging slab and the sums are all given
        or all not; the rest, and each page the native call hands back, one by one (``store``).
        Why: each GIL-free call returns to Python and waits for the GIL, and beside a busy
        Python thread (vLLM's, or the GPU pipeline's driver) that wait is most of a page's
        time (docs/measurements/scaling.md)."""
        out: list[tuple[bool, int] | PageError | None] = [None] * len(items)
        try:
            if len(items) > 1:
                self.native.store_many(items, out)
        except Exception:  # a bug in the batch path must not fail the batch: store one by one
            logger.exception("tierstore: batch store of %d pages failed; storing them one by one", len(items))
            out = [None] * len(items)
        for i, (key, slot, token_count, sums) in enumerate(items):
            if out[i] is None:
                try:
                    out[i] = self.store(key, slot, token_count, sums)
                except PageError as exc:
                    out[i] = exc
        return out  # type: ignore[return-value]

    # ----------------------------------------------------------------- load
    def load(self, key: bytes, slot: StagingSlot, verify: bool) -> tuple[int, tuple[int, ...] | None]:
        """Read ``key`` into ``slot``: (bytes, None) when verified here, else (bytes, header sums)."""
        path = self.mapper.final_path(key)
        if not self.python_only and self.codec == Codec.NONE:
            done = self.native.load(key, slot, path, verify)
            if done is not None:
                return done
        return self._load_python(key, slot, path, verify)

    def load_many(self, items: list[tuple[bytes, StagingSlot, bool]]) -> list[tuple[int, tuple[int, ...] | None] | PageError]:
        """``load`` of each (key, slot, verify), the result or the ``PageError`` of each: the
        common case of every page in ONE GIL-free call (``native_page.load_pages``), where the
        keys have one length, ``verify`` one value and the slots one staging slab; the rest,
        and each page the native call hands back, one by one (``load``'s paths)."""
        out: list[tuple[int, tuple[int, ...] | None] | PageError | None] = [None] * len(items)
        try:
            native_done = self.native.load_many(items, out) if len(items) > 1 else False
        except Exception:  # a bug in the batch path must not fail the batch: load one by one
            logger.exception("tierstore: batch load of %d pages failed; loading them one by one", len(items))
            native_done, out = False, [None] * len(items)
        for i, (key, slot, verify) in enumerate(items):
            if out[i] is not None:
                continue
            try:
                out[i] = (self._load_python(key, slot, self.mapper.final_path(key), verify) if native_done
                          else self.load(key, slot, verify))
            except PageError as exc:
                out[i] = exc
            except OSError as exc:  # the Python path names I/O errors; this is a guard
                out[i] = read_error(exc, "read", self.mapper.final_path(key), key)
        return out  # type: ignore[return-value]

    def _load_python(self, key: bytes, slot: StagingSlot, path: str, verify: bool) -> tuple[int, tuple[int, ...] | None]:
        """``load`` without the native call: names every error."""
        tmpl = self.template(len(key))
        hl = tmpl.header_len
        dir_fd = self._dirs.fanout(fanout(key), where=path, key=key)
        try:
            fd, st = open_page(os.path.basename(path), key, dir_fd=dir_fd, where=path)
        finally:
            os.close(dir_fd)
        slot.source = file_identity(st)
        try:
            if self.sealed_pages is not None and st.st_size == hl + self._nbytes + self._trailer:
                if self.sealed_pages.open(fd, tmpl, key, slot.view, path):
                    return self._nbytes, None
            elif st.st_size == hl + self._nbytes + self._trailer:
                file_buf = self.geometry.file_view(slot.frame, hl, padded=True)
                cold = self.direct_loads and cachestat_pages(fd, self._local.cachestat) <= 0
                if cold:
                    self._count("loads_odirect")
                read = cold and own_read.read_direct(fd, file_buf, hl + self._nbytes, path)
                sums = own_read.read_own_page(fd, tmpl, file_buf, slot.view, self.layout, self.read_plan(hl),
                                              key=key, path=path, verify=verify, already_read=read)
                if read:  # the general reader below and the trailer are unaligned reads
                    own_read.clear_direct(fd)
                if sums is not None:
                    if self.mac is not None:  # never served without a valid tag, verified or not
                        trailer = os.pread(fd, MAC_TRAILER_LEN, hl + self._nbytes)
                        got: list[int] = sums

                        def content() -> None:  # verify=False hashed nothing yet: damage is told apart here
                            if not verify:
                                check_section_sums(self.layout, section_sums(self.layout.spans, slot.view),
                                                            got, 0, path=path, key=key)

                        authenticate(self.mac, file_buf[:hl], slot.view, trailer, path=path, key=key,
                                              check_content=content)
                    return self._nbytes, (None if verify else tuple(sums))
            # Not byte for byte the header this engine writes (another codec or header length, a
            # wrong size, a damaged header): the general reader verifies it or names the error.
            self._count("loads_general_reader")
            read_page_fd(fd, st, path, self.expectation(key), slot.view, mac=self.mac, sealer=self.sealer)
            return self._nbytes, None
        except OSError as exc:
            raise read_error(exc, "read", path, key) from exc
        finally:
            os.close(fd)

    def contains(self, key: bytes) -> bool:
        """Whether a file is under ``key``'s name (one stat; a hint: a load verifies it)."""
        try:
            return self.mapper.path_for(key).exists()
        except (OSError, ValueError):
            return False

    def page_pieces(self, key: bytes, slot: StagingSlot, token_count: int, sums: tuple[int, ...] | None,
                    padded: bool = False) -> list[Any]:
        """The page file of ``slot``'s page under ``key`` as pieces to write in order: what
        ``store`` publishes here and the object tier PUTs. The slot's alignment gaps are zeroed
        (canonical bytes whoever filled the slot); with codec none the header is filled into
        the slot's frame, so the first piece is a view of the frame (``padded``: up to the next
        O_DIRECT boundary; valid while the slot is held); sealed pieces are this thread's
        buffers (valid until its next seal)."""
        if self.sealer is not None:
            zero_gaps(self.layout, slot.view)  # canonical plaintext
            return list(self.sealed_pages.seal(self.template(len(key)), key, slot.view, token_count))
        if self.codec == Codec.NONE:
            tmpl = self.template(len(key))
            hl = tmpl.header_len
            zero_gaps(self.layout, slot.view)
            file_buf = self.geometry.file_view(slot.frame, hl, padded=padded)
            tmpl.fill(file_buf[:hl], key, token_count,
                      sums if sums is not None else section_checksums(self.layout, slot.view))
            pieces: list[Any] = [file_buf]
            if self.mac is not None:
                pieces.append(self.mac.tag(file_buf[:hl], slot.view))
            return pieces
        st = self._local
        if st.compressor is None:
            st.compressor = zstandard.ZstdCompressor(level=self.zstd_level)
        header, payload = encode_page(self._meta(key, token_count), self.layout, slot.view, Codec.ZSTD,
                                      st.compressor, self._flags)
        pieces = [header, *payload]
        if self.mac is not None:
            pieces.append(self.mac.tag(header, payload))
        return pieces

    # ----------------------------------------------------------------- damaged pages
    def remove_damaged(self, key: bytes, source: FileIdentity | None, error: PageError) -> None:
        """Remove the bad file a load read, so the next store of its key can replace it.

        Names are content addresses: a damaged file under a final name would otherwise count as
        "already stored" forever. Only the file that was read goes (``source``); a file we did
        not get to identify (not a regular file) stays for fsck."""
        if source is None:
            return
        path = self.mapper.final_path(key)
        if self._dirs.remove_damaged(fanout(key), os.path.basename(path), source, where=path, key=key):
            page_index.note_removed(self.mapper.base, key)
            logger.warning("removed damaged page %s (%s)", path, error)
            self._count("bad_pages_discarded")

    # ----------------------------------------------------------------- cached shapes
    def expectation(self, key: bytes) -> PageExpectation:
        """What a page of ``key`` written here must be (``page_read.read_page``)."""
        return PageExpectation(self.namespace.digest_bytes, key, self.group_index, self.rank, self.layout)

    def header_len(self, key_len: int) -> int:
        """Header bytes of these pages for a key of ``key_len`` bytes."""
        return self.template(key_len).header_len

    def read_plan(self, header_len: int) -> ReadPlan:
        """``own_read.read_plan`` for this layout and ``warm_piece_bytes`` (cached)."""
        k = (header_len, self.warm_piece_bytes)
        plan = self._plans.get(k)
        if plan is None:
            plan = self._plans[k] = own_read.read_plan(self.layout, header_len, self.warm_piece_bytes)
        return plan

    def _meta(self, key: bytes, token_count: int) -> PageMeta:
        return PageMeta(self.namespace.digest_bytes, key, self.group_index, self.group.kind, token_count,
                        self.rank, self.head_start, self.head_count)

    def template(self, key_len: int) -> HeaderTemplate:
        """The header of these pages for a key of ``key_len`` bytes (cached)."""
        tmpl = self._templates.get(key_len)
        if tmpl is None:
            tmpl = self._templates[key_len] = HeaderTemplate(self._meta(b"\0" * key_len, 0), self.layout, self._flags)
        return tmpl
