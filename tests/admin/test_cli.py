"""The tierstore command line: stats, ls, dispatch of the delegated commands, entry points."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tierstore.admin import cli
from tierstore.admin.stats import collect_stats
from tierstore.format.header import Codec
from tierstore.format.identity import Namespace
from tierstore.testing import fill_pages, hybrid_namespace, page_key, simple_namespace, write_page

REPO = Path(__file__).resolve().parents[2]


def _run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict]:
    rc = cli.main(list(argv))
    return rc, json.loads(capsys.readouterr().out)


def test_stats_counts_files_bytes_tokens_and_age(root: Path, hybrid_ns: Namespace, capsys) -> None:
    # Group 0: 4 pages with known token counts (a partial last chunk); groups 1, 2: 2 pages.
    counts = [32, 32, 32, 7]
    pages = [write_page(root, hybrid_ns, 0, page_key(i), token_count=t) for i, t in enumerate(counts)]
    pages += fill_pages(root, hybrid_ns, 2, groups=(1, 2), codec=Codec.ZSTD)
    old = pages[0].path
    t_old = time.time() - 86400
    os.utime(old, (t_old, t_old))
    dense = simple_namespace("float8_e4m3fn")
    fill_pages(root, dense, 3)

    rc, st = _run_json(capsys, "stats", str(root), "--json", "--exact")
    assert rc == 0
    by_ns = {n["namespace"]: n for n in st["namespaces"]}
    assert set(by_ns) == {hybrid_ns.digest, dense.digest}
    h = by_ns[hybrid_ns.digest]
    assert h["model"] == hybrid_ns.model and h["dtype"] == "bfloat16" and h["revision"] == "r0"
    g = {x["group"]: x for x in h["groups"]}
    assert [g[i]["kind"] for i in range(3)] == ["attention", "sliding_window", "mamba"]
    assert g[0]["files"] == 4 and g[0]["tokens"] == sum(counts) and g[0]["tokens_source"] == "headers"
    assert g[0]["bytes"] == sum(p.path.stat().st_size for p in pages[:4])
    assert g[1]["files"] == 2 and g[1]["tokens"] == 64
    assert g[0]["oldest"] < g[0]["newest"]
    assert h["files"] == 8 and h["bytes"] == sum(p.path.stat().st_size for p in pages)
    assert h["tokens"] == 64  # the least-covered group bounds the servable prefix
    assert st["totals"]["files"] == 11

    # ls reads no file: the token count is estimated from tokens_per_chunk.
    rc, ls = _run_json(capsys, "ls", str(root), "--json")
    assert ls["tierstore_ls"] == 1  # ls lists: one row per namespace and group
    g_ls = {x["group"]: x for x in ls["rows"] if x["namespace"] == hybrid_ns.digest}
    assert g_ls[0]["files"] == 4 and g_ls[0]["tokens"] == 4 * 32 and g_ls[0]["tokens_source"] == "estimate"


def test_listing_bytes_say_where_they_come_from_and_never_undercount_zstd(root: Path, hybrid_ns: Namespace,
                                                                          capsys) -> None:
    """From the listing (no stat), bytes are the uncompressed page size x files, tagged
    ``bytes_source: "layout"`` and marked ~ in text: exact for uncompressed pages, an upper bound
    for zstd ones; ``--exact`` gives st_size, the bytes gc counts."""
    plain = fill_pages(root, hybrid_ns, 2, groups=(0,))
    packed = fill_pages(root, hybrid_ns, 2, groups=(1,), codec=Codec.ZSTD)
    rc, st = _run_json(capsys, "stats", str(root), "--json")
    g = {x["group"]: x for x in st["namespaces"][0]["groups"]}
    assert rc == 0 and g[0]["bytes_source"] == g[1]["bytes_source"] == "layout"
    assert g[0]["bytes"] == sum(p.path.stat().st_size for p in plain)  # exact, uncompressed
    assert g[1]["bytes"] > sum(p.path.stat().st_size for p in packed)  # an upper bound, zstd
    rc, exact = _run_json(capsys, "stats", str(root), "--json", "--exact")
    g = {x["group"]: x for x in exact["namespaces"][0]["groups"]}
    assert g[1]["bytes"] == sum(p.path.stat().st_size for p in packed) and g[1]["bytes_source"] != "layout"
    assert cli.main(["stats", str(root)]) == 0
    assert "~" in capsys.readouterr().out


def test_stats_text_and_ls_text(root: Path, hybrid_ns: Namespace, capsys) -> None:
    fill_pages(root, hybrid_ns, 2)
    (root / hybrid_ns.digest / "stray").write_text("x")
    assert cli.main(["stats", str(root)]) == 0
    out = capsys.readouterr().out
    assert hybrid_ns.model in out and "sliding_window" in out and "foreign=1" in out
    assert cli.main(["ls", str(root)]) == 0
    out = capsys.readouterr().out
    assert out.count(hybrid_ns.digest) == 3  # one line per group


def test_stats_reports_unreadable_headers_without_failing(root: Path, hybrid_ns: Namespace) -> None:
    pages = fill_pages(root, hybrid_ns, 2)
    pages[0].path.write_bytes(b"garbage" * 100)
    st = collect_stats(root)
    assert st["other"]["bad_page"] == 1
    assert st["namespaces"][0]["files"] == len(pages) - 1


def test_stats_of_missing_root_is_an_operational_error(tmp_path: Path, capsys) -> None:
    assert cli.main(["stats", str(tmp_path / "nope")]) == 8
    assert "not accessible" in capsys.readouterr().err


def test_stats_as_dict_is_extensible(root: Path, hybrid_ns: Namespace) -> None:
    fill_pages(root, hybrid_ns, 1)
    st = collect_stats(root, read_headers=False)
    st["tiers"] = {"local": {"bytes": 1}}  # other packages may add keys
    json.dumps(st)


def test_delegated_command_missing_module(monkeypatch, capsys) -> None:
    monkeypatch.setitem(cli.DELEGATED, "gc", ("tierstore.no_such_module", "x"))
    assert cli.main(["gc", "--help"]) == 8
    err = capsys.readouterr().err
    assert "tierstore gc" in err and "tierstore.no_such_module" in err


def test_delegated_command_dispatch(tmp_path: Path, monkeypatch, capsys) -> None:
    pkg = tmp_path / "fakecmd.py"
    pkg.write_text(textwrap.dedent('''
        """A fake command."""
        def add_arguments(parser):
            parser.add_argument("--times", type=int, default=1)
        def run(args):
            print("ran", args.times)
            return 3
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(cli.BENCH, "io", ("fakecmd", "x"))
    assert cli.main(["bench", "io", "--times", "5"]) == 3
    assert capsys.readouterr().out.strip() == "ran 5"
    monkeypatch.setitem(cli.DELEGATED, "demo", ("json", "x"))  # importable, but not a command
    assert cli.main(["demo"]) == 8
    assert "add_arguments/run missing" in capsys.readouterr().err


def test_bench_without_subcommand_is_a_usage_error(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["bench"])
    assert info.value.code == 2


def test_python_m_tierstore_and_no_heavy_imports(root: Path, hybrid_ns: Namespace) -> None:
    pages = fill_pages(root, hybrid_ns, 2)
    pages[0].path.write_bytes(b"x")
    code = textwrap.dedent(f"""
        import sys, runpy
        sys.argv = ["tierstore", "fsck", {str(root)!r}, "--json"]
        try:
            runpy.run_module("tierstore", run_name="__main__")
        except SystemExit as e:
            heavy = sorted(m for m in ("torch", "vllm", "triton", "numpy") if m in sys.modules)
            print("HEAVY", heavy, "RC", e.code, file=sys.stderr)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert "HEAVY [] RC 4" in out.stderr, out.stderr
    assert json.loads(out.stdout)["counts"]["bad_page"] == 1
    out = subprocess.run([sys.executable, "-m", "tierstore", "fsck", str(root), "--repair"],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 1, out.stdout + out.stderr


def test_gc_command_imports_no_torch(root: Path, hybrid_ns: Namespace) -> None:
    """An operator's gc (cron, a sidecar) starts without torch: it only lists and unlinks."""
    fill_pages(root, hybrid_ns, 2)
    code = textwrap.dedent(f"""
        import sys, runpy
        sys.argv = ["tierstore", "gc", {str(root)!r}, "--max-bytes", "1"]
        try:
            runpy.run_module("tierstore", run_name="__main__")
        except SystemExit as e:
            heavy = sorted(m for m in ("torch", "vllm", "triton") if m in sys.modules)
            print("HEAVY", heavy, "RC", e.code, file=sys.stderr)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert "HEAVY [] RC 0" in out.stderr, out.stderr
    assert not list(root.rglob("*.kvp"))  # a cap of one byte: every page evicted


def test_other_namespaces_do_not_disturb(root: Path, capsys) -> None:
    # Two models side by side: stats keeps them apart.
    a, b = hybrid_namespace(model="a/a"), hybrid_namespace(model="b/b")
    fill_pages(root, a, 1)
    fill_pages(root, b, 3)
    rc, st = _run_json(capsys, "stats", str(root), "--json", "--namespace", b.digest[:6])
    assert [n["model"] for n in st["namespaces"]] == ["b/b"] and st["totals"]["files"] == 9


def test_stats_lists_groups_without_pages(root: Path, hybrid_ns: Namespace) -> None:
    fill_pages(root, hybrid_ns, 2, groups=(0, 1))  # no Mamba states stored
    st = collect_stats(root)
    (ns,) = st["namespaces"]
    assert [(g["group"], g["files"]) for g in ns["groups"]] == [(0, 2), (1, 2), (2, 0)]
    assert ns["tokens"] == 0  # without the Mamba state nothing of this hybrid model is reusable


def test_version_is_the_installed_distributions() -> None:
    from importlib.metadata import version

    out = subprocess.run([sys.executable, "-m", "tierstore", "--version"], capture_output=True, text=True,
                         timeout=120, cwd=REPO)
    assert out.returncode == 0 and out.stdout.strip() == f"tierstore {version('tierstore')}", out


def test_a_closed_pipe_ends_a_command_quietly(tmp_path: Path) -> None:
    """``tierstore fsck ROOT | head -1``: no "Broken pipe" message or traceback, and the status
    of a process a closed pipe ends (128 + SIGPIPE); it printed an error and exited 8."""
    fill_pages(tmp_path, simple_namespace(), 2)
    for i in range(3000):  # 3,000 findings: far more output than a pipe buffers
        (tmp_path / f"junk-{i:05d}").touch()
    proc = subprocess.Popen([sys.executable, "-m", "tierstore", "fsck", str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=REPO)
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline().startswith(b"foreign/")
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(120) == 141 and err == b"", err


@pytest.mark.parametrize("command", ["stats", "ls", "fsck"])
def test_every_json_document_names_its_schema_version(tmp_path: Path, command: str) -> None:
    fill_pages(tmp_path, simple_namespace(), 2)
    out = subprocess.run([sys.executable, "-m", "tierstore", command, str(tmp_path), "--json"], capture_output=True,
                         text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc[f"tierstore_{command}"] == 1

