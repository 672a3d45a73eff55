"""Which file system holds a path, and with which mount options (``/proc/self/mountinfo``).

Contract: ``parse_mountinfo(text)`` turns the kernel's mountinfo text into ``Mount`` records
(mount point and source unescaped, per-mount and super-block options merged into one dict);
``mount_of(path)`` returns the mount that holds ``path`` (the longest mount point that is a
prefix of its resolved path; of equal ones the last listed, which is the one on top), or None
when mountinfo cannot be read (not Linux). ``is_network(mount)`` says whether its type is a
network or FUSE file system on which POSIX locks, sqlite and local-disk assumptions break.
Tests feed a fake mountinfo through the ``mountinfo`` argument or ``MOUNTINFO_PATH``.

Failure policy: an unreadable mountinfo gives None (the caller decides; nothing raises); a
malformed line is skipped. ``mount_of`` resolves the path with ``os.path.realpath``, which
``lstat``s each component: call it on a path that exists on a mount that answers.
Threading: pure functions; safe from any thread.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

MOUNTINFO_PATH = "/proc/self/mountinfo"

# Types whose files live on another machine (or behind a user-space daemon): sqlite's locking,
# O_DIRECT and close-to-open semantics differ from a local disk's there.
NETWORK_FS_TYPES = frozenset({
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "9p", "ceph", "glusterfs", "lustre", "gpfs", "beegfs",
    "afs", "ncpfs", "davfs", "orangefs", "pvfs2", "ocfs2", "gfs2",
})
# FUSE file systems (``fuse.<name>``) that reach over the network; others (fuse-overlayfs of a
# rootless container, ntfs-3g) are local.
NETWORK_FUSE_NAMES = frozenset({"sshfs", "s3fs", "gcsfuse", "rclone", "juicefs", "glusterfs", "cephfs",
                                "goofys", "mountpoint-s3", "blobfuse", "blobfuse2", "davfs"})
_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")


@dataclass(frozen=True)
class Mount:
    """One line of mountinfo: where, what type, from where, with which options."""

    mount_point: str
    fstype: str  # "nfs", "nfs4", "ext4", "fuse.sshfs", ...
    source: str  # "server:/export", "/dev/vda", ...
    options: dict[str, str | None] = field(default_factory=dict)  # "ro"/"rw", "vers": "4.2", "soft": None, ...

    def option(self, name: str) -> str | None:
        """The value of option ``name`` ("" for a flag such as ``soft``), None if absent."""
        if name not in self.options:
            return None
        value = self.options[name]
        return "" if value is None else value


def _unescape(text: str) -> str:
    return _OCTAL_ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), text)


def _options(text: str, into: dict[str, str | None]) -> None:
    for item in text.split(","):
        if item:
            name, sep, value = item.partition("=")
            into[name] = value if sep else None


def parse_mountinfo(text: str) -> list[Mount]:
    """The mounts of a mountinfo text, in its order; malformed lines are skipped.

    Line format (proc(5)): ``id parent major:minor root mount_point mount_options [optional
    fields...] - fstype source super_options``."""
    mounts = []
    for line in text.splitlines():
        fields = line.split(" ")
        try:
            sep = fields.index("-", 6)
        except ValueError:
            continue
        if len(fields) < sep + 3:
            continue
        options: dict[str, str | None] = {}
        _options(fields[sep + 3] if len(fields) > sep + 3 else "", options)  # super-block options
        _options(fields[5], options)  # per-mount options (ro/rw, noatime) win
        mounts.append(Mount(mount_point=_unescape(fields[4]), fstype=fields[sep + 1],
                            source=_unescape(fields[sep + 2]), options=options))
    return mounts


def read_mountinfo() -> str | None:
    """The text of ``MOUNTINFO_PATH``, or None where it cannot be read."""
    try:
        with open(MOUNTINFO_PATH, encoding="utf-8", errors="surrogateescape") as f:
            return f.read()
    except OSError:
        return None


def mount_of(path: str | os.PathLike[str], mountinfo: str | None = None) -> Mount | None:
    """The mount holding ``path`` (resolved), from ``mountinfo`` text or the running system's."""
    text = read_mountinfo() if mountinfo is None else mountinfo
    if text is None:
        return None
    target = os.path.realpath(path)
    best: Mount | None = None
    for m in parse_mountinfo(text):
        point = m.mount_point.rstrip("/") or "/"
        inside = target == point or point == "/" or target.startswith(point + "/")
        if inside and (best is None or len(point) >= len(best.mount_point.rstrip("/") or "/")):
            best = m
    return best


def is_network(mount: Mount) -> bool:
    """Whether ``mount`` is a network file system (NFS, SMB, Ceph, ...) or a networked FUSE one (sshfs)."""
    base, _, sub = mount.fstype.partition(".")
    return base in NETWORK_FS_TYPES or (base == "fuse" and sub in NETWORK_FUSE_NAMES)
