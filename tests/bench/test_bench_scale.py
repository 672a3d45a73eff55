"""``tierstore bench scale`` on a tiny root: every figure and every ratio against the plain walks,
for the page count asked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tierstore.bench.scale import RATIOS

REPO = Path(__file__).resolve().parents[2]


def test_bench_scale_reports_figures_and_ratios_against_the_walks(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "tierstore", "bench", "scale", "--pages", "200", "--dir", str(tmp_path),
                          "--json"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads(out.stdout)
    assert next(iter(doc)) == "tierstore_bench_scale" and doc["tierstore_bench_scale"] == 1
    (row,) = doc["rows"]
    assert row["pages"] == 200
    for key in ("walk_list_s", "walk_stat_s", "walk_read_s", "scandir_base_s", "page_index_load_s", "stats_listing_s",
                "stats_exact_s", "ls_s", "fsck_s", "local_index_reconciled_s", "gc_s"):
        assert row[key] > 0, key
    assert 0 < row["page_index_bytes_per_page"] < 100_000
    assert abs(row["fsck_pages_per_s"] * row["fsck_s"] - 200) < 1
    assert set(row["ratios"]) == set(RATIOS) and all(v > 0 for v in row["ratios"].values()), row["ratios"]
    assert set(doc["extrapolated"]) == {"1000000", "10000000"}
    assert list(tmp_path.iterdir()) == []  # the roots it wrote are gone
