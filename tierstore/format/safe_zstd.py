"""zstd decompression whose memory is bounded by the expected layout, never by the frame.

Contract: ``decompress_into(frame, out)`` decodes one zstd frame into the caller's buffer
``out`` (the page buffer of the expected layout) and raises ``PageCorrupt`` unless the frame
decodes to exactly ``len(out)`` bytes. python-zstandard ignores ``max_output_size`` when a frame
declares its content size (a 64 KiB frame declaring 2 GiB allocates 2 GiB), so the declared size
is read from the frame header first (``get_frame_parameters``) and must equal ``len(out)``; then
the frame is streamed into ``out`` with ``readinto`` and one extra byte is asked for to prove
the end. The decoder's window is capped at ``max_window_for(len(out))``, so a frame declaring a
huge window is refused instead of allocated. Extra memory: the window plus zstd's fixed buffers.

Threading: pure functions; each call makes its own decompressor (about 100 KiB, cheap next to
a page).
"""

from __future__ import annotations

import io

import zstandard

from tierstore.errors import PageCorrupt

_MIN_WINDOW = 1 << 20  # what zstd level 1..19 uses for small inputs anyway
_MAX_WINDOW = 1 << 27  # zstd's own default limit (ZSTD_WINDOWLOG_LIMIT_DEFAULT)


def max_window_for(expected_len: int) -> int:
    """Largest window a frame of ``expected_len`` decoded bytes may need (a power of two)."""
    w = _MIN_WINDOW
    while w < expected_len and w < _MAX_WINDOW:
        w <<= 1
    return w


def declared_size(frame: bytes | memoryview) -> int | None:
    """The content size the frame header declares, or None when it declares none."""
    try:
        params = zstandard.get_frame_parameters(frame)
    except zstandard.ZstdError as exc:
        raise PageCorrupt(f"bad zstd frame header ({exc})") from exc
    size = params.content_size
    return None if size in (zstandard.CONTENTSIZE_UNKNOWN, zstandard.CONTENTSIZE_ERROR) else size


def decompress_into(frame: bytes | memoryview, out: memoryview | bytearray, *, path: str | None = None) -> None:
    """Decode ``frame`` into ``out``; raise ``PageCorrupt`` unless it is exactly ``len(out)`` bytes."""
    out = memoryview(out).cast("B")
    expected = len(out)
    try:
        size = declared_size(frame)
    except PageCorrupt as exc:
        raise PageCorrupt(exc.message, path=path) from exc
    if size is not None and size != expected:
        raise PageCorrupt(f"zstd frame declares {size} bytes, the layout expects {expected}", path=path)
    dctx = zstandard.ZstdDecompressor(max_window_size=max_window_for(expected))
    got = 0
    try:
        with dctx.stream_reader(io.BytesIO(frame), read_across_frames=False) as reader:
            while got < expected:
                n = reader.readinto(out[got:])
                if not n:
                    break
                got += n
            extra = reader.read(1) if got == expected else b""
    except zstandard.ZstdError as exc:
        raise PageCorrupt(f"bad zstd frame ({exc})", path=path) from exc
    if got != expected or extra:
        raise PageCorrupt(f"zstd frame decodes to {'more' if extra else got} bytes, the layout expects {expected}",
                          path=path)


def decompress_capped(frame: bytes | memoryview, expected_len: int, *, path: str | None = None) -> bytearray:
    """``decompress_into`` a new buffer of ``expected_len`` bytes (allocated before decoding,
    from the expectation, never from the frame)."""
    out = bytearray(expected_len)
    decompress_into(frame, out, path=path)
    return out
