"""Copy kernels compiled on a CUDA GPU: larger random cases against the torch reference, and
the GPU transfer path (side stream, pinned slots, events). The shared cases run on CUDA too,
as the cuda-* targets of tests/test_kernels.py.

Skipped without CUDA. Must not run with TRITON_INTERPRET=1 (the kernels would be interpreted).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (compiled Triton)"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="TRITON_INTERPRET=1 is set"),
]

from kernel_cases import AttentionCase, bits, random_values  # noqa: E402

from tierstore.format.layout import attention_layout  # noqa: E402
from tierstore.kernels import GroupCopier  # noqa: E402
from tierstore.kernels.transfer import PageTransfer  # noqa: E402
from tierstore.kernels.views import ATTENTION_LAYOUTS, make_attention_caches  # noqa: E402


def test_auto_backend_is_triton_on_cuda() -> None:
    case = AttentionCase("bfloat16")
    views, ids = case.build("LBHNC", 8, "cuda")
    assert GroupCopier(views, case.layout, 1, [1, 1]).backend == "triton"


@pytest.mark.parametrize("layout", ATTENTION_LAYOUTS)
@pytest.mark.parametrize("bpp", [1, 2, 4])
def test_real_sized_pages_match_reference(layout: str, bpp: int) -> None:
    """8 heads x 128 dims x 16-token kernel blocks, bf16, 4 layers: Triton == torch, both ways."""
    H, D, N, L, pages = 8, 128, 16, 4, 24
    nb = pages * bpp + 17
    gen = torch.Generator().manual_seed(bpp)
    _, views = make_attention_caches(layout, L, nb, H, N, D, torch.bfloat16, "cuda")
    for v in views:
        v.copy_(random_values(tuple(v.shape), torch.bfloat16, gen).cuda())
    lay = attention_layout([f"l{i}" for i in range(L)], H, N * bpp, D, "bfloat16")
    ids = torch.randperm(nb, generator=gen)[: pages * bpp].view(pages, bpp).cuda()
    tri = GroupCopier(views, lay, bpp, [1] * L, backend="triton")
    ref = GroupCopier(views, lay, bpp, [1] * L, backend="torch")
    a = torch.full((pages, lay.nbytes), 0xA5, dtype=torch.uint8, device="cuda")
    b = torch.full_like(a, 0x5A)
    tri.gather(ids, a)
    ref.gather(ids, b)
    assert torch.equal(a, b)  # whole pages: buffers pre-filled with different bytes agree
    # scatter back into a zeroed copy of the caches: the gathered blocks come back
    _, views2 = make_attention_caches(layout, L, nb, H, N, D, torch.bfloat16, "cuda")
    GroupCopier(views2, lay, bpp, [1] * L, backend="triton").scatter(a, ids)
    flat = ids.reshape(-1)
    for v, v2 in zip(views, views2, strict=True):
        assert torch.equal(bits(v2[flat]), bits(v[flat]))
        keep = torch.ones(nb, dtype=torch.bool, device="cuda")
        keep[flat] = False
        assert not bits(v2[keep]).any()


def test_transfer_store_waits_for_producer_and_does_not_block(tmp_path: Path) -> None:
    """KV written on the current stream behind a long GPU op is what the store gathers; the
    start call returns before the GPU gets there; load scatters back through pinned slots."""
    case = AttentionCase("bfloat16", layers=2, heads=8, head_size=128, tokens=64, n_pages=4, seed=3)
    views, ids = case.build("LBNHC", 16, "cuda")
    copier = GroupCopier(views, case.layout, 4, [1] * case.layers)
    transfer = PageTransfer(copier, scratch_pages=8)
    with case.engine(tmp_path, 8, pin=True) as engine:
        assert engine.pinned
        slots = [engine.acquire_slot() for _ in range(case.n_pages)]
        assert all(s.tensor.is_pinned() for s in slots)
        warm = transfer.start_store(ids, slots)  # compile the kernel before timing anything
        transfer.wait()
        assert warm.done()
        # the "forward pass": a long sleep, then it writes the KV that will be stored
        flat = ids.reshape(-1).cuda()  # made now: a host->device copy later would wait for the sleep
        saved = [v[flat].clone() for v in views]
        for v in views:
            v.zero_()
        torch.cuda._sleep(1_000_000_000)  # ~0.5 s of GPU time on the current stream
        for v, s in zip(views, saved, strict=True):
            v[flat] = s  # queued behind the sleep
        t0 = time.perf_counter()
        h = transfer.start_store(ids, slots)
        start_s = time.perf_counter() - t0
        assert h is not None
        assert not h.done(), "the store finished before the producer's queued work"
        assert start_s < 0.1, f"start_store blocked for {start_s:.3f} s"
        transfer.wait()
        assert h.done() and h.blocks_free()
        got = torch.stack([s.tensor.clone() for s in slots])
        want = case.expected_pages()
        for sec, off in zip(case.layout.sections, case.layout.offsets, strict=True):
            assert torch.equal(got[:, off : off + sec.nbytes], want[:, off : off + sec.nbytes])
        keys = [bytes([i + 7]) * 16 for i in range(case.n_pages)]
        res = engine.wait([engine.submit_store(k, s, case.tokens) for k, s in zip(keys, slots, strict=True)], 60)
        assert all(r.ok for r in res), [r.error for r in res]
        loaded = engine.wait([engine.submit_load(k) for k in keys], 60)
        assert all(r.ok for r in loaded), [r.error for r in loaded]
        by_key = {r.key: r.slot for r in loaded}
        lslots = [by_key[k] for k in keys]
        _, views2 = make_attention_caches("SPLIT_NHD", case.layers, 40, case.heads, 32, case.head_size,
                                          case.dtype, "cuda")
        ids2 = torch.randperm(40)[: case.n_pages * 2].view(case.n_pages, 2)
        lt = PageTransfer(GroupCopier(views2, case.layout, 2, [1] * case.layers), scratch_pages=4)
        h2 = lt.start_load(lslots, ids2)
        assert h2 is not None
        h2.wait_on(torch.cuda.current_stream())
        out = case.logical_from(views2, ids2)  # runs on the current stream, after the load
        lt.wait()
        assert h2.slots_free()
        for s in lslots:
            engine.release_slot(s)
    assert torch.equal(bits(out), bits(case.logical))


def test_transfer_rejects_batch_over_scratch_and_defers_when_full() -> None:
    case = AttentionCase("bfloat16", n_pages=3)
    views, ids = case.build("LBHNC", 8, "cuda")
    transfer = PageTransfer(GroupCopier(views, case.layout, 1, [1] * case.layers), scratch_pages=4)
    slots = [torch.empty(case.layout.nbytes, dtype=torch.uint8).pin_memory() for _ in range(3)]
    with pytest.raises(ValueError, match="exceeds the transfer scratch"):
        transfer.start_store(torch.zeros(5, 1, dtype=torch.int64), [slots[0]] * 5)
    warm = transfer.start_store(ids, slots)  # compiles the kernel
    transfer.wait()
    assert transfer.poll() == [] and warm.done()  # wait() already handed it back
    torch.cuda._sleep(1_000_000_000)  # ~0.5 s of GPU time ahead of the store
    first = transfer.start_store(ids, slots)
    assert first is not None and not first.done()
    assert transfer.start_store(ids[:2], slots[:2]) is None  # 3 of 4 rows held, 2 asked
    assert transfer.poll() == []  # nothing finished; a refused start hands nothing back
    transfer.wait()
    second = transfer.start_store(ids[:2], slots[:2])
    assert second is not None
    second.synchronize()
    assert transfer.poll() == [second]


@pytest.mark.parametrize("pinned", [True, False])
def test_gather_into_host_slots_and_scatter_back(pinned: bool) -> None:
    """CUDA caches <-> host page buffers directly (what a worker without PageTransfer does):
    pinned buffers go through the Triton kernel over PCIe, pageable ones through torch."""
    H, D, N, L, pages, bpp = 8, 128, 16, 4, 6, 4
    nb = pages * bpp + 5
    gen = torch.Generator().manual_seed(7)
    _, views = make_attention_caches("LBNHC", L, nb, H, N, D, torch.bfloat16, "cuda")
    for v in views:
        v.copy_(random_values(tuple(v.shape), torch.bfloat16, gen).cuda())
    lay = attention_layout([f"l{i}" for i in range(L)], H, N * bpp, D, "bfloat16")
    ids = torch.randperm(nb, generator=gen)[: pages * bpp].view(pages, bpp)
    copier = GroupCopier(views, lay, bpp, [1] * L)
    assert copier.backend == "triton"
    slab = torch.full((pages, lay.nbytes), 0xA5, dtype=torch.uint8)
    if pinned:
        slab = slab.pin_memory()
    slots = list(slab)  # separate 1-D page buffers, like staging slots
    copier.gather(ids.cuda(), slots)
    torch.cuda.synchronize()
    want = torch.zeros(pages, lay.nbytes, dtype=torch.uint8, device="cuda")
    GroupCopier(views, lay, bpp, [1] * L, backend="torch").gather(ids.cuda(), want)
    for s, off in zip(lay.sections, lay.offsets, strict=True):
        assert torch.equal(slab[:, off : off + s.nbytes], want[:, off : off + s.nbytes].cpu())
    _, views2 = make_attention_caches("LBHNC", L, nb, H, N, D, torch.bfloat16, "cuda")
    GroupCopier(views2, lay, bpp, [1] * L).scatter(slots, ids.cuda())
    torch.cuda.synchronize()
    flat = ids.reshape(-1).cuda()
    for v, v2 in zip(views, views2, strict=True):
        assert torch.equal(bits(v2[flat]), bits(v[flat]))


def test_transfer_checksums_on_gpu_feed_the_engine_and_catch_damage(tmp_path: Path) -> None:
    """Store: the GPU's section sums equal xxhash of the slot bytes, and the engine writes them
    (a verified read accepts the file). Load with verify=False: the GPU checks the H2D'd bytes
    against the header sums and does not scatter a damaged page (its blocks keep their bytes)."""
    import xxhash

    case = AttentionCase("bfloat16", layers=4, heads=8, head_size=128, tokens=16, n_pages=6, seed=8)
    views, ids = case.build("LBNHC", 16, "cuda")  # sections of 64 KiB: the GIL-bound size on the CPU
    lay = case.layout
    transfer = PageTransfer(GroupCopier(views, lay, 1, [1] * case.layers), scratch_pages=8)
    assert transfer.checksums_on_gpu, transfer.checksum_reason
    keys = [bytes([i + 30]) * 16 for i in range(case.n_pages)]
    with case.engine(tmp_path, 16, pin=True) as engine:
        slots = [engine.acquire_slot() for _ in range(case.n_pages)]
        h = transfer.start_store(ids, slots)
        assert h is not None
        transfer.wait()
        sums = h.sums
        assert sums is not None
        for s, got in zip(slots, sums, strict=True):
            raw = memoryview(s.tensor.numpy())
            assert got == tuple(xxhash.xxh3_64_intdigest(raw[o : o + sec.nbytes])
                                for o, sec in zip(lay.offsets, lay.sections, strict=True))
        res = engine.wait([engine.submit_store(k, s, case.tokens, sums=c)
                           for k, s, c in zip(keys, slots, sums, strict=True)], 60)
        assert all(r.ok and r.stored for r in res), [r.error for r in res]
        checked = engine.wait([engine.submit_load(keys[0])], 60)  # the engine's own check agrees
        assert checked[0].ok and checked[0].verified
        engine.release_slot(checked[0].slot)
        loaded = engine.wait([engine.submit_load(k, verify=False) for k in keys], 60)
        by_key = {r.key: r for r in loaded}
        results = [by_key[k] for k in keys]
        assert all(r.ok and not r.verified for r in results), [r.error for r in results]
        assert [r.sums for r in results] == sums
        results[2].slot.tensor[70_000] ^= 0x40  # damaged after the engine's read (section 1)
        nb = int(ids.max()) + 9
        _, views2 = make_attention_caches("LBHNC", case.layers, nb, case.heads, 16, case.head_size, case.dtype, "cuda")
        for v in views2:
            bits(v).fill_(0x3C)
        lt = PageTransfer(GroupCopier(views2, lay, 1, [1] * case.layers), scratch_pages=8)
        assert lt.checksums_on_gpu
        h2 = lt.start_load([r.slot for r in results], ids, expect=[r.sums for r in results[:5]] + [None])
        assert h2 is not None
        lt.wait()
        assert h2.done() and h2.failed == [2]
        for r in results:
            engine.release_slot(r.slot)
    got = case.logical_from(views2, ids)
    good = [0, 1, 3, 4, 5]
    assert torch.equal(bits(got[:, good]), bits(case.logical[:, good]))
    assert bool((bits(got[:, 2]) == 0x3C).all()), "a page that failed the GPU check was scattered"


@pytest.mark.parametrize("use_driver", [True, False], ids=["driver-calls", "torch-calls"])
def test_adjacent_slots_copy_in_one_piece_and_touch_no_other_frame(tmp_path: Path, use_driver: bool,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Staging slots of adjacent frames, in address order, move in ONE copy each way (the
    scratch rows take the frames' stride). The store writes the pages whole (canonical: the
    torch reference's bytes, zero gaps included) and no byte of the frames outside the batch,
    nor the header room before the first page or the padding after the last; the load puts the
    same bytes back and still masks a page damaged in its slot."""
    import xxhash

    from tierstore.fs.directio import round_up
    from tierstore.kernels import cuda_driver
    from tierstore.kernels.transfer import slot_address

    if not use_driver:  # torch's copies and events (where libcuda cannot be bound)
        monkeypatch.setattr(cuda_driver, "driver", lambda: None)
    case = AttentionCase("bfloat16", layers=2, heads=8, head_size=128, tokens=16, n_pages=6, seed=21)
    views, ids = case.build("LBNHC", 16, "cuda")
    lay = case.layout
    t = PageTransfer(GroupCopier(views, lay, 1, [1] * case.layers), scratch_pages=8)
    assert t.driver_calls == use_driver
    ref = torch.full((case.n_pages, lay.nbytes), 0xA5, dtype=torch.uint8, device="cuda")
    GroupCopier(views, lay, 1, [1] * case.layers, backend="torch").gather(ids.cuda(), ref)
    with case.engine(tmp_path, 8, pin=True) as engine:
        slots = sorted((engine.acquire_slot() for _ in range(8)), key=slot_address)
        for s in slots:
            s.frame[:] = b"\x5a" * len(s.frame)
        batch = slots[1:7]
        h = t.start_store(ids, batch)
        assert h is not None
        t.wait()
        assert t.host_copies == 1, "six adjacent frames should be one device-to-host copy"
        room = len(batch[0].frame) - round_up(lay.nbytes)  # header room before each page
        assert set(bytes(slots[0].frame)) == {0x5A} and set(bytes(slots[7].frame)) == {0x5A}
        assert set(bytes(batch[0].frame[:room])) == {0x5A}
        assert set(bytes(batch[-1].frame[room + lay.nbytes :]) or b"\x5a") == {0x5A}
        got = torch.stack([s.tensor.clone() for s in batch])
        assert torch.equal(got, ref.cpu())
        assert h.sums == [tuple(xxhash.xxh3_64_intdigest(memoryview(s.tensor.numpy())[o : o + sec.nbytes])
                                for o, sec in zip(lay.offsets, lay.sections, strict=True)) for s in batch]
        batch[3].tensor[100] ^= 0x01  # damaged in the slot after the store
        nb = int(ids.max()) + 9
        _, views2 = make_attention_caches("LBHNC", case.layers, nb, case.heads, 16, case.head_size, case.dtype, "cuda")
        for v in views2:
            bits(v).fill_(0x3C)
        lt = PageTransfer(GroupCopier(views2, lay, 1, [1] * case.layers), scratch_pages=8)
        h2 = lt.start_load(batch, ids, expect=h.sums)
        assert h2 is not None
        lt.wait()
        assert lt.host_copies == 1 and h2.failed == [3]
        for s in slots:
            engine.release_slot(s)
    out = case.logical_from(views2, ids)
    good = [0, 1, 2, 4, 5]
    assert torch.equal(bits(out[:, good]), bits(case.logical[:, good]))
    assert bool((bits(out[:, 3]) == 0x3C).all()), "a page that failed the GPU check was scattered"


def test_warm_up_writes_no_block() -> None:
    """warm_up compiles every variant (1, 2, 16 pages) and leaves the cache untouched."""
    case = AttentionCase("bfloat16", layers=2, heads=8, head_size=128, tokens=16, n_pages=4, seed=9)
    views, _ = case.build("LBNHC", 16, "cuda")
    before = [v.clone() for v in views]
    t = PageTransfer(GroupCopier(views, case.layout, 1, [1] * case.layers), scratch_pages=16)
    t.warm_up()
    assert t.in_flight == 0
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(views, before, strict=True))


def test_result_rows_reused_after_retirement_keep_each_handles_results(tmp_path: Path) -> None:
    """A handle's checksums live in per-row pinned buffers that the next transfer reuses: they
    are copied out when the handle retires, so reading them late still gives its own pages'."""
    import xxhash

    case = AttentionCase("bfloat16", layers=2, heads=8, head_size=128, tokens=16, n_pages=4, seed=12)
    views, ids = case.build("LBNHC", 16, "cuda")
    lay = case.layout
    t = PageTransfer(GroupCopier(views, lay, 1, [1] * case.layers), scratch_pages=2)
    assert t.checksums_on_gpu
    with case.engine(tmp_path, 4, pin=True) as engine:
        slots = [engine.acquire_slot() for _ in range(4)]
        first = t.start_store(ids[:2], slots[:2])
        t.wait()  # retired: its results are copied out of rows 0-1
        second = t.start_store(ids[2:], slots[2:])  # the same scratch rows and result rows
        t.wait()
        for h, ss in ((first, slots[:2]), (second, slots[2:])):
            want = [tuple(xxhash.xxh3_64_intdigest(memoryview(s.tensor.numpy())[o : o + sec.nbytes])
                          for o, sec in zip(lay.offsets, lay.sections, strict=True)) for s in ss]
            assert h.sums == want
        assert first.sums != second.sums
        for s in slots:
            engine.release_slot(s)


def test_torch_scatter_of_cuda_ids_does_not_wait_for_the_gpu() -> None:
    """The torch fallback's scatter queues its copies and returns: reading CUDA block ids on the
    host (to skip masked pages) would wait for everything queued before it, e.g. a forward pass."""
    case = AttentionCase("bfloat16", n_pages=3, seed=9)
    views, ids = case.build("LBNHC", 4, "cuda")
    copier = GroupCopier(views, case.layout, 2, [1] * case.layers, backend="torch")
    pages = torch.zeros(case.n_pages, case.layout.nbytes, dtype=torch.uint8, device="cuda")
    ids_dev = ids.cuda()
    copier.scatter(pages, ids_dev)  # first call outside the timing (allocator, lazy init)
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)  # ~0.5 s of GPU time queued ahead
    t0 = time.perf_counter()
    copier.scatter(pages, ids_dev)
    took = time.perf_counter() - t0
    torch.cuda.synchronize()
    assert took < 0.1, f"scatter blocked the host for {took:.3f} s"


# -- canonical bytes and golden files through the GPU paths ----------------------------------

@pytest.mark.parametrize("path", ["gather", "transfer"])
def test_gpu_paths_reproduce_golden_files(path: str) -> None:
    """Compiled Triton gather, and PageTransfer (scratch and pinned slot pre-filled with
    garbage, GPU checksums), give the committed golden files byte for byte (tests/golden/)."""
    from tierstore.format.checksums import section_checksums
    from tierstore.testing import golden

    for fill in (0xAA, 0x55, -1):
        files = {}
        for gp in golden.golden_pages():
            page, sums = golden.page_buffer(gp, "cuda", "triton", path, fill)
            if path == "transfer" and sums is not None:
                assert tuple(sums) == section_checksums(gp.layout, memoryview(page)), gp.name
            files[gp.filename] = golden.file_bytes(gp, page)
        assert golden.check(files=files) == [], (path, fill)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_gpu_gather_writes_gaps_whatever_the_buffer_held(backend: str) -> None:
    """A GDN page with gaps, gathered into device buffers and pinned host slots holding
    different bytes, is the same page (the canonical one)."""
    from tierstore.testing import golden

    gp = next(g for g in golden.golden_pages() if g.name == "gdn_gaps")
    views, ids, dims, bpp = gp.caches("cuda")
    copier = GroupCopier(views, gp.layout, bpp, dims, backend=backend)
    for fill in (0xAA, 0x55, 0xFF):
        dev = torch.full((1, gp.layout.nbytes), fill, dtype=torch.uint8, device="cuda")
        host = [torch.full((gp.layout.nbytes,), fill, dtype=torch.uint8).pin_memory()]
        copier.gather(ids.cuda(), dev)
        copier.gather(ids.cuda(), host)
        torch.cuda.synchronize()
        assert dev.cpu().numpy().tobytes() == gp.expected
        assert host[0].numpy().tobytes() == gp.expected
