"""Shared pytest fixtures (small and generic; page helpers live in tierstore.testing)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hostile_helpers import sentinel  # noqa: F401 - the hostile-root tests' fixture, defined with its helpers

from tierstore.format.identity import Namespace
from tierstore.testing import hybrid_namespace


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """An empty cache root directory."""
    path = tmp_path / "root"
    path.mkdir()
    return path


@pytest.fixture
def hybrid_ns() -> Namespace:
    """The hybrid test namespace: full attention, sliding window, Mamba states."""
    return hybrid_namespace()


@pytest.fixture(autouse=True)
def _cuda_errors_stay_with_their_test():  # noqa: ANN202 - generator fixture
    """Synchronize after each test that used CUDA: an asynchronous device error (a device-side
    assert) then fails the test that caused it, not whichever test synchronizes next."""
    yield
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.synchronize()


@pytest.fixture(params=["python", "native"])
def fsck_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run the test on each of fsck's page paths: the per-page Python verifier, and the batched
    native one (fsck_batch) that engine-written pages take once it is compiled. Each must
    report exactly the same."""
    from tierstore.admin.fsck_batch import NativeBatch
    from tierstore.native import loader as native

    if request.param == "native":
        native.start(wait=True)
        if not NativeBatch.ready():
            pytest.skip(f"the native path is not available here: {native.failure() or 'not x86-64 Linux'}")
    else:
        monkeypatch.setattr(NativeBatch, "ready", staticmethod(lambda: False))
    return request.param



# The test files that start engine processes, slowest first (seconds in a serial CI run). Under
# two workers (tools/test.sh: ``-n 2 --dist loadfile``) a file is a unit of work handed to the
# next free worker in collection order: starting these first keeps a 5-minute file from being
# the tail of the run. Within a file the order is unchanged.
SLOW_FILES_FIRST = (
    "test_vllm_tp_mamba.py",  # ~300 s
    "test_vllm_serve.py",  # ~200 s
    "test_vllm_serve_recipes.py",  # ~250 s
    "test_nfs_vllm.py",
    "test_vllm_tp_gdn.py",
    "test_vllm_faults.py",
    "test_vllm_tp_sliding.py",
    "test_vllm_tp.py",
    "test_demo.py",
    "test_nfs_vllm_live.py",
    "test_vllm_restore.py",
    "test_vllm_families.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: files keep their order
