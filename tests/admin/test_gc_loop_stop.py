"""``tierstore gc --loop`` stops on SIGTERM or SIGINT between passes (admin/loop_stop.py).

The first signal lets the pass in progress finish and print its report; the command then exits,
0 for SIGTERM (a service manager's stop) and 32 for SIGINT ("interrupted"). The same loop runs
the object gc (tests/objstore/test_object_gc.py stops two of them with SIGINT).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tiers_helpers import key, store

from tierstore.config import TierStoreConfig
from tierstore.testing.pages import simple_namespace
from tierstore.tiers import open_group_store

REPO = Path(__file__).resolve().parents[2]


def _cache_root(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    st = open_group_store(TierStoreConfig(root=str(root)), simple_namespace(), 0)
    try:
        assert store(st, key(1)).ok
    finally:
        st.close()
    return root


@pytest.mark.parametrize(("sig", "status"), [(signal.SIGTERM, 0), (signal.SIGINT, 32)])
def test_a_loop_stops_between_passes_on_a_signal(tmp_path: Path, sig: signal.Signals, status: int) -> None:
    root = _cache_root(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "tierstore", "gc", str(root), "--max-bytes", "1G", "--loop", "0.2",
                             "--json"], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stdout.readline()  # one pass reported: the loop is running
        assert json.loads(first)["tierstore_gc"], first
        proc.send_signal(sig)
        sent = time.monotonic()
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == status, err
    assert time.monotonic() - sent < 10
    assert f"stopped by {sig.name} after the pass in progress" in err
    assert "Traceback" not in err and "interrupted" not in err  # no KeyboardInterrupt landed in a pass
    for line in out.splitlines():  # every pass's report whole
        json.loads(line)
