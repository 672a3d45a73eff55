"""``tierstore bench gil`` at a tiny size, CPU only: a row per stand-in and io_loop with the engine's
figures, the raw-file baseline of the same run and their ratios; the native io_loop, where it
cannot run, is skipped with its reason instead of failing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TINY = ["--threads", "2", "--page-mib", "1", "--total-mib", "8", "--rounds", "1"]


def _gil(root: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tierstore", "bench", "gil", "--root", str(root), *TINY, *args],
                          capture_output=True, text=True, timeout=120, cwd=REPO, env=env)


def test_bench_gil_rows_and_ratios_against_raw_files(tmp_path: Path) -> None:
    out = _gil(tmp_path / "scratch", "--beside", "alone,spin87", "--io-loops", "native,python", "--direct", "2",
               "--json")
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads(out.stdout)
    assert next(iter(doc)) == "tierstore_bench_gil" and doc["tierstore_bench_gil"] == 1
    assert doc["pages"] == 8 and doc["page_bytes"] == 1 << 20 and doc["threads"] == 2
    loops = ["python"] if any(s["what"] == "io_loop native" for s in doc["skipped"]) else ["native", "python"]
    assert [(r["beside"], r["io_loop"]) for r in doc["rows"]] == [(b, lp) for b in ("alone", "spin87") for lp in loops]
    for r in doc["rows"]:
        for key in ("engine_store_gbps", "engine_load_warm_gbps", "raw_write_gbps", "raw_read_warm_gbps",
                    "direct_2_gbps", "engine_store_s_per_job"):
            assert r[key] > 0, (key, r)
        for key in ("store_vs_raw", "load_vs_raw", "direct_2_vs_raw"):
            assert 0 < r[key] < 100, (key, r)
        assert r["io_batch_pages_used"] == 8
    assert not (tmp_path / "scratch").exists()  # its ts/ and raw/ removed, and the directory it made


def test_bench_gil_skips_the_native_loop_where_it_cannot_run(tmp_path: Path) -> None:
    out = _gil(tmp_path, "--beside", "alone", "--io-loops", "native,python",
               env={**os.environ, "TIERSTORE_NATIVE": "0"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "skipping io_loop native: the native I/O loop is unavailable: TIERSTORE_NATIVE=0" in out.stderr
    assert "skipped io_loop native" in out.stdout
    table = [line for line in out.stdout.splitlines() if line.startswith("| alone")]
    assert len(table) == 1 and "python" in table[0], out.stdout
