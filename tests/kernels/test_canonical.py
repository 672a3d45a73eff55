"""Canonical bytes: every byte of a page file is determined by the page's content.

The same logical pages, copied through staging slots (the IOEngine's) pre-filled with
different bytes (0xAA, 0x55, random) before each store, give identical files, for every group
kind (attention bf16/fp8 with kernel-block splits, sliding window, Mamba/GDN with alignment
gaps, MLA), both codecs, both CPU copy backends (torch; Triton interpreted). Writers zero the
gaps whatever their input held; readers reject non-zero gap bytes. GPU variants:
tests/test_kernels_gpu.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import zstandard

from tierstore.config import TierStoreConfig
from tierstore.errors import PageCorrupt, PageFormatError
from tierstore.format.header import Codec, decode_header
from tierstore.format.page import decode_payload, encode_page
from tierstore.format.page_layout import check_gaps, nonzero_gap, zero_gaps
from tierstore.kernels import GroupCopier
from tierstore.kernels.transfer import PageTransfer
from tierstore.rootstore.engine import IOEngine
from tierstore.rootstore.page_read import read_page
from tierstore.testing import golden

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" and not torch.cuda.is_available()
BACKENDS = [pytest.param("torch", id="torch"),
            pytest.param("triton", id="triton-interpreted", marks=pytest.mark.skipif(
                not INTERPRETED, reason="Triton on CPU needs TRITON_INTERPRET=1 and no GPU"))]
FILLS = (0xAA, 0x55, -1)


def _garbage(slot_tensor: torch.Tensor, fill: int) -> None:
    if fill < 0:
        slot_tensor.copy_(torch.randint(0, 256, slot_tensor.shape, dtype=torch.uint8))
    else:
        slot_tensor.fill_(fill)


def _store_through_engine(root: Path, gp: golden.GoldenPage, backend: str, fill: int, codec: str,
                          transfer: bool) -> bytes:
    cfg = TierStoreConfig(root=str(root), codec=codec, zstd_level=golden.ZSTD_LEVEL)
    views, ids, dims, bpp = gp.caches("cpu")
    copier = GroupCopier(views, gp.layout, bpp, dims, backend=backend)
    with IOEngine(root, gp.namespace, 0, config=cfg, staging_slots=1) as eng:
        slot = eng.acquire_slot()
        _garbage(slot.tensor, fill)
        if transfer:
            h = PageTransfer(copier).start_store(ids, [slot])
            assert h is not None and h.done()
        else:
            copier.gather(ids, [slot.tensor])
        (res,) = eng.wait([eng.submit_store(gp.meta.key, slot, gp.meta.token_count)], timeout=30)
        assert res.ok, res.error
        return eng.mapper.path_for(gp.meta.key).read_bytes()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_garbage_in_staging_slots_never_reaches_a_file(tmp_path: Path, backend: str, codec: str) -> None:
    for gp in golden.golden_pages():
        if backend == "triton" and gp.codec == Codec.ZSTD:
            continue  # the same copy as its codec-none twin; keeps the interpreter run short
        files = {_store_through_engine(tmp_path / f"{gp.name}-{fill}-{tr}", gp, backend, fill, codec, tr)
                 for fill in FILLS for tr in (False, True)}
        assert len(files) == 1, f"{gp.name}: {len(files)} different files from one logical page"
        if gp.codec.name.lower() == codec:  # and it is the golden file, byte for byte
            assert files == {(golden.GOLDEN_DIR / gp.filename).read_bytes()}, gp.name


def _gdn() -> golden.GoldenPage:
    return next(g for g in golden.golden_pages() if g.name == "gdn_gaps")


def test_encode_page_zeroes_gaps_of_its_input_and_leaves_the_input_alone() -> None:
    gp = _gdn()
    dirty = bytearray(gp.expected)
    for a, b in gp.layout.gaps:
        dirty[a:b] = b"\x5a" * (b - a)
    for codec in (Codec.NONE, Codec.ZSTD):
        comp = zstandard.ZstdCompressor(level=golden.ZSTD_LEVEL) if codec == Codec.ZSTD else None
        clean = encode_page(gp.meta, gp.layout, gp.expected, codec, comp)
        comp = zstandard.ZstdCompressor(level=golden.ZSTD_LEVEL) if codec == Codec.ZSTD else None
        got = encode_page(gp.meta, gp.layout, dirty, codec, comp)
        assert got[0] == clean[0] and b"".join(map(bytes, got[1])) == b"".join(map(bytes, clean[1]))
    assert nonzero_gap(gp.layout, dirty) == gp.layout.gaps[0]  # the caller's buffer is untouched


@pytest.mark.parametrize("name", ["gdn_gaps", "gdn_gaps_zstd"])
def test_reader_rejects_non_zero_gap_bytes(tmp_path: Path, name: str) -> None:
    gp = next(g for g in golden.golden_pages() if g.name == name)
    data = bytearray((golden.GOLDEN_DIR / gp.filename).read_bytes())
    header = decode_header(data)
    if gp.codec == Codec.NONE:
        pos = header.header_len + gp.layout.gaps[0][0] + 3
    else:  # the padding between the first zstd frame and the second
        e = header.sections[0]
        pos = header.header_len + e.stored_offset + e.stored_len
        assert pos < header.header_len + header.sections[1].stored_offset
    data[pos] = 0x01
    path = tmp_path / gp.filename
    path.write_bytes(bytes(data))
    out = memoryview(bytearray(gp.layout.nbytes))
    with pytest.raises(PageCorrupt, match="non-zero"):
        read_page(path, gp.expectation(), out, zstandard.ZstdDecompressor())


def test_misplaced_zstd_frames_are_not_canonical() -> None:
    gp = next(g for g in golden.golden_pages() if g.name == "gdn_gaps_zstd")
    data = (golden.GOLDEN_DIR / gp.filename).read_bytes()
    header = decode_header(data)
    payload = memoryview(data)[header.header_len:]
    import dataclasses

    moved = dataclasses.replace(header, sections=(header.sections[0], dataclasses.replace(
        header.sections[1], stored_offset=header.sections[1].stored_offset + 64), *header.sections[2:]))
    with pytest.raises(PageFormatError, match="canonical place"):
        decode_payload(moved, payload, memoryview(bytearray(gp.layout.nbytes)), zstandard.ZstdDecompressor())


def test_decode_payload_zeroes_the_gaps_of_a_reused_output_buffer() -> None:
    gp = next(g for g in golden.golden_pages() if g.name == "gdn_gaps_zstd")
    data = (golden.GOLDEN_DIR / gp.filename).read_bytes()
    header = decode_header(data)
    out = bytearray(b"\xcc" * gp.layout.nbytes)
    decode_payload(header, memoryview(data)[header.header_len:], memoryview(out), zstandard.ZstdDecompressor())
    assert bytes(out) == gp.expected


def test_check_and_zero_gaps_helpers() -> None:
    gp = _gdn()
    buf = bytearray(gp.expected)
    check_gaps(gp.layout, buf)
    buf[gp.layout.gaps[1][1] - 1] = 7
    with pytest.raises(PageCorrupt, match="after section 'gdn.1.conv'"):
        check_gaps(gp.layout, buf)
    zero_gaps(gp.layout, buf)
    assert bytes(buf) == gp.expected
