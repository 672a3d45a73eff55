"""Typed errors of tierstore.

Contract: every failure a user or the engine can meet is one of these classes. Page errors
carry a short machine-readable ``kind`` (used as a metrics label and in fsck reports), the
path and the key when known. Readers never return partial data: they raise one of these.
No threading rules: these are plain values.
"""

from __future__ import annotations

import errno as _errno
from pathlib import Path


class TierStoreError(Exception):
    """Base class of every tierstore error."""

    kind = "error"


class ConfigError(TierStoreError, ValueError):
    """A setting is missing or invalid; the message names the setting and what to do."""

    kind = "config"


class PageError(TierStoreError):
    """A page could not be read or written; ``kind`` says why (``errno`` when the OS said)."""

    kind = "page"

    def __init__(self, message: str, *, path: str | Path | None = None, key: bytes | None = None,
                 errno: int | None = None):
        super().__init__(message)
        self.path = str(path) if path is not None else None
        self.key = key
        self.errno = errno

    @property
    def message(self) -> str:
        """What went wrong, without the kind and path that ``str()`` adds."""
        return super().__str__()

    def __str__(self) -> str:
        where = f" [{self.path}]" if self.path else ""
        return f"{self.kind}: {self.message}{where}"


class PageMissing(PageError):
    """No page file under the expected name (ENOENT or ESTALE)."""

    kind = "missing"


class PageTruncated(PageError):
    """The file is shorter than its header says (or too short to hold a header)."""

    kind = "truncated"


class PageCorrupt(PageError):
    """A checksum did not match: header or one section."""

    kind = "checksum"


class PageSealedCorrupt(PageCorrupt):
    """An encrypted page's ciphertext checksums do not match, found by a reader without the key
    (fsck without ``--encryption-key-file``): damage, reported, and not removed (nothing is
    deleted that the reader cannot authenticate; fsck with the key repairs it)."""

    kind = "sealed_checksum"


class PageFormatError(PageError):
    """Not a tierstore page, an unsupported format version, or an inconsistent header."""

    kind = "format"


class PageForeign(PageError):
    """The page belongs to another namespace (model, dtype, layout, ...)."""

    kind = "foreign"


class PageKeyMismatch(PageError):
    """The page's key, group or rank disagrees with the name it was read under."""

    kind = "key_mismatch"


class PageUnsafe(PageError):
    """The entry under a page's name is not what tierstore writes there: a symlink, a FIFO or
    other non-regular file, a file with more than one link, or a file larger than any page of
    the expected layout. Never served, never followed, never removed by a load (it may be
    someone else's file); fsck reports it. A store of the key moves the entry itself aside
    (rename(2) to ``.<name>.planted-<random>``: a link's target, a hard link's other names and a
    directory's content are untouched) and publishes the page, so a planted entry cannot block
    a key."""

    kind = "unsafe"


class PageTimeout(PageError):
    """The operation did not finish before its deadline."""

    kind = "timeout"


class PageCancelled(PageError):
    """The engine was closed before the operation ran."""

    kind = "cancelled"


class PageQueueFull(PageError):
    """The engine could not take the job (its queue is full or no staging slot is free)."""

    kind = "queue_full"


# errno of a failed store -> its kind (any other errno: "io").
_STORE_KINDS = {
    _errno.ENOSPC: "enospc",
    _errno.EDQUOT: "enospc",
    _errno.EROFS: "readonly",
    _errno.EACCES: "permission",
    _errno.EPERM: "permission",
}


class PageStoreError(PageError):
    """A store failed at the file system (no space, read-only, permissions, I/O error)."""

    kind = "store"

    def __init__(self, message: str, *, path: str | Path | None = None, key: bytes | None = None,
                 errno: int | None = None) -> None:
        super().__init__(message, path=path, key=key, errno=errno)
        if errno is not None:
            self.kind = _STORE_KINDS.get(errno, "io")


class PageIOError(PageError):
    """A read failed at the file system with an error other than 'not found'."""

    kind = "io"


# Kinds of load failure that prove the file under the final name is bad (its bytes, not a
# transient I/O error): the store that served it removes it, and the key may be stored again.
# "unsafe" is not one: a symlink or hard link is never acted on. Neither is "mac".
BAD_CONTENT_KINDS: frozenset[str] = frozenset(
    {PageCorrupt.kind, PageTruncated.kind, PageFormatError.kind, PageForeign.kind, PageKeyMismatch.kind})

# Kinds of load failure that say the page cannot be checked here, not that it is bad: "mac"
# (mac.PageUnauthenticated: a fleet key is configured and the page's tag does not verify with
# it: no tag, another key's tag, a MAC algorithm not installed here). During a key rotation, or
# on a node without the ``blake3`` package, such a page is another node's good page, so it is a
# miss that nobody removes (engines, ``tierstore fsck --repair``); damage in such a page is
# still found by its checksums, which need no key, and reported as that damage. A page planted
# without the key stays until gc evicts it or an operator removes it
# (``tierstore fsck --repair --remove-unverifiable``).
UNVERIFIABLE_KINDS: frozenset[str] = frozenset({"mac"})

# errno values of a file server that did not answer this time (a soft NFS mount during a server
# restart, a stale handle, the network): a tier that meets one while opening starts down and is
# reopened by its health probe, never given up for the life of the process.
TRANSIENT_ERRNOS: tuple[int, ...] = (_errno.EIO, _errno.ESTALE, _errno.ETIMEDOUT, _errno.EAGAIN, _errno.ENOLCK,
                                     _errno.ENETDOWN, _errno.ENETUNREACH, _errno.EHOSTDOWN, _errno.EHOSTUNREACH,
                                     _errno.ECONNREFUSED, _errno.ECONNRESET, _errno.ECONNABORTED)

# errno values that mean "the file system has no room": full (ENOSPC) or over a quota (EDQUOT).
SPACE_ERRNOS: tuple[int, ...] = (_errno.ENOSPC, _errno.EDQUOT)

# errno values that mean "the file is gone" (ESTALE: removed by another NFS client; ENOTDIR: a
# directory on its path is gone too, a file in its place). The one list: every module uses it.
GONE_ERRNOS: tuple[int, ...] = (_errno.ENOENT, _errno.ESTALE, _errno.ENOTDIR)
