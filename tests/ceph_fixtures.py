"""Fixtures of the tests that need a real Ceph cluster (tierstore.testing.ceph_lab) serving S3
(tests/objstore, tests/vllm/test_vllm_object_tier.py); tests/conftest.py imports them.

``ceph_lab_session``: one lab per test process, started when a test first asks for it (about
30 s) and stopped at the end of the session; under pytest-xdist each worker starts its own (its
own directory and ports). It has CephFS where ceph-fuse can run (``lab.cephfs``). ``ceph_lab``:
the same lab for one test, put back in service after it (the OSD continued, radosgw restarted)
so that a fault a test left behind does not fail the next test. ``s3_bucket``: a fresh bucket
per test; ``s3_env``: the lab's ``AWS_*`` variables, set for the test. ``ceph_data_dir``: a path
for a lab a test starts itself.

Where the lab cannot run (no Ceph packages: ``tools/ceph-lab.sh`` installs them; not root) the
tests skip with the reason; under ``CI=true`` that skip fails the run (tests/conftest.py).
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tierstore.testing.ceph_lab import CephLab, ceph_available


@contextlib.contextmanager
def _data_dir() -> Iterator[Path]:
    # Not under pytest's temporary directory: a concurrent pytest session (another checkout,
    # another user of the machine) removes old ones, and a lab's files with them. A short path
    # also keeps the admin sockets' under the 107 bytes of a Unix socket's name.
    top = Path(tempfile.mkdtemp(prefix="tierstore-ceph-"))
    try:
        yield top / "lab"  # the lab creates it and removes it when it stops
    finally:
        shutil.rmtree(top, ignore_errors=True)


@pytest.fixture(scope="session")
def ceph_lab_session() -> Iterator[CephLab]:
    """A started lab shared by this process's tests (with CephFS where ceph-fuse can run)."""
    why = ceph_available()
    if why is not None:
        pytest.skip(why)
    cephfs = ceph_available(cephfs=True) is None
    with _data_dir() as data_dir, CephLab.start(data_dir, cephfs=cephfs) as lab:
        yield lab


@pytest.fixture
def ceph_data_dir() -> Iterator[Path]:
    """A path for a lab of the test's own (``CephLab.start`` creates it; removed after)."""
    with _data_dir() as data_dir:
        yield data_dir


@pytest.fixture
def ceph_lab(ceph_lab_session: CephLab) -> Iterator[CephLab]:
    """The session's lab; after the test the OSD runs and radosgw answers again."""
    lab = ceph_lab_session
    yield lab
    if "osd" in lab.pids:
        lab.cont_osd()
    else:
        lab.restart_osd()
    if "rgw" not in lab.pids:
        lab.restart_rgw()


@pytest.fixture
def s3_bucket(ceph_lab: CephLab) -> str:
    """The name of a new, empty bucket in the lab."""
    return ceph_lab.make_bucket(f"t-{uuid.uuid4().hex[:20]}")


@pytest.fixture
def s3_env(ceph_lab: CephLab, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The lab's ``AWS_*`` variables (endpoint, keys, region, allow HTTP), set in os.environ."""
    env = ceph_lab.env()
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env
