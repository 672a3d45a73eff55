"""fsck's memory against a planted manifest.json, for the pages it cannot verify in pieces: a
zstd page, or a sealed one fsck decrypts, whose layout (as the manifest declares it) needs more
than fsck's memory budget is reported unverified and left alone, never read into a buffer of
the declared size (issue 42, finding 3: plain pages over 8 MiB were already verified in pieces).
Shown failing before the fix: fsck took the declared 256 MiB and ran past 300 s."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import pytest
from hostile_helpers import fsck_per_page

from tierstore.admin.findings import UNREADABLE
from tierstore.admin.fsck import FsckOptions, run_fsck
from tierstore.format.header import Codec, SectionEntry, encode_header
from tierstore.format.identity import write_manifest
from tierstore.format.layout import attention_layout
from tierstore.fs.mapper import FileMapper
from tierstore.testing.pages import layout_namespace, page_key, page_meta

BUDGET = 64 << 20
pytestmark = pytest.mark.timeout(120)  # before the fix: fsck allocated and hashed the declared page


@pytest.mark.parametrize("repair", [False, True])
def test_a_zstd_page_beyond_the_budget_is_reported_not_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            repair: bool) -> None:
    fsck_per_page(monkeypatch)
    root = tmp_path / "root"
    root.mkdir()
    huge = layout_namespace(attention_layout(("l0",), 8, 8192, 1024, "float16"), 8192, model="huge")
    layout = huge.groups[0].layout
    assert layout.nbytes >= 4 * BUDGET
    write_manifest(root, huge)
    key = page_key(1)
    frames = 4096  # a few KiB of frames for a page of 256 MiB: the planter's whole cost
    entries = [SectionEntry(spec, 64 * i, 64, 0) for i, spec in enumerate(layout.sections)]
    header = encode_header(page_meta(huge, 0, key), Codec.ZSTD, entries, frames)
    path = FileMapper(root, huge.digest, 0).path_for(key)
    path.parent.mkdir(parents=True)
    path.write_bytes(header + bytes(frames))
    tracemalloc.start()
    try:
        rep = run_fsck(FsckOptions(root, repair=repair, progress=False, budget_bytes=BUDGET))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < BUDGET // 2, peak
    assert [(p.category, p.kind) for p in rep.problems] == [(UNREADABLE, "too_large")], rep.format_text()
    assert rep.problems[0].action is None and path.exists()  # left for a human, never deleted
    assert rep.exit_code == 4
