"""Thin wrapper: ``python tools/bench_io.py --root DIR [--json]`` = ``tierstore bench io``."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tierstore.bench.io import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
