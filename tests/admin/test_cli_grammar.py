"""One grammar for every command: a table over commands x situations.

Commands: ls, stats, fsck, gc, doctor (and bench fsck for the JSON and flag grammar).
Situations: missing root, not a cache, empty cache, healthy, damaged, closed pipe.
Per cell: the exit status of the shared table (cli.EXIT_TABLE), errors on stderr and nothing on
stdout, results on stdout, ``--json`` documents whose first key is ``tierstore_<command>``, and
a quiet 141 when the reader closes the pipe. Also: ``--progress`` draws a bar with a rate and
an ETA, ``--no-progress`` draws nothing, and gc and stats count the same bytes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tierstore.admin import cli
from tierstore.format.header import Codec
from tierstore.testing import fill_pages, hybrid_namespace, simple_namespace

REPO = Path(__file__).resolve().parents[2]
DOCTOR_FAST = ["--ops", "10", "--pages", "1", "--page-bytes", "64K"]
COMMANDS: dict[str, Callable[[Path], list[str]]] = {
    "ls": lambda root: ["ls", str(root)],
    "stats": lambda root: ["stats", str(root)],
    "fsck": lambda root: ["fsck", str(root)],
    "gc": lambda root: ["gc", str(root), "--max-bytes", "1G"],
    "doctor": lambda root: ["doctor", str(root), *DOCTOR_FAST],
}
SCHEMA = {"ls": ("tierstore_ls", 1), "stats": ("tierstore_stats", 1), "fsck": ("tierstore_fsck", 1),
          "gc": ("tierstore_gc", 2), "doctor": ("tierstore_doctor", 1)}


def _odirect_works(where: Path) -> bool:
    try:
        fd = os.open(where / "probe", os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o600)
    except OSError:
        return False
    os.close(fd)
    os.unlink(where / "probe")
    return True


def _make(situation: str, tmp_path: Path) -> Path:
    root = tmp_path / "root"
    if situation == "missing":
        return root
    root.mkdir(mode=0o700)
    if situation == "not_a_cache":
        (root / "notes.txt").write_text("not pages")
        (root / "photos").mkdir()
    elif situation in ("healthy", "damaged"):
        pages = fill_pages(root, simple_namespace(), 3)
        if situation == "damaged":
            with open(pages[0].path, "r+b") as f:  # flip payload bytes: the checksum no longer matches
                f.seek(-16, os.SEEK_END)
                f.write(b"\xff" * 16)
    return root


# Exit status per command and situation (doctor's "ok" cells: 16 where this machine's
# file system lacks O_DIRECT, a warning).
EXPECTED = {
    #            missing  not_a_cache  empty  healthy  damaged
    "ls":       (8,       8,           0,     0,       0),
    "stats":    (8,       8,           0,     0,       0),
    "fsck":     (8,       4,           0,     0,       4),  # not a cache: foreign entries listed
    "gc":       (8,       8,           0,     0,       0),
    "doctor":   (8,       16,          0,     0,       0),
}
SITUATIONS = ("missing", "not_a_cache", "empty", "healthy", "damaged")


@pytest.mark.parametrize("situation", SITUATIONS)
@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_exit_status_streams_and_schema(command: str, situation: str, as_json: bool, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    root = _make(situation, tmp_path)
    want = EXPECTED[command][SITUATIONS.index(situation)]
    if command == "doctor" and want == 0 and not _odirect_works(tmp_path):
        want = 16
    argv = COMMANDS[command](root) + (["--json"] if as_json else []) + ["--no-progress"]
    rc = cli.main(argv)
    out = capsys.readouterr()
    assert rc == want, (argv, out.out, out.err)
    assert "Traceback" not in out.err
    if rc == 8:  # an operational error: on stderr, naming the command and what to do
        assert out.err.startswith(f"tierstore {command}: ") and out.err.count("\n") == 1
        assert "root" in out.err and ("pass" in out.err or "create" in out.err), out.err
        if not as_json:
            assert out.out == ""
        else:  # and a document on stdout: the schema key, the error, the exit status
            doc = json.loads(out.out)
            key, version = SCHEMA[command]
            assert next(iter(doc)) == key and doc[key] == version and doc["exit_code"] == 8 and doc["error"]
        return
    assert out.out.strip(), "a result on stdout"
    assert out.err == ""
    if as_json:
        doc = json.loads(out.out)
        key, version = SCHEMA[command]
        assert next(iter(doc)) == key and doc[key] == version
        _assert_json_grammar(doc)


def _assert_json_grammar(doc: object, path: str = "") -> None:
    """Times are ISO 8601 strings (keys *_at, oldest, newest), never epoch floats; sizes are ints."""
    if isinstance(doc, dict):
        for k, v in doc.items():
            where = f"{path}.{k}"
            if k.endswith("_at") or k in ("oldest", "newest"):
                assert v is None or (isinstance(v, str) and v[:4].isdigit() and "T" in v), (where, v)
            if k in ("started", "finished"):
                raise AssertionError(f"{where}: an epoch time; print ISO 8601 (*_at)")
            if k.endswith("bytes") and v is not None and not isinstance(v, (dict, list)):
                assert isinstance(v, int), (where, v)
            _assert_json_grammar(v, where)
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            _assert_json_grammar(v, f"{path}[{i}]")


@pytest.mark.parametrize("command", list(COMMANDS))
def test_closed_pipe_ends_every_command_quietly(command: str, tmp_path: Path) -> None:
    """`tierstore CMD ROOT | head -0`: the reader is gone before the command writes; it exits
    141 with nothing on stderr about the pipe (no "Broken pipe", no traceback)."""
    root = _make("healthy", tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "tierstore", *COMMANDS[command](root), "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # before the interpreter has even started: every write meets a closed pipe
    err = proc.stderr.read().decode()
    assert proc.wait(120) == 141, err
    assert "Broken pipe" not in err and "Traceback" not in err and "Exception" not in err, err
    if command == "doctor":
        assert [p.name for p in root.iterdir() if p.name.startswith(".tierstore-doctor")] == []


@pytest.mark.parametrize("command", ["stats", "ls", "fsck", "gc", "doctor"])
def test_progress_bar_has_rate_and_eta_and_can_be_turned_off(command: str, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    root = _make("healthy", tmp_path)
    rc = cli.main([*COMMANDS[command](root), "--progress"])
    err = capsys.readouterr().err
    assert rc in (0, 16), err
    unit = "check/s" if command == "doctor" else "dir/s"
    assert unit in err and "<" in err, err  # tqdm: [elapsed<remaining, rate]
    rc = cli.main([*COMMANDS[command](root), "--no-progress"])
    err = capsys.readouterr().err
    assert unit not in err


def test_gc_dry_run_draws_its_bar_and_still_changes_nothing(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    root = _make("healthy", tmp_path)
    before = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
    assert cli.main([*COMMANDS["gc"](root), "--max-bytes", "1", "--dry-run", "--progress"]) == 0
    err = capsys.readouterr().err
    assert "dir/s" in err and "<" in err, err
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*")) == before  # no lease, no trash


def test_gc_and_stats_count_the_same_bytes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One meaning (file bytes, st_size): gc's page bytes are stats' exact bytes, also for zstd
    pages whose allocated blocks are more than their size; for uncompressed pages the default
    (listing) stats agrees as well."""
    root = tmp_path / "root"
    fill_pages(root, simple_namespace(), 4)
    fill_pages(root, hybrid_namespace(), 3, codec=Codec.ZSTD)
    sizes = sum(p.stat().st_size for p in root.rglob("*.kvp"))
    assert cli.main(["gc", str(root), "--max-bytes", "1G", "--dry-run", "--json"]) == 0
    gc_doc = json.loads(capsys.readouterr().out)
    assert cli.main(["stats", str(root), "--exact", "--json"]) == 0
    stats_doc = json.loads(capsys.readouterr().out)
    assert gc_doc["page_bytes"] == stats_doc["totals"]["bytes"] == sizes

    plain = tmp_path / "plain"
    fill_pages(plain, simple_namespace(), 5)
    assert cli.main(["gc", str(plain), "--max-bytes", "1G", "--dry-run", "--json"]) == 0
    gc_plain = json.loads(capsys.readouterr().out)["page_bytes"]
    assert cli.main(["stats", str(plain), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["totals"]["bytes"] == gc_plain


def test_human_sizes_in_text_exact_bytes_in_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = _make("healthy", tmp_path)
    assert cli.main(["gc", str(root), "--max-bytes", "1G", "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "KiB" in text and "cap 1.0 GiB" in text and "bytes" not in text.split("(cap")[0]


def test_bench_speaks_the_same_grammar(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main(["bench", "fsck", "--work", str(tmp_path), "--pages", "20", "--jobs", "1", "--paths", "python",
                   "--json", "--no-progress"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0 and next(iter(doc)) == "tierstore_bench_fsck" and doc["tierstore_bench_fsck"] == 1


def test_exit_table_is_in_every_help() -> None:
    for argv in (["--help"], *([c, "--help"] for c in ("ls", "stats", "fsck", "gc", "doctor", "demo")),
                 *(["bench", b, "--help"] for b in ("fsck", "scale", "gil", "restore"))):
        out = subprocess.run([sys.executable, "-m", "tierstore", *argv], capture_output=True, text=True,
                             timeout=120, cwd=REPO)
        assert out.returncode == 0 and "16   doctor: warnings only" in out.stdout, (argv, out.stdout[-500:])
