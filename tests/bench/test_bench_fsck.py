"""``tierstore bench fsck`` runs both page paths and a fresh CLI process and reports ratios."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_bench_fsck_runs_both_paths_and_the_cli(tmp_path: Path) -> None:
    from tierstore.native import loader as native

    native.start(wait=True)
    if native.page_kernels() is None:
        pytest.skip(f"the native path is not available here: {native.failure() or 'not x86-64 Linux'}")
    out = subprocess.run([sys.executable, "-m", "tierstore", "bench", "fsck", "--work", str(tmp_path), "--pages", "300",
                          "--jobs", "1,auto", "--paths", "python,native,cli", "--json"],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    rep = json.loads(out.stdout)
    assert rep["native_compile_s"] > 0
    rows = {(r["path"], r["jobs"]): r for r in rep["rows"]}
    assert set(rows) == {("python", 1), ("python", "auto"), ("native", 1), ("native", "auto"), ("cli", "auto")}
    for (path, _), r in rows.items():
        assert r["pages"] == 300
        # The per-page path never takes the batch; the native rows take it for every page; a
        # 300-page CLI run stays below the compile threshold.
        assert r["native_pages"] == (300 if path == "native" else 0), r
        assert r["vs_python"] is not None and r["vs_python"] > 0
    assert rows[("python", 1)]["vs_python"] == 1.0
