"""Display-safe text for names and manifest strings that come from an untrusted root.

Contract: ``escape(value)`` returns printable text with no control characters, no line breaks,
no bidi or other format characters and no undecodable bytes, so a file name or manifest field
cannot forge a report line or send terminal escape sequences. Bytes that are not UTF-8
(``os.fsdecode`` keeps them as surrogates, surrogateescape) become ``\\xNN``; C0/C1 controls and
DEL become ``\\xNN`` (``\\n``, ``\\r``, ``\\t`` by name); format characters, line/paragraph
separators and lone surrogates become ``\\uXXXX``; a backslash becomes ``\\\\`` so the escaping is
unambiguous. Printable text (any script) is unchanged. Use it for text output only: JSON output
keeps the raw value (json.dumps escapes by itself).

Threading: pure functions; safe from any thread.
"""

from __future__ import annotations

import os
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
