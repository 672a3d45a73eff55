"""Safe file-system access under a root that others can write to.

Contract: every reader and writer of a tierstore root reaches entries through directory file
descriptors opened with ``O_DIRECTORY|O_NOFOLLOW`` (a symlinked namespace, group, rank, fan-out
or trash directory raises ``UnsafeEntry``, it is never followed), opens files with
``O_NOFOLLOW|O_NONBLOCK`` (a FIFO never blocks the opener) and ``fstat``s the descriptor before
reading: only a regular file with one link is read. Unlink and rename use ``*at`` calls relative
to the directory fd that was checked, after re-checking the entry's (device, inode): a directory
swapped for a symlink after a scan cannot redirect them outside the root. Small files
(manifests, leases, key files) are read through the checked fd with a size cap. Walks are
iterative (no recursion) with a depth limit, and keep at most one fd open per level.
Creation modes are 0600/0700 (``PRIVATE``) unless the caller passes ``GROUP_SHARED``
(0660/2770) for a fleet that shares a service group.

The root itself is opened following symlinks: the operator chose that path.
Threading: plain functions over fds the caller owns; safe from any thread. A fd yielded by
``walk`` is valid only until the generator resumes.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tierstore.errors import ConfigError, TierStoreError

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC
FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC
# A symlink met with O_NOFOLLOW gives ELOOP (Linux; some BSDs say EMLINK); a non-directory
# met with O_DIRECTORY gives ENOTDIR.
_LINK_ERRNOS = (errno.ELOOP, errno.EMLINK)
MAX_SMALL_FILE = 1 << 20  # default cap of ``read_small``: manifests and leases are a few KiB


@dataclass(frozen=True)
class Perms:
    """Creation modes (before the umask) for files and directories."""

    file_mode: int
    dir_mode: int


PRIVATE = Perms(0o600, 0o700)
# For a fleet whose processes share a service group: group read/write, setgid directories so
# new entries inherit the group.
GROUP_SHARED = Perms(0o660, 0o2770)


class UnsafeEntry(TierStoreError, OSError):
    """An entry is not what tierstore would create there; ``reason`` says what it is.

    reasons: "symlink", "not_dir", "not_regular", "hardlink", "too_large", "changed",
    "too_deep".
    """

    kind = "unsafe"

    def __init__(self, reason: str, name: str, detail: str = ""):
        self.reason = reason
        self.name = name
        super().__init__(f"{name!r}: {reason}" + (f" ({detail})" if detail else ""))


Identity = tuple[int, int]  # (st_dev, st_ino)


def identity(st: os.stat_result) -> Identity:
    return (st.st_dev, st.st_ino)


def open_root(path: str | os.PathLike[str]) -> int:
    """A directory fd of the root (following a symlink at the root itself: the operator's choice)."""
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)


def open_dir(name: str, dir_fd: int) -> int:
    """Open the subdirectory ``name`` of ``dir_fd`` without following a symlink."""
    if not name or "/" in name or name in (".", ".."):
        raise UnsafeEntry("not_dir", name, "not a single path component")
    try:
        return os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in _LINK_ERRNOS:
            raise UnsafeEntry("symlink", name, "a symlink where a directory belongs") from None
        if exc.errno == errno.ENOTDIR:  # Linux says ENOTDIR for a symlink under O_DIRECTORY too
            try:
                is_link = stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
            except OSError:
                is_link = False
            if is_link:
                raise UnsafeEntry("symlink", name, "a symlink where a directory belongs") from None
            raise UnsafeEntry("not_dir", name, "not a directory") from None
        raise


def open_dir_path(root_fd: int, parts: tuple[str, ...] | list[str], *, create: bool = False,
                  perms: Perms = PRIVATE) -> int:
    """Open ``root/parts...`` component by component (each O_NOFOLLOW); create missing ones
    with ``perms.dir_mode`` when asked. The caller closes the returned fd."""
    fd = os.dup(root_fd)
    try:
        for part in parts:
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, perms.dir_mode, dir_fd=fd)
            nfd = open_dir(part, fd)
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_regular(st: os.stat_result, name: str, *, single_link: bool = True) -> None:
    """Raise ``UnsafeEntry`` unless ``st`` is a regular file (with one link when asked)."""
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeEntry("symlink", name, "a symlink where a file belongs")
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeEntry("not_regular", name, f"file type {stat.S_IFMT(st.st_mode):#o}, not a regular file")
    if single_link and st.st_nlink > 1:  # 0: removed since an fd was opened, reachable by nobody
        raise UnsafeEntry("hardlink", name, f"{st.st_nlink} links; tierstore never hard-links a file")


def open_regular(name: str, dir_fd: int, *, single_link: bool = True,
                 expected: Identity | None = None) -> tuple[int, os.stat_result]:
    """Open ``name`` in ``dir_fd`` for reading: O_NOFOLLOW|O_NONBLOCK (a FIFO opens at once and
    is then refused), fstat, require a regular file (with one link). Returns (fd, stat)."""
    try:
        fd = os.open(name, FILE_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in _LINK_ERRNOS:
            raise UnsafeEntry("symlink", name, "a symlink where a file belongs") from None
        raise
    try:
        st = os.fstat(fd)
        check_regular(st, name, single_link=single_link)
        if expected is not None and identity(st) != expected:
            raise UnsafeEntry("changed", name, "replaced since it was listed")
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_fd_capped(fd: int, cap: int, name: str = "") -> bytes:
    """Read a whole file through ``fd``, refusing (``too_large``) more than ``cap`` bytes;
    memory never exceeds ``cap + 1`` whatever the file claims or grows to."""
    chunks: list[bytes] = []
    got = 0
    while True:
        chunk = os.read(fd, min(1 << 16, cap + 1 - got))
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        got += len(chunk)
        if got > cap:
            raise UnsafeEntry("too_large", name, f"more than {cap} bytes")



def read_secret_file(path: str | os.PathLike[str], *, what: str, setting: str, mode_mask: int, cap: int) -> bytes:
    """The bytes of a key file (``mac_key_file``, ``encryption_key_file``): a regular file with
    one link, owned by the running user, with none of ``mode_mask``'s bits, at most ``cap``
    bytes. Failure policy: ConfigError naming ``what``, the ``setting`` and what to do."""
    where = os.fsdecode(path)
    try:
        dir_fd = os.open(os.path.dirname(where) or ".", os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        raise ConfigError(f"cannot use the {what} {where!r} (setting {setting}): {exc.strerror}") from None
    try:
        fd, st = open_regular(os.path.basename(where), dir_fd)
    except (OSError, UnsafeEntry) as exc:
        raise ConfigError(f"cannot use the {what} {where!r} (setting {setting}): {exc}") from None
    finally:
        os.close(dir_fd)
    try:
        if st.st_uid != os.geteuid():
            raise ConfigError(f"the {what} {where!r} (setting {setting}) is owned by uid {st.st_uid}, not by "
                              f"you (uid {os.geteuid()}): chown it")
        if st.st_mode & mode_mask:
            raise ConfigError(f"the {what} {where!r} (setting {setting}) has mode {stat.S_IMODE(st.st_mode):04o}: "
                              "others could read or change the key; chmod 600 it")
        return read_fd_capped(fd, cap, where)
    finally:
        os.close(fd)

def read_small(name: str, dir_fd: int, cap: int = MAX_SMALL_FILE, *, single_link: bool = True) -> bytes:
    """Read a small file (manifest, lease, key) through a checked fd, at most ``cap`` bytes."""
    fd, st = open_regular(name, dir_fd, single_link=single_link)
    try:
        if st.st_size > cap:
            raise UnsafeEntry("too_large", name, f"{st.st_size} bytes, more than {cap}")
        return read_fd_capped(fd, cap, name)
    finally:
        os.close(fd)


def lstat_at(name: str, dir_fd: int) -> os.stat_result:
    return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)


def _require_same(name: str, dir_fd: int, expected: Identity | None) -> os.stat_result:
    st = lstat_at(name, dir_fd)
    if expected is not None and identity(st) != expected:
        raise UnsafeEntry("changed", name, "replaced since it was listed; nothing done")
    return st


def unlink_at(name: str, dir_fd: int, expected: Identity | None = None) -> None:
    """Unlink ``name`` in the checked directory ``dir_fd`` if it still is ``expected``."""
    st = _require_same(name, dir_fd, expected)
    if stat.S_ISDIR(st.st_mode):
        raise UnsafeEntry("not_regular", name, "a directory; not removed")
    os.unlink(name, dir_fd=dir_fd)


def create_file(name: str, dir_fd: int, perms: Perms = PRIVATE) -> int:
    """Create ``name`` exclusively (never through a planted symlink) for writing; the fd."""
    return os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC,
                   perms.file_mode, dir_fd=dir_fd)


def write_all(fd: int, data: bytes | memoryview) -> None:
    """Write every byte of ``data`` to ``fd`` (os.write may write less than asked)."""
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view):]


def write_file_atomic(name: str, dir_fd: int, data: bytes, tmp_name: str, perms: Perms = PRIVATE) -> None:
    """Write ``data`` to ``tmp_name`` and rename it over ``name``, both in ``dir_fd``."""
    fd = create_file(tmp_name, dir_fd, perms)
    try:
        try:
            write_all(fd, data)
        finally:
            os.close(fd)
        os.rename(tmp_name, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp_name, dir_fd=dir_fd)
        raise


@dataclass
class DirListing:
    """One directory met by ``walk``: its path parts under the root, its fd (valid until the
    walk resumes) and its entries as (name, lstat) pairs; entries that vanished are left out."""

    parts: tuple[str, ...]
    fd: int
    entries: list[tuple[str, os.stat_result]] = field(default_factory=list)


@dataclass
class _DirRef:
    fd: int
    pending: int = 0


def walk(root_fd: int, *, max_depth: int, descend: Callable[[tuple[str, ...]], bool] | None = None,
         on_error: Callable[[tuple[str, ...], BaseException], None] | None = None) -> Iterator[DirListing]:
    """Iterative, depth-first walk from ``root_fd`` that never follows a symlink.

    Subdirectories deeper than ``max_depth`` (the root's children are depth 1) and those for
    which ``descend(parts)`` is False are listed but not entered. A subdirectory that cannot be
    opened (swapped for a symlink, vanished, no permission) goes to ``on_error`` with its parts
    and the walk goes on. Open fds: at most one per level plus one per pending parent.
    """
    stack: list[tuple[tuple[str, ...], _DirRef | None, str]] = [((), None, "")]
    try:
        while stack:
            parts, parent, name = stack.pop()
            fd = _open_child(root_fd, parts, parent, name, on_error)
            if fd < 0:
                continue
            ref = _DirRef(fd, pending=1)  # the walk's own hold until the children are queued
            stack_len = len(stack)
            try:
                listing = DirListing(parts, fd, list_dir(fd))
                yield listing
                for child, st in listing.entries:
                    cparts = (*parts, child)
                    if not stat.S_ISDIR(st.st_mode) or len(cparts) > max_depth:
                        continue
                    if descend is not None and not descend(cparts):
                        continue
                    ref.pending += 1
                    stack.append((cparts, ref, child))
            except BaseException:
                ref.pending -= len(stack) - stack_len
                del stack[stack_len:]
                raise
            finally:
                _release(ref)
    finally:
        for _parts, parent, _name in stack:  # abandoned early: close what the queue holds
            if parent is not None:
                _release(parent)


def _open_child(root_fd: int, parts: tuple[str, ...], parent: _DirRef | None, name: str,
                on_error: Callable[[tuple[str, ...], BaseException], None] | None) -> int:
    try:
        return os.dup(root_fd) if parent is None else open_dir(name, parent.fd)
    except OSError as exc:
        if on_error is not None:
            on_error(parts, exc)
        return -1
    finally:
        if parent is not None:
            _release(parent)


def _release(ref: _DirRef) -> None:
    ref.pending -= 1
    if ref.pending == 0:
        os.close(ref.fd)


def list_dir(fd: int) -> list[tuple[str, os.stat_result]]:
    """The entries of the directory ``fd`` with their ``lstat`` (an entry gone since readdir is left out)."""
    out = []
    with os.scandir(fd) as it:
        for entry in it:
            try:
                out.append((entry.name, entry.stat(follow_symlinks=False)))
            except OSError:
                continue  # vanished since readdir
    return out


def unlink_under(root: str | os.PathLike[str], relpaths: Iterable[str]) -> None:
    """Remove the files at ``relpaths`` under ``root`` through directory fds opened without
    following a link (a directory swapped for a symlink is never followed); a file that is gone,
    or any other error, skips that file (best effort: eviction, whose accounting is already
    done)."""
    try:
        root_fd = open_root(root)
    except OSError:
        return
    try:
        for rel in relpaths:
            *parts, name = Path(rel).parts
            with contextlib.suppress(OSError):
                dir_fd = open_dir_path(root_fd, parts)
                try:
                    unlink_at(name, dir_fd)
                finally:
                    os.close(dir_fd)
    finally:
        os.close(root_fd)
