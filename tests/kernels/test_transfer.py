"""Transfer path: KV cache -> staging slots -> IOEngine page files -> slots -> another cache.

CPU path in CI (the copier writes straight into the engine's slots); the scratch ring's
bookkeeping is tested with fake events; the CUDA path runs in tests/test_kernels_gpu.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kernel_cases import AttentionCase, bits

from tierstore.kernels import GroupCopier
from tierstore.kernels.transfer import PageTransfer, TransferHandle
from tierstore.kernels.views import make_attention_caches


def test_store_and_load_through_engine_on_cpu(tmp_path: Path) -> None:
    case = AttentionCase("bfloat16", n_pages=3, seed=11)
    views, ids = case.build("LBNHC", 4, "cpu")
    transfer = PageTransfer(GroupCopier(views, case.layout, ids.shape[1], [1] * case.layers))
    keys = [bytes([i + 1]) * 16 for i in range(case.n_pages)]
    with case.engine(tmp_path, slots=4) as engine:
        slots = [engine.acquire_slot() for _ in range(case.n_pages)]
        h = transfer.start_store(ids, slots)
        assert h is not None and h.done() and h.blocks_free()
        jobs = [engine.submit_store(k, s, case.tokens) for k, s in zip(keys, slots, strict=True)]
        results = engine.wait(jobs, timeout=30)
        assert [r.ok for r in results] == [True] * case.n_pages, [r.error for r in results]

        # load into a zeroed cache of another layout and kernel block size
        ids2 = torch.randperm(12, generator=torch.Generator().manual_seed(4))[:12].view(3, 4)
        _, views2 = make_attention_caches("SPLIT_HND", case.layers, 12, case.heads, 2, case.head_size, case.dtype)
        load_transfer = PageTransfer(GroupCopier(views2, case.layout, 4, [1] * case.layers))
        loaded = engine.wait([engine.submit_load(k) for k in keys], timeout=30)
        assert all(r.ok for r in loaded), [r.error for r in loaded]
        by_key = {r.key: r.slot for r in loaded}
        lslots = [by_key[k] for k in keys]
        h2 = load_transfer.start_load(lslots, ids2)
        assert h2 is not None and h2.done()
        for s in lslots:
            engine.release_slot(s)
    assert torch.equal(bits(case.logical_from(views2, ids2)), bits(case.logical))


class _FakeEvent:
    def __init__(self) -> None:
        self.fired = False

    def query(self) -> bool:
        return self.fired


def test_scratch_ring_reserves_frees_in_order_and_wraps() -> None:
    case = AttentionCase("bfloat16")
    views, ids = case.build("LBHNC", 8, "cpu")
    t = PageTransfer(GroupCopier(views, case.layout, 1, [1] * case.layers))
    t.capacity = 8  # exercise the GPU ring bookkeeping without a GPU

    def start(n: int) -> tuple[TransferHandle, _FakeEvent] | None:
        span = t._reserve(n)
        if span is None:
            return None
        ev = _FakeEvent()
        h = TransferHandle("store", [], span, ev, ev)
        t._inflight.append(h)
        return h, ev

    a, ev_a = start(3)
    b, ev_b = start(4)
    assert a.rows == [(0, 3)] and b.rows == [(3, 7)]
    assert start(2) is None  # one row left at the end, none at the front
    ev_a.fired = True
    c, ev_c = start(2)  # wraps: skips row 7, takes rows 0-1
    assert c.rows == [(7, 8), (0, 2)]
    assert start(2) is None  # rows 2..2 free only (3 .. 7 held by b, 7 by c)
    d, _ = start(1)
    assert d.rows == [(2, 3)]
    ev_b.fired = True
    assert t.poll() == [a, b]  # a retired inside _reserve is still handed back, once
    assert t.poll() == []  # c is not done, so d (newer) stays held
    assert t.in_flight == 2
    ev_c.fired = True
    assert t._reserve(6) is None  # c freed; d holds row 2: free = [3, 8) + [0, 2)
    assert t._reserve(5) == [(3, 8)]
    with pytest.raises(ValueError, match="exceeds the transfer scratch"):
        t._reserve(9)


def test_load_with_expected_sums_skips_mismatching_pages_on_cpu() -> None:
    """start_load(expect=...) on CPU checks the slots first; a page that does not match its
    checksums is listed in ``failed`` and its blocks are not written."""
    from tierstore.format.checksums import checksum

    case = AttentionCase("bfloat16", n_pages=3, seed=12)
    views, ids = case.build("LBNHC", 4, "cpu")
    pages = [p.clone() for p in case.expected_pages()]
    lay = case.layout
    sums = [[checksum(memoryview(p.numpy())[o : o + s.nbytes]) for o, s in zip(lay.offsets, lay.sections, strict=True)]
            for p in pages]
    pages[2][5] ^= 0xFF  # damaged in transit: its header sums no longer match
    _, views2 = make_attention_caches("LBNHC", case.layers, int(ids.max()) + 4, case.heads, 4, case.head_size,
                                      case.dtype)
    for v in views2:
        bits(v).fill_(7)
    t = PageTransfer(GroupCopier(views2, lay, 2, [1] * case.layers))
    assert not t.checksums_on_gpu
    h = t.start_load(pages, ids, expect=[sums[0], None, sums[2]])
    assert h is not None and h.done() and h.failed == [2]
    got = case.logical_from(views2, ids)
    assert torch.equal(bits(got[:, :2]), bits(case.logical[:, :2]))
    assert bool((bits(got[:, 2]) == 7).all())
    with pytest.raises(ValueError, match="checksum lists"):
        t.start_load(pages, ids, expect=[None])


def test_warm_up_on_cpu_is_a_no_op() -> None:
    case = AttentionCase("bfloat16")
    views, _ = case.build("LBNHC", 4, "cpu")
    before = [v.clone() for v in views]
    PageTransfer(GroupCopier(views, case.layout, 2, [1] * case.layers)).warm_up()
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(views, before, strict=True))


def test_the_automatic_scratch_holds_two_pages_per_io_thread_within_64_to_512_mib() -> None:
    """transfer_scratch_mib unset: 64 MiB, raised to 2 x io_threads pages, at most 512 MiB and
    the staging slots, at least one page; a set value is used as given."""
    from tierstore.kernels.scratch import transfer_scratch_pages

    mib = 1 << 20
    assert transfer_scratch_pages(72, 8 * mib, None, 4) == 8  # 64 MiB already holds 2 x 4
    assert transfer_scratch_pages(72, 8 * mib, None, 16) == 32  # raised: 256 MiB
    assert transfer_scratch_pages(72, 2 * mib, None, 16) == 32  # 64 MiB holds 32 small pages
    assert transfer_scratch_pages(24, 8 * mib, None, 16) == 24  # never more than the slots
    assert transfer_scratch_pages(200, 16 * mib, None, 64) == 32  # at most 512 MiB
    assert transfer_scratch_pages(72, 1024 * mib, None, 16) == 1  # at least one page
    assert transfer_scratch_pages(72, 8 * mib, 64 * mib, 16) == 8  # the setting, as given
