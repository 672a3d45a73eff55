"""Refuse a cache root that someone else can rearrange, unless the operator says it is intended.

Contract: ``check_root_trust(root, trust_shared_root=False)`` raises ``UntrustedRoot`` (a
``ConfigError``) when the root directory is group- or world-writable and not owned by the
running user, or world-writable without the sticky bit (whoever owns it): another user can then
rename our namespaces away and plant their own, and checksums do not detect a planted page
(only the MAC option does, mac.py). A fleet that shares a service group sets
``trust_shared_root: true`` (and creates with group modes, safefs.GROUP_SHARED).
The root itself is stat'ed following symlinks (the operator chose the path).

Threading: a pure function; safe from any thread.
"""

from __future__ import annotations

import os
import stat

from tierstore.errors import ConfigError

TRUST_SETTING = "trust_shared_root"


class UntrustedRoot(ConfigError):
    """The root is writable by other users; the message says why and names the setting."""

    kind = "untrusted_root"


def root_problem(st: os.stat_result, uid: int) -> str | None:
    """Why a root with this stat is unsafe for user ``uid``, or None."""
    mode = st.st_mode
    if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
        return "it is world-writable without the sticky bit: any user can rename entries in it"
    if st.st_uid != uid and mode & (stat.S_IWGRP | stat.S_IWOTH):
        who = "any user" if mode & stat.S_IWOTH else f"every member of group {st.st_gid}"
        return (f"it is owned by uid {st.st_uid}, not you (uid {uid}), and {who} can write to it: "
                "they can replace a namespace directory with pages of their own")
    return None


def check_root_trust(root: str | os.PathLike[str], *, trust_shared_root: bool = False) -> None:
    """Raise ``UntrustedRoot`` for a root others can rearrange, unless ``trust_shared_root``."""
    if trust_shared_root:
        return
    st = os.stat(root)
    problem = root_problem(st, os.geteuid())
    if problem is not None:
        raise UntrustedRoot(
            f"tierstore refuses the cache root {os.fsdecode(root)!r} (mode {stat.S_IMODE(st.st_mode):04o}): "
            f"{problem}. Give each user a root of their own (mode 0700), or, if a fleet shares this "
            f'root on purpose, set "{TRUST_SETTING}": true (and consider a fleet key, "mac_key_file", '
            "so that planted pages are never served)."
        )
