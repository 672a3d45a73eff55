"""SectionHasher (tierstore/kernels/checksum.py): xxh3-64 of page sections on the device must be
bit-exact with ``xxhash.xxh3_64_intdigest``.

Targets: cpu (Triton interpreter; needs TRITON_INTERPRET=1 before import, set here where there is
no GPU) with small pages covering every xxh3 length class, and cuda (compiled) with the same
cases plus real-sized layouts (skipped without CUDA).
"""

from __future__ import annotations

import importlib
import os
import sys
import time

import pytest
import torch
import xxhash

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if "tierstore.kernels.checksum" in sys.modules:  # imported earlier, maybe not interpreted
        importlib.reload(sys.modules["tierstore.kernels.checksum"])

from tierstore.format.layout import attention_layout, mamba_layout  # noqa: E402
from tierstore.format.page_layout import PageLayout, SectionSpec  # noqa: E402
from tierstore.kernels.checksum import HAVE_TRITON, SectionHasher  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
ON_CUDA = torch.cuda.is_available()
_NO_INTERPRETER = pytest.mark.skipif(
    not (HAVE_TRITON and INTERPRETED), reason="Triton on CPU tensors needs TRITON_INTERPRET=1 (set where there is no GPU)")
_NO_CUDA = pytest.mark.skipif(not ON_CUDA or INTERPRETED, reason="needs a CUDA device (compiled Triton)")
DEVICES = [
    pytest.param("cpu", id="cpu-interpreted", marks=_NO_INTERPRETER),
    pytest.param("cuda", id="cuda", marks=[pytest.mark.gpu, _NO_CUDA]),
]
MASK64 = 0xFFFFFFFFFFFFFFFF

# Every xxh3 length class with its boundaries: 0, 1-3, 4-8, 9-16, 17-128 (16-byte rounds at
# 32/64/96), 129-240 (rounds up to 15), > 240 (stripes of 64, blocks of 1024, +-1 around them).
CLASS_LENGTHS = (
    0, 1, 2, 3, 4, 5, 7, 8, 9, 12, 15, 16, 17, 31, 32, 33, 63, 64, 65, 96, 97, 127, 128,
    129, 130, 143, 144, 160, 208, 239, 240, 241, 255, 256, 257, 319, 320, 1023, 1024, 1025,
    1087, 1088, 1089, 2047, 2048, 2049, 3071, 3072, 3133, 4096, 4097, 8 * 1024 + 64,
)


def byte_layout(lengths: tuple[int, ...]) -> PageLayout:
    return PageLayout(tuple(SectionSpec(f"s{i}", "uint8", (n,)) for i, n in enumerate(lengths)))


def random_pages(n: int, nbytes: int, seed: int, device: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, nbytes), dtype=torch.uint8, generator=gen).to(device)


def expected(pages: torch.Tensor, layout: PageLayout) -> list[list[int]]:
    host = pages.cpu().numpy()
    return [
        [xxhash.xxh3_64_intdigest(row[o : o + s.nbytes].tobytes()) for o, s in zip(layout.offsets, layout.sections, strict=True)]
        for row in host
    ]


def unsigned(sums: torch.Tensor) -> list[list[int]]:
    assert sums.dtype == torch.int64
    return [[v & MASK64 for v in row] for row in sums.cpu().tolist()]


@pytest.mark.parametrize("device", DEVICES)
def test_every_length_class_bit_exact(device: str) -> None:
    lay = byte_layout(CLASS_LENGTHS)
    pages = random_pages(2, lay.nbytes, 1, device)
    hasher = SectionHasher(lay, device)
    assert hasher.supported and hasher.reason is None
    sums = hasher.hash(pages)
    assert sums.shape == (2, len(CLASS_LENGTHS)) and sums.device == pages.device
    assert unsigned(sums) == expected(pages, lay)


@pytest.mark.parametrize("device", DEVICES)
def test_structured_inputs(device: str) -> None:
    """All-zero, all-0xFF and counting bytes (carries through every 64-bit word and product)."""
    lay = byte_layout((0, 3, 8, 16, 100, 200, 300, 1024, 2500))
    n = lay.nbytes
    pages = torch.stack([
        torch.zeros(n, dtype=torch.uint8),
        torch.full((n,), 255, dtype=torch.uint8),
        (torch.arange(n) % 256).to(torch.uint8),
    ]).to(device)
    assert unsigned(SectionHasher(lay, device).hash(pages)) == expected(pages, lay)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("n", "pad", "shift"), [(3, 0, 0), (2, 5, 0), (1, 0, 1), (3, 0, 3), (2, 8, 8)])
def test_unaligned_pages_and_row_strides(device: str, n: int, pad: int, shift: int) -> None:
    """Odd page sizes, rows with a larger stride and a shifted base (byte-assembled words)."""
    lay = byte_layout((1500, 5, 1025, 250, 1091))
    stride = lay.nbytes + pad
    flat = random_pages(1, n * stride + shift, 7 + n + pad + shift, device)[0]
    pages = flat[shift:].view(n, stride)[:, : lay.nbytes]
    assert unsigned(SectionHasher(lay, device).hash(pages)) == expected(pages, lay)


@pytest.mark.parametrize("device", DEVICES)
def test_model_shaped_layouts(device: str) -> None:
    """Small attention (bf16 [H, T, 2, D]) and Mamba-style layouts built by tierstore.format.layout."""
    att = attention_layout(["l0", "l1", "l2"], 2, 4, 16, "bfloat16")  # 512 B sections
    mamba = mamba_layout(["m0", "m1"], [("conv", (40, 3), "bfloat16"), ("ssm", (2, 8, 12), "float32")])
    for i, lay in enumerate((att, mamba)):
        pages = random_pages(4, lay.nbytes, 20 + i, device)
        assert unsigned(SectionHasher(lay, device).hash(pages)) == expected(pages, lay)


@pytest.mark.parametrize("device", DEVICES)
def test_verify_flags_exactly_the_corrupted_pages(device: str) -> None:
    lay = byte_layout((1100, 7, 150, 300))
    pages = random_pages(5, lay.nbytes, 3, device)
    hasher = SectionHasher(lay, device)
    good = hasher.hash(pages)
    assert hasher.verify(pages, good).cpu().tolist() == [True] * 5
    bad = pages.clone()
    for page, section, at in ((1, 0, 1050), (3, 1, 6), (4, 2, 0)):  # one byte in one section each
        o = lay.offsets[section] + at
        bad[page, o] ^= 0x10
    ok = hasher.verify(bad, good)
    assert ok.dtype == torch.bool and ok.device == pages.device
    assert ok.cpu().tolist() == [True, False, True, False, False]
    # expect from the host (python ints folded to int64) works the same
    host = torch.tensor([[v - (1 << 64) if v >= 1 << 63 else v for v in row] for row in expected(pages, lay)])
    assert hasher.verify(bad, host.to(device)).cpu().tolist() == [True, False, True, False, False]


@pytest.mark.parametrize("device", DEVICES)
def test_hash_into_out_and_check_and_mask(device: str) -> None:
    """``hash(out=)`` writes the given rows (pinned host memory on CUDA: no copy back), and
    ``check_and_mask`` keeps the block ids of pages that match or are skipped, puts -1 in those
    of the others and flags them, reading ids either from the meta rows or another tensor."""
    from tierstore.kernels.checksum import check_and_mask

    lay = byte_layout((1100, 7, 150, 300))
    pages = random_pages(5, lay.nbytes, 4, device)
    hasher = SectionHasher(lay, device)
    host_out = torch.full((6, 4), 7, dtype=torch.int64, pin_memory=device == "cuda")
    hasher.hash(pages, out=host_out[1:])
    if device == "cuda":
        torch.cuda.synchronize()
    assert unsigned(host_out[1:]) == expected(pages, lay) and host_out[0].tolist() == [7] * 4
    with pytest.raises(ValueError, match="out must be"):
        hasher.hash(pages, out=host_out[:3])
    bad = pages.clone()
    bad[1, 3] ^= 1  # page 1 damaged, checked: masked
    bad[4, lay.offsets[3]] ^= 1  # page 4 damaged but skipped: kept
    sums = hasher.hash(bad)
    bpp = 3
    ids = torch.arange(5 * bpp, dtype=torch.int64).view(5, bpp) + 100
    meta = torch.zeros(5, bpp + 4 + 1 + 2, dtype=torch.int64)  # two spare columns: any row stride
    meta[:, :bpp] = ids
    meta[:, bpp : bpp + 4] = hasher.hash(pages).cpu()
    meta[:, bpp + 4] = torch.tensor([0, 0, 0, 0, 1])
    meta[2, bpp + 1] ^= 1 << 40  # page 2: its expected sums are wrong
    meta_d = meta.to(device)
    for ids_in in (meta_d[:, :bpp], ids.to(device)):
        ids_out = torch.full((5, bpp), 9, dtype=torch.int64, device=device)
        ok = torch.full((8,), 9, dtype=torch.uint8, pin_memory=device == "cuda")
        check_and_mask(sums, meta_d, bpp, ids_in, ids_out, ok)
        if device == "cuda":
            torch.cuda.synchronize()
        assert ok[:5].tolist() == [1, 0, 0, 1, 1] and ok[5:].tolist() == [9] * 3
        want = ids.clone()
        want[[1, 2]] = -1
        assert torch.equal(ids_out.cpu(), want)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_batches_and_layouts(device: str) -> None:
    lay = byte_layout((300, 4))
    hasher = SectionHasher(lay, device)
    assert hasher.hash(torch.empty((0, lay.nbytes), dtype=torch.uint8, device=device)).shape == (0, 2)
    empty = SectionHasher(PageLayout(()), device)
    assert empty.hash(torch.empty((2, 0), dtype=torch.uint8, device=device)).shape == (2, 0)
    with pytest.raises(ValueError):
        hasher.hash(torch.zeros((2, lay.nbytes), dtype=torch.int16, device=device))
    with pytest.raises(ValueError):
        hasher.hash(torch.zeros((2, lay.nbytes - 1), dtype=torch.uint8, device=device))


def test_unsupported_on_cpu_without_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    hasher = SectionHasher(byte_layout((10,)), "cpu")
    assert not hasher.supported and hasher.reason
    with pytest.raises(RuntimeError):
        hasher.hash(torch.zeros((1, 10), dtype=torch.uint8))


# --- compiled, real-sized -------------------------------------------------------------------

REAL_LAYOUTS = {
    # dense 8B-class attention: 32 layers x (8 heads x 16 tokens x 2 x 128 x bf16) = 64 KiB each
    "attention-32x64KiB": attention_layout([f"l{i}" for i in range(32)], 8, 16, 128, "bfloat16"),
    # GDN: 6 layers x (conv 6144 x 3 bf16 = 36,864 B, SSM 32 x 128 x 128 bf16 = 1 MiB)
    "gdn-6x(1MiB+36KiB)": mamba_layout(
        [f"g{i}" for i in range(6)], [("conv", (6144, 3), "bfloat16"), ("ssm", (32, 128, 128), "bfloat16")]
    ),
    "attention-4x256KiB-32tok": attention_layout([f"l{i}" for i in range(4)], 8, 64, 128, "bfloat16"),
}


@pytest.mark.gpu
@_NO_CUDA
@pytest.mark.parametrize("name", list(REAL_LAYOUTS))
def test_real_sized_layouts_bit_exact_on_gpu(name: str) -> None:
    lay = REAL_LAYOUTS[name]
    n = 48
    pages = random_pages(n, lay.nbytes, 11, "cuda")
    hasher = SectionHasher(lay, "cuda")
    sums = hasher.hash(pages)
    assert unsigned(sums) == expected(pages, lay)
    assert hasher.verify(pages, sums).all().item()
    flipped = pages.clone()
    flipped[n // 2, lay.offsets[-1] + lay.sections[-1].nbytes - 1] ^= 1  # the very last byte
    assert hasher.verify(flipped, sums).cpu().tolist() == [i != n // 2 for i in range(n)]


@pytest.mark.gpu
@_NO_CUDA
def test_a_batch_past_2_gib_hashes_bit_exactly_in_two_queued_launches() -> None:
    """A batch of real-sized pages (32 x 256 KiB sections and a short one: the transfer's
    batches of a large model) spanning more than 2 GiB: pages whose bytes lie past 2**31 from
    the batch's start (offsets an int32 cannot hold) hash bit-exactly; a call is one launch per
    kernel (long and short sections) whatever the page count, and only queues them: it returns
    while the stream is still busy (the thread that drives transfers never waits on the GPU)."""
    from tierstore.kernels import checksum

    lay = byte_layout(tuple([256 * 1024] * 32) + (112,))  # rows stay 16-byte aligned
    n = (1 << 31) // lay.nbytes + 4
    assert (n - 3) * lay.nbytes > 1 << 31  # the last three pages start past 2 GiB
    gen = torch.Generator(device="cuda").manual_seed(5)
    pages = torch.randint(0, 256, (n, lay.nbytes), dtype=torch.uint8, device="cuda", generator=gen)
    hasher = SectionHasher(lay, "cuda")
    hasher.hash(pages)  # compiled (or loaded) here, outside the timed call
    torch.cuda.synchronize()

    def launches() -> dict[str, int]:
        return {name: sum(lw.counts().values()) for name, lw in checksum._LAUNCH.items()}

    before = launches()
    torch.cuda._sleep(1_000_000_000)  # ~0.5-1 s of GPU time queued ahead of the hash
    t0 = time.perf_counter()
    sums = hasher.hash(pages)
    took = time.perf_counter() - t0
    done = torch.cuda.Event()
    done.record()
    assert not done.query(), "the stream finished during hash(): it waited for the GPU"
    assert took < 0.1, f"hash() took {took:.3f} s behind a busy stream"
    after = launches()
    assert {k: after[k] - before[k] for k in after} == {"hash_long": 1, "hash_short": 1, "check_mask": 0}
    torch.cuda.synchronize()
    rows = [0, n - 4, n - 3, n - 1]  # the first page, the one across 2 GiB, two past it
    got = unsigned(sums[rows])
    assert got == expected(pages[rows], lay)
