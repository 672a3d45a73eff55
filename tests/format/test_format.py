"""Page format: round trips through publish/read, and property tests on the header codec."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tierstore.errors import (
    PageCorrupt,
    PageError,
    PageForeign,
    PageFormatError,
    PageKeyMismatch,
    PageMissing,
)
from tierstore.format.checksums import checksum
from tierstore.format.header import (
    FLAG_MAC,
    FORMAT_VERSION,
    HEADER_ALIGN,
    MAGIC,
    MAX_PAGE_BYTES,
    PREAMBLE_LEN,
    Codec,
    GroupKind,
    PageExpectation,
    PageMeta,
    SectionEntry,
    decode_header,
    encode_header,
)
from tierstore.format.identity import Namespace
from tierstore.format.page import encode_page
from tierstore.format.page_layout import DTYPES, SECTION_ALIGN, PageLayout, SectionSpec
from tierstore.fs.mapper import FileMapper
from tierstore.rootstore.page_read import inspect_page, read_page
from tierstore.rootstore.publish import publish_page
from tierstore.testing import (
    hybrid_namespace,
    page_bytes,
    page_key,
    page_meta,
    read_stored,
    simple_namespace,
    write_page,
)

CODECS = [Codec.NONE, Codec.ZSTD]

# (label, namespace factory, group index): every group kind of the hybrid namespace and a
# one-group namespace per model dtype, fp8 included (stored as bytes).
CASES = [
    ("hybrid-full-attn-bf16", lambda: hybrid_namespace(), 0),
    ("hybrid-swa-bf16", lambda: hybrid_namespace(), 1),
    ("hybrid-mamba-bf16+fp32", lambda: hybrid_namespace(), 2),
    ("hybrid-mamba-fp16+fp16", lambda: hybrid_namespace(dtype="float16", ssm_dtype="float16"), 2),
    ("dense-fp16", lambda: simple_namespace("float16"), 0),
    ("dense-bf16", lambda: simple_namespace("bfloat16"), 0),
    ("dense-fp32", lambda: simple_namespace("float32"), 0),
    ("dense-fp8-e4m3", lambda: simple_namespace("float8_e4m3fn"), 0),
    ("dense-fp8-e5m2", lambda: simple_namespace("float8_e5m2"), 0),
    ("swa-fp16", lambda: simple_namespace("float16", kind=GroupKind.SLIDING_WINDOW), 0),
]


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.name.lower())
@pytest.mark.parametrize(("label", "make_ns", "group"), CASES, ids=[c[0] for c in CASES])
def test_round_trip(root: Path, label: str, make_ns, group: int, codec: Codec) -> None:
    ns: Namespace = make_ns()
    key = page_key(7)
    page = write_page(root, ns, group, key, codec=codec, token_count=11)
    assert page.stored
    assert read_stored(root, ns, page) == page.data
    header = inspect_page(page.path, zstandard.ZstdDecompressor())
    m = header.meta
    assert (m.namespace, m.key, m.group_index, m.group_kind, m.token_count, m.rank) == (
        ns.digest_bytes, key, group, ns.groups[group].kind, 11, 0)
    assert header.codec == codec
    assert header.layout == ns.groups[group].layout
    size = page.path.stat().st_size
    assert size == header.header_len + header.payload_len
    if codec == Codec.NONE:
        assert header.header_len == HEADER_ALIGN  # small pages: one 4 KiB header block
        assert header.payload_len == ns.groups[group].layout.nbytes
        # The payload is byte for byte the page buffer (zero-copy load).
        assert page.path.read_bytes()[header.header_len :] == page.data


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.name.lower())
def test_same_page_gives_same_bytes(tmp_path: Path, codec: Codec) -> None:
    ns = hybrid_namespace()
    a = write_page(tmp_path / "a", ns, 2, page_key(1), codec=codec)
    b = write_page(tmp_path / "b", ns, 2, page_key(1), codec=codec)
    assert a.path.read_bytes() == b.path.read_bytes()


def test_publish_existing_counts_as_stored(root: Path, hybrid_ns: Namespace) -> None:
    first = write_page(root, hybrid_ns, 0, page_key(3))
    before = first.path.read_bytes()
    again = write_page(root, hybrid_ns, 0, page_key(3), seed=99)  # different bytes, same key
    assert first.stored and not again.stored
    assert first.path.read_bytes() == before
    assert [p.name for p in first.path.parent.iterdir()] == [first.path.name]  # no temp left


def test_read_checks_expectation(root: Path, hybrid_ns: Namespace) -> None:
    page = write_page(root, hybrid_ns, 0, page_key(1))
    layout = hybrid_ns.groups[0].layout
    out = memoryview(bytearray(layout.nbytes))
    good = PageExpectation(hybrid_ns.digest_bytes, page.key, 0, 0, layout)
    read_page(page.path, good, out)
    assert bytes(out) == page.data
    other_ns = hybrid_namespace(model="other/model")
    cases = [
        (PageExpectation(other_ns.digest_bytes, page.key, 0, 0, layout), PageForeign),
        (PageExpectation(hybrid_ns.digest_bytes, page_key(2), 0, 0, layout), PageKeyMismatch),
        (PageExpectation(hybrid_ns.digest_bytes, page.key, 1, 0, layout), PageKeyMismatch),
        (PageExpectation(hybrid_ns.digest_bytes, page.key, 0, 1, layout), PageKeyMismatch),
        (PageExpectation(hybrid_ns.digest_bytes, page.key, 0, 0, hybrid_namespace(head_size=32).groups[0].layout),
         PageFormatError),
    ]
    for expect, error in cases:
        with pytest.raises(error):
            read_page(page.path, expect, out)
    with pytest.raises(PageMissing):
        read_page(FileMapper(root, hybrid_ns.digest, 0).path_for(page_key(9)), good, out)


@pytest.mark.parametrize("num_layers", [1, 24, 64])
def test_header_is_the_smallest_aligned_block_that_holds_it(num_layers: int) -> None:
    layers = [f"model.layers.{i}.self_attn" for i in range(num_layers)]
    layout = PageLayout(tuple(SectionSpec(n, "bfloat16", (8, 16, 2, 128)) for n in layers))
    meta = PageMeta(bytes(16), bytes(32), 0, GroupKind.ATTENTION, 16)
    header, _ = encode_page(meta, layout, bytes(layout.nbytes))
    # per section: u16 name length, name, u8 dtype, u8 ndim, 4 x u32 dims, 4 x u64
    table = sum(2 + len(n.encode()) + 2 + 4 * 4 + 32 for n in layers)
    needed = PREAMBLE_LEN + len(meta.key) + table + 8
    assert len(header) % HEADER_ALIGN == 0
    assert len(header) - HEADER_ALIGN < needed <= len(header)


# -- property tests on the header codec ---------------------------------------------------

_names = st.text(st.characters(min_codepoint=33, max_codepoint=0x2FF), min_size=1, max_size=24)
_dtypes = st.sampled_from(sorted(DTYPES))
_shapes = st.lists(st.integers(0, 40), min_size=0, max_size=4).map(tuple)


@st.composite
def headers(draw: st.DrawFn) -> tuple[PageMeta, Codec, list[SectionEntry], int]:
    names = draw(st.lists(_names, min_size=0, max_size=6, unique=True))
    specs = [SectionSpec(n, draw(_dtypes), draw(_shapes)) for n in names]
    layout = PageLayout(tuple(specs))
    codec = draw(st.sampled_from(CODECS))
    entries = []
    if codec == Codec.NONE:
        for s, off in zip(specs, layout.offsets, strict=True):
            entries.append(SectionEntry(s, off, s.nbytes, draw(st.integers(0, 2**64 - 1))))
        payload_len = layout.nbytes
    else:
        pos = 0
        for s in specs:
            stored = draw(st.integers(0, 5000))
            entries.append(SectionEntry(s, pos, stored, draw(st.integers(0, 2**64 - 1))))
            pos = (pos + stored + SECTION_ALIGN - 1) // SECTION_ALIGN * SECTION_ALIGN
        payload_len = pos + draw(st.integers(0, 100))
    meta = PageMeta(
        namespace=draw(st.binary(min_size=16, max_size=16)),
        key=draw(st.binary(min_size=1, max_size=200)),
        group_index=draw(st.integers(0, 2**32 - 1)),
        group_kind=draw(st.sampled_from(list(GroupKind))),
        token_count=draw(st.integers(0, 2**32 - 1)),
        rank=draw(st.integers(0, 2**32 - 1)),
        head_start=draw(st.integers(0, 2**32 - 1)),
        head_count=draw(st.integers(0, 2**32 - 1)),
    )
    return meta, codec, entries, payload_len


@settings(max_examples=150, deadline=None)
@given(headers())
def test_header_encode_decode_identity(h: tuple[PageMeta, Codec, list[SectionEntry], int]) -> None:
    meta, codec, entries, payload_len = h
    raw = encode_header(meta, codec, entries, payload_len)
    assert len(raw) % HEADER_ALIGN == 0
    dec = decode_header(raw)
    assert dec.meta == meta
    assert dec.codec == codec
    assert list(dec.sections) == entries
    assert dec.payload_len == payload_len
    assert dec.header_len == len(raw)
    assert encode_header(dec.meta, dec.codec, dec.sections, dec.payload_len) == raw


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(headers(), st.data())
def test_any_single_bit_flip_in_header_is_detected(h, data: st.DataObject) -> None:
    meta, codec, entries, payload_len = h
    raw = bytearray(encode_header(meta, codec, entries, payload_len))
    # Bias half the flips into the meaningful part (preamble, key, table, checksum).
    used = PREAMBLE_LEN + len(meta.key) + 64 * len(entries) + 64
    hi = data.draw(st.sampled_from([min(used, len(raw)), len(raw)]))
    pos = data.draw(st.integers(0, hi - 1) | st.integers(len(raw) - 8, len(raw) - 1))
    raw[pos] ^= 1 << data.draw(st.integers(0, 7))
    with pytest.raises(PageError):
        decode_header(bytes(raw))


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=0, max_size=9000))
def test_random_bytes_never_decode(blob: bytes) -> None:
    with pytest.raises(PageError):
        decode_header(blob)


def _preamble_start(version: int = FORMAT_VERSION, flags: int = 0) -> bytes:
    """The first 16 bytes of a one-block header that ``header_len_of`` accepts: magic, this
    tierstore's format version (a header of another version is refused before its checksum is
    looked at, so a test with an old version never reaches the checksum or the parser)."""
    return MAGIC + struct.pack("<HHI", version, flags, HEADER_ALIGN)


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=0, max_size=HEADER_ALIGN - PREAMBLE_LEN - 8),
       st.binary(min_size=PREAMBLE_LEN - 16, max_size=PREAMBLE_LEN - 16),
       st.sampled_from([0, FLAG_MAC]))
def test_random_header_with_valid_magic_never_decodes(tail: bytes, preamble_rest: bytes, flags: int) -> None:
    # Valid magic, version, flags and header length, random everything else: the header
    # checksum must reject it (PageCorrupt, kind "checksum"). Random bytes would mostly fail
    # the parser too, so only the checksum's own error shows that the checksum was checked.
    buf = bytearray(HEADER_ALIGN)
    buf[:16] = _preamble_start(flags=flags)
    buf[16:PREAMBLE_LEN] = preamble_rest
    buf[PREAMBLE_LEN : PREAMBLE_LEN + len(tail)] = tail
    with pytest.raises(PageCorrupt, match="header checksum mismatch"):
        decode_header(bytes(buf))


@st.composite
def _section_entry_bytes(draw: st.DrawFn) -> bytes:
    """One section-table entry, field by field, each field either plausible or broken: a name
    that may be empty or not UTF-8, a dtype code that may be unknown (0 and above the table),
    a raw length that may disagree with the shape, a stored span that may leave the payload."""
    name = draw(st.binary(min_size=0, max_size=6) | _names.map(str.encode))
    code = draw(st.integers(0, max(c for c, _ in DTYPES.values()) + 2))
    shape = draw(st.lists(st.integers(0, 64) | st.integers(0, 2**32 - 1), min_size=0, max_size=4))
    itemsize = next((size for c, size in DTYPES.values() if c == code), 1)
    nbytes = itemsize
    for d in shape:
        nbytes *= d
    raw_len = draw(st.just(nbytes % 2**64) | st.integers(0, 2**64 - 1))
    stored_off = draw(st.integers(0, 4096) | st.integers(0, 2**64 - 1))
    stored_len = draw(st.integers(0, 4096) | st.integers(0, 2**64 - 1))
    return b"".join((
        struct.pack("<H", len(name)), name, struct.pack("<BB", code, len(shape)),
        struct.pack(f"<{len(shape)}I", *shape),
        struct.pack("<QQQQ", raw_len, stored_off, stored_len, draw(st.integers(0, 2**64 - 1))),
    ))


@st.composite
def _checksummed_headers(draw: st.DrawFn) -> bytes:
    """A one-block header with a correct checksum: either random bytes after a valid start, or
    a preamble with small counts and a table of ``_section_entry_bytes`` (which random bytes
    almost never produce), so that every check of the parser is reached."""
    buf = bytearray(HEADER_ALIGN)
    if draw(st.booleans()):
        buf[:16] = _preamble_start()
        buf[16:PREAMBLE_LEN] = draw(st.binary(min_size=PREAMBLE_LEN - 16, max_size=PREAMBLE_LEN - 16))
        tail = draw(st.binary(max_size=400))
    else:
        key = draw(st.binary(min_size=0, max_size=40))
        table = b"".join(draw(st.lists(_section_entry_bytes(), min_size=0, max_size=4)))
        nsec = draw(st.integers(0, 5))  # may disagree with the table drawn
        preamble = struct.pack(
            "<8sHHIQ16sIBBHIIIIH6x", MAGIC, FORMAT_VERSION, draw(st.sampled_from([0, FLAG_MAC])), HEADER_ALIGN,
            draw(st.integers(0, 1 << 14) | st.integers(0, 2**64 - 1)), draw(st.binary(min_size=16, max_size=16)),
            draw(st.integers(0, 3)), draw(st.integers(0, len(GroupKind))), draw(st.integers(0, len(Codec))),
            len(key), draw(st.integers(0, 64)), 0, 0, 0, nsec)
        assert len(preamble) == PREAMBLE_LEN  # the table in page.py's docstring
        buf[:PREAMBLE_LEN] = preamble
        tail = key + table
        tail = tail[: HEADER_ALIGN - PREAMBLE_LEN - 8]
    buf[PREAMBLE_LEN : PREAMBLE_LEN + len(tail)] = tail
    buf[-8:] = struct.pack("<Q", checksum(bytes(buf[:-8])))
    return bytes(buf)


@settings(max_examples=300, deadline=None)
@given(_checksummed_headers())
def test_checksummed_garbage_raises_only_page_errors(raw: bytes) -> None:
    # A crafted header with a correct checksum: it may parse, but anything wrong must come out
    # as the typed PageFormatError (never struct.error, UnicodeDecodeError, ValueError, ...);
    # never as a checksum error, since the checksum is right.
    try:
        header = decode_header(raw)
    except PageFormatError:
        return
    # If it parsed, it is self-consistent.
    assert header.header_len == HEADER_ALIGN
    assert header.layout.nbytes <= MAX_PAGE_BYTES
    for e in header.sections:
        assert e.stored_offset + e.stored_len <= header.payload_len
        assert e.spec.dtype in DTYPES and e.spec.name
    if header.codec == Codec.NONE:
        assert header.payload_len == header.layout.nbytes


@pytest.mark.parametrize("extra", [0, 1])
def test_header_declaring_a_huge_layout_is_rejected(tmp_path: Path, extra: int) -> None:
    # A crafted zstd page with a valid checksum can declare any raw size; readers such as
    # inspect_page allocate it, so the header parser bounds it (MAX_PAGE_BYTES and one more).
    spec = SectionSpec("huge", "uint8", (1 << 20, MAX_PAGE_BYTES >> 20))
    sections = [SectionEntry(spec, 0, 64, 0)]
    if extra:
        sections.append(SectionEntry(SectionSpec("one_more", "uint8", (extra,)), 64, 1, 0))
    meta = PageMeta(bytes(16), b"k", 0, GroupKind.ATTENTION, 1)
    raw = encode_header(meta, Codec.ZSTD, sections, 128)
    if not extra:
        assert decode_header(raw).layout.nbytes == MAX_PAGE_BYTES
        return
    with pytest.raises(PageFormatError, match="more than any page"):
        decode_header(raw)
    path = tmp_path / "huge.kvp"
    path.write_bytes(raw + bytes(128))
    with pytest.raises(PageFormatError, match="more than any page"):
        inspect_page(path, zstandard.ZstdDecompressor())


def test_page_meta_rejects_bad_values() -> None:
    with pytest.raises(PageFormatError):
        PageMeta(bytes(15), b"k", 0, GroupKind.ATTENTION, 1)
    with pytest.raises(PageFormatError):
        PageMeta(bytes(16), b"", 0, GroupKind.ATTENTION, 1)
    meta = page_meta(hybrid_namespace(), 0, page_key(0))
    layout = hybrid_namespace().groups[0].layout
    with pytest.raises(ValueError, match="page buffer"):
        encode_page(meta, layout, page_bytes(layout, page_key(0))[:-1])


def test_publish_failure_is_typed_and_leaves_no_temp(root: Path, hybrid_ns: Namespace, monkeypatch) -> None:
    import errno

    from tierstore.errors import PageStoreError
    from tierstore.rootstore import publish as publish_module

    mapper = FileMapper(root, hybrid_ns.digest, 0)
    key = page_key(4)
    layout = hybrid_ns.groups[0].layout
    header, pieces = encode_page(page_meta(hybrid_ns, 0, key), layout, page_bytes(layout, key))

    def no_space(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    # the step that gives the temp its final name (renameat2 or link: publish.place)
    monkeypatch.setattr(publish_module, "place", no_space)
    with pytest.raises(PageStoreError) as info:
        publish_page(mapper.path_for(key), mapper.temp_path_for(key), header, pieces)
    assert info.value.kind == "enospc"
    assert list(mapper.path_for(key).parent.iterdir()) == []


@pytest.mark.parametrize("key_len", [1, 32, 96])
@pytest.mark.parametrize(("label", "make_ns", "group"), CASES[:3])
def test_header_template_is_encode_header_with_fields_patched(label: str, make_ns, group: int, key_len: int) -> None:
    """HeaderTemplate.fill writes exactly encode_header's bytes; parse reads back only our header."""
    from tierstore.format.header import PREAMBLE_OFFSETS
    from tierstore.format.header_template import HeaderTemplate

    ns = make_ns()
    layout = ns.groups[group].layout
    meta = PageMeta(ns.digest_bytes, b"k" * key_len, group, ns.groups[group].kind, 123, 2, 4, 8)
    tmpl = HeaderTemplate(meta, layout)
    sums = [checksum(bytes([i])) for i in range(len(layout.sections))]
    entries = [SectionEntry(sp, o, sp.nbytes, c) for sp, o, c in zip(layout.sections, layout.offsets, sums, strict=True)]
    ref = encode_header(meta, Codec.NONE, entries, layout.nbytes)
    buf = bytearray(tmpl.header_len)
    tmpl.fill(buf, meta.key, 123, sums)
    assert bytes(buf) == ref and PREAMBLE_OFFSETS["token_count"] == 48  # the docstring's table
    assert tmpl.parse(memoryview(buf), meta.key) == sums
    assert tmpl.parse(memoryview(buf), b"x" * key_len) is None  # another key
    other = encode_header(PageMeta(ns.digest_bytes, meta.key, group, meta.group_kind, 123, 3, 4, 8),
                          Codec.NONE, entries, layout.nbytes)
    assert tmpl.parse(memoryview(other), meta.key) is None  # another rank: not our header
    buf[-1] ^= 1
    assert tmpl.parse(memoryview(buf), meta.key) is None  # a damaged header


def test_pages_of_format_2_are_cleanly_refused(tmp_path, monkeypatch) -> None:
    """Format 3 zeroes alignment gaps (canonical bytes); a format-2 page is not read: the
    reader says which version it found (its tree is another namespace, see test_fsck)."""
    import pytest

    import tierstore.format.header as fmt
    from tierstore.errors import PageFormatError
    from tierstore.format.page import encode_page
    from tierstore.rootstore.page_read import read_page
    from tierstore.testing import golden

    assert fmt.FORMAT_VERSION == 3
    gp = next(g for g in golden.golden_pages() if g.name == "gdn_gaps")
    monkeypatch.setattr(fmt, "FORMAT_VERSION", 2)
    header, pieces = encode_page(gp.meta, gp.layout, gp.expected)
    monkeypatch.undo()
    path = tmp_path / "old.kvp"
    path.write_bytes(header + b"".join(bytes(p) for p in pieces))
    with pytest.raises(PageFormatError, match="unsupported page format version 2; this tierstore reads 3"):
        read_page(path, gp.expectation(), memoryview(bytearray(gp.layout.nbytes)))
    version, old = fmt.decode_header_any_version(path.read_bytes())
    assert (version, old.meta) == (2, gp.meta)  # only fsck --deep reads such headers, to report them


@pytest.mark.parametrize("past", [1, 4096])
def test_a_zstd_section_past_the_payload_is_refused_by_the_header(past: int) -> None:
    # A checksum-valid zstd header whose section table points past the payload: the header
    # decoder refuses it before any reader slices the payload (a slice past the end would be
    # silently short, and inspect_page, fsck and the engine all trust a decoded header's spans).
    spec = SectionSpec("k", "uint8", (64,))
    meta = PageMeta(bytes(16), b"k", 0, GroupKind.ATTENTION, 1)
    inside = encode_header(meta, Codec.ZSTD, [SectionEntry(spec, 0, 64, 0)], 64)
    assert decode_header(inside).payload_len == 64  # the control: the same header, in bounds
    raw = encode_header(meta, Codec.ZSTD, [SectionEntry(spec, 0, 64 + past, 0)], 64)
    with pytest.raises(PageFormatError, match="runs past the payload"):
        decode_header(raw)
