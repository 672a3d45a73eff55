"""The ``tierstore`` command line: fsck, stats, ls, doctor, gc, bench io|kernels|lookup|fsck|serve|scale|gil, demo.

Contract: ``main(argv) -> int`` (the exit status; the console script passes it to
``sys.exit``). ``fsck``, ``stats``, ``ls``, ``doctor`` and ``gc`` live in this package's light
modules and import neither torch nor vLLM. ``gc`` (gc_command.py), the benches and ``demo``
expose ``add_arguments(parser)`` and ``run(args) -> int`` and are imported only when their
command runs, so a missing or broken one fails with a clear message and never slows down the
others.

One grammar for every command: the exit statuses of ``EXIT_TABLE`` (fsck's follow e2fsck);
errors on stderr, naming what to do; a closed output pipe ends the command quietly (141);
``--json`` prints one document whose first key names its schema and version
(``tierstore_<command>``: ls lists rows, stats summarises); in JSON, sizes are file bytes
(``st_size``; gc counts the same bytes), except where ``bytes_source`` is "layout" (stats and
ls answering from the listing: the uncompressed page size x files, exact for uncompressed
pages, an upper bound for zstd ones), and times ISO 8601 UTC, durations in seconds
(keys ``seconds`` or ``*_s``); in text, sizes are human-readable (KiB, MiB, ...);
``--progress/--no-progress`` everywhere (default: a bar with rate and ETA when stderr is a
terminal; tqdm, see progress.progress_bar).
Threading: runs on the main thread.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import textwrap
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from tierstore.errors import TierStoreError

EXIT_OK = 0
EXIT_REPAIRED = 1
EXIT_USAGE = 2
EXIT_PROBLEMS = 4
EXIT_OPERATIONAL = 8
EXIT_WARNINGS = 16
EXIT_CANCELLED = 32
EXIT_UNVERIFIABLE = 64
EXIT_CLOSED_PIPE = 141  # 128 + SIGPIPE
EXIT_TABLE = """exit status, every command:
  0    done (fsck: clean; doctor: every check passed; gc: also when another node holds the lease)
  1    fsck: problems found, all repaired
  2    usage error (a bad option or value)
  4    problems left: fsck: damage not repaired; doctor: a check failed (do not use ROOT as is)
  8    operational error: ROOT missing, not a cache directory, unreadable; a bad lease path
  16   doctor: warnings only (ROOT works; a setting costs speed or safety)
  32   interrupted
  64   fsck: pages not verifiable with this key (--mac-key-file): kept, not damage; 68 = 4 + 64
  141  the output pipe was closed (tierstore ... | head)
errors go to stderr. --json: one document, first key tierstore_<command> (schema version);
sizes in file bytes (st_size, the number gc counts; stats and ls from the listing give the
uncompressed page size x files, bytes_source "layout": exact unless pages are zstd, --exact
stats every page), times ISO 8601 UTC, durations in seconds. Text: human-readable sizes,
~ where estimated."""

# command -> (module, one-line help). Imported lazily by _run_delegated.
DELEGATED: dict[str, tuple[str, str]] = {
    "gc": ("tierstore.admin.gc_command", "evict pages until a tier is under its byte cap"),
    "demo": ("tierstore.demo", "store model-shaped pages, reload them in a new process, fsck, print figures"),
}
BENCH: dict[str, tuple[str, str]] = {
    "io": ("tierstore.bench.io", "page store/load throughput against raw file I/O (and vLLM's fs tier)"),
    "kernels": ("tierstore.bench.kernels", "gather/scatter kernel throughput"),
    "lookup": ("tierstore.bench.lookup", "scheduler-thread page lookups: in-memory index vs stat"),
    "fsck": ("tierstore.bench.fsck", "fsck pages/s and reads in flight at several --jobs (optionally a latency stand-in)"),
    "serve": ("tierstore.bench.serve", "vllm serve TTFT cold vs restored vs no connector (vLLM's bench client)"),
    "scale": ("tierstore.bench.scale", "whole-root tools' time and memory against page count, vs plain walks"),
    "gil": ("tierstore.bench.gil", "engine stores/loads vs raw files, alone and beside a busy Python thread"),
    "sealing": ("tierstore.bench.sealing", "engine stores/loads with encryption_key_file vs without"),
    "restore": ("tierstore.bench.restore", "vLLM prefill of a long prompt: cold vs restored from tierstore pages"),
    "object": ("tierstore.bench.object", "object tier store/warm load vs the raw S3 client's PUT/GET of the same bytes (obstore, boto3)"),
}


def _para(text: str) -> str:
    """A sub-command's description, wrapped: its parser keeps the exit table's lines as written."""
    return textwrap.fill(text, 88)


def _add_root(p: argparse.ArgumentParser) -> None:
    p.add_argument("root", metavar="ROOT", help="the cache directory (a tier root), or an object tier's "
                   "s3://BUCKET/PREFIX (endpoint and credentials from AWS_*)")
    p.add_argument("--namespace", metavar="N", help="only this namespace (its digest or a unique prefix)")
    p.add_argument("--jobs", "-j", type=positive_int, default=None, metavar="J",
                   help="threads listing and reading files (default: fsck up to 64, as many at once as pay "
                        "off, measured as it goes; stats/ls 8; on NFS more threads hide latency)")
    p.add_argument("--json", action="store_true", help="print a machine-readable JSON report on stdout")
    add_progress_flag(p)


def add_progress_flag(p: argparse.ArgumentParser) -> None:
    """``--progress/--no-progress``, the same on every command."""
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar on stderr with rate and ETA (default: only when stderr is a terminal)")


def positive_int(text: str) -> int:
    """argparse type: an integer above 0 (every command's and bench's counts)."""
    v = int(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return v


def _non_negative_float(text: str) -> float:
    v = float(text)
    if not v >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return v


def package_version() -> str:
    """The installed distribution's version (``pip install .`` or ``-e .``), else ``unknown``
    (run from a source tree that was never installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tierstore")
    except PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tierstore",
        description="Disk and shared-NFS KV-cache tier for vLLM: inspect, check and repair a cache directory.",
        epilog=EXIT_TABLE, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"tierstore {package_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("fsck", epilog=EXIT_TABLE, formatter_class=argparse.RawDescriptionHelpFormatter,
                       help="verify every file under ROOT; --repair fixes what it can",
                       description=_para("Verify every page (header, checksums, size, namespace/key/path "
                                         "agreement) and list stale temps, orphans, foreign files and symlinks. "
                                         "Exit codes as e2fsck: 0 clean, 1 errors found and all repaired, 4 "
                                         "errors left, 8 operational error; 64 pages not verifiable with the "
                                         "--mac-key-file key (kept, never deleted), added to the others."))
    _add_root(p)
    p.add_argument("--repair", action="store_true",
                   help="delete bad pages, orphans and stale temps; unlink symlinks; move foreign files "
                   "to ROOT/.quarantine/")
    p.add_argument("--quarantine-bad", action="store_true",
                   help="with --repair: move bad pages to ROOT/.quarantine/ instead of deleting them")
    p.add_argument("--tmp-age", type=_non_negative_float, default=3600.0, metavar="SECONDS",
                   help="a temp file older than this is stale (default 3600); a temp of this host whose "
                   "writer process is gone is stale at once")
    p.add_argument("--group-access", action="store_true",
                   help="pages of a fleet sharing a service group (shared_group_access): 0660 is not a finding")
    p.add_argument("--deep", action="store_true",
                   help="also recompute each page's content checks: zero alignment gaps, no NaN/Inf in "
                   "floating-point sections; and count non-canonical pages in trees of older page formats")
    p.add_argument("--mac-key-file", metavar="PATH", default=None,
                   help="the fleet key (setting mac_key_file): every page must carry a valid MAC tag; one that "
                   "does not verify with it is counted as not verifiable (exit 64), never deleted")
    p.add_argument("--encryption-key-file", metavar="PATH", default=None, action="append",
                   help="an encryption key (settings encryption_key_file, tenant_key_files; repeat it for each): "
                   "encrypted pages are decrypted and fully checked; without their key their ciphertext checksums "
                   "are, and damage found is reported, never deleted")
    p.add_argument("--remove-unverifiable", action="store_true",
                   help="with --repair and --mac-key-file: also delete the pages not verifiable with that key "
                   "(only once it is the fleet's one key: during a rotation they are the other key's pages)")

    p = sub.add_parser("stats", epilog=EXIT_TABLE, formatter_class=argparse.RawDescriptionHelpFormatter,
                       help="per namespace and group: files, bytes, token coverage, age",
                       description=_para("Answers from the directory listing (one readdir per fan-out "
                                         "directory, no stat or read per page): bytes are the uncompressed page "
                                         "size x files (exact unless pages are zstd), token coverage "
                                         "tokens_per_chunk x files (marked ~). --exact stats every page (the "
                                         "bytes gc counts) and reads its header (the first 4 KiB)."))
    _add_root(p)
    p.add_argument("--exact", action="store_true",
                   help="exact figures: stat every page and read its header (slow at millions of pages)")
    p.add_argument("--no-headers", action="store_true",
                   help="with --exact: stat every page but read none; estimate token coverage as "
                   "tokens_per_chunk x files")

    p = sub.add_parser("ls", epilog=EXIT_TABLE, formatter_class=argparse.RawDescriptionHelpFormatter,
                       help="one line per namespace and group (reads no file, only directories)")
    _add_root(p)
    p.add_argument("--exact", action="store_true",
                   help="exact bytes and ages: stat every page (slow at millions of pages)")

    from tierstore.admin import doctor

    p = sub.add_parser("doctor", help="check a file system before a fleet uses it as ROOT (NFS advice, "
                       "O_DIRECT, renames, clock skew, space, modes, latency, GB/s)",
                       description=(doctor.__doc__ or "").split("\n\n")[0], epilog=EXIT_TABLE,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    doctor.add_arguments(p)
    add_progress_flag(p)

    for name, (_, help_text) in DELEGATED.items():
        sub.add_parser(name, help=help_text, add_help=False)
    bench = sub.add_parser("bench", help="benchmarks: " + ", ".join(BENCH))
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="BENCH", required=True)
    for name, (_, help_text) in BENCH.items():
        bench_sub.add_parser(name, help=help_text, add_help=False)
    return parser


def _import_delegate(module: str, command: str) -> ModuleType:
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module.startswith(exc.name):
            raise TierStoreError(f"`tierstore {command}` is not available in this installation "
                                 f"(module {module} is missing)") from exc
        raise TierStoreError(f"`tierstore {command}` needs the package {exc.name!r}, which is not installed "
                             f"(pip install 'tierstore[vllm]' or 'tierstore[dev]')") from exc
    if not (hasattr(mod, "add_arguments") and hasattr(mod, "run")):
        raise TierStoreError(f"module {module} does not implement `tierstore {command}` (add_arguments/run missing)")
    return mod


def _run_delegated(module: str, command: str, argv: Sequence[str]) -> int:
    mod = _import_delegate(module, command)
    parser = argparse.ArgumentParser(prog=f"tierstore {command}", description=(mod.__doc__ or "").split("\n\n")[0],
                                     epilog=EXIT_TABLE, formatter_class=argparse.RawDescriptionHelpFormatter)
    mod.add_arguments(parser)
    if not any("--progress" in a.option_strings for a in parser._actions):
        add_progress_flag(parser)  # one grammar: accepted everywhere (a bench prints its steps on stderr)
    args = parser.parse_args(list(argv))
    rc = mod.run(args)
    return int(rc or 0)


# The schema key and version of each command's --json document.
SCHEMAS = {"ls": ("tierstore_ls", 1), "stats": ("tierstore_stats", 1), "fsck": ("tierstore_fsck", 1),
           "gc": ("tierstore_gc", 2), "doctor": ("tierstore_doctor", 1),
           **{f"bench {name}": (f"tierstore_bench_{name}", 1) for name in BENCH}}


def print_error_document(command: str, message: str, exit_code: int) -> None:
    """With --json, an error is also a document on stdout (a consumer always gets one): the
    command's schema key, ``error`` and ``exit_code``. The message is on stderr as well."""
    key, version = SCHEMAS.get(command, (f"tierstore_{command.replace(' ', '_')}", 1))
    _print_json({key: version, "error": message, "exit_code": exit_code})


def _print_json(data: Any) -> None:
    json.dump(data, sys.stdout, indent=2, sort_keys=False)
    sys.stdout.write("\n")


def refuse_not_a_cache(root: str) -> None:
    """Raise ``TierStoreError`` (exit 8) when ``root`` holds entries but no namespace directory:
    every command refuses such a directory alike (gc's rule, tiers/gc.not_a_cache)."""
    from tierstore.admin.walk import check_root
    from tierstore.fs import safefs
    from tierstore.tiers.gc import not_a_cache

    path = check_root(root)
    fd = safefs.open_root(path)
    try:
        why = not_a_cache(fd)
    finally:
        os.close(fd)
    if why:
        raise TierStoreError(f"refusing {path}: {why}")


def _cmd_fsck(args: argparse.Namespace) -> int:
    """fsck reports a directory that is not a cache as foreign entries (exit 4) and refuses
    to ``--repair`` it (exit 8): it checks a tree, so it does not refuse to look. On an
    ``s3://`` URL: ``object_fsck`` (its docstring says which flags apply there)."""
    from tierstore.admin.fsck import FsckOptions, run_fsck
    from tierstore.config import is_object_url

    options = FsckOptions(
        root=args.root, repair=args.repair, namespace=args.namespace, jobs=args.jobs,
        tmp_age=args.tmp_age, quarantine_bad=args.quarantine_bad, progress=args.progress, deep=args.deep,
        group_access=True if args.group_access else None, mac_key_file=args.mac_key_file,
        remove_unverifiable=args.remove_unverifiable, encryption_key_file=args.encryption_key_file,
    )
    message = None
    if args.remove_unverifiable and not (args.repair and args.mac_key_file):
        message = "--remove-unverifiable needs --repair and --mac-key-file (the key the pages must verify with)"
    elif is_object_url(args.root):
        from tierstore.admin.object_fsck import refusal

        message = refusal(options)
    if message is not None:
        print(f"tierstore fsck: {message}", file=sys.stderr)
        if args.json:
            _print_json({"tierstore_fsck": 1, "error": message, "exit_code": EXIT_USAGE})
        return EXIT_USAGE
    if is_object_url(args.root):
        from tierstore.admin.object_fsck import run_object_fsck

        report = run_object_fsck(options)
    else:
        report = run_fsck(options)
    if report.error:
        print(f"tierstore fsck: {report.error}", file=sys.stderr)
    if args.json:
        _print_json(report.to_json())
    elif not report.error:
        print(report.format_text())
    return report.exit_code


def _cmd_stats(args: argparse.Namespace, *, listing: bool) -> int:
    from tierstore.admin.progress import Progress
    from tierstore.admin.render import format_listing, format_stats
    from tierstore.admin.stats import collect_stats, listing_json
    from tierstore.config import is_object_url

    if is_object_url(args.root):  # the listing's exact sizes and times; --exact, --no-headers, --jobs: no effect
        from tierstore.admin.object_walk import collect_object_stats

        stats = collect_object_stats(args.root, namespace=args.namespace, progress=args.progress,
                                     label="stats" if not listing else "ls")
    else:
        refuse_not_a_cache(args.root)
        progress = Progress("stats" if not listing else "ls", enabled=args.progress)
        try:
            stats = collect_stats(args.root, namespace=args.namespace, jobs=args.jobs or 8,
                                  read_headers=not listing and not args.no_headers, progress=progress,
                                  listing=not args.exact)
        finally:
            progress.close()
    if args.json:
        doc = listing_json(stats) if listing else stats
        _print_json({**doc, "tierstore_version": package_version()})
    else:
        print(format_listing(stats) if listing else format_stats(stats))
    return 0


def _cmd_doctor(args: argparse.Namespace) -> int:
    from tierstore.admin import doctor
    from tierstore.config import is_object_url

    if is_object_url(args.root):  # an object tier's bucket
        from tierstore.admin.object_doctor import run_objects

        return run_objects(args)
    return doctor.run(args)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] in DELEGATED:
            return _run_delegated(DELEGATED[argv[0]][0], argv[0], argv[1:])
        if len(argv) >= 2 and argv[0] == "bench" and argv[1] in BENCH:
            return _run_delegated(BENCH[argv[1]][0], f"bench {argv[1]}", argv[2:])
        args = build_parser().parse_args(argv)
        if args.command == "fsck":
            return _cmd_fsck(args)
        if args.command in ("stats", "ls"):
            return _cmd_stats(args, listing=args.command == "ls")
        if args.command == "doctor":
            return _cmd_doctor(args)
        raise AssertionError(f"unhandled command {args.command}")  # argparse enforces the choices
    except BrokenPipeError:
        # The reader closed the pipe (``tierstore stats ROOT | head``): no message, and the exit
        # status of a process a closed pipe ends (128 + SIGPIPE), as cat, ls and grep report it.
        # stdout goes to /dev/null so the interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_CLOSED_PIPE
    except (TierStoreError, OSError) as exc:
        command = " ".join(argv[:2] if argv[:1] == ["bench"] else argv[:1])
        print(f"tierstore {command}: {exc}" if command else f"tierstore: {exc}", file=sys.stderr)
        if "--json" in argv and command:
            print_error_document(command, str(exc), EXIT_OPERATIONAL)
        return EXIT_OPERATIONAL
    except KeyboardInterrupt:
        print("tierstore: interrupted", file=sys.stderr)
        return EXIT_CANCELLED


if __name__ == "__main__":
    sys.exit(main())
