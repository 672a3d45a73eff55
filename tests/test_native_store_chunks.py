"""The native store's chunked path (``native_page.store_page`` with sums computed in the kernel,
no O_DIRECT): each chunk is hashed (streaming XXH3 per section) and then written at its file
offset, the header last. Chunks cut through sections and alignment gaps; the file must be byte
for byte the Python path's, and a failed write must leave nothing behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import xxhash

from tierstore import native, native_page
from tierstore.config import TierStoreConfig
from tierstore.engine import IOEngine
from tierstore.format import PageLayout, SectionSpec
from tierstore.testing.pages import hybrid_namespace, layout_namespace, page_bytes, page_key

pytest.importorskip("numba", reason="the native path needs numba (a vLLM dependency)")


@pytest.fixture(scope="module", autouse=True)
def _compiled() -> None:
    assert native.start(wait=True), native.failure()


def _layout(*sizes: int) -> PageLayout:
    return PageLayout(tuple(SectionSpec(f"s{i}", "uint8", (n,)) for i, n in enumerate(sizes)))


# Section sizes that leave alignment gaps (SECTION_ALIGN 64) and an empty section; two equal
# sections without gaps; the hybrid namespace's Mamba group (4 sections of 2 sizes).
LAYOUTS = {
    "odd_gaps_empty": _layout(1000, 0, 70_001, 333, 5, 4097),
    "two_even": _layout(32_768, 32_768),
    "mamba": hybrid_namespace().groups[2].layout,
}


def _watch_store_kernel(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(code, chunks written by the chunked path) of every store_page kernel call."""
    real = native.page_kernels()
    assert real is not None
    seen: list[tuple[int, int]] = []

    def store(*args: Any) -> Any:
        code = real[1](*args)
        seen.append((int(code), int(args[-1][native_page.STORE_CHUNKS])))
        return code

    monkeypatch.setattr(native, "page_kernels", lambda: (real[0], store, real[2], real[3]))
    return seen


def _store(root: Path, layout: PageLayout, key: bytes, data: bytes, sums: list[int] | None) -> bytes:
    """Store ``data`` from a slot whose gap bytes hold junk; the file's bytes."""
    with IOEngine(root, layout_namespace(layout, 16), 0, staging_slots=1,
                  config=TierStoreConfig.from_dict({"root": str(root), "odirect": "off"})) as eng:
        slot = eng.acquire_slot(10)
        assert slot is not None
        slot.view[:] = data
        for a, b in layout.gaps:
            slot.view[a:b] = b"\xee" * (b - a)  # the store zeroes them before hashing
        [res] = eng.wait([eng.submit_store(key, slot, 16, sums)], 10)
        assert res.ok and res.stored, res.error
        return eng.mapper.path_for(key).read_bytes()


@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
@pytest.mark.parametrize("chunk", [64, 1000, 4096, 5003, 1 << 20])
def test_chunked_store_writes_the_python_paths_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     layout_name: str, chunk: int) -> None:
    layout = LAYOUTS[layout_name]
    key = page_key(21)
    data = page_bytes(layout, key)
    monkeypatch.setattr(native_page, "STORE_CHUNK_BYTES", chunk)
    seen = _watch_store_kernel(monkeypatch)
    chunked = _store(tmp_path / "chunked", layout, key, data, None)
    [(code, chunks)] = seen
    # A page of one chunk or less: the one-shot path (no chunks); else every chunk written.
    assert code == 0 and chunks == (-(-layout.nbytes // chunk) if layout.nbytes > chunk else 0)
    given = _store(tmp_path / "given", layout, key, data, [xxhash.xxh3_64_intdigest(data[a:b]) for a, b in layout.spans])
    assert seen[1] == (0, 0)  # the caller's sums: the one-shot path
    monkeypatch.setattr(native_page, "store_page", lambda *a: None)
    python = _store(tmp_path / "python", layout, key, data, None)
    assert len(seen) == 2
    assert chunked == python and given == python


def test_chunked_store_never_writes_through_an_existing_temp(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """O_EXCL on the chunked path too: a temp name that exists is handed to the Python path
    (which names the error), untouched, and nothing is published."""
    layout = LAYOUTS["two_even"]
    monkeypatch.setattr(native_page, "STORE_CHUNK_BYTES", 4096)
    seen = _watch_store_kernel(monkeypatch)
    with IOEngine(root, layout_namespace(layout, 16), 0, staging_slots=1,
                  config=TierStoreConfig.from_dict({"root": str(root), "odirect": "off"})) as eng:
        key = page_key(22)
        real_temp = eng.mapper.temp_path
        monkeypatch.setattr(eng.mapper, "temp_path",
                            lambda k, final=None: os.path.dirname(real_temp(k, final)) + "/fixed.tmp")
        squatter = Path(eng.mapper.temp_path(key))
        squatter.parent.mkdir(parents=True, exist_ok=True)
        squatter.write_bytes(b"x")
        slot = eng.acquire_slot(10)
        assert slot is not None
        slot.view[:] = page_bytes(layout, key)
        [res] = eng.wait([eng.submit_store(key, slot, 16)], 10)
        assert not res.ok and res.error is not None
        assert seen == [(native.STORE_FAILED, 0)]
        assert squatter.read_bytes() == b"x" and not eng.mapper.path_for(key).exists()


_FAILING_WRITE = """
import json, os, resource, signal, sys
from tierstore import native, native_page
from tierstore.config import TierStoreConfig
from tierstore.engine import IOEngine
from tierstore.format import PageLayout, SectionSpec
from tierstore.testing.pages import layout_namespace, page_bytes, page_key

assert native.start(wait=True), native.failure()
native_page.STORE_CHUNK_BYTES = 4096
real = native.page_kernels()
seen = []
def store(*args):
    code = real[1](*args)
    seen.append((int(code), int(args[-1][native_page.STORE_CHUNKS])))
    return code
native.page_kernels = lambda: (real[0], store, real[2], real[3])
root = sys.argv[1]
layout = PageLayout((SectionSpec("a", "uint8", (40_001,)), SectionSpec("b", "uint8", (24_000,))))
eng = IOEngine(root, layout_namespace(layout, 16), 0, staging_slots=1,
               config=TierStoreConfig.from_dict({"root": root, "odirect": "off"}))
key = page_key(23)
slot = eng.acquire_slot(10)
slot.view[:] = page_bytes(layout, key)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, hard))  # a pwrite past 20 kB fails (EFBIG)
[res] = eng.wait([eng.submit_store(key, slot, 16)], 10)
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
final = eng.mapper.path_for(key)
left = sorted(p.name for p in final.parent.iterdir())
eng.close()
print(json.dumps({"ok": res.ok, "seen": seen, "published": final.exists(), "left": left}))
"""


def test_a_write_failing_mid_page_leaves_no_temp_and_publishes_nothing(root: Path) -> None:
    """The file system refuses a write after a few chunks (RLIMIT_FSIZE, in a child process):
    the kernel removes its temp and hands over (STORE_FAILED); the Python path fails too and
    names the error; no temp file is left and the final name is never created."""
    proc = subprocess.run([sys.executable, "-c", _FAILING_WRITE, str(root)], capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).parents[1])
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    [(code, chunks)] = got["seen"]
    assert code == native.STORE_FAILED and 1 < chunks < 16, got  # failed within the page (16 chunks)
    assert not got["ok"] and not got["published"] and got["left"] == [], got
