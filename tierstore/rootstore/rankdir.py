"""PageFiles: the file operations of one (root, namespace, group, rank) directory, in the exact
format of one ``IOEngine`` (its header, codec, MAC trailer and O_DIRECT choice).

``pagefile`` holds one flat function per operation on one page file; this class binds them to
one rank directory and one page shape, and caches what every page of that shape shares (the
header template per key length, the warm read plan). ``IOEngine`` decides when an operation
runs and what its result means (queue, slots, stats, settle); this module only does it.

- ``store``: an existing final file counts as stored (``stored=False``) before anything is
  hashed. Codec none: the header (``HeaderTemplate.fill``, the caller's section sums or ours)
  is written into the slot's frame right before the page, the gaps between sections zeroed
  (``format.zero_gaps``), and the file goes out as one buffer (O_DIRECT: padded to 4096, then
  truncated). Codec zstd: ``format.encode_page``. With a MAC the tag is appended. Failures are
  ``PageStoreError`` (or ``PageUnsafe`` for a directory that is not ours).
- ``load``: a file of exactly our size is read into the slot's frame
  (``pagefile.read_own_page``): a page whose first block is cached is copied piece by piece
  (about ``warm_piece_bytes``), each piece hashed while in the CPU cache; an uncached one is
  read with O_DIRECT in one request when ``direct_loads``. A header that is not byte for byte
  ours (another codec or header length, damage) goes through ``pagefile.read_page_fd``, which
  names the error. Once ``native`` has compiled, the common case (a plain file of exactly
  our size and header, cached or read with O_DIRECT) is opened, checked, read, hashed and
  closed in one GIL-free call (``_load_native``, ``native_page.load_page``; one GIL hand-off
  per page instead of ~8), header, checksum and gap checks included; anything else falls back
  to the path above. The identity of the file read is left in ``slot.source`` (for
  ``remove_damaged``); errors are ``PageError``s, never served bytes.
- ``load_many``: ``load`` of an I/O thread's batch, the result or the ``PageError`` of each;
  the common case of every page in one GIL-free call (``native_page.load_pages``, keys of one
  length, one ``verify``, slots of one staging slab), the rest one by one as ``load`` does.
- ``remove_damaged``: removes the file a load read, and only that one
  (``pagefile.remove_damaged_at`` compares file identity): a file republished under the name
  meanwhile stays, and so does one that was never identified.

Every file is reached through ``pagefile.RankDir`` (directory fds, no symlink followed) and
opened ``O_NOFOLLOW|O_NONBLOCK``. Counters the owner keeps (``loads_odirect``,
``loads_general_reader``, ``bad_pages_discarded``) are reported through the ``count`` callback.

Threading: ``store``, ``load`` and ``remove_damaged`` may run on several threads at once
(I/O threads); they hold no lock while doing file I/O. zstd compressors and cachestat(2)
arguments are per thread; the template and plan caches are filled idempotently (a race builds
the same value twice). ``count`` is called with no lock of this class held.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import zstandard

from tierstore.config import TierStoreConfig
from tierstore.errors import PageError, PageStoreError
from tierstore.format.identity import Namespace
from tierstore.format.mac import PageMac
from tierstore.format.page import (
    FLAG_MAC,
    MAC_TRAILER_LEN,
    Codec,
    HeaderTemplate,
    PageExpectation,
    PageLayout,
    PageMeta,
    check_gaps,
    encode_page,
    section_checksums,
    zero_gaps,
)
from tierstore.fs import safefs
from tierstore.fs.directio import CachestatArgs, FrameGeometry, cachestat_pages
from tierstore.fs.mapper import MAX_KEY_BYTES, FileMapper, fanout
from tierstore.index import page_index
from tierstore.native import loader as native
from tierstore.native import page as native_page
from tierstore.rootstore import pageops as pagefile
from tierstore.rootstore.pageops import WARM_PIECE_BYTES, FileIdentity
from tierstore.rootstore.staging import StagingSlot

__all__ = ["WARM_PIECE_BYTES", "PageFiles"]

logger = logging.getLogger("tierstore.engine")  # the engine's log: what operators filter on

ReadPlan = list[tuple[int, int, int, int]]


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
                 layout: PageLayout | None = None) -> None:
        self.mapper = mapper
        self.namespace, self.group_index, self.rank = namespace, group_index, rank
        self.group = namespace.groups[group_index]
        # A head slice's layout comes from the caller; the group's (one rank's) otherwise.
        self.layout: PageLayout = layout if layout is not None else self.group.layout
        self.head_start, self.head_count = head_start, head_count
        self.codec, self.perms, self.mac = codec, perms, mac
        self.fsync, self.zstd_level = config.fsync, config.zstd_level
        self.odirect = odirect  # stores write with O_DIRECT (codec none, no MAC)
        self.direct_loads = direct_loads  # cold loads read with O_DIRECT (odirect + cachestat)
        self.warm_piece_bytes = WARM_PIECE_BYTES
        self._count = count
        self._nbytes = self.layout.nbytes
        self._flags = FLAG_MAC if mac is not None else 0
        self._trailer = MAC_TRAILER_LEN if mac is not None else 0
        self._templates: dict[int, HeaderTemplate] = {}  # key length -> header of our pages
        self._plans: dict[tuple[int, int], ReadPlan] = {}
        self._shapes: dict[tuple[int, bool, int], native_page.PageShape] = {}
        self._frames: dict[int, tuple[memoryview, Any]] = {}  # id(slot frame) -> (frame, its array)
        self._slabs: dict[int, tuple[memoryview, Any, int]] = {}  # id(slot frame) -> (frame, slab array, offset)
        self._slab_arrays: dict[int, tuple[Any, Any]] = {}  # id(buffer owner) -> (owner, its uint8 array)
        self._local = _ThreadState()
        self._dirs = pagefile.RankDir(mapper.root, mapper.dir_parts, perms)
        # Header room of a staging frame: the longest header of this layout (keys up to MAX_KEY_BYTES).
        self.geometry = FrameGeometry(self.header_len(MAX_KEY_BYTES), self._nbytes)

    def close(self) -> None:
        """Close the directory fds (only once no I/O thread can still use them)."""
        self._dirs.close()

    # ----------------------------------------------------------------- store
    def store(self, key: bytes, slot: StagingSlot, token_count: int, sums: tuple[int, ...] | None) -> tuple[bool, int]:
        """Publish ``slot``'s page under ``key``: (stored, payload bytes); ``stored`` is False
        when a file of that name exists already."""
        final = self.mapper.final_path(key)
        name = os.path.basename(final)
        done = self._store_native(key, name, final, slot, token_count, sums)
        if done is not None:
            page_index.note_stored(self.mapper.base, key)
            return done
        try:
            dir_fd = self._dirs.fanout(fanout(key), create=True, where=final, key=key)
        except OSError as exc:
            raise PageStoreError(f"cannot open the page's directory: {exc.strerror}", errno=exc.errno, path=final,
                                 key=key) from exc
        try:
            result = self._store_in(dir_fd, name, final, key, slot, token_count, sums)
        finally:
            os.close(dir_fd)
        page_index.note_stored(self.mapper.base, key)  # this process's own pages: never a stale miss
        return result

    def _store_in(self, dir_fd: int, name: str, final: str, key: bytes, slot: StagingSlot, token_count: int,
                  sums: tuple[int, ...] | None) -> tuple[bool, int]:
        """``store`` in the checked fan-out directory ``dir_fd``."""
        try:
            os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            return False, self._nbytes  # before hashing anything: names are content addresses
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise PageStoreError(f"cannot stat the page: {exc.strerror}", errno=exc.errno, path=final, key=key) from exc
        tmp = os.path.basename(self.mapper.temp_path(key, final))
        mode = self.perms.file_mode
        if self.codec == Codec.NONE:
            tmpl = self._template(len(key))
            hl = tmpl.header_len
            zero_gaps(self.layout, slot.view)  # canonical bytes whoever filled the slot (< 64 B a section)
            file_buf = self.geometry.file_view(slot._frame, hl, padded=self.odirect)
            tmpl.fill(file_buf[:hl], key, token_count, sums if sums is not None else section_checksums(self.layout, slot.view))
            pieces: list[Any] = [file_buf]
            if self.mac is not None:
                pieces.append(self.mac.tag(file_buf[:hl], slot.view))
            pagefile.publish(name, tmp, pieces, key=key, fsync=self.fsync, direct=self.odirect,
                             exact_len=hl + self._nbytes, dir_fd=dir_fd, mode=mode, where=final)
        else:
            st = self._local
            if st.compressor is None:
                st.compressor = zstandard.ZstdCompressor(level=self.zstd_level)
            header, payload = encode_page(self._meta(key, token_count), self.layout, slot.view, Codec.ZSTD,
                                          st.compressor, self._flags)
            pieces = [header, *payload]
            if self.mac is not None:
                pieces.append(self.mac.tag(header, payload))
            pagefile.publish(name, tmp, pieces, key=key, fsync=self.fsync, dir_fd=dir_fd, mode=mode, where=final)
        return True, self._nbytes

    def _store_native(self, key: bytes, name: str, final: str, slot: StagingSlot, token_count: int,
                      sums: tuple[int, ...] | None) -> tuple[bool, int] | None:
        """``_store_in``'s codec-none store in one GIL-free call (``native_page.store_page``:
        exists? else zero the gaps, hash, fill the header, temp, write, rename). None: not
        applicable here (another codec, a MAC, group-shared modes, not compiled) or something
        failed; the caller's Python path redoes the store and names the error."""
        target = self._native_store_target(len(key))
        if target is None:
            return None
        rank_fd, shape, flags, file_off, length = target
        tmp = os.path.basename(self.mapper.temp_path(key, final))
        code = native_page.store_page(shape, rank_fd, fanout(key), tmp, name, key, flags, self.perms.file_mode,
                                      self._frame_array(slot), file_off, length, self.fsync, token_count, sums)
        return self._native_stored(code)

    def _native_store_target(self, key_len: int) -> tuple[int, native_page.PageShape, tuple[int, int], int, int] | None:
        """What a native store of a key of ``key_len`` bytes takes: (rank directory fd, page
        shape, (directory, temp file) open flags, the file's start in the frame, bytes written).
        None where the native store does not apply (another codec, a MAC, group-shared modes,
        not compiled, no rank directory)."""
        plan = self.native_store_plan(key_len)
        if plan is None:
            return None
        try:
            rank_fd = self._dirs.rank_fd()
        except (PageError, OSError):
            return None
        return (rank_fd, *plan)

    def native_store_plan(self, key_len: int) -> tuple[native_page.PageShape, tuple[int, int], int, int] | None:
        """``_native_store_target`` without the rank directory (no file system call): (page
        shape, open flags, the file's start in the frame, bytes written), or None."""
        if self.codec != Codec.NONE or self.mac is not None or self.perms.file_mode & 0o070 or not native.ready():
            return None
        shape = self._shape(key_len, True)
        hl = shape.header_len
        length = self.geometry.padded_nbytes + hl if self.odirect else hl + self._nbytes
        return shape, (safefs.DIR_FLAGS, pagefile.temp_flags(self.odirect)), self.geometry.header_room - hl, length

    def held_rank_fd(self) -> int:
        """The rank directory's fd if already open, else -1 (never waits on the file system)."""
        return self._dirs.held_fd()

    def _native_stored(self, code: int) -> tuple[bool, int] | None:
        """A native store's code as ``store``'s result; None: the Python path redoes it."""
        if code == native.STORE_EXISTS:
            return False, self._nbytes
        return (True, self._nbytes) if code == 0 else None

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
                self._store_native_many(items, out)
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

    def _store_native_many(self, items: list[tuple[bytes, StagingSlot, int, tuple[int, ...] | None]],
                           out: list[tuple[bool, int] | PageError | None]) -> None:
        """``_store_native`` of every item in one call, results into ``out`` (None where the
        Python path must redo the store); nothing when not applicable."""
        key_len = len(items[0][0])
        target = self._native_store_target(key_len)
        if target is None or any(len(key) != key_len for key, _, _, _ in items):
            return
        frames = [self._frame_in_slab(slot) for _, slot, _, _ in items]
        slab = frames[0][0]
        if any(f[0] is not slab for f in frames):
            return
        rank_fd, shape, flags, file_off, length = target
        files = []
        for key, _, _, _ in items:
            final = self.mapper.final_path(key)
            files.append((fanout(key), os.path.basename(self.mapper.temp_path(key, final)), os.path.basename(final),
                          key))
        codes = native_page.store_pages(shape, rank_fd, files, flags, self.perms.file_mode, slab,
                                        [f[1] + file_off for f in frames], length, self.fsync,
                                        [t for _, _, t, _ in items], [s for _, _, _, s in items])
        for i, code in enumerate(codes or ()):
            done = self._native_stored(code)
            if done is not None:
                page_index.note_stored(self.mapper.base, items[i][0])
                out[i] = done

    # ----------------------------------------------------------------- load
    def load(self, key: bytes, slot: StagingSlot, verify: bool) -> tuple[int, tuple[int, ...] | None]:
        """Read ``key`` into ``slot``: (bytes, None) when verified here, else (bytes, header sums)."""
        path = self.mapper.final_path(key)
        if self.mac is None and self.codec == Codec.NONE:
            done = self._load_native(key, slot, path, verify)
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
            native_done = self._load_native_many(items, out) if len(items) > 1 else False
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
                out[i] = pagefile.read_error(exc, "read", self.mapper.final_path(key), key)
        return out  # type: ignore[return-value]

    def _load_python(self, key: bytes, slot: StagingSlot, path: str, verify: bool) -> tuple[int, tuple[int, ...] | None]:
        """``load`` without the native call: names every error."""
        tmpl = self._template(len(key))
        hl = tmpl.header_len
        dir_fd = self._dirs.fanout(fanout(key), where=path, key=key)
        try:
            fd, st = pagefile.open_page(os.path.basename(path), key, dir_fd=dir_fd, where=path)
        finally:
            os.close(dir_fd)
        slot.source = pagefile.file_identity(st)
        try:
            if st.st_size == hl + self._nbytes + self._trailer:
                file_buf = self.geometry.file_view(slot._frame, hl, padded=True)
                cold = self.direct_loads and cachestat_pages(fd, self._local.cachestat) <= 0
                if cold:
                    self._count("loads_odirect")
                read = cold and pagefile.read_direct(fd, file_buf, hl + self._nbytes, path)
                sums = pagefile.read_own_page(fd, tmpl, file_buf, slot.view, self.layout, self.read_plan(hl),
                                              key=key, path=path, verify=verify, already_read=read)
                if read:  # the general reader below and the trailer are unaligned reads
                    pagefile.clear_direct(fd)
                if sums is not None:
                    if self.mac is not None:  # never served without a valid tag, verified or not
                        trailer = os.pread(fd, MAC_TRAILER_LEN, hl + self._nbytes)
                        self.mac.verify(file_buf[:hl], slot.view, trailer, path=path)
                    return self._nbytes, (None if verify else tuple(sums))
            # Not byte for byte the header this engine writes (another codec or header length, a
            # wrong size, a damaged header): the general reader verifies it or names the error.
            self._count("loads_general_reader")
            pagefile.read_page_fd(fd, st, path, self.expectation(key), slot.view, mac=self.mac)
            return self._nbytes, None
        except OSError as exc:
            raise pagefile.read_error(exc, "read", path, key) from exc
        finally:
            os.close(fd)

    def _load_native(self, key: bytes, slot: StagingSlot, path: str, verify: bool) -> tuple[int, tuple[int, ...] | None] | None:
        """The common load in one GIL-free call (``native_page.load_page``: open, fstat, read
        (O_DIRECT when not cached and ``direct_loads``), hash, close, then the same header,
        checksum and gap checks as ``read_own_page``;
        ``verify=False``: read in one request, nothing hashed, the header's sums returned).
        None: the native path is not ready or the file is not the common case (missing, cold,
        another size or header); the caller's Python path redoes the load and names any error."""
        if native.page_kernels() is None:
            return None
        try:
            rank_fd = self._dirs.rank_fd()
        except (PageError, OSError):
            return None
        shape = self._shape(len(key), verify)
        file_off = self.geometry.header_room - shape.header_len  # ALIGN-aligned (HEADER_ALIGN)
        direct_len = self.direct_len(shape)
        got = native_page.load_page(shape, rank_fd, fanout(key), os.path.basename(path), key, pagefile.NATIVE_OPEN_FLAGS,
                                    self.direct_loads, self._frame_array(slot), file_off, direct_len)
        if got is None:
            return None
        return self._native_result(key, slot, path, verify, got)

    def _native_result(self, key: bytes, slot: StagingSlot, path: str, verify: bool,
                       outcome: native_page.LoadOutcome) -> tuple[int, tuple[int, ...] | None] | None:
        """A native load's ``outcome`` as ``load``'s result; damage raises its ``PageError``
        (named by the Python checks); None: not the common case (the Python path redoes it)."""
        code, slot.source, sums, header_sums, direct = outcome
        if code not in (0, native_page.LOAD_BAD_SUM, native_page.LOAD_BAD_GAP):
            return None
        if direct:
            self._count("loads_odirect")
        if code == native_page.LOAD_BAD_SUM:
            pagefile.check_section_sums(self.layout, sums, header_sums, 0, path=path, key=key)
        if code == native_page.LOAD_BAD_GAP:
            check_gaps(self.layout, slot.view, path=path, key=key)
        if code != 0:  # damage the Python checks did not name (cannot happen)
            return None
        return self._nbytes, (None if verify else tuple(header_sums))

    def _load_native_many(self, items: list[tuple[bytes, StagingSlot, bool]],
                          out: list[tuple[int, tuple[int, ...] | None] | PageError | None]) -> bool:
        """``_load_native`` of every item in one call, results into ``out`` (None where the
        Python path must redo the load). False: not applicable (the caller loads one by one)."""
        if self.mac is not None or self.codec != Codec.NONE or native.page_kernels() is None:
            return False
        key_len, verify = len(items[0][0]), items[0][2]
        if any(len(k) != key_len or v != verify for k, _, v in items):
            return False
        frames = [self._frame_in_slab(slot) for _, slot, _ in items]
        slab = frames[0][0]
        if any(f[0] is not slab for f in frames):
            return False
        try:
            rank_fd = self._dirs.rank_fd()
        except (PageError, OSError):
            return False
        shape = self._shape(key_len, verify)
        file_off = self.geometry.header_room - shape.header_len
        direct_len = self.direct_len(shape)
        paths = [self.mapper.final_path(key) for key, _, _ in items]
        got = native_page.load_pages(shape, rank_fd, [(fanout(key), os.path.basename(p), key)
                                                      for (key, _, _), p in zip(items, paths, strict=True)],
                                     pagefile.NATIVE_OPEN_FLAGS, self.direct_loads, slab, [f[1] + file_off for f in frames],
                                     direct_len)
        if got is None:
            return False
        for i, outcome in enumerate(got):
            key, slot, _ = items[i]
            try:
                out[i] = self._native_result(key, slot, paths[i], verify, outcome)
            except PageError as exc:
                out[i] = exc
        return True

    def _frame_in_slab(self, slot: StagingSlot) -> tuple[Any, int]:
        """(the uint8 array over ``slot``'s whole staging slab, the frame's offset in it): one
        native call can then read a batch of slots of one pool (cached per slot)."""
        got = self._slabs.get(id(slot._frame))
        if got is None or got[0] is not slot._frame:
            frame = self._frame_array(slot)
            owner = slot._frame.obj
            slab = self._slab_arrays.get(id(owner))
            if slab is None or slab[0] is not owner:
                try:
                    whole = native_page.frame_array(memoryview(owner).cast("B"))
                except (TypeError, ValueError):  # not one flat, contiguous buffer
                    whole = frame
                slab = self._slab_arrays[id(owner)] = (owner, whole)
            offset = frame.ctypes.data - slab[1].ctypes.data
            if not 0 <= offset <= slab[1].shape[0] - frame.shape[0]:
                offset, slab = 0, (slot._frame, frame)  # not inside its owner's buffer: alone
            got = self._slabs[id(slot._frame)] = (slot._frame, slab[1], offset)
        return got[1], got[2]

    def direct_len(self, shape: native_page.PageShape) -> int:
        """The bytes of one O_DIRECT read of a cold page of ``shape`` (its header and the
        ALIGN-padded page), or 0 while cold loads are not read with O_DIRECT."""
        return shape.header_len + self.geometry.padded_nbytes if self.direct_loads else 0

    def _shape(self, key_len: int, verify: bool) -> native_page.PageShape:
        """The native arrays of this writer's pages for a key length (cached; a race builds the
        same value twice)."""
        k = (key_len, verify, self.warm_piece_bytes)
        shape = self._shapes.get(k)
        if shape is None:
            tmpl = self._template(key_len)
            hl = tmpl.header_len
            plan = self.read_plan(hl) if verify else [(0, hl + self._nbytes, 0, 0)]
            shape = self._shapes[k] = native_page.PageShape(tmpl, self.layout, plan, hashed=verify)
        return shape

    def _frame_array(self, slot: StagingSlot) -> Any:
        """The uint8 array over ``slot``'s frame that the native calls take (one per slot)."""
        got = self._frames.get(id(slot._frame))
        if got is None or got[0] is not slot._frame:
            got = self._frames[id(slot._frame)] = (slot._frame, native_page.frame_array(slot._frame))
        return got[1]

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
        """What a page of ``key`` written here must be (``pagefile.read_page``)."""
        return PageExpectation(self.namespace.digest_bytes, key, self.group_index, self.rank, self.layout)

    def header_len(self, key_len: int) -> int:
        """Header bytes of these pages for a key of ``key_len`` bytes."""
        return self._template(key_len).header_len

    def read_plan(self, header_len: int) -> ReadPlan:
        """``pagefile.read_plan`` for this layout and ``warm_piece_bytes`` (cached)."""
        k = (header_len, self.warm_piece_bytes)
        plan = self._plans.get(k)
        if plan is None:
            plan = self._plans[k] = pagefile.read_plan(self.layout, header_len, self.warm_piece_bytes)
        return plan

    def _meta(self, key: bytes, token_count: int) -> PageMeta:
        return PageMeta(self.namespace.digest_bytes, key, self.group_index, self.group.kind, token_count,
                        self.rank, self.head_start, self.head_count)

    def _template(self, key_len: int) -> HeaderTemplate:
        tmpl = self._templates.get(key_len)
        if tmpl is None:
            tmpl = self._templates[key_len] = HeaderTemplate(self._meta(b"\0" * key_len, 0), self.layout, self._flags)
        return tmpl
