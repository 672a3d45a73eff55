"""Serving a page from head slices written at another tensor-parallel size: ``assemble``.

``assemble`` reads the covering files (``format.head_slices.cover``'s answer), each fully
verified by the one verify-then-serve function of every reader (``page_read.read_page_fd`` with
that writer's expectation: header checksum, namespace, key, group, rank, layout, every section
checksum and, with the fleet key ``mac``, the MAC tag) into a scratch buffer, and copies their
units into the reader's page. Every byte a rank scatters from it was verified as a page served
by an engine is: with a key, a slice file written without it is never served (and so never
stored back under the reader's slice with a valid tag). Files are opened through directory fds
from the root down (``rank_dir.RankDir``: no symlinked namespace, group, slice or fan-out
directory is followed, ``open_page``: no symlink, FIFO or hard link under the page's name is
read), as every other reader opens pages. It returns the cost: bytes read and files opened
(the read amplification of a TP change).

Failure policy: ``assemble`` raises the typed ``PageError`` of the first piece that fails
(missing, checksum, unsafe, mac, ...); the output buffer then holds garbage and must not be used.
Threading: blocking file reads (call it from an I/O thread); no shared state.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tierstore.errors import BAD_CONTENT_KINDS, PageError
from tierstore.format.head_slices import HeadRange, copy_heads, slice_layout, split_dir_name
from tierstore.format.header import PageExpectation
from tierstore.format.mac import PageMac
from tierstore.format.page_layout import PageLayout
from tierstore.format.sealing import KeyRing
from tierstore.rootstore import page_read
from tierstore.rootstore.page_io import open_page
from tierstore.rootstore.rank_dir import FileIdentity, RankDir, file_identity


@dataclass
class AssembleCost:
    """What serving one page from other slices cost: bytes read from files (verified) and
    bytes copied into the reader's page, and files opened."""

    bytes_read: int = 0
    bytes_scattered: int = 0
    files: int = 0
    token_count: int = 0  # the covering pages' (one key: the same tokens in every slice)

    @property
    def amplification(self) -> float:
        """Bytes read per byte the reader uses (1.0: none wasted)."""
        return self.bytes_read / self.bytes_scattered if self.bytes_scattered else 0.0


def open_slice_file(path: Path, key: bytes) -> tuple[int, os.stat_result]:
    """Open the slice file ``ROOT/<ns>/g<g>/<slice>/<aa>/<name>`` for reading through directory
    fds opened from ROOT component by component without following a symlink (``RankDir``), the
    file itself ``O_NOFOLLOW|O_NONBLOCK`` (``open_page``): (fd, fstat); the caller closes the fd.

    Failure policy: ``PageUnsafe`` for a symlinked or non-directory component, or a symlink,
    FIFO or hard-linked file under the name; ``PageMissing``/``PageIOError`` as ``open_page``."""
    parts = path.parts
    if len(parts) < 6:
        raise ValueError(f"{path} is not ROOT/<namespace>/g<group>/<slice>/<fan-out>/<page>")
    dirs = RankDir(Path(*parts[:-5]), parts[-5:-2])
    try:
        dir_fd = dirs.fanout(parts[-2], where=str(path), key=key)
        try:
            return open_page(parts[-1], key, dir_fd=dir_fd, where=str(path))
        finally:
            os.close(dir_fd)
    finally:
        dirs.close()


def assemble(need: HeadRange, pieces: Sequence[HeadRange], full_layout: PageLayout, out: memoryview,
             locate: Callable[[HeadRange], tuple[Path, PageExpectation]],
             on_damage: Callable[[Path, FileIdentity, PageError], None] | None = None,
             *, mac: PageMac | None = None, sealer: KeyRing | None = None) -> AssembleCost:
    """Fill ``out`` (the ``slice_layout(full_layout, need)`` page) from the files of ``pieces``
    (``cover``'s answer). ``locate(piece)`` gives a piece's path and its writer's expectation
    (layout ``slice_layout(full_layout, piece)``). Each file is opened by ``open_slice_file``
    and read and verified in full (``read_page_fd``: its MAC with ``mac``, decrypted with
    ``sealer`` under ``encryption_key_file``) into a scratch buffer
    before any of its bytes is copied; see the module's failure policy.
    ``on_damage(path, identity, error)``: called for a file whose content is bad
    (``BAD_CONTENT_KINDS``; not kind ``mac``, which is not damage) before the error is raised,
    with the identity of the file read (the caller may remove exactly that file)."""
    dst_layout = slice_layout(full_layout, need)
    if len(out) < dst_layout.nbytes:
        raise ValueError(f"output buffer of {len(out)} bytes for a {dst_layout.nbytes}-byte page")
    cost = AssembleCost()
    for piece in pieces:
        path, expect = locate(piece)
        layout = slice_layout(full_layout, piece)
        if expect.layout != layout:
            raise ValueError(f"the expectation of slice {split_dir_name(piece)} has another layout")
        scratch = memoryview(bytearray(layout.nbytes))
        fd, st = open_slice_file(path, expect.key)  # read_page's steps, keeping the file's identity
        try:
            header = page_read.read_page_fd(fd, st, str(path), expect, scratch, mac=mac,  # as every page served
                                           sealer=sealer)
        except PageError as exc:
            if on_damage is not None and exc.kind in BAD_CONTENT_KINDS:
                on_damage(path, file_identity(st), exc)
            raise
        finally:
            os.close(fd)
        cost.token_count = header.meta.token_count
        cost.files += 1
        cost.bytes_read += layout.nbytes
        cost.bytes_scattered += copy_heads(full_layout, scratch, piece, out, need)
    return cost
