"""ObjectFiles: an ``IOEngine``'s pages as objects of one bucket (the object tier's medium).

Store path: the page file a ``PageFiles`` of the same engine would publish
(``PageFiles.page_pieces``: header, body, MAC or sealed trailer; byte for byte the canonical
file) goes out in one PUT with ``If-None-Match: *`` under the key that mirrors its path under a
file root (``ObjectLocation.key``): ``PREFIX/<ns>/g<g>/r<r>/<aa>/<key>.kvp``. A 412 means an
object of that name exists: names are content addresses, so ``stored=False``, as a file root
reports an existing file. No exists-check first: the conditional PUT is the check (one
request, and exactly one of several racing writers stores).

Load path: one GET of the whole object, then the same checks as a file. An object of exactly
this engine's size whose header is byte for byte this engine's (codec none, no MAC, not
sealed) is copied into the slot's frame and its sections hashed there (``verify=False``:
handed to the caller with the header's sums, as a file is); anything else goes through the
general reader of files on an in-memory file holding the body (``page_read.read_page_body``), so
MAC, sealed pages, zstd and every header check are the one code of the file tiers.

- ``remove_damaged``: deletes the object a load proved bad, unless a HEAD shows another object
  (another ETag) under the key since (RGW ignores conditional DELETE, so the check is a HEAD;
  a page republished between the HEAD and the DELETE is lost, which costs a recompute, never a
  wrong page).
- ``contains``: the tier's object index (``objstore.object_index``), never a request.

Failure policy: every failure is a typed ``PageError`` of the job (``client.ObjectClient``'s
for requests: ``PageMissing``, ``PageTimeout``, ``PageIOError``; the reader's for bad bytes).
Threading: ``store``, ``load`` and ``remove_damaged`` run on the engine's I/O threads, several
at once, holding no lock; the client is thread-safe.
"""

from __future__ import annotations

import logging
from typing import Any

from tierstore.config import ObjectLocation
from tierstore.errors import PageError
from tierstore.format.checksums import section_sums
from tierstore.format.header import Codec, PageExpectation
from tierstore.format.page_layout import check_gaps
from tierstore.objstore.client import ObjectClient
from tierstore.objstore.listing import object_key
from tierstore.objstore.object_index import ObjectIndex
from tierstore.rootstore.own_read import WARM_PIECE_BYTES, check_section_sums
from tierstore.rootstore.page_files import PageFiles
from tierstore.rootstore.page_read import read_page_body
from tierstore.rootstore.staging import StagingSlot

logger = logging.getLogger(__name__)


class ObjectFiles:
    """The file operations of ``PageFiles`` on objects (module docstring)."""

    direct_loads = False  # no O_DIRECT on objects
    warm_piece_bytes = WARM_PIECE_BYTES

    def __init__(self, files: PageFiles, client: ObjectClient, location: ObjectLocation) -> None:
        self.format = files  # the page format of this engine; never opens a file
        self.client = client
        self.location = location
        self.geometry = files.geometry
        self.index: ObjectIndex | None = None

    def bind_index(self, index: ObjectIndex) -> None:
        """Answer ``contains`` from ``index`` and tell it of every page stored or found stored."""
        self.index = index

    def object_key(self, key: bytes) -> str:
        """The object key of a page: its path under a file root, under the location's prefix."""
        return object_key(self.location, self.format.mapper.final_path(key))

    def _where(self, okey: str) -> str:
        return f"s3://{self.location.bucket}/{okey}"

    # ----------------------------------------------------------------- store
    def store(self, key: bytes, slot: StagingSlot, token_count: int, sums: tuple[int, ...] | None) -> tuple[bool, int]:
        """Publish ``slot``'s page under ``key``: (stored, payload bytes)."""
        pieces = self.format.page_pieces(key, slot, token_count, sums)
        body: Any = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        okey = self.object_key(key)
        try:
            stored = self.client.put_create(okey, body)
        except PageError as exc:
            exc.key = key
            raise
        if self.index is not None:
            self.index.add(okey)  # stored now, or found there (412)
        return stored, self.format.layout.nbytes

    def store_many(self, items: list[tuple[bytes, StagingSlot, int, tuple[int, ...] | None]],
                   ) -> list[tuple[bool, int] | PageError]:
        out: list[tuple[bool, int] | PageError] = []
        for key, slot, token_count, sums in items:
            try:
                out.append(self.store(key, slot, token_count, sums))
            except PageError as exc:
                out.append(exc)
        return out

    # ----------------------------------------------------------------- load
    def load(self, key: bytes, slot: StagingSlot, verify: bool) -> tuple[int, tuple[int, ...] | None]:
        """GET ``key``'s object into ``slot``: (bytes, None) when verified here, else (bytes, header sums)."""
        okey = self.object_key(key)
        try:
            body, etag = self.client.get(okey)
        except PageError as exc:
            exc.key = key
            raise
        slot.source = (okey, etag)  # what remove_damaged may delete
        return self.serve(key, body, slot, verify, self._where(okey))

    def serve(self, key: bytes, body: memoryview, slot: StagingSlot, verify: bool,
              where: str) -> tuple[int, tuple[int, ...] | None]:
        """Check the page file ``body`` of ``key`` and put its page into ``slot`` (module docstring)."""
        fmt = self.format
        layout = fmt.layout
        tmpl = fmt.template(len(key))
        hl = tmpl.header_len
        if not fmt.python_only and fmt.codec == Codec.NONE and len(body) == hl + layout.nbytes:
            file_buf = self.geometry.file_view(slot.frame, hl)
            file_buf[:] = body
            sums = tmpl.parse(file_buf[:hl], key)
            if sums is not None:
                if verify:
                    check_section_sums(layout, section_sums(layout.spans, slot.view), sums, 0, path=where, key=key)
                check_gaps(layout, slot.view, path=where, key=key)
                return layout.nbytes, (None if verify else tuple(sums))
        read_page_body(body, where, fmt.expectation(key), slot.view, mac=fmt.mac, sealer=fmt.sealer)
        return layout.nbytes, None

    def load_many(self, items: list[tuple[bytes, StagingSlot, bool]],
                  ) -> list[tuple[int, tuple[int, ...] | None] | PageError]:
        out: list[tuple[int, tuple[int, ...] | None] | PageError] = []
        for key, slot, verify in items:
            try:
                out.append(self.load(key, slot, verify))
            except PageError as exc:
                out.append(exc)
        return out

    # ----------------------------------------------------------------- the rest of EngineFiles
    def contains(self, key: bytes) -> bool:
        return self.index is not None and self.index.contains(self.object_key(key))

    def remove_damaged(self, key: bytes, source: Any, error: PageError) -> None:
        """Delete the object a load proved bad (``source``: its key and ETag as read), unless
        another object is under the key since (module docstring). Failure policy: a failed
        request is logged (fsck --repair removes the object later), never raised."""
        if not isinstance(source, tuple):
            return
        okey, etag = source
        try:
            now = self.client.head(okey)
            if now is None or (etag and now.etag != etag):
                return
            self.client.delete_many([okey])
            if self.index is not None:
                self.index.discard(okey)
        except PageError as exc:
            logger.warning("could not remove the damaged page %s (%s); fsck --repair removes it",
                           self._where(okey), exc)
            return
        logger.warning("removed damaged page %s (%s)", self._where(okey), error)

    def expectation(self, key: bytes) -> PageExpectation:
        return self.format.expectation(key)

    def header_len(self, key_len: int) -> int:
        return self.format.header_len(key_len)

    def close(self) -> None:
        """Nothing to close: the client's connections go with it."""

