"""The one rule for leftover temp files, and a sweep that applies it.

tierstore writes four kinds of temp files, all named after their writer:

- pages:     ``.<key hex>.kvp.<host>.<pid>.<random>.tmp`` (``mapper.parse_temp_name``)
- manifests: ``.manifest.json.<host>.<pid>.<random>.tmp`` (``identity.write_manifest``)
- O_DIRECT probes: ``.odirect-probe.<pid>.<thread>.tmp`` (``engine.probe_odirect``; no host)
- the root's format marker: ``.tierstore-format.<host>.<pid>.<random>.tmp``
  (``mapper.write_format_marker``; gc sweeps it at the root, the only temp that lives there)

The rule (``writer_gone``): a temp may be removed only if its writer is provably gone --

1. written by a writer with our tag (``mapper.host_tag``: our host name, boot and PID
   namespace, so its pid is one of ours) and its pid is not a live process: the pid does not
   exist, is a zombie, or is a *different* process that started after the temp was last
   written (pid reuse);
2. written under another tag (another host, or a container with our host name in another PID
   namespace, or an earlier boot), or with no host in its name: its mtime is older than
   ``grace_s``, the longest a write may take (a live writer publishes a page in one write and
   a rename; hours without a change mean the writer died). An mtime in the future (clock skew
   between NFS clients) never counts as old.

A temp of a live process on this host is never removed, however old. Anything that is not a
tierstore temp name is left alone. A temp that vanishes under the sweep (its writer renamed it,
another node swept it) is not an error.

Threading: no shared state; safe from any thread and from several processes at once (two
sweeps racing remove each file once, the other sees ENOENT).
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from tierstore.errors import GONE_ERRNOS
from tierstore.fs.mapper import FORMAT_MARKER_TEMP_RE, host_tag, parse_temp_name

logger = logging.getLogger("tierstore.stale_temps")

DEFAULT_GRACE_S = 3600.0  # gc's and fsck's default age for temps of other hosts
MANIFEST_TEMP_RE = re.compile(r"^\.manifest\.json\.(.+)\.(\d+)\.([0-9a-f]+)\.tmp$")  # any host tag, older ones with dots too
_PROBE_TEMP_RE = re.compile(r"^\.odirect-probe\.(\d+)\.(\d+)\.tmp$")


@dataclass(frozen=True)
class TempWriter:
    """Who wrote a temp file, from its name; ``host`` None when the name does not say."""

    host: str | None
    pid: int


def temp_writer(name: str) -> TempWriter | None:
    """The writer named in a tierstore temp file name, or None if ``name`` is no such temp.
    A name whose pid is not a possible process id (``pid_possible``) is no tierstore temp:
    every caller (gc, the start-up sweep, the local scan) leaves it alone, as fsck and ``ls``
    report it as foreign."""
    page = parse_temp_name(name)
    if page is not None:
        writer = TempWriter(page.host, page.pid)
    elif (m := MANIFEST_TEMP_RE.match(name)) or (m := FORMAT_MARKER_TEMP_RE.match(name)):
        writer = TempWriter(m.group(1), int(m.group(2)))
    elif m := _PROBE_TEMP_RE.match(name):
        writer = TempWriter(None, int(m.group(1)))
    else:
        return None
    return writer if pid_possible(writer.pid) else None


def _boot_time() -> float | None:
    try:
        with open("/proc/stat", "rb") as f:
            for line in f:
                if line.startswith(b"btime "):
                    return float(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


# Linux's PID_MAX_LIMIT: a pid above it (in a temp name, a lease) was not written by tierstore.
PID_LIMIT = 1 << 22


def pid_possible(pid: int) -> bool:
    """The one pid rule: whether ``pid`` (from a temp name or a lease) could be a process id;
    one that cannot (0, negative, a 20-digit number that would overflow ``os.kill``) was not
    written by tierstore."""
    return 0 < pid <= PID_LIMIT


def process_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this host and can still write (a zombie cannot;
    EPERM: it exists, someone else's; unknown counts as alive). The one liveness rule of
    temps, leases and the local index."""
    return _process_state(pid)[0]


def _process_state(pid: int) -> tuple[bool, float | None]:
    """(alive, start time as a Unix time or None if unknown) of ``pid`` on this host."""
    if pid <= 0:
        return True, None  # os.kill(0, ...) would signal our own process group: treat as alive
    if pid > PID_LIMIT:
        return False, None  # no such process can exist (and os.kill would overflow)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False, None
    except OSError:
        pass  # EPERM: it exists, owned by someone else
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return True, None  # no /proc: existence is all we know
    if fields[0] == b"Z":  # killed, not yet reaped: it writes nothing any more
        return False, None
    boot = _boot_time()
    try:
        started = boot + int(fields[19]) / os.sysconf("SC_CLK_TCK") if boot is not None else None
    except (IndexError, ValueError, OSError):
        started = None
    return True, started


def writer_gone(writer: TempWriter, mtime: float, *, grace_s: float = DEFAULT_GRACE_S,
                now: float | None = None, this_host: str | None = None,
                stuck_after_s: float | None = None) -> tuple[bool, str]:
    """Whether the writer of a temp last written at ``mtime`` is provably gone; (gone, why).

    ``stuck_after_s`` (fsck's ``--tmp-age`` only, an operator's explicit choice): a temp of a
    live writer on this host untouched for longer counts as abandoned too. The engine, gc and
    the local index never pass it: they never touch a temp a live process may be writing."""
    now = time.time() if now is None else now
    if writer.host is not None and writer.host == (this_host or host_tag()):
        alive, started = _process_state(writer.pid)
        if not alive:
            return True, f"writer pid {writer.pid} on this host is gone"
        # /proc start times have clock-tick resolution and btime whole seconds: 2 s of slack.
        if started is not None and started > mtime + 2.0:
            return True, f"pid {writer.pid} now belongs to a process started after the temp was written"
        if stuck_after_s is not None and now - mtime > stuck_after_s:
            return True, (f"writer pid {writer.pid} is alive but the temp is {now - mtime:.0f} s old "
                          f"(older than --tmp-age {stuck_after_s:.0f} s)")
        return False, f"writer pid {writer.pid} on this host is alive"
    age = now - mtime
    where = "another host" if writer.host is not None else "an unknown host"
    if age > grace_s:
        return True, f"written on {where} {age:.0f} s ago (grace {grace_s:.0f} s)"
    return False, f"written on {where} {max(age, 0.0):.0f} s ago, within the grace of {grace_s:.0f} s"


@dataclass
class SweepReport:
    scanned: int = 0  # temp files looked at
    removed: int = 0
    removed_bytes: int = 0
    kept: int = 0  # temps whose writer may still be alive
    errors: list[str] = field(default_factory=list)


def _walk(directory: str, recursive: bool) -> Iterable[tuple[str, list[str]]]:
    if recursive:
        for dirpath, dirnames, filenames in os.walk(directory):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]  # local index, trash
            yield dirpath, filenames
        return
    try:
        yield directory, [e.name for e in os.scandir(directory) if e.is_file(follow_symlinks=False)]
    except FileNotFoundError:
        return


def sweep_stale_temps(*directories: str | os.PathLike[str], grace_s: float = DEFAULT_GRACE_S,
                      recursive: bool = True, dry_run: bool = False) -> SweepReport:
    """Remove the temp files under ``directories`` whose writer is provably gone (``writer_gone``).

    ``recursive=False`` looks only at the directories' own entries. ``dry_run`` counts what
    would be removed without removing it. Hidden sub-directories (``.tierstore-*``) are skipped.
    """
    rep = SweepReport()
    now = time.time()
    here = host_tag()
    for directory in directories:
        for dirpath, names in _walk(os.fspath(directory), recursive):
            for name in names:
                writer = temp_writer(name)
                if writer is None:
                    continue
                full = os.path.join(dirpath, name)
                try:
                    st = os.stat(full, follow_symlinks=False)
                except OSError as exc:
                    if exc.errno not in GONE_ERRNOS:
                        rep.errors.append(f"{full}: {exc.strerror}")
                    continue
                rep.scanned += 1
                gone, why = writer_gone(writer, st.st_mtime, grace_s=grace_s, now=now, this_host=here)
                if not gone:
                    rep.kept += 1
                    continue
                if not dry_run:
                    try:
                        os.unlink(full)
                    except OSError as exc:
                        if exc.errno not in GONE_ERRNOS:
                            rep.errors.append(f"{full}: {exc.strerror}")
                        continue
                logger.debug("tierstore: stale temp %s removed: %s", full, why)
                rep.removed += 1
                rep.removed_bytes += st.st_size
    if rep.removed:
        logger.info("tierstore: removed %d stale temp files (%d bytes) under %s", rep.removed,
                    rep.removed_bytes, ", ".join(os.fspath(d) for d in directories))
    for err in rep.errors[:5]:
        logger.warning("tierstore: stale temp sweep: %s (left in place)", err)
    return rep
