"""NativeFileCalls: ``PageFiles``' page I/O through the native kernels (one GIL-free call per
page or per batch), the half of the rank directory's file work that needs numba.

Contract: each method returns None (or leaves an item unset) where the native call does not
apply (another codec, a MAC, group-shared modes, not compiled, a slot of another slab) or did
not succeed; the caller's Python path (``PageFiles``) then redoes the work and names the error.
A mixin of ``PageFiles``: it reads the attributes ``PageFiles.__init__`` sets (mapper, layout,
geometry, codec, python_only, perms, odirect, direct_loads, fsync, warm_piece_bytes, the rank directory
``_dirs``, the caches and counters) and calls its ``_note_stored``, ``_template``,
``read_plan`` and ``_count``. The native lane (``lane.py``) builds its jobs from the same calls.

Threading: as ``PageFiles``: any number of I/O threads at once, no lock held during I/O.
"""

from __future__ import annotations

import os
from typing import Any

from tierstore.errors import PageError
from tierstore.format.page import Codec, check_gaps
from tierstore.fs import safefs
from tierstore.fs.mapper import fanout
from tierstore.native import loader as native
from tierstore.native import page as native_page
from tierstore.rootstore import pageops as pagefile
from tierstore.rootstore.staging import StagingSlot


class NativeFileCalls:
    """The native half of ``PageFiles`` (module docstring)."""

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
        return self._native_stored(key, code)

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
        if self.codec != Codec.NONE or self.python_only or self.perms.file_mode & 0o070 or not native.ready():
            return None
        shape = self._shape(key_len, True)
        hl = shape.header_len
        length = self.geometry.padded_nbytes + hl if self.odirect else hl + self._nbytes
        return shape, (safefs.DIR_FLAGS, pagefile.temp_flags(self.odirect)), self.geometry.header_room - hl, length

    def held_rank_fd(self) -> int:
        """The rank directory's fd if already open, else -1 (never waits on the file system)."""
        return self._dirs.held_fd()

    def _native_stored(self, key: bytes, code: int) -> tuple[bool, int] | None:
        """A native store's code as ``store``'s result (the page noted, ``_note_stored``);
        None: the Python path redoes it, for an existing entry too (``STORE_EXISTS``: one stat
        there tells a page from a FIFO, directory or link planted under its name, which is
        refused rather than reported stored)."""
        if code != 0:
            return None
        self._note_stored(key)
        return True, self._nbytes

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
            done = self._native_stored(items[i][0], code)
            if done is not None:
                out[i] = done

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
        if self.python_only or self.codec != Codec.NONE or native.page_kernels() is None:
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
