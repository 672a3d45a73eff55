"""NativeFileCalls: ``PageFiles``' page I/O through the native kernels (one GIL-free call per
page or per batch), the half of the rank directory's file work that needs numba.

Contract: each method returns None (or leaves an item unset) where the native call does not
apply (another codec, a MAC, group-shared modes, not compiled, a slot of another slab) or did
not succeed; the caller's Python path (``PageFiles``) then redoes the work and names the error.
A part of one ``PageFiles`` (its ``native``), built with it: it reads the settings of its
``files`` (``NativeFileSettings``) at each call, since the engine changes ``direct_loads`` and
``warm_piece_bytes`` at run time, uses the same header templates and read plans
(``template``, ``read_plan``) and tells stores through ``note_stored``. The native arrays of
each page shape and staging frame are its own caches. The native lane (``lane.py``) builds
its jobs from the same calls (``store_plan``, ``shape``, ``frame_in_slab``) and reads its
results through ``stored`` and ``load_result``.

Threading: as ``PageFiles``: any number of I/O threads at once, no lock held during I/O; the
caches are filled idempotently (a race builds the same value twice).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Protocol

from tierstore.errors import PageError
from tierstore.format.header import Codec
from tierstore.format.header_template import HeaderTemplate
from tierstore.format.page_layout import PageLayout, check_gaps
from tierstore.fs import safefs
from tierstore.fs.directio import FrameGeometry
from tierstore.fs.mapper import FileMapper, fanout
from tierstore.native import loader as native
from tierstore.native import page_calls as native_page
from tierstore.rootstore.own_read import ReadPlan, check_section_sums
from tierstore.rootstore.page_io import NATIVE_OPEN_FLAGS
from tierstore.rootstore.publish import CreateOnly, temp_flags
from tierstore.rootstore.rank_dir import RankDir
from tierstore.rootstore.staging import StagingSlot

__all__ = ["NativeFileCalls", "NativeFileSettings"]


class NativeFileSettings(Protocol):
    """What the native calls read of their ``PageFiles`` (at each call: the engine changes
    ``direct_loads`` and ``warm_piece_bytes`` while it runs)."""

    mapper: FileMapper
    layout: PageLayout
    geometry: FrameGeometry
    codec: Codec
    perms: safefs.Perms
    fsync: bool
    odirect: bool
    python_only: bool
    direct_loads: bool
    warm_piece_bytes: int
    create_only: CreateOnly  # renameat2 or link(2) under this root (publish.py), shared with the Python path

    def template(self, key_len: int) -> HeaderTemplate: ...

    def read_plan(self, header_len: int) -> ReadPlan: ...

    def note_stored(self, key: bytes) -> None: ...


class NativeFileCalls:
    """The native half of one ``PageFiles`` (module docstring)."""

    def __init__(self, files: NativeFileSettings, rank_dir: RankDir, count: Callable[[str], None]) -> None:
        self.files = files
        self.rank_dir = rank_dir
        self._count = count
        self._nbytes = files.layout.nbytes
        # ``odirect`` is fixed at the start: the store's open flags and write length follow it
        self._odirect = files.odirect
        self._store_flags = (safefs.DIR_FLAGS, temp_flags(files.odirect))  # (directory, temp file)
        self._shapes: dict[tuple[int, bool, int], native_page.PageShape] = {}
        self._frames: dict[int, tuple[memoryview, Any]] = {}  # id(slot frame) -> (frame, its array)
        self._slabs: dict[int, tuple[memoryview, Any, int]] = {}  # id(slot frame) -> (frame, slab array, offset)
        self._slab_arrays: dict[int, tuple[Any, Any]] = {}  # id(buffer owner) -> (owner, its uint8 array)

    # ----------------------------------------------------------------- store
    def store(self, key: bytes, name: str, final: str, slot: StagingSlot, token_count: int,
              sums: tuple[int, ...] | None) -> tuple[bool, int] | None:
        """``PageFiles.store``'s codec-none store in one GIL-free call (``native_page.store_page``:
        exists? else zero the gaps, hash, fill the header, temp, write, create-only publish with
        the root's ``create_only`` choice). None: not
        applicable here (another codec, a MAC, group-shared modes, not compiled) or something
        failed; the caller's Python path redoes the store and names the error."""
        target = self._store_target(len(key))
        if target is None:
            return None
        rank_fd, shape, flags, file_off, length = target
        files = self.files
        tmp = os.path.basename(files.mapper.temp_path(key, final))
        code = native_page.store_page(shape, rank_fd, fanout(key), tmp, name, key, flags, files.perms.file_mode,
                                      self.frame_array(slot), file_off, length, files.fsync, token_count, sums,
                                      files.create_only)
        return self.stored(key, code)

    def _store_target(self, key_len: int) -> tuple[int, native_page.PageShape, tuple[int, int], int, int] | None:
        """What a native store of a key of ``key_len`` bytes takes: (rank directory fd, page
        shape, (directory, temp file) open flags, the file's start in the frame, bytes written).
        None where the native store does not apply (another codec, a MAC, group-shared modes,
        not compiled, no rank directory)."""
        plan = self.store_plan(key_len)
        if plan is None:
            return None
        try:
            rank_fd = self.rank_dir.rank_fd()
        except (PageError, OSError):
            return None
        return (rank_fd, *plan)

    def store_plan(self, key_len: int) -> tuple[native_page.PageShape, tuple[int, int], int, int] | None:
        """``_store_target`` without the rank directory (no file system call): (page shape,
        open flags, the file's start in the frame, bytes written), or None."""
        files = self.files
        if files.codec != Codec.NONE or files.python_only or files.perms.file_mode & 0o070 or not native.ready():
            return None
        shape = self.shape(key_len, True)
        hl = shape.header_len
        geometry = files.geometry
        length = geometry.padded_nbytes + hl if self._odirect else hl + self._nbytes
        return shape, self._store_flags, geometry.header_room - hl, length

    def held_rank_fd(self) -> int:
        """The rank directory's fd if already open, else -1 (never waits on the file system)."""
        return self.rank_dir.held_fd()

    def stored(self, key: bytes, code: int) -> tuple[bool, int] | None:
        """A native store's code as ``store``'s result (the page noted, ``note_stored``);
        None: the Python path redoes it, for an existing entry too (``STORE_EXISTS``, found
        first or by the create-only publish: one stat there tells a page, ``stored=False``, from
        a FIFO, directory or link planted under its name, which is moved aside and the page
        stored rather than reported stored)."""
        if code != 0:
            return None
        self.files.note_stored(key)
        return True, self._nbytes

    def store_many(self, items: list[tuple[bytes, StagingSlot, int, tuple[int, ...] | None]],
                   out: list[tuple[bool, int] | PageError | None]) -> None:
        """``store`` of every item in one call, results into ``out`` (None where the Python
        path must redo the store); nothing when not applicable."""
        key_len = len(items[0][0])
        target = self._store_target(key_len)
        if target is None or any(len(key) != key_len for key, _, _, _ in items):
            return
        frames = [self.frame_in_slab(slot) for _, slot, _, _ in items]
        slab = frames[0][0]
        if any(f[0] is not slab for f in frames):
            return
        rank_fd, shape, flags, file_off, length = target
        mapper = self.files.mapper
        files = []
        for key, _, _, _ in items:
            final = mapper.final_path(key)
            files.append((fanout(key), os.path.basename(mapper.temp_path(key, final)), os.path.basename(final), key))
        codes = native_page.store_pages(shape, rank_fd, files, flags, self.files.perms.file_mode, slab,
                                        [f[1] + file_off for f in frames], length, self.files.fsync,
                                        [t for _, _, t, _ in items], [s for _, _, _, s in items],
                                        self.files.create_only)
        for i, code in enumerate(codes or ()):
            done = self.stored(items[i][0], code)
            if done is not None:
                out[i] = done

    # ----------------------------------------------------------------- load
    def load(self, key: bytes, slot: StagingSlot, path: str, verify: bool) -> tuple[int, tuple[int, ...] | None] | None:
        """The common load in one GIL-free call (``native_page.load_page``: open, fstat, read
        (O_DIRECT when not cached and ``direct_loads``), hash, close, then the same header,
        checksum and gap checks as ``own_read.read_own_page``;
        ``verify=False``: read in one request, nothing hashed, the header's sums returned).
        None: the native path is not ready or the file is not the common case (missing, cold,
        another size or header); the caller's Python path redoes the load and names any error."""
        if native.page_kernels() is None:
            return None
        try:
            rank_fd = self.rank_dir.rank_fd()
        except (PageError, OSError):
            return None
        shape = self.shape(len(key), verify)
        file_off = self.files.geometry.header_room - shape.header_len  # ALIGN-aligned (HEADER_ALIGN)
        direct_len = self.direct_len(shape)
        got = native_page.load_page(shape, rank_fd, fanout(key), os.path.basename(path), key, NATIVE_OPEN_FLAGS,
                                    self.files.direct_loads, self.frame_array(slot), file_off, direct_len)
        if got is None:
            return None
        return self.load_result(key, slot, path, verify, got)

    def load_result(self, key: bytes, slot: StagingSlot, path: str, verify: bool,
                    outcome: native_page.LoadOutcome) -> tuple[int, tuple[int, ...] | None] | None:
        """A native load's ``outcome`` as ``load``'s result; damage raises its ``PageError``
        (named by the Python checks); None: not the common case (the Python path redoes it)."""
        code, slot.source, sums, header_sums, direct = outcome
        if code not in (0, native_page.LOAD_BAD_SUM, native_page.LOAD_BAD_GAP):
            return None
        if direct:
            self._count("loads_odirect")
        if code == native_page.LOAD_BAD_SUM:
            check_section_sums(self.files.layout, sums, header_sums, 0, path=path, key=key)
        if code == native_page.LOAD_BAD_GAP:
            check_gaps(self.files.layout, slot.view, path=path, key=key)
        if code != 0:  # damage the Python checks did not name (cannot happen)
            return None
        return self._nbytes, (None if verify else tuple(header_sums))

    def load_many(self, items: list[tuple[bytes, StagingSlot, bool]],
                  out: list[tuple[int, tuple[int, ...] | None] | PageError | None]) -> bool:
        """``load`` of every item in one call, results into ``out`` (None where the Python path
        must redo the load). False: not applicable (the caller loads one by one)."""
        files = self.files
        if files.python_only or files.codec != Codec.NONE or native.page_kernels() is None:
            return False
        key_len, verify = len(items[0][0]), items[0][2]
        if any(len(k) != key_len or v != verify for k, _, v in items):
            return False
        frames = [self.frame_in_slab(slot) for _, slot, _ in items]
        slab = frames[0][0]
        if any(f[0] is not slab for f in frames):
            return False
        try:
            rank_fd = self.rank_dir.rank_fd()
        except (PageError, OSError):
            return False
        shape = self.shape(key_len, verify)
        file_off = files.geometry.header_room - shape.header_len
        direct_len = self.direct_len(shape)
        paths = [files.mapper.final_path(key) for key, _, _ in items]
        got = native_page.load_pages(shape, rank_fd, [(fanout(key), os.path.basename(p), key)
                                                      for (key, _, _), p in zip(items, paths, strict=True)],
                                     NATIVE_OPEN_FLAGS, files.direct_loads, slab, [f[1] + file_off for f in frames],
                                     direct_len)
        if got is None:
            return False
        for i, outcome in enumerate(got):
            key, slot, _ = items[i]
            try:
                out[i] = self.load_result(key, slot, paths[i], verify, outcome)
            except PageError as exc:
                out[i] = exc
        return True

    def direct_len(self, shape: native_page.PageShape) -> int:
        """The bytes of one O_DIRECT read of a cold page of ``shape`` (its header and the
        ALIGN-padded page), or 0 while cold loads are not read with O_DIRECT."""
        return shape.header_len + self.files.geometry.padded_nbytes if self.files.direct_loads else 0

    # ----------------------------------------------------------------- cached arrays
    def shape(self, key_len: int, verify: bool) -> native_page.PageShape:
        """The native arrays of this writer's pages for a key length (cached; a race builds the
        same value twice)."""
        files = self.files
        k = (key_len, verify, files.warm_piece_bytes)
        shape = self._shapes.get(k)
        if shape is None:
            tmpl = files.template(key_len)
            hl = tmpl.header_len
            plan = files.read_plan(hl) if verify else [(0, hl + self._nbytes, 0, 0)]
            shape = self._shapes[k] = native_page.PageShape(tmpl, files.layout, plan, hashed=verify)
        return shape

    def frame_in_slab(self, slot: StagingSlot) -> tuple[Any, int]:
        """(the uint8 array over ``slot``'s whole staging slab, the frame's offset in it): one
        native call can then read a batch of slots of one pool (cached per slot)."""
        frame = slot.frame
        got = self._slabs.get(id(frame))
        if got is None or got[0] is not frame:
            array = self.frame_array(slot)
            owner = frame.obj
            slab = self._slab_arrays.get(id(owner))
            if slab is None or slab[0] is not owner:
                try:
                    whole = native_page.frame_array(memoryview(owner).cast("B"))
                except (TypeError, ValueError):  # not one flat, contiguous buffer
                    whole = array
                slab = self._slab_arrays[id(owner)] = (owner, whole)
            offset = array.ctypes.data - slab[1].ctypes.data
            if not 0 <= offset <= slab[1].shape[0] - array.shape[0]:
                offset, slab = 0, (frame, array)  # not inside its owner's buffer: alone
            got = self._slabs[id(frame)] = (frame, slab[1], offset)
        return got[1], got[2]

    def frame_array(self, slot: StagingSlot) -> Any:
        """The uint8 array over ``slot``'s frame that the native calls take (one per slot)."""
        frame = slot.frame
        got = self._frames.get(id(frame))
        if got is None or got[0] is not frame:
            got = self._frames[id(frame)] = (frame, native_page.frame_array(frame))
        return got[1]
