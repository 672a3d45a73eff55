"""Golden page files (tests/golden/): the CPU copy paths and the engine reproduce them byte for
byte, the current reader reads them, and a change of bytes without a format version change
fails with a message that says so. The GPU paths: tests/test_kernels_gpu.py
(test_gpu_paths_reproduce_golden_files). Regenerate: ``python -m tierstore.testing.golden --write``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
import zstandard

from tierstore.config import TierStoreConfig
from tierstore.format.header import FORMAT_VERSION, Codec, decode_header
from tierstore.rootstore.engine import IOEngine
from tierstore.rootstore.page_read import read_page
from tierstore.testing import golden

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" and not torch.cuda.is_available()


def test_golden_set_is_small_and_recorded_with_the_format_version() -> None:
    rec = json.loads((golden.GOLDEN_DIR / golden.MANIFEST).read_text())
    assert rec["format_version"] == FORMAT_VERSION
    names = {gp.filename for gp in golden.golden_pages()}
    assert set(rec["files"]) == names
    assert {rec["files"][n]["group_kind"] for n in names} == {"attention", "sliding_window", "mamba", "mla"}
    assert "zstd" in {rec["files"][n]["codec"] for n in names}
    assert sum((golden.GOLDEN_DIR / n).stat().st_size for n in names) < 1 << 20
    sums = dict(reversed(line.split("  ")) for line in (golden.GOLDEN_DIR / golden.SUMS).read_text().splitlines())
    assert sums == {n: rec["files"][n]["sha256"] for n in names}


@pytest.mark.parametrize("fill", [0xAA, 0x55, -1])
def test_cpu_torch_path_reproduces_golden_files(fill: int) -> None:
    assert golden.check(files=golden.build_files("cpu", "torch", "gather", fill)) == []


def test_cpu_transfer_path_reproduces_golden_files() -> None:
    assert golden.check(files=golden.build_files("cpu", "torch", "transfer", 0x55)) == []


@pytest.mark.skipif(not INTERPRETED, reason="the Triton interpreter runs on CPU only (TRITON_INTERPRET=1, no GPU)")
def test_cpu_triton_interpreter_reproduces_golden_files() -> None:
    if "tierstore.kernels.triton_kernels" in sys.modules and not os.environ.get("TRITON_INTERPRET"):
        pytest.skip("triton_kernels was imported without the interpreter")
    assert golden.check(files=golden.build_files("cpu", "triton", "gather", -1)) == []


def test_current_reader_reads_golden_files() -> None:
    for gp in golden.golden_pages():
        path = golden.GOLDEN_DIR / gp.filename
        out = bytearray(b"\xee" * gp.layout.nbytes)  # a reused buffer: gaps must come out zero
        header = read_page(path, gp.expectation(), memoryview(out), zstandard.ZstdDecompressor())
        assert bytes(out) == gp.expected, gp.name
        assert header.codec == gp.codec and header.meta == gp.meta
        assert path.read_bytes()[8:10] == FORMAT_VERSION.to_bytes(2, "little")


@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_engine_writes_the_golden_bytes(tmp_path: Path, codec: str) -> None:
    """The IOEngine's own store path (header template, slot frame) writes the golden files,
    from staging slots that held other bytes before."""
    cfg = TierStoreConfig(root=str(tmp_path), codec=codec, zstd_level=golden.ZSTD_LEVEL)
    for gp in golden.golden_pages():
        if (gp.codec == Codec.ZSTD) != (codec == "zstd"):
            continue
        with IOEngine(tmp_path, gp.namespace, 0, config=cfg, staging_slots=1) as eng:
            slot = eng.acquire_slot()
            slot.tensor.fill_(0xA5)
            views, ids, dims, bpp = gp.caches("cpu")
            from tierstore.kernels import GroupCopier

            GroupCopier(views, gp.layout, bpp, dims).gather(ids, [slot.tensor])
            (res,) = eng.wait([eng.submit_store(gp.meta.key, slot, gp.meta.token_count)], timeout=30)
            assert res.ok, res.error
            written = eng.mapper.path_for(gp.meta.key).read_bytes()
        assert written == (golden.GOLDEN_DIR / gp.filename).read_bytes(), gp.name


def test_changed_bytes_without_version_change_fail_clearly(tmp_path: Path) -> None:
    files = golden.build_files()
    name = "gdn_gaps.kvp"
    header_len = decode_header(files[name]).header_len
    changed = bytearray(files[name])
    changed[header_len + 100] ^= 0x01  # one gap byte: what format 2 let through
    problems = golden.check(files={**files, name: bytes(changed)})
    assert len(problems) == 1 and problems[0].startswith(name)
    assert golden.FORMAT_CHANGED in problems[0] and "FORMAT_VERSION" in problems[0]


def test_a_version_change_asks_for_regenerated_files(tmp_path: Path) -> None:
    d = tmp_path / "golden"
    shutil.copytree(golden.GOLDEN_DIR, d)
    rec = json.loads((d / golden.MANIFEST).read_text())
    rec["format_version"] = FORMAT_VERSION - 1
    (d / golden.MANIFEST).write_text(json.dumps(rec))
    (problem,) = golden.check(d)
    assert f"format {FORMAT_VERSION - 1}" in problem and "--write" in problem


def test_write_then_check_round_trips(tmp_path: Path) -> None:
    assert golden.main(["--write", "--dir", str(tmp_path)]) == 0
    assert golden.main(["--check", "--dir", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        os.listdir(golden.GOLDEN_DIR))
