"""A Ceph lab for a shell: ``python -m tierstore.testing.ceph_lab_cli start DIR [--cephfs]``.

It starts a ``tierstore.testing.ceph_lab.CephLab`` in DIR, prints ``describe()`` as one JSON line
and keeps the lab up until SIGTERM or SIGINT, then stops it (``tools/ceph-lab.sh start`` runs it).

Threading: the main thread only; the signal handlers turn the first signal into
``KeyboardInterrupt`` and ignore later ones, so the stop is never cut short.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path

from tierstore.testing.ceph_lab import CephLab, CephLabError, ceph_available


def _interrupt(signum: int, frame: object) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)  # a second signal must not cut the stop short
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    """``start DIR [--cephfs] [--timeout S]``: start a lab, print ``describe()`` as one JSON line,
    stop it at SIGTERM/SIGINT. Exit status 0, 1 (the lab failed) or 2 (it cannot run here)."""
    parser = argparse.ArgumentParser(prog="python -m tierstore.testing.ceph_lab_cli", description=(__doc__ or "").split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    start = commands.add_parser("start", help="start a lab in DIR and keep it up until SIGTERM/SIGINT")
    start.add_argument("data_dir", type=Path, help="the lab's directory (created; removed at the end)")
    start.add_argument("--cephfs", action="store_true", help="also a CephFS file system and its MDS")
    start.add_argument("--timeout", type=float, default=120.0, help="seconds the start may take")
    args = parser.parse_args(argv)
    if (why := ceph_available(cephfs=args.cephfs)) is not None:
        print(f"ceph-lab: {why}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    try:
        with CephLab.start(args.data_dir, cephfs=args.cephfs, timeout=args.timeout) as lab:
            print(json.dumps(lab.describe()), flush=True)
            while True:
                time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    except CephLabError as exc:
        print(f"ceph-lab: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
