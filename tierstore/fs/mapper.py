"""FileMapper: the on-disk identity contract of one KV-cache group (and rank).

    ROOT/<namespace digest>/g<group>/r<rank>/<aa>/<key hex>.kvp
    ROOT/<namespace digest>/g<group>/h<start>-<count>/<aa>/<key hex>.kvp   (a head slice)

The rank directory is ``r<rank>`` (one file per rank), or ``h<start>-<count>`` for the KV heads
``[start, start+count)`` of an attention page stored as a head slice, readable at any tensor-
parallel size (docs/DESIGN.md §9; its header's rank is ``start // count``). Group, rank and head
numbers are plain decimal (``g3``, never ``g03``): ``locate`` and fsck accept nothing else. ``aa`` is the first byte of xxh3-64(key) in hex: 256 fan-out directories per
group and rank, all created when an engine starts (``make_fanout_dirs``), so a store never
creates a directory. Pages are MiB-sized, so a group and rank rarely holds more than 10^6 of
them (about 4,000 per directory; ext4's htree and NFS readdir stay fast, and flat directories
only hit ext4's limits near 7.5M entries). The earlier two-level ``aa/bb`` fan-out (65,536
leaves) made almost every store of a young tier create a directory: on the H200 host that took
store throughput from 0.98 to 0.75 of raw writes (medians, docs/DESIGN.md §6 and docs/measurements/fanout.md), plus
4 KiB of disk and one more readdir per leaf for fsck over NFS.

A page is written to a temp file in its final directory and renamed into place (rename is
atomic on local file systems and NFS). Temp names are

    .<key hex>.kvp.<host>.<pid>.<random>.tmp

so fsck can tell a temp from a page, and on the writer's own host whether the writer still
lives. ``<host>`` (``host_tag``) is the writer's identity, not just its host name: the host
name (its first 27 characters) and 12 hex digits of a hash of the whole host name, the
kernel's boot id and the inode of the writer's PID namespace (``/proc/self/ns/pid``). Two
writers with the same tag therefore share a PID namespace, so a pid in the name can be
checked with a local pid (``stale_temps.writer_gone``); pods on one node with one host name
(hostNetwork) or long names cut to one prefix, each in its own PID namespace, get different
tags and judge each other's temps by age only, as another host's. A reboot changes the tag
too: the previous boot's temps are judged by age. Everything else in a namespace directory
(besides ``manifest.json``) is foreign.

``FileMapper`` is the one owner of these names: ``path_for``/``temp_path_for`` (pathlib, with
the key checked) and ``final_path``/``temp_path`` (plain strings for the I/O threads' hot
path, the key already checked by the caller) build them from the same two functions.

Threading: immutable after construction; safe from any thread.
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path

import xxhash

from tierstore.errors import ConfigError
from tierstore.fs import safefs

PAGE_SUFFIX = ".kvp"
TEMP_SUFFIX = ".tmp"
MAX_KEY_BYTES = 96  # 192 hex characters keep every file name under 255 bytes
HOST_NAME_CHARS = 27  # the host name's share of a 40-character tag ("-" and 12 hex digits follow)


def _proc_text(path: str) -> str:
    """A small /proc file's text, or "" where it cannot be read (no /proc: the tag then rests on
    what can be read; never an error)."""
    try:
        with open(path, "rb") as f:
            return f.read(256).decode("ascii", "replace").strip()
    except OSError:
        return ""


def _pid_namespace() -> str:
    """The inode of this process's PID namespace (``/proc/self/ns/pid``), or "" unknown."""
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return ""


def writer_tag(host: str, boot_id: str, pid_namespace: str) -> str:
    """The ``<host>`` of temp names written from ``host`` in one boot (``boot_id``) and one PID
    namespace (its inode): the host name's first ``HOST_NAME_CHARS`` characters (``-`` for
    anything but letters, digits and ``-``), then ``-`` and 12 hex digits of a hash of all
    three. At most 40 characters, as before. Pure."""
    name = re.sub(r"[^A-Za-z0-9-]", "-", host)[:HOST_NAME_CHARS] or "host"
    digest = hashlib.blake2b("\0".join((host, boot_id, pid_namespace)).encode(), digest_size=6,
                             person=b"tierstore-host").hexdigest()
    return f"{name}-{digest}"


_HOST = writer_tag(socket.gethostname(), _proc_text("/proc/sys/kernel/random/boot_id"), _pid_namespace())
# The names tierstore writes, one pattern each (every reader of a tree uses these): a page is
# its key's hex (whole bytes, 1-96 of them), a temp adds the writer (host, pid, random), a
# namespace directory is its 16-byte digest, a slice directory h<start>-<count>.
PAGE_NAME_RE = re.compile(r"^((?:[0-9a-f]{2}){1,96})\.kvp$")
_TEMP_RE = re.compile(r"^\.((?:[0-9a-f]{2}){1,96})\.kvp\.([A-Za-z0-9-]+)\.(\d+)\.([0-9a-f]+)\.tmp$")
_FAN_RE = re.compile(r"^[0-9a-f]{2}$")
SLICE_DIR_RE = re.compile(r"^h(0|[1-9][0-9]*)-([1-9][0-9]*)$")
NAMESPACE_DIR_RE = re.compile(r"^[0-9a-f]{32}$")


def check_key(key: bytes) -> None:
    """ValueError unless ``key`` is 1..MAX_KEY_BYTES bytes (longer names would not fit)."""
    if not 0 < len(key) <= MAX_KEY_BYTES:
        raise ValueError(f"a page key must be 1..{MAX_KEY_BYTES} bytes, got {len(key)}")


def _temp_name(key: bytes) -> str:
    """``.<key hex>.kvp.<host>.<pid>.<random>.tmp`` (``parse_temp_name`` reads it back)."""
    return f".{key.hex()}{PAGE_SUFFIX}.{_HOST}.{os.getpid()}.{os.urandom(6).hex()}{TEMP_SUFFIX}"


def host_tag() -> str:
    """This writer's identity as it appears in temp file names (``writer_tag``: the host name,
    boot and PID namespace; module docstring)."""
    return _HOST


FANOUT_DIRS = tuple(f"{i:02x}" for i in range(256))


def group_dir_name(group_index: int) -> str:
    """The directory of a KV-cache group's files under its namespace: ``g<index>``."""
    return f"g{group_index}"


def group_dir(root: str | os.PathLike[str], namespace: str, group_index: int) -> Path:
    """``ROOT/<namespace>/g<index>``: the parent of every rank and slice directory of a group."""
    return Path(root) / namespace / group_dir_name(group_index)


def fanout(key: bytes) -> str:
    """The fan-out directory of ``key``: the first byte of xxh3-64(key), in hex."""
    return xxhash.xxh3_64_hexdigest(key)[0:2]


@dataclass(frozen=True)
class TempName:
    key_hex: str
    host: str
    pid: int


def parse_index_dir(name: str, prefix: str) -> int | None:
    """``g3`` -> 3 for prefix "g" (``r0`` -> 0 for "r"); None for anything else, including
    ``g03``, which no mapper writes."""
    digits = name[len(prefix) :]
    if not name.startswith(prefix) or not digits.isascii() or not digits.isdigit():
        return None
    return int(digits) if digits == str(int(digits)) else None


def parse_slice_dir(name: str) -> tuple[int, int] | None:
    """``h0-2`` -> (0, 2): the (start, count) of a head-slice directory; None for anything
    else (``h00-2``, ``h1-0``, ``r0``)."""
    m = SLICE_DIR_RE.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def parse_rank_dir(name: str) -> int | None:
    """The header rank of the files of a rank directory: ``r3`` -> 3, ``h2-2`` -> 1 (start //
    count); None if ``name`` is neither form."""
    rank = parse_index_dir(name, "r")
    if rank is not None:
        return rank
    heads = parse_slice_dir(name)
    return heads[0] // heads[1] if heads is not None else None


def is_fanout_name(name: str) -> bool:
    """Whether ``name`` is a fan-out directory name (two lower-case hex digits)."""
    return _FAN_RE.match(name) is not None


def parse_temp_name(name: str) -> TempName | None:
    m = _TEMP_RE.match(name)
    return TempName(m.group(1), m.group(2), int(m.group(3))) if m else None


def parse_page_name(name: str) -> bytes | None:
    """The key a page file name stands for, or None if it is not a page name."""
    m = PAGE_NAME_RE.match(name)
    if not m or len(m.group(1)) % 2:
        return None
    return bytes.fromhex(m.group(1))


@dataclass(frozen=True)
class PageLocation:
    """Where a page file sits, parsed back from its path (see ``locate``)."""

    namespace: str
    group_index: int
    rank: int
    key: bytes
    rank_dir: str = ""  # ``r<rank>`` or ``h<start>-<count>``

    @property
    def directory(self) -> str:
        """``<ns>/g<group>/<rank dir>`` relative to the root."""
        return f"{self.namespace}/g{self.group_index}/{self.rank_dir or f'r{self.rank}'}"


def locate(root: str | os.PathLike[str], path: str | os.PathLike[str]) -> PageLocation | None:
    """Parse ``path`` under ``root``; None if it is not where a page of that key belongs."""
    try:
        rel = Path(path).relative_to(root).parts
    except ValueError:
        return None
    if len(rel) != 5:
        return None
    ns, g, r, aa, name = rel
    group, rank, key = parse_index_dir(g, "g"), parse_rank_dir(r), parse_page_name(name)
    if group is None or rank is None or key is None or fanout(key) != aa:
        return None
    return PageLocation(ns, group, rank, key, r)


class FileMapper:
    """Key -> path for one (namespace, group, rank directory) under one root.

    ``rank_dir``: the directory of the files, ``r<rank>`` by default, or a head slice's
    ``h<start>-<count>`` (then ``rank`` is the header rank, ``start // count``)."""

    def __init__(self, root: str | os.PathLike[str], namespace: str, group_index: int, rank: int = 0,
                 rank_dir: str | None = None):
        self.root = Path(root)
        self.namespace = namespace
        self.group_index = group_index
        self.rank = rank
        self.rank_dir = rank_dir if rank_dir is not None else f"r{rank}"
        if parse_rank_dir(self.rank_dir) != rank:
            raise ValueError(f"rank directory {self.rank_dir!r} does not hold rank {rank}'s files")
        # The directories below the root, as fd-relative walks open them (RankDir).
        self.dir_parts: tuple[str, str, str] = (namespace, group_dir_name(group_index), self.rank_dir)
        self.base = self.root.joinpath(*self.dir_parts)

        self._base = str(self.base)

    def path_for(self, key: bytes) -> Path:
        """The final path of ``key``'s page; ValueError for a key outside 1..MAX_KEY_BYTES."""
        check_key(key)
        return Path(self.final_path(key))

    def temp_path_for(self, key: bytes) -> Path:
        """A unique temp name beside the final path (same directory: rename stays atomic)."""
        check_key(key)
        return Path(self.temp_path(key))

    def final_path(self, key: bytes) -> str:
        """``path_for(key)`` as a string, without pathlib or the key check (hot path)."""
        return f"{self._base}/{fanout(key)}/{key.hex()}{PAGE_SUFFIX}"

    def temp_path(self, key: bytes, final: str | None = None) -> str:
        """A unique temp name beside ``final`` (``final_path(key)`` if not given), as a string."""
        directory = os.path.dirname(final) if final is not None else f"{self._base}/{fanout(key)}"
        return f"{directory}/{_temp_name(key)}"

    def make_fanout_dirs(self, perms: safefs.Perms = safefs.PRIVATE) -> int:
        """Create this group and rank's directory and those of its 256 fan-out directories that
        are missing (one readdir when they all exist), with ``perms.dir_mode``; the number
        created. Every component under the root is opened without following a symlink: a
        namespace, group, rank or fan-out directory that is a symlink (or not a directory)
        raises ``ConfigError`` naming it (an engine never reads or writes through it). Safe to
        race with other engines and nodes. Raises OSError (e.g. a read-only root)."""
        os.makedirs(self.root, exist_ok=True)  # the root itself: the operator's path
        parts = (self.namespace, f"g{self.group_index}", self.rank_dir)
        root_fd = safefs.open_root(self.root)
        try:
            base_fd = safefs.open_dir_path(root_fd, parts, create=True, perms=perms)
        except safefs.UnsafeEntry as exc:
            raise ConfigError(f"refusing the cache tree under {os.fsdecode(self.root)!r}: {exc}. tierstore "
                              "never follows a symlink under its root (another user could point it anywhere); "
                              "remove the entry (tierstore fsck reports it)") from None
        finally:
            os.close(root_fd)
        made = 0
        try:
            with os.scandir(base_fd) as it:
                have = {e.name: e.is_dir(follow_symlinks=False) for e in it}
            bad = sorted(n for n in FANOUT_DIRS if n in have and not have[n])
            if bad:
                raise ConfigError(f"refusing the cache tree {self.base}: fan-out entries {bad[:4]} are not "
                                  "directories (a symlink?); tierstore never follows a symlink under its root; "
                                  "remove them (tierstore fsck reports them)")
            for name in FANOUT_DIRS:
                if name not in have:
                    try:
                        os.mkdir(name, perms.dir_mode, dir_fd=base_fd)
                        made += 1
                    except FileExistsError:
                        continue
                    if perms.dir_mode & 0o7070:  # setgid and group bits: not left to the umask
                        os.chmod(name, perms.dir_mode, dir_fd=base_fd, follow_symlinks=False)
        finally:
            os.close(base_fd)
        return made

    def __repr__(self) -> str:
        return f"FileMapper({self.base})"


# ----------------------------------------------------------------- the root's format marker
# ``ROOT/.tierstore-format``: a small JSON object a writer leaves at the root on its first store,
# {"format": 1, "layouts": [...], "writer": "tierstore"}, naming the directory kinds it writes.
# A tool that repairs or evicts (fsck --repair, gc) reads it and refuses a root whose marker
# names a format or a layout it does not know: a newer tierstore's tree is not its to change.
# A root without a marker is an older writer's and is treated as before.
# Root entries named so are tierstore's own state (lease, trash, format marker, probes, the
# local index): skipped by every walk, never taken for foreign content.
RESERVED_PREFIX = ".tierstore"
# what an NFS or FUSE client leaves in place of a file unlinked or renamed over while open (a
# silly rename): the client's, never foreign content, and removed by the client when closed
SILLY_RENAME_PREFIXES = (".nfs", ".fuse_hidden")
FORMAT_MARKER_NAME = ".tierstore-format"
# the marker being written: a writer killed before its rename leaves this at the root
FORMAT_MARKER_TEMP_RE = re.compile(r"^\.tierstore-format\.([A-Za-z0-9-]+)\.(\d+)\.([0-9a-f]+)\.tmp$")
FORMAT_MARKER_VERSION = 1
# a file tierstore creates and unlinks at once: a health probe (``fs.deadline.probe_root``, at the
# root and in a group directory), the lease's server-clock probe and the lease being published
# (``fs.lease``). A soft mount's timed-out unlink or a killed process leaves one; gc removes
# those older than its temp age (``tiers.gc``).
PROBE_LEFTOVER_RE = re.compile(r"^\.tierstore-(probe-[0-9a-f]{32}|gc\.lease\.(clock\.)?[0-9a-f]{12}\.tmp)$")
LAYOUT_RANK_DIRS = "rank_dirs"  # ROOT/<ns>/g<g>/r<rank>/<aa>/<key>.kvp
LAYOUT_HEAD_SLICE_DIRS = "head_slice_dirs"  # ROOT/<ns>/g<g>/h<start>-<count>/<aa>/<key>.kvp
KNOWN_LAYOUTS = (LAYOUT_RANK_DIRS, LAYOUT_HEAD_SLICE_DIRS)
_MARKER_MAX_BYTES = 4096


def _parse_marker(data: bytes) -> tuple[int, list[str]] | None:
    """(format, layouts) of a marker's bytes, or None when it is not a marker this code can read."""
    import json

    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):
        return None
    if not isinstance(doc, dict):
        return None
    version, layouts = doc.get("format"), doc.get("layouts")
    if (not isinstance(version, int) or isinstance(version, bool) or not isinstance(layouts, list)
            or not all(isinstance(x, str) for x in layouts)):
        return None
    return version, layouts


def read_format_marker(root: str | os.PathLike[str]) -> tuple[int, list[str]] | None:
    """The root's marker as (format, layouts); None when there is none. Raises ``ValueError``
    naming the file when one exists but cannot be read as a marker (too large, not a regular
    file, not the JSON object above), OSError for other failures."""
    where = os.path.join(os.fsdecode(root), FORMAT_MARKER_NAME)
    root_fd = safefs.open_root(root)
    try:
        data = safefs.read_small(FORMAT_MARKER_NAME, root_fd, _MARKER_MAX_BYTES)
    except FileNotFoundError:
        return None
    except safefs.UnsafeEntry as exc:
        raise ValueError(f"{where} is not tierstore's format marker ({exc})") from None
    finally:
        os.close(root_fd)
    got = _parse_marker(data)
    if got is None:
        raise ValueError(f"{where} is not a format marker this tierstore can read")
    return got


def unknown_format(root: str | os.PathLike[str]) -> str | None:
    """Why a tool of this version must not repair or evict under ``root`` (its marker names a
    newer format or a layout this version does not know, or is not a marker it can read), or
    None (no marker, or one this version knows). The message says what to do. Raises OSError
    when the file system does not answer (EIO on a soft NFS mount, ESTALE): that is no verdict
    on the root, and the caller's pass fails instead (``gc --loop`` tries again)."""
    try:
        got = read_format_marker(root)
    except ValueError as exc:
        return f"{exc}; run a newer tierstore here (this root's writer may be newer), or remove the file"
    if got is None:
        return None
    version, layouts = got
    unknown = sorted(set(layouts) - set(KNOWN_LAYOUTS))
    if version <= FORMAT_MARKER_VERSION and not unknown:
        return None
    what = f"layouts {unknown}" if unknown else f"format {version}"
    return (f"a newer tierstore wrote this root ({FORMAT_MARKER_NAME} names {what}, which this version does not "
            "know); use that version's fsck --repair and gc here")


def write_format_marker(root: str | os.PathLike[str], layouts: tuple[str, ...] = KNOWN_LAYOUTS,
                        perms: safefs.Perms = safefs.PRIVATE) -> bool:
    """Leave the marker at ``root`` (temp + rename, through the root's fd) unless one there
    already names every layout of ``layouts``; a marker naming more (a newer writer) keeps its
    layouts and format. True if written. Raises OSError (the caller's policy decides; a store
    never fails for it)."""
    try:
        got = read_format_marker(root)
    except ValueError:
        got = None  # unreadable: replaced by ours
    if got is not None and set(layouts) <= set(got[1]):
        return False
    import json

    version = max(FORMAT_MARKER_VERSION, got[0] if got is not None else 0)
    names = sorted(set(layouts) | set(got[1] if got is not None else ()))
    data = json.dumps({"format": version, "layouts": names, "writer": "tierstore"}).encode()
    tmp = f"{FORMAT_MARKER_NAME}.{_HOST}.{os.getpid()}.{os.urandom(6).hex()}{TEMP_SUFFIX}"  # FORMAT_MARKER_TEMP_RE
    root_fd = safefs.open_root(root)
    try:
        safefs.write_file_atomic(FORMAT_MARKER_NAME, root_fd, data, tmp, perms)
        if perms.file_mode & 0o070:  # a fleet sharing a group reads it too (not left to the umask)
            os.chmod(FORMAT_MARKER_NAME, perms.file_mode, dir_fd=root_fd, follow_symlinks=False)
    finally:
        os.close(root_fd)
    return True
