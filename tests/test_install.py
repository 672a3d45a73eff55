"""The wheel installs as README documents it and carries every module (issue 34, item 1).

A wheel is built from a copy of the working tree (the project venv's ``pip wheel --no-deps
--no-build-isolation``: no download, and no ``build/`` left in the repository), installed with
``--no-deps`` into a fresh venv whose dependencies (torch, vLLM, ...) come from the project
venv's site-packages through a ``.pth`` line, and then run from a directory outside the
repository: ``tierstore --version``, ``tierstore --help``, the imports README's config and CLI
need, and ``tierstore demo --mode pages --preset tiny`` (no vLLM, ~6 s). Every file under
``tierstore/`` in the working tree (git's tracked and untracked-but-not-ignored files) must be
in the wheel, and nothing but ``tierstore/`` and its ``.dist-info``; a planted packaging fault
(a subpackage excluded in a copy's pyproject.toml) must be caught by the same check.

Skipped with the reason where the tree is not a git checkout or git is missing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]
# What the build reads besides the package: metadata, the readme and the licence file.
BUILD_INPUTS = ("pyproject.toml", "README.md", "LICENSE")

pytestmark = pytest.mark.slow


def _tree_files() -> list[str]:
    """The working tree's files under ``tierstore/`` as git sees them: tracked, plus untracked
    files that are not ignored (a module added but not yet committed still ships)."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout (or no git): the wheel's contents cannot be compared with the tree")
    out = subprocess.run(["git", "-C", str(REPO), "ls-files", "-co", "--exclude-standard", "--", "tierstore"],
                         check=True, capture_output=True, text=True).stdout.split()
    return sorted(f for f in out if (REPO / f).is_file())


def _copy_tree(dst: Path) -> list[str]:
    """Copy what a build reads into ``dst``; returns the package files copied."""
    files = _tree_files()
    for rel in (*BUILD_INPUTS, *files):
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, dst / rel)
    return files


def _build_wheel(src: Path, out: Path) -> Path:
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                           "--disable-pip-version-check", "-q", str(src), "-w", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"pip wheel failed:\n{proc.stdout}\n{proc.stderr}"
    (wheel,) = out.glob("tierstore-*.whl")
    return wheel


def wheel_problems(wheel: Path, package_files: list[str]) -> list[str]:
    """What is wrong with the wheel's file list against the tree's package files: each file
    missing from the wheel, and each entry that is neither ``tierstore/`` nor its dist-info."""
    names = set(zipfile.ZipFile(wheel).namelist())
    problems = [f"missing from the wheel: {f}" for f in package_files if f not in names]
    dist_info = f"tierstore-{VERSION}.dist-info/"
    problems += [f"unexpected in the wheel: {n}" for n in sorted(names)
                 if not (n.startswith(("tierstore/", dist_info)) and "__pycache__" not in n)]
    return problems


def _fresh_venv(where: Path) -> tuple[Path, dict[str, str]]:
    """A new venv (no pip of its own) that sees the project venv's packages after its own."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True, timeout=60)
    py = where / "bin" / "python"
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    # A plain path line: the project venv's own .pth files (its editable tierstore) are not read.
    (Path(purelib) / "project-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["PATH"] = f"{where / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return py, env


def test_the_wheel_installs_and_runs_outside_the_repository(tmp_path: Path) -> None:
    src = tmp_path / "src"
    files = _copy_tree(src)
    assert "tierstore/config.py" in files and "tierstore/admin/cli.py" in files
    wheel = _build_wheel(src, tmp_path / "dist")
    assert wheel.name == f"tierstore-{VERSION}-py3-none-any.whl"
    assert wheel_problems(wheel, files) == []

    meta = zipfile.ZipFile(wheel).read(f"tierstore-{VERSION}.dist-info/METADATA").decode()
    requires = next(line.split(":", 1)[1].strip() for line in meta.splitlines() if line.startswith("Requires-Python:"))
    assert SpecifierSet(requires) == SpecifierSet(PYPROJECT["project"]["requires-python"])  # the backend sorts them
    assert 'extra == "vllm"' in meta and "License-File: LICENSE" in meta

    py, env = _fresh_venv(tmp_path / "venv")
    proc = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index",
                           "--disable-pip-version-check", "-q", str(wheel)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, f"pip install failed:\n{proc.stdout}\n{proc.stderr}"

    outside = tmp_path / "elsewhere"
    outside.mkdir()

    def run(*argv: str, timeout: float = 60) -> str:
        p = subprocess.run(argv, cwd=outside, env=env, capture_output=True, text=True, timeout=timeout)
        assert p.returncode == 0, f"{argv} exited {p.returncode}:\n{p.stdout}\n{p.stderr}"
        return p.stdout

    cli = str(tmp_path / "venv" / "bin" / "tierstore")
    assert VERSION in run(cli, "--version")
    help_text = run(cli, "--help")
    for command in ("fsck", "stats", "ls", "gc", "demo"):
        assert command in help_text
    where = run(str(py), "-c", "import tierstore, tierstore.config, tierstore.admin.cli; print(tierstore.__file__)")
    assert Path(where.strip()).is_relative_to(tmp_path / "venv"), f"tierstore imported from {where}, not the wheel"
    demo = run(cli, "demo", "--mode", "pages", "--preset", "tiny", timeout=120)
    assert "result: OK" in demo, demo


def test_a_subpackage_left_out_of_the_wheel_is_caught(tmp_path: Path) -> None:
    """The planted fault: the copy's pyproject excludes ``tierstore.index``; its modules are
    named missing (and the unplanted copy has no problem, so the check is what differs)."""
    src = tmp_path / "src"
    files = _copy_tree(src)
    pyproject = src / "pyproject.toml"
    text = pyproject.read_text()
    assert text.count('include = ["tierstore*"]') == 1
    pyproject.write_text(text.replace('include = ["tierstore*"]',
                                      'include = ["tierstore*"]\nexclude = ["tierstore.index", "tierstore.index.*"]'))
    problems = wheel_problems(_build_wheel(src, tmp_path / "dist"), files)
    index_files = [f for f in files if f.startswith("tierstore/index/")]
    assert index_files and problems == [f"missing from the wheel: {f}" for f in index_files]


def _checkout_files() -> list[str]:
    """Every file of the working tree as git sees it (tracked, and untracked but not ignored)."""
    _tree_files()  # skips where this is not a git checkout
    out = subprocess.run(["git", "-C", str(REPO), "ls-files", "-co", "--exclude-standard", "-z"],
                         check=True, capture_output=True, text=True).stdout.split("\0")
    return sorted(f for f in out if f and (REPO / f).is_file())


def _clone_venv(clone: Path) -> dict[str, str]:
    """``clone/.venv`` as tools/setup-env.sh leaves it, without downloading vLLM again: a venv
    whose dependencies come from the project venv (a ``.pth`` line), with ``pip`` and ``ruff``
    of the project venv, and setup-env's stamp, so its second-run path (an editable install of
    the clone, no build isolation, no index) is what runs. Returns the commands' environment."""
    py, env = _fresh_venv(clone / ".venv")
    bin_dir = py.parent
    (bin_dir / "pip").write_text(f'#!/bin/sh\nexec "{py}" -m pip "$@"\n')
    (bin_dir / "pip").chmod(0o755)
    (bin_dir / "ruff").symlink_to(Path(sys.prefix) / "bin" / "ruff")
    (clone / ".venv" / ".tierstore-setup-v2").touch()
    # the editable install builds with the project venv's setuptools, from no index: no network
    env.update(PIP_NO_BUILD_ISOLATION="0", PIP_NO_INDEX="1", TIERSTORE_TEST_WORKERS="0")
    return env


def test_the_readme_commands_run_from_a_clone_under_tmp_with_a_space() -> None:
    """The README's two commands from a checkout under /tmp whose path has a space: the demo
    (pages mode: no vLLM) and the test command on the kernel-NFS guest's path tests, which boot
    the guest from that checkout (the guest once hid /tmp: exit 127 inside it)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="tierstore clone ", dir="/tmp") as top:
        clone = Path(top) / "main"
        for rel in _checkout_files():
            (clone / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, clone / rel)
        env = _clone_venv(clone)

        def run(*argv: str, timeout: float) -> str:
            p = subprocess.run(argv, cwd=clone, env=env, capture_output=True, text=True, timeout=timeout)
            assert p.returncode == 0, f"{argv} exited {p.returncode} in {clone}:\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}"
            return p.stdout + p.stderr

        demo = run("bash", "tools/demo.sh", "--mode", "pages", "--preset", "tiny", timeout=300)
        assert "result: OK" in demo, demo
        where = run(str(clone / ".venv" / "bin" / "python"), "-c", "import tierstore; print(tierstore.__file__)",
                    timeout=60)
        assert Path(where.strip()).is_relative_to(clone), f"tierstore imported from {where}, not the clone"
        tests = run("bash", "tools/test.sh", "-p", "no:cacheprovider", "tests/nfs_kernel/test_guest_paths.py",
                    timeout=540)
        assert "3 passed" in tests, tests
