"""``tierstore doctor ROOT``: what an operator runs before pointing a fleet at a file system.

Checks, each with a status (ok, info, warn, fail), one line of findings, advice and its figures:
file-system type and mount options (NFS advice: ``hard``/``soft``, ``actimeo``/``noac``,
``lookupcache``, ``nconnect``); whether O_DIRECT works; rename atomicity and cross-open
visibility (write, rename over, reopen by path, verify; an fd opened before keeps the old
bytes); clock skew between this node and the server (the mtime of a file just written against
this node's clock); free space and quota (statvfs) against ``max_bytes``; ownership and modes
against ``trust_shared_root``/``shared_group_access`` (fs/trust.py's rule) and the owner the
server gives new files; what ROOT holds (empty, a cache, or other files); metadata latency
(create, rename, stat, readdir, unlink: p50/p99 over ``--ops``) and write/read GB/s over a few
page-sized files.

Contract: ``add_arguments(parser)``, ``run(args) -> int`` (exit 0 every check ok or info, 16
warnings only, 4 a check failed, 8 ROOT missing or not a directory, 2 a bad ``--config``);
``diagnose(options) -> DoctorReport`` for callers. Options come from ``--config FILE`` (the JSON
of ``kv_connector_extra_config``, or a whole ``--kv-transfer-config`` document holding it,
validated by ``TierStoreConfig``) and flags, flags winning. Doctor writes only under
``ROOT/.tierstore-doctor-<host>-<pid>/`` (tierstore's walkers skip ``.tierstore*`` names) and
removes it, also when a check raises.

Failure policy: a check that raises becomes a ``fail`` with the error; the others still run.
Threading: one thread.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import socket
import stat
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tierstore.config import TierStoreConfig
from tierstore.errors import ConfigError, PageTimeout
from tierstore.fs import mounts, trust
from tierstore.fs.deadline import DeadlineRunner, probe_root
from tierstore.fs.display import escape, iso_utc, parse_size
from tierstore.fs.mapper import NAMESPACE_DIR_RE

SCHEMA_VERSION = 1
STATUSES = ("ok", "info", "warn", "fail")  # in rising severity
EXIT_OK, EXIT_FAILED, EXIT_OPERATIONAL, EXIT_WARNINGS, EXIT_USAGE = 0, 4, 8, 16, 2
CLOCK_WARN_S = 1.0  # mtimes and leases (fs/lease.py) tolerate this much without notice
CLOCK_FAIL_S = 5.0  # the lease's skew margin: beyond it a lagging node takes a live lease
ALIGN = 4096


@dataclass
class Check:
    name: str
    status: str  # one of STATUSES
    summary: str
    advice: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class DoctorOptions:
    root: Path
    max_bytes: int | None = None
    trust_shared_root: bool = False
    shared_group_access: bool = False
    ops: int = 200  # metadata operations of each kind
    pages: int = 8  # files of the throughput check
    page_bytes: int = 2 << 20
    mountinfo: str | None = None  # mountinfo text; None: the running system's
    progress: bool | None = None


@dataclass
class DoctorReport:
    root: str
    host: str
    checks: list[Check] = field(default_factory=list)
    seconds: float = 0.0
    generated: float = 0.0

    @property
    def status(self) -> str:
        return max((c.status for c in self.checks), key=STATUSES.index, default="ok")

    @property
    def exit_code(self) -> int:
        return {"fail": EXIT_FAILED, "warn": EXIT_WARNINGS}.get(self.status, EXIT_OK)

    def to_json(self) -> dict[str, Any]:
        from importlib.metadata import PackageNotFoundError, version

        try:
            installed = version("tierstore")
        except PackageNotFoundError:
            installed = "unknown (not installed)"
        return {"tierstore_doctor": SCHEMA_VERSION, "tierstore_version": installed, "root": self.root,
                "host": self.host,
                "generated_at": iso_utc(self.generated),
                "seconds": round(self.seconds, 3), "status": self.status, "exit_code": self.exit_code,
                "checks": [asdict(c) for c in self.checks]}

    def format_text(self) -> str:
        lines = []
        for c in self.checks:
            lines.append(f"[{c.status:<4}] {c.name}: {c.summary}")
            lines += [f"         - {a}" for a in c.advice]
        counts = {s: sum(c.status == s for c in self.checks) for s in STATUSES}
        lines.append(f"doctor {escape(self.root)}: {counts['ok'] + counts['info']} ok, {counts['warn']} warning(s), "
                     f"{counts['fail']} failure(s) in {self.seconds:.1f} s")
        return "\n".join(lines)


# -- checks -------------------------------------------------------------------------------


def check_filesystem(opts: DoctorOptions, work: Path) -> Check:
    """The mount holding ROOT and advice on its options (NFS above all)."""
    mount = mounts.mount_of(opts.root, opts.mountinfo)
    if mount is None:
        return Check("filesystem", "info", "mount table unreadable (not Linux?): no advice on mount options")
    data = {"fstype": mount.fstype, "source": mount.source, "mount_point": mount.mount_point,
            "options": mount.options, "network": mounts.is_network(mount)}
    where = f"{escape(mount.fstype)} {escape(mount.source)} on {escape(mount.mount_point)}"
    if mount.fstype in ("nfs", "nfs4"):
        status, advice = nfs_advice(mount)
        return Check("filesystem", status, f"NFS: {where} (vers {mount.option('vers') or '?'})", advice, data)
    if mounts.is_network(mount):
        return Check("filesystem", "warn", f"network file system {where}", [
            "tierstore is tested on local disks and NFS; other network file systems may differ in rename "
            "atomicity and close-to-open consistency: the checks below try both"], data)
    if mount.fstype == "tmpfs":
        return Check("filesystem", "info", f"{where}: memory, lost at reboot", [
            "fine for tests; a cache here competes with the engine for RAM"], data)
    return Check("filesystem", "ok", f"local file system {where}", [], data)


def nfs_advice(mount: mounts.Mount) -> tuple[str, list[str]]:
    """(status, advice) for an NFS mount's options: what tierstore recommends and why."""
    status, advice = "ok", []

    def warn(text: str) -> None:
        nonlocal status
        status = "warn"
        advice.append(text)

    if mount.option("soft") is not None or mount.option("softerr") is not None:
        warn("`soft`: a slow server turns into EIO in the middle of a write or read; tierstore rejects such "
             "pages by checksum, but stores fail and loads miss whenever the server pauses. Mount `hard` "
             "(the default): tierstore bounds its own waits (deadline_s) and marks the tier down, so a hung "
             "server costs misses, not errors")
    if mount.option("noac") is not None:
        warn("`noac`: every write is synchronous and every stat a round trip; stores slow down several times. "
             "Drop it: pages are immutable once renamed into place, and tierstore verifies what it reads")
    elif mount.option("actimeo") == "0" or mount.option("acregmax") == "0":
        warn("`actimeo=0`: every stat is a round trip to the server (lookups and gc's scan pay it per page). "
             "Keep the default attribute cache; for fast cross-node visibility use `lookupcache=positive`")
    lookup = mount.option("lookupcache")
    if lookup == "none":
        warn("`lookupcache=none`: every open is a LOOKUP round trip. Use `lookupcache=positive`")
    elif lookup != "positive" and lookup != "pos":
        advice.append("`lookupcache=positive` recommended: with the default (all) a page another node stored "
                      "can stay invisible here for up to acdirmax (60 s) after a miss cached it")
    nconnect = mount.option("nconnect")
    if not nconnect or nconnect == "1":
        advice.append("`nconnect=4` (to 16) spreads page traffic over several TCP connections: more GB/s "
                      "on fast networks (Linux 5.3+)")
    if mount.option("sync") is not None:
        warn("`sync`: every write waits for the server; tierstore publishes pages by rename, so async "
             "writes with close-to-open consistency are safe. Drop `sync`")
    vers = mount.option("vers") or ""
    if vers.startswith("3"):
        advice.append("NFSv3: no delegations; open files removed by another node turn into ESTALE "
                      "(tierstore counts it, a miss). v4.1+ is preferred")
    return status, advice


def _aligned(n: int) -> mmap.mmap:
    buf = mmap.mmap(-1, n)  # page-aligned anonymous memory: what O_DIRECT needs
    buf.write(os.urandom(n))
    return buf


def check_odirect(opts: DoctorOptions, work: Path) -> Check:
    """Write and read back one aligned block with O_DIRECT."""
    path = work / "odirect"
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return Check("odirect", "warn", "this platform has no O_DIRECT: buffered I/O only")
    buf = _aligned(ALIGN)
    try:
        fd = os.open(path, os.O_CREAT | os.O_WRONLY | flag, 0o600)
        try:
            os.write(fd, buf)
        finally:
            os.close(fd)
        back = _aligned(ALIGN)
        fd = os.open(path, os.O_RDONLY | flag)
        try:
            os.readv(fd, [back])
        finally:
            os.close(fd)
    except OSError as exc:
        return Check("odirect", "warn", f"O_DIRECT does not work here: {exc.strerror}", [
            'with "odirect": "auto" tierstore falls back to buffered I/O (cold loads then go through the page '
            'cache); set "odirect": "off" to skip the probe'], {"works": False, "errno": exc.errno})
    if back[:] != buf[:]:
        return Check("odirect", "fail", "O_DIRECT read back other bytes than it wrote", [
            'set "odirect": "off" and report the file system'], {"works": False})
    return Check("odirect", "ok", "O_DIRECT writes and reads work", [], {"works": True})


def _write(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def check_rename(opts: DoctorOptions, work: Path) -> Check:
    """Publish by rename as tierstore does; replace it; reopen by path; an fd held keeps the old."""
    first, second = os.urandom(4096), os.urandom(4096)
    target, tmp = work / "page.kvp", work / ".page.kvp.tmp"
    _write(tmp, first)
    os.rename(tmp, target)
    held = os.open(target, os.O_RDONLY)
    problems = []
    try:
        _write(tmp, second)
        os.rename(tmp, target)
        if tmp.exists():
            problems.append("the temp name still exists after the rename")
        if "page.kvp" not in os.listdir(work):
            problems.append("the renamed file is not listed")
        if target.read_bytes() != second:
            problems.append("reopening by path after the rename read the old or other bytes")
        if os.pread(held, 4096, 0) != first:
            problems.append("a file opened before the rename changed under its reader")
    finally:
        os.close(held)
    if problems:
        return Check("rename", "fail", "; ".join(problems), [
            "tierstore publishes every page by rename and relies on it being atomic and visible on reopen: "
            "do not use this file system for ROOT"], {"atomic": False})
    return Check("rename", "ok", "rename over an existing file is atomic; a reopen by path sees the new bytes, "
                 "an open file keeps the old", [], {"atomic": True})


def check_clock(opts: DoctorOptions, work: Path) -> Check:
    """The server's clock (the mtime it gives a file just written) against this node's."""
    path = work / "clock"
    t0 = time.time()
    _write(path, b"t")
    st = os.stat(path)
    t1 = time.time()
    skew = st.st_mtime - (t0 + t1) / 2
    data = {"skew_s": round(skew, 3), "uncertainty_s": round((t1 - t0) / 2, 3)}
    text = f"file times run {abs(skew):.3f} s {'ahead of' if skew > 0 else 'behind'} this node's clock"
    # mtimes are stamped with a coarse clock (a tick): a few ms before t0 is no skew.
    if abs(skew) <= CLOCK_WARN_S + (t1 - t0):
        return Check("clock", "ok", text, [], data)
    advice = [f"gc's lease tolerates {CLOCK_FAIL_S:.0f} s of skew and LRU stamps are file times: run NTP "
              "(chrony) on every node and on the server"]
    return Check("clock", "warn" if abs(skew) <= CLOCK_FAIL_S else "fail", text, advice, data)


def check_space(opts: DoctorOptions, work: Path) -> Check:
    """statvfs (which reports the export's or the user's quota where the server applies one)
    against max_bytes."""
    from tierstore.admin.render import human_bytes

    sv = os.statvfs(opts.root)
    total, avail = sv.f_blocks * sv.f_frsize, sv.f_bavail * sv.f_frsize
    data = {"total_bytes": total, "available_bytes": avail, "inodes_available": sv.f_favail,
            "max_bytes": opts.max_bytes}
    text = f"{human_bytes(avail)} available of {human_bytes(total)}, {sv.f_favail} inodes"
    if opts.max_bytes is None:
        return Check("space", "info", f"{text}; no max_bytes", [
            'nothing caps ROOT: set "max_bytes" (or `tierstore gc --max-bytes`) below the space available, '
            "or stores fail with ENOSPC once it is full"], data)
    text += f"; max_bytes {human_bytes(opts.max_bytes)}"
    if opts.max_bytes > total:
        return Check("space", "fail", text + " is more than the file system holds", [
            '"max_bytes" must be below the export\'s size (or its quota): lower it'], data)
    if opts.max_bytes > avail:
        return Check("space", "warn", text + " is more than is available now", [
            "unless the cache already holds the difference, stores fail with ENOSPC before gc evicts: "
            'lower "max_bytes" or free space'], data)
    return Check("space", "ok", text, [], data)


def check_ownership(opts: DoctorOptions, work: Path) -> Check:
    """ROOT's owner and mode against trust_shared_root/shared_group_access (fs/trust.py's
    rule), and the owner the server gives a new file (root_squash)."""
    st = os.stat(opts.root)
    mode = stat.S_IMODE(st.st_mode)
    data = {"uid": st.st_uid, "gid": st.st_gid, "mode": f"{mode:04o}", "euid": os.geteuid(),
            "trust_shared_root": opts.trust_shared_root, "shared_group_access": opts.shared_group_access}
    status, advice = "ok", []
    try:
        trust.check_root_trust(opts.root, trust_shared_root=opts.trust_shared_root)
    except trust.UntrustedRoot as exc:
        status, advice = "fail", [str(exc)]
    if opts.trust_shared_root and trust.root_problem(st, os.geteuid()):
        status = "warn"
        advice.append('"trust_shared_root" is set and others can write to ROOT: they can plant pages; set '
                      '"mac_key_file" (a fleet key) so that planted pages are never served')
    if opts.shared_group_access and not (mode & stat.S_IWGRP and mode & stat.S_ISGID):
        status = "fail" if status == "fail" else "warn"
        advice.append(f'"shared_group_access" is set but ROOT is {mode:04o}: other members of group {st.st_gid} '
                      "cannot create namespaces there; chmod 2770 ROOT (group-writable, setgid)")
    owner = os.stat(work).st_uid
    data["new_file_uid"] = owner
    if owner != os.geteuid():
        status = "fail" if status == "fail" else "warn"
        advice.append(f"files this node creates are owned by uid {owner}, not {os.geteuid()} (root_squash or "
                      "all_squash on the server): run every node as the export's owner")
    return Check("ownership", status, f"ROOT uid {st.st_uid} gid {st.st_gid} mode {mode:04o}", advice, data)


def check_contents(opts: DoctorOptions, work: Path) -> Check:
    """What ROOT holds besides doctor's own directory: nothing, a cache, or other files."""
    names = [n for n in os.listdir(opts.root) if n != work.name]
    namespaces = [n for n in names if NAMESPACE_DIR_RE.match(n)]
    data = {"entries": len(names), "namespaces": len(namespaces)}
    if not names:
        return Check("contents", "ok", "empty: a new cache", [], data)
    if namespaces:
        return Check("contents", "ok", f"a tierstore cache with {len(namespaces)} namespace(s)",
                     ["doctor does not verify pages: run `tierstore fsck ROOT` for that"], data)
    mine = [n for n in names if n.startswith(".tierstore")]
    if len(mine) == len(names):
        return Check("contents", "ok", "tierstore's own state only (lease, trash): a cache without pages", [], data)
    return Check("contents", "warn", f"{len(names)} entries and no namespace directory", [
        "this does not look like a cache directory: give tierstore a directory of its own (gc and fsck "
        "refuse this one)"], data)


def _pcts(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3, 3)
    return {"p50_ms": at(0.5), "p99_ms": at(0.99), "n": len(ordered)}


def check_metadata(opts: DoctorOptions, work: Path) -> Check:
    """create, rename, stat, readdir and unlink latency over ``opts.ops`` files."""
    d = work / "meta"
    d.mkdir()
    times: dict[str, list[float]] = {"create": [], "rename": [], "stat": [], "readdir": [], "unlink": []}
    n = max(1, opts.ops)
    for i in range(n):
        t = time.perf_counter()
        os.close(os.open(d / f"f{i}.tmp", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        times["create"].append(time.perf_counter() - t)
        t = time.perf_counter()
        os.rename(d / f"f{i}.tmp", d / f"f{i}.kvp")
        times["rename"].append(time.perf_counter() - t)
    for i in range(n):
        t = time.perf_counter()
        os.stat(d / f"f{i}.kvp")
        times["stat"].append(time.perf_counter() - t)
    for _ in range(min(n, 20)):
        t = time.perf_counter()
        with os.scandir(d) as it:
            sum(1 for _ in it)
        times["readdir"].append(time.perf_counter() - t)
    for i in range(n):
        t = time.perf_counter()
        os.unlink(d / f"f{i}.kvp")
        times["unlink"].append(time.perf_counter() - t)
    data = {op: _pcts(v) for op, v in times.items()}
    summary = ", ".join(f"{op} {v['p50_ms']:.3f}/{v['p99_ms']:.3f}" for op, v in data.items())
    return Check("metadata", "info", f"p50/p99 ms: {summary} (readdir of {n} entries)", [], data)


def check_throughput(opts: DoctorOptions, work: Path) -> Check:
    """Write (with fsync) and read back (after dropping them from the cache) a few page-sized files."""
    d = work / "io"
    d.mkdir()
    payload = os.urandom(opts.page_bytes)
    paths = [d / f"p{i}.kvp" for i in range(max(1, opts.pages))]
    t = time.perf_counter()
    for p in paths:
        _write(p, payload)
    write_s = time.perf_counter() - t
    for p in paths:  # drop the cached copies so the reads come from the disk or the server
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    t = time.perf_counter()
    bad = 0
    for p in paths:
        bad += p.read_bytes() != payload
    read_s = time.perf_counter() - t
    total = len(paths) * opts.page_bytes
    data = {"files": len(paths), "file_bytes": opts.page_bytes, "write_gbps": round(total / write_s / 1e9, 3),
            "read_gbps": round(total / read_s / 1e9, 3), "write_s": round(write_s, 4), "read_s": round(read_s, 4)}
    if bad:
        return Check("throughput", "fail", f"{bad} file(s) read back other bytes than written", [
            "do not use this file system for ROOT"], data)
    return Check("throughput", "info", f"write {data['write_gbps']} GB/s (fsync each), read {data['read_gbps']} "
                 f"GB/s (dropped from the cache first), {len(paths)} x {opts.page_bytes} B", [], data)


CHECKS: list[Callable[[DoctorOptions, Path], Check]] = [
    check_filesystem, check_contents, check_ownership, check_space, check_odirect, check_rename, check_clock,
    check_metadata, check_throughput,
]


def work_dir_name() -> str:
    return f".tierstore-doctor-{socket.gethostname()}-{os.getpid()}"


def diagnose(opts: DoctorOptions) -> DoctorReport:
    """Run every check on ``opts.root`` (an existing directory); see the module docstring."""
    from tierstore.admin.progress import progress_bar

    start = time.monotonic()
    rep = DoctorReport(root=str(opts.root), host=socket.gethostname(), generated=time.time())
    work = opts.root / work_dir_name()
    os.mkdir(work, 0o700)
    bar = progress_bar("doctor", total=len(CHECKS), unit="check", enabled=opts.progress)
    try:
        for check in CHECKS:
            name = check.__name__.removeprefix("check_")
            bar.set_postfix_str(name)
            try:
                rep.checks.append(check(opts, work))
            except OSError as exc:
                rep.checks.append(Check(name, "fail", f"{type(exc).__name__}: {exc}", [
                    "the file system refused an operation tierstore needs"]))
            bar.update(1)
    finally:
        bar.close()
        shutil.rmtree(work, ignore_errors=True)
    rep.seconds = time.monotonic() - start
    return rep


# -- command line -------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("root", metavar="ROOT", nargs="?", default=None,
                        help="the directory to check (default: \"root\" of --config), or an object tier's "
                        "s3://BUCKET/PREFIX")
    parser.add_argument("--config", metavar="FILE",
                        help="tierstore settings as JSON (kv_connector_extra_config, or a whole "
                        "--kv-transfer-config document): max_bytes, trust_shared_root, shared_group_access")
    parser.add_argument("--max-bytes", metavar="N", type=_size, default=None,
                        help="the cap gc will keep (e.g. 500G), checked against the free space")
    parser.add_argument("--trust-shared-root", action=argparse.BooleanOptionalAction, default=None,
                        help="as the setting trust_shared_root")
    parser.add_argument("--shared-group-access", action=argparse.BooleanOptionalAction, default=None,
                        help="as the setting shared_group_access")
    parser.add_argument("--ops", type=int, default=200, metavar="N",
                        help="metadata operations of each kind for the latency check (default 200)")
    parser.add_argument("--pages", type=int, default=8, metavar="N", help="files of the GB/s check (default 8)")
    parser.add_argument("--page-bytes", type=_size, default=2 << 20, metavar="N",
                        help="size of each of those files (default 2M)")
    parser.add_argument("--mountinfo", metavar="FILE",
                        help="read the mount table from FILE instead of /proc/self/mountinfo")
    parser.add_argument("--json", action="store_true", help="print the report as JSON (schema key tierstore_doctor)")
    parser.add_argument("--deadline-s", type=float, default=10.0, metavar="S",
                        help="how long ROOT may take to answer a create before doctor gives up on it as a hung "
                        "mount (default 10)")


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def load_config(path: str, root: str | None) -> TierStoreConfig:
    """The settings in ``path`` (see ``--config``), validated; ROOT fills a missing "root".
    Raises ConfigError naming the file and what is wrong."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--config {path}: cannot read it as JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise ConfigError(f"--config {path}: expected a JSON object of tierstore settings")
    extra = doc.get("kv_connector_extra_config", doc)
    if not isinstance(extra, dict):
        raise ConfigError(f"--config {path}: \"kv_connector_extra_config\" must be an object")
    if "root" not in extra and root is not None:
        extra = {**extra, "root": root}
    return TierStoreConfig.from_dict(extra)


def options_from_args(args: argparse.Namespace) -> DoctorOptions:
    """DoctorOptions from flags over ``--config``; raises ConfigError for a bad config or no ROOT."""
    cfg = load_config(args.config, args.root) if args.config else None
    root = args.root or (cfg.root if cfg else None)
    if root is None:
        raise ConfigError("no ROOT: pass the directory to check, or --config with a \"root\" setting")
    mountinfo = None
    if args.mountinfo:
        mountinfo = Path(args.mountinfo).read_text(encoding="utf-8", errors="surrogateescape")

    def pick(flag: Any, setting: str, default: Any) -> Any:
        return flag if flag is not None else (getattr(cfg, setting) if cfg else default)

    return DoctorOptions(
        root=Path(os.path.abspath(root)), max_bytes=pick(args.max_bytes, "max_bytes", None),
        trust_shared_root=pick(args.trust_shared_root, "trust_shared_root", False),
        shared_group_access=pick(args.shared_group_access, "shared_group_access", False),
        ops=args.ops, pages=args.pages, page_bytes=args.page_bytes, mountinfo=mountinfo,
        progress=getattr(args, "progress", None))


def run(args: argparse.Namespace) -> int:
    """``tierstore doctor``: the exit status of the shared table (module docstring)."""
    try:
        opts = options_from_args(args)
    except ConfigError as exc:
        print(f"tierstore doctor: {exc}", file=sys.stderr)
        return EXIT_USAGE
    deadline_s = getattr(args, "deadline_s", 10.0)

    def answers() -> str | None:
        st = os.stat(opts.root)
        if not stat.S_ISDIR(st.st_mode):
            return "not a directory"
        probe_root(opts.root)  # a create the file server must answer (a stat may come from a cache)
        return None

    try:
        problem = DeadlineRunner("doctor-probe", max_inflight=1).call(answers, deadline_s)
        hint = "create it, or pass the directory given as \"root\""
    except PageTimeout:
        problem = f"it did not answer a create within {deadline_s:g} s (--deadline-s): a hung mount?"
        hint = "check the mount and its server"
    except OSError as exc:
        problem, hint = exc.strerror, "create it, or pass the directory given as \"root\""
    if problem is not None:
        message = f"ROOT {escape(opts.root)} is not accessible: {problem} ({hint})"
        print(f"tierstore doctor: {message}", file=sys.stderr)
        if args.json:
            print(json.dumps({"tierstore_doctor": SCHEMA_VERSION, "error": message, "exit_code": EXIT_OPERATIONAL}))
        return EXIT_OPERATIONAL
    rep = diagnose(opts)
    if args.json:
        json.dump(rep.to_json(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(rep.format_text())
    return rep.exit_code
