"""Display-safe text for names and manifest strings that come from an untrusted root.

Contract: ``escape(value)`` returns printable text with no control characters, no line breaks,
no bidi or other format characters and no undecodable bytes, so a file name or manifest field
cannot forge a report line or send terminal escape sequences. Bytes that are not UTF-8
(``os.fsdecode`` keeps them as surrogates, surrogateescape) become ``\\xNN``; C0/C1 controls and
DEL become ``\\xNN`` (``\\n``, ``\\r``, ``\\t`` by name); format characters, line/paragraph
separators and lone surrogates become ``\\uXXXX``; a backslash becomes ``\\\\`` so the escaping is
unambiguous. Printable text (any script) is unchanged. Use it for text output only: JSON output
keeps the raw value (json.dumps escapes by itself).

``iso_utc(epoch)``: the one time format of the command line's output (ISO 8601, UTC, ``Z``).

Threading: pure functions; safe from any thread.
"""

from __future__ import annotations

import datetime as _dt
import os
import re
import unicodedata

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\\": "\\\\"}
_UNSAFE_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp", "Co", "Cn"})


def _escape_char(ch: str) -> str:
    if ch in _NAMED:
        return _NAMED[ch]
    code = ord(ch)
    if 0xDC80 <= code <= 0xDCFF:  # a byte that was not UTF-8 (surrogateescape)
        return f"\\x{code - 0xDC00:02x}"
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def escape(value: str | bytes | os.PathLike[str] | object) -> str:
    """``value`` as display-safe text (see the module docstring); non-strings via ``str``."""
    if isinstance(value, bytes):
        text = value.decode("utf-8", "surrogateescape")
    elif isinstance(value, os.PathLike):
        text = os.fsdecode(value)
    else:
        text = value if isinstance(value, str) else str(value)
    if text.isascii() and text.isprintable() and "\\" not in text:
        return text  # the usual case: hex names, numbers
    return "".join(
        _escape_char(ch) if ch in _NAMED or unicodedata.category(ch) in _UNSAFE_CATEGORIES else ch
        for ch in text
    )


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """A byte count written as an operator writes one: digits, an optional fraction, an optional
    binary unit K/M/G/T (2^10 .. 2^40) and an optional ``B`` or ``iB`` (``"1048576"``, ``"512M"``,
    ``"500GiB"``, ``"1.5T"``); the one rule of ``tierstore gc --max-bytes`` and the config's
    byte settings. ValueError for anything else (an exponent, ``inf``, a negative or zero count)."""
    m = _SIZE_RE.match(text)
    if m is None:
        raise ValueError(f"not a byte count: {text!r} (examples: 1048576, 512M, 500G, 1.5T)")
    n = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if n <= 0:
        raise ValueError(f"byte count must be positive: {text!r}")
    return n


def iso_utc(epoch: float | None, timespec: str = "seconds") -> str | None:
    """``epoch`` as ISO 8601 UTC with a ``Z`` (None or 0: None); ``timespec`` as ``isoformat``'s."""
    if not epoch:
        return None
    return _dt.datetime.fromtimestamp(epoch, _dt.UTC).isoformat(timespec=timespec).replace("+00:00", "Z")
