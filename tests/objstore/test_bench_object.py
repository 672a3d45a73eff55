"""``tierstore bench object`` at a tiny size against the Ceph lab: a row per phase with the tier's,
obstore's and boto3's MB/s and the two ratios, the targets' verdict, and no object left in the
bucket afterwards (every key it wrote deleted, the tier's own objects under .tierstore/ too)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RATIO = r"\d+\.\d\d \(\d+\.\d\d-\d+\.\d\d\)"


def test_bench_object_prints_ratios_and_leaves_no_objects(s3_env, s3_bucket, ceph_lab) -> None:
    out = subprocess.run([sys.executable, "-m", "tierstore", "bench", "object", "--url", f"s3://{s3_bucket}/bench",
                          "--sizes", "0.5", "--pages", "4", "--repeats", "1"],
                         capture_output=True, text=True, timeout=180, cwd=REPO, env={**os.environ, **s3_env})
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| 0.5 |")]
    assert [row.split("|")[3].strip() for row in rows] == ["store", "load"], out.stdout
    for row in rows:
        cells = [c.strip() for c in row.split("|")[1:-1]]
        assert all(float(c) > 0 for c in cells[3:6]), row  # tier, obstore, boto3 MB/s
        assert re.fullmatch(RATIO, cells[6]) and re.fullmatch(RATIO, cells[7]), row  # tier/obstore, tier/boto3
        assert re.fullmatch(r">= 0\.8: (met|NOT met)", cells[8]), row
    assert re.search(r"^targets .*: (met|NOT met)$", out.stdout, re.M), out.stdout
    # 2 rounds (warm-up + 1) x 4 pages x 3 systems, and the tier's own objects (.tierstore/), all deleted
    done = re.search(r"^objects written and deleted: (\d+); left under \S+: 0$", out.stdout, re.M)
    assert done is not None and int(done.group(1)) >= 24, out.stdout
    listing = ceph_lab.s3_client().list_objects_v2(Bucket=s3_bucket)
    assert listing.get("KeyCount", 0) == 0, [o["Key"] for o in listing.get("Contents", [])]
