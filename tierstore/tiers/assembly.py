"""Serving a page from head slices written at another tensor-parallel size: ``assemble``.

``assemble`` reads the covering files (``format.head_slices.cover``'s answer), each fully
verified by the general reader (``pageops.read_page_fd`` with that writer's expectation:
header checksum, namespace, key, group, rank, layout and every section checksum) into a
scratch buffer, and copies their units into the reader's page. Every byte a rank scatters from
it was checksum-verified. It returns the cost: bytes read and files opened (the read
amplification of a TP change).

Failure policy: ``assemble`` raises the typed ``PageError`` of the first piece that fails
(missing, checksum, ...); the output buffer then holds garbage and must not be used.
Threading: blocking file reads (call it from an I/O thread); no shared state.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tierstore.errors import BAD_CONTENT_KINDS, PageError
from tierstore.format.head_slices import HeadRange, copy_heads, slice_layout, split_dir_name
from tierstore.format.page import PageExpectation, PageLayout
from tierstore.rootstore import pageops as pagefile


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


def assemble(need: HeadRange, pieces: Sequence[HeadRange], full_layout: PageLayout, out: memoryview,
             locate: Callable[[HeadRange], tuple[Path, PageExpectation]],
             on_damage: Callable[[Path, pagefile.FileIdentity, PageError], None] | None = None,
             ) -> AssembleCost:
    """Fill ``out`` (the ``slice_layout(full_layout, need)`` page) from the files of ``pieces``
    (``cover``'s answer). ``locate(piece)`` gives a piece's path and its writer's expectation
    (layout ``slice_layout(full_layout, piece)``). Each file is read and verified in full into
    a scratch buffer before any of its bytes is copied; see the module's failure policy.
    ``on_damage(path, identity, error)``: called for a file whose content is bad
    (``BAD_CONTENT_KINDS``) before the error is raised, with the identity of the file read (the
    caller may remove exactly that file)."""
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
        fd, st = pagefile.open_page(str(path), expect.key)  # read_page's steps, keeping the file's identity
        try:
            header = pagefile.read_page_fd(fd, st, str(path), expect, scratch)  # every section checksum verified
        except PageError as exc:
            if on_damage is not None and exc.kind in BAD_CONTENT_KINDS:
                on_damage(path, pagefile.file_identity(st), exc)
            raise
        finally:
            os.close(fd)
        cost.token_count = header.meta.token_count
        cost.files += 1
        cost.bytes_read += layout.nbytes
        cost.bytes_scattered += copy_heads(full_layout, scratch, piece, out, need)
    return cost
