"""``tierstore gc s3://BUCKET/PREFIX --max-bytes N``: gc of an object tier (the logic: tiers/object_gc.py).

Contract: the grammar of ``tierstore gc ROOT`` (admin/gc_command.py, which hands an ``s3://``
ROOT to ``run`` here with its two renderers, so the JSON document and the text lines are the
directory command's): exit 0 done (also when another node holds the lease), 2 a bad value or
a flag with no meaning on an object tier, 8 an operational error (the endpoint failed, a
prefix that is not a cache). ``--loop``, ``--json``, ``--dry-run``, ``--progress``,
``--lease-ttl`` and ``--metrics-*`` work as on a directory (a loop stops after the pass in
progress on SIGTERM or SIGINT: admin/loop_stop.py); ``--trash-grace`` (a delete is
immediate: no trash) and ``--temp-max-age`` (an object store has no temps) are refused when
given other values than their defaults; ``--evict-threads`` is ignored (one ``DeleteObjects``
of up to 1,000 keys at a time). The JSON document carries the object pass's fields too
(``journals``, ``hot_pages``, ``lease_holder``, ``lease_taken_over``, ``lease_from``,
``lease_to``: the server's clock).

Failure policy: a failed request (``PageError``) propagates to cli.main (exit 8), except that
``--loop`` outlives it: said on stderr (and as ``{"error", "retry_in_s"}`` with ``--json``),
counted as an error pass, tried again after the interval. A refusal ends the loop.
Threading: the main thread.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tierstore.admin import metrics_export
from tierstore.admin.cli import EXIT_OPERATIONAL, EXIT_USAGE, SCHEMAS
from tierstore.admin.loop_stop import LoopStop
from tierstore.admin.progress import progress_bar
from tierstore.config import ObjectLocation
from tierstore.errors import ConfigError, PageError
from tierstore.fs.display import escape
from tierstore.objstore.client import ObjectClient
from tierstore.objstore.lease import ObjectLease
from tierstore.tiers.gc_report import GcReport
from tierstore.tiers.object_gc import ObjectGcReport, collect_object

DEFAULT_TEMP_MAX_AGE_S = 3600.0  # gc_command's default: a value given differently is refused here
UNSUPPORTED = (("trash_grace", "--trash-grace", 0.0, "a delete on an object store is immediate: there is no trash"),
               ("temp_max_age", "--temp-max-age", DEFAULT_TEMP_MAX_AGE_S, "an object store has no temp files"))
RenderJson = Callable[[GcReport], dict[str, Any]]
RenderText = Callable[[GcReport, argparse.Namespace, Path], list[str]]


def _say(args: argparse.Namespace, message: str, **fields: object) -> None:
    print(f"tierstore gc: {message}", file=sys.stderr, flush=True)
    if args.json:
        key, version = SCHEMAS["gc"]
        print(json.dumps({key: version, "error": message, **fields}), flush=True)


def refused_flag(args: argparse.Namespace) -> str | None:
    """The first flag that has no meaning on an object tier, with why; None when there is none."""
    for attr, flag, default, why in UNSUPPORTED:
        if getattr(args, attr, default) != default:
            return f"{flag} does not apply to an object tier ({why}); leave it out"
    return None


def text_lines(rep: ObjectGcReport, args: argparse.Namespace, url: str, render: RenderText) -> list[str]:
    """The text report: the directory command's lines, the object pass's own after them."""
    if rep.busy:
        return [f"tierstore gc: another node holds the gc lease ({escape(url)}/.tierstore/gc-lease, held by "
                f"{escape(rep.lease_holder or '?')}); nothing done"]
    lines = render(rep, args, Path(url))
    if rep.journals or rep.hot_pages:
        lines.append(f"tierstore gc: merged {rep.journals} access journals: {rep.hot_pages} pages ranked by "
                     "their last hit")
    if rep.lease_taken_over:
        lines.append(f"tierstore gc: took over the expired lease of {escape(rep.lease_taken_over)}")
    if rep.lease_lost:
        lines.append("tierstore gc: the lease was lost during the pass (another node took it over): eviction "
                     "stopped early")
    return lines


def one_pass(args: argparse.Namespace, loc: ObjectLocation, client: ObjectClient, lease: ObjectLease) -> ObjectGcReport:
    """One pass as the command line asked (with its progress bar over listed keys and batches)."""
    bar = progress_bar("gc list (keys)", unit="key", enabled=args.progress)
    phase = ["list"]

    def tick(step: str, n: int) -> None:
        if step != phase[0]:
            phase[0] = step
            bar.set_description_str("gc evict (pages)")
            bar.reset(total=None)
        bar.update(n)

    try:
        return collect_object(loc, args.max_bytes, low_watermark=args.low_watermark, client=client, lease=lease,
                              dry_run=args.dry_run, tick=None if bar.disable else tick)
    finally:
        bar.close()


def run(args: argparse.Namespace, render_json: RenderJson, render_text: RenderText) -> int:
    """gc of the object prefix ``args.root`` (module docstring); the exit status."""
    why = refused_flag(args)
    if why is not None:
        print(f"tierstore gc: {why}", file=sys.stderr)
        return EXIT_USAGE
    try:
        loc = ObjectLocation.parse(args.root, "ROOT")
        lease_ttl = float(args.lease_ttl)
        client = ObjectClient(loc, max(5.0, min(30.0, lease_ttl / 3)))
        lease = ObjectLease(client, ttl_s=lease_ttl)
    except (ConfigError, ValueError) as exc:
        print(f"tierstore gc: {exc}", file=sys.stderr)
        return EXIT_USAGE
    exporter = metrics_export.start(args, loc.url, args.max_bytes)  # type: ignore[arg-type]  # a label
    with LoopStop("gc") as stop:
        return _loop(args, loc, client, lease, exporter, stop, render_json, render_text)


def _loop(args: argparse.Namespace, loc: ObjectLocation, client: ObjectClient, lease: ObjectLease, exporter: Any,
          stop: LoopStop, render_json: RenderJson, render_text: RenderText) -> int:
    """One pass, or passes every ``args.loop`` seconds until a stop signal (``LoopStop``)."""
    while True:
        try:
            rep = one_pass(args, loc, client, lease)
        except PageError as exc:
            if args.loop <= 0:
                raise
            _say(args, f"a pass failed: {escape(str(exc))}; nothing more evicted, trying again in {args.loop:g} s",
                 retry_in_s=args.loop)
            if exporter is not None:
                exporter.failed()
            if stop.wait(args.loop):
                return stop.exit_status()
            continue
        if exporter is not None:
            exporter.update(rep)
        if rep.refused:
            _say(args, f"refusing {escape(loc.url)}: {rep.refused}", exit_code=EXIT_OPERATIONAL)
            return EXIT_OPERATIONAL
        if args.json:
            print(json.dumps(render_json(rep)), flush=True)
        else:
            print("\n".join(text_lines(rep, args, loc.url, render_text)), flush=True)
        if args.loop <= 0:
            return 0
        if stop.wait(args.loop):
            return stop.exit_status()
