"""Check that ``tools/test.sh --quick`` fails on each of a list of deliberate breakages (mutants).

Usage: .venv/bin/python tools/quick-mutants.py [--rev REV] [NAME ...]   (default: all; ~1-3 min each)

The working tree's files (git's tracked and untracked-but-not-ignored) are copied once to a
temporary directory (with ``--rev``, the files of that commit instead: a tree that others'
unfinished edits in the checkout cannot break); each mutant replaces one piece of text in one module of the copy, runs the
quick selection there (``pytest -m quick --maxfail=1``, the copy first on ``PYTHONPATH``) and
puts the text back. A mutant is *caught* when the run fails, and the first failing test is
printed; the unbroken copy runs first and must pass. The checkout itself is never modified.
Exit status 0 when every mutant was caught, 1 when one survived, 2 when the unbroken copy
already fails or a mutant's text is no longer in its module (the code moved: update MUTANTS).
A maintainer's tool: the quick loop's claim re-checked, not part of the test run.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]


class Mutant(NamedTuple):
    name: str
    path: str  # relative to the repository
    old: str
    new: str


MUTANTS = (
    Mutant("page checksum verification", "tierstore/format/page.py",
           "if checksum(out[off : off + raw_len]) != e.checksum:", "if False:"),
    Mutant("header checksum verification", "tierstore/format/header.py",
           "if checksum(buf[: header_len - 8]) != stored_sum:", "if False:"),
    Mutant("section bounds", "tierstore/format/header.py",
           "if off + stored_len > payload_len:", "if False:"),
    Mutant("zero-gap check", "tierstore/format/page_layout.py",
           "bad = nonzero_gap(layout, buf)", "bad = None"),
    Mutant("fsck's verdict on a bad page", "tierstore/admin/fsck.py",
           "code = EXIT_REPAIRED if self.left == 0 else EXIT_ERRORS_LEFT", "code = EXIT_CLEAN"),
    Mutant("page-name validation", "tierstore/fs/mapper.py",
           r'PAGE_NAME_RE = re.compile(r"^((?:[0-9a-f]{2}){1,96})\.kvp$")',
           r'PAGE_NAME_RE = re.compile(r"^((?:[0-9a-zA-Z._-]{2}){1,96})\.kvp$")'),
    Mutant("gc's byte cap", "tierstore/tiers/gc.py",
           "elif rep.total_before > max_bytes:", "elif rep.total_before > 2 * max_bytes:"),
    Mutant("lease expiry", "tierstore/fs/lease.py",
           'data = {**data, "live_until": mtime + ttl + self.skew_s, "server_now": now}',
           'data = {**data, "live_until": math.inf, "server_now": now}'),
    Mutant("head-slice assembly verification", "tierstore/tiers/assembly.py",
           "scratch, mac=mac,  # as every page served", "scratch, mac=None,  # as every page served"),
    Mutant("the MAC comparison", "tierstore/format/mac.py",
           "if not hmac.compare_digest(tag, digest):", "if False:"),
    Mutant("the stale-handle reopen", "tierstore/rootstore/rank_dir.py",
           "        try:\n            held = os.fstat(fd)\n",
           "        return False\n        try:\n            held = os.fstat(fd)\n"),
    # The same properties on the paths an engine takes: its loads compare the sums that the
    # Python or native reader computed here, not in page.py; a head-slice piece read whole but
    # never hashed; a stale rank directory detected but never reopened.
    Mutant("engine load checksum comparison", "tierstore/rootstore/own_read.py",
           "        if c != want[i]:\n", "        if False:\n"),
    Mutant("head-slice pieces read unverified", "tierstore/tiers/assembly.py",
           "header = page_read.read_page_fd(fd, st, str(path), expect, scratch, mac=mac,  # as every page served\n"
           "                                           sealer=sealer)",
           "header, _ = page_read._read_header(fd, str(path), st.st_size); "
           "scratch[:] = os.pread(fd, len(scratch), header.header_len)"),
    Mutant("stale rank directory never reopened", "tierstore/rootstore/rank_dir.py",
           "        fd = self._reopen(create, stale)\n", "        fd = stale\n"),
)


def _copy_tree(dst: Path, rev: str | None) -> None:
    dst.mkdir(parents=True)
    if rev is not None:
        archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", rev], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(dst)], input=archive, check=True)
        return
    out = subprocess.run(["git", "-C", str(REPO), "ls-files", "-co", "--exclude-standard", "-z"],
                         check=True, capture_output=True, text=True).stdout.split("\0")
    for rel in out:
        if rel and (REPO / rel).is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, dst / rel)


# The project venv installs tierstore editable, through a meta-path finder that answers before
# PYTHONPATH: in the copy's processes (pytest's workers too) a sitecustomize drops it, so the
# copy's modules are the ones imported.
SITECUSTOMIZE = """import sys
sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")]
"""


def _env(tree: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{tree.parent / 'site'}"}


def _quick_env(tree: Path) -> dict[str, str]:
    return {**_env(tree), "TRITON_INTERPRET": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def _compile_native(tree: Path) -> None:
    """Fill the copy's numba cache before the first run, as tools/test.sh does: a copy starts with
    none, and tests that count the pieces of a load see the native path turn on mid-test while
    the workers compile."""
    subprocess.run([str(REPO / ".venv" / "bin" / "python"), "-c",
                    "from tierstore.native import loader as native; native.start(wait=True) or "
                    "print('native kernels not compiled:', native.failure())"],
                   cwd=tree, env=_quick_env(tree), check=True, timeout=600)


# Tests of the code's text, not its behaviour, left out of every run: the check of MUTANTS'
# texts fails in every mutated copy (the text is gone), and the private-names check fails on a
# mutant spelled with a private name; left in, they "caught" mutants whatever the others did.
TEXT_CHECKS = ("tests/test_quick_mutants.py::test_every_mutant_names_text_found_once_in_its_module",
               "tests/test_limits.py::test_no_module_uses_another_modules_private_names")


def _run_quick(tree: Path) -> tuple[int, str, float, str]:
    """Run the quick selection in ``tree``: (exit status, the first failing test or the summary
    line, seconds, pytest's output)."""
    started = time.monotonic()
    proc = subprocess.run([str(REPO / ".venv" / "bin" / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-m", "quick", "--maxfail=1", "-n", os.environ.get("TIERSTORE_TEST_WORKERS", "2"),
                           "--dist", "loadfile", *(f"--deselect={t}" for t in TEXT_CHECKS)], cwd=tree, env=_quick_env(tree),
                          capture_output=True, text=True,
                          timeout=900)
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", proc.stdout, re.M)
    last = proc.stdout.strip().splitlines()[-1:] or [proc.stderr.strip()]
    return proc.returncode, failed[0] if failed else last[0], time.monotonic() - started, proc.stdout


def main(args: list[str]) -> int:
    rev = None
    if args[:1] == ["--rev"]:
        if len(args) < 2:
            print("--rev needs a commit", file=sys.stderr)
            return 2
        rev, args = args[1], args[2:]
    names = args
    unknown = sorted(set(names) - {m.name for m in MUTANTS})
    if unknown:
        print(f"no mutant named {unknown}; the names: {[m.name for m in MUTANTS]}", file=sys.stderr)
        return 2
    chosen = [m for m in MUTANTS if not names or m.name in names]
    with tempfile.TemporaryDirectory(prefix="tierstore-mutants-") as tmp:
        tree = Path(tmp) / "tree"
        _copy_tree(tree, rev)
        (Path(tmp) / "site").mkdir()
        (Path(tmp) / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
        where = subprocess.run([str(REPO / ".venv" / "bin" / "python"), "-c", "import tierstore; print(tierstore.__file__)"],
                               env=_env(tree), cwd=tree, capture_output=True, text=True).stdout
        if not where.startswith(str(tree)):
            print(f"the copy's tierstore is not the one imported ({where.strip()})", file=sys.stderr)
            return 2
        _compile_native(tree)
        rc, first, seconds, output = _run_quick(tree)
        if rc != 0:  # a mutant is caught only where the unbroken tree passes
            print("\n".join(output.splitlines()[-60:]))
            print(f"the quick selection fails without a breakage ({seconds:.0f} s): {first}; fix that first")
            return 2
        print(f"baseline: the quick selection passes ({seconds:.0f} s)", flush=True)
        missed = 0
        for m in chosen:
            module = tree / m.path
            text = module.read_text()
            if text.count(m.old) != 1:
                print(f"{m.name}: its text is in {m.path} {text.count(m.old)} times, not once: update MUTANTS")
                return 2
            module.write_text(text.replace(m.old, m.new))
            try:
                rc, first, seconds, _ = _run_quick(tree)
            finally:
                module.write_text(text)
            caught = rc != 0
            missed += not caught
            print(f"{'caught' if caught else 'MISSED'} {m.name} ({m.path}, {seconds:.0f} s): {first}", flush=True)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
