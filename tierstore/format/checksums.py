"""Section and header checksums of the page format: xxh3-64 of the raw bytes.

``checksum`` is the one function every checksum of a page is (sections, the header's own);
``section_sums`` hashes many sections of a buffer at once, through a faster hasher once one is
installed (``install_span_hasher``: ``native.loader`` plugs its GIL-free kernel in after its
self-check, so this module imports no I/O layer). Device tensors hold checksums as int64
(``checksum_as_int64``).

Threading: pure functions; the installed hasher is set once (a reference assignment) and safe
from any thread.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import xxhash

from tierstore.format.page_layout import PageLayout


def checksum(data: bytes | memoryview) -> int:
    """xxh3-64 of ``data`` (the checksum used for sections and headers)."""
    return xxhash.xxh3_64_intdigest(data)


# A hasher of many spans in one GIL-free call, installed by ``native.loader`` once its kernels
# are compiled (None before, or without numba): this module describes bytes and imports no I/O
# layer; the layer that can hash faster plugs in here. It returns None to decline (small spans).
SpanHasher = Callable[[Sequence[tuple[int, int]], memoryview, int, int], "list[int] | None"]
_span_hasher: SpanHasher | None = None


def install_span_hasher(hasher: SpanHasher) -> None:
    """Hash sections with ``hasher`` from now on (``native.loader``, after its self-check)."""
    global _span_hasher
    _span_hasher = hasher


def section_sums(spans: Sequence[tuple[int, int]], data: memoryview, first: int = 0,
                 end: int | None = None) -> list[int]:
    """``checksum`` of ``data[o:e]`` for the spans ``first`` to ``end``, equal to
    ``[checksum(data[o:e]) ...]`` byte for byte. The I/O threads' hot path: once the native
    kernels are compiled, large spans are hashed in one GIL-free call (``install_span_hasher``)."""
    end = len(spans) if end is None else end
    if _span_hasher is not None:
        got = _span_hasher(spans, data, first, end)
        if got is not None:
            return got
    return [checksum(data[o:e]) for o, e in spans[first:end]]


U64_MASK = (1 << 64) - 1


def checksum_as_int64(value: int) -> int:
    """A checksum (or any 64-bit pattern) as the int64 with the same bits: device tensors hold
    int64; ``v & U64_MASK`` turns it back."""
    value &= U64_MASK
    return value - (1 << 64) if value >= 1 << 63 else value


def section_checksums(layout: PageLayout, data: memoryview) -> tuple[int, ...]:
    """The checksum of each section of a page buffer of ``layout`` (what the header records)."""
    return tuple(section_sums(layout.spans, memoryview(data).cast("B")))
