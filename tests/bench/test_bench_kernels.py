"""CPU-side pieces of ``tierstore bench kernels`` (the benchmark itself needs a CUDA device)."""

from __future__ import annotations

import time

import pytest

from tierstore.bench import transfer as bk


def test_idle_tracks_progress_and_reports_a_stall(monkeypatch: pytest.MonkeyPatch) -> None:
    before = time.perf_counter()
    last, stalled = bk._idle(True, 0.0)
    assert last >= before and not stalled  # progress: now
    assert bk._idle(False, last) == (last, False)  # no progress yet: unchanged
    monkeypatch.setattr(bk, "STALL_S", 0.0)
    assert bk._idle(False, 0.0) == (0.0, True)


def test_median_run_pairs_ratios_and_keeps_the_spread() -> None:
    runs = [{"store_gbps": g, "store_ratio": r, "verified": v, "case": "c", "raw_files": {"write_gbps": w}}
            for g, r, v, w in ((1.0, 0.5, True, 2.0), (3.0, 0.9, True, 4.0), (2.0, 0.7, False, 3.0))]
    out = bk.median_run(runs)
    assert out["store_gbps"] == 2.0 and out["store_ratio"] == 0.7 and out["raw_files"] == {"write_gbps": 3.0}
    assert out["verified"] is False  # every repeat must verify
    assert out["repeats"] == 3 and [r["store_ratio"] for r in out["per_repeat"]] == [0.5, 0.9, 0.7]


@pytest.mark.parametrize("kind", ["attention", "mla"])
def test_worker_pipelines_store_and_load_a_case_on_the_cpu(tmp_path, kind: str) -> None:
    """The transfer benchmark drives the vLLM worker's pipelines; on the CPU (torch copier, no
    scratch) a store then a load into poisoned blocks gives back the gathered pages (an MLA
    latent case too: vLLM's [nb, 1, N, C] caches through ``mla_view``)."""
    import torch

    from tierstore.bench import kernels as kern
    from tierstore.config import TierStoreConfig
    from tierstore.format.identity import GroupKind
    from tierstore.kernels import GroupCopier
    from tierstore.kernels.transfer import PageTransfer
    from tierstore.rootstore.engine import IOEngine
    from tierstore.testing.pages import layout_namespace

    if kind == "mla":
        case = kern.build_mla(kern.MlaShape("tiny mla", 2, 24, 16, 2, torch.bfloat16), 6, "cpu")
    else:
        case = kern.build_attention(kern.AttnShape("tiny", 2, 2, 16, 16, 2, torch.float16, ("LBNHC",)),
                                    "LBNHC", 6, "cpu")
    views, lay, bpp, cds = case.copier_args
    copier = GroupCopier(views, lay, bpp, cds, backend="torch")
    want = torch.zeros(6, lay.nbytes, dtype=torch.uint8)
    copier.gather(case.ids, want)
    assert want.any()
    ns = layout_namespace(lay, 32, kind=GroupKind.MLA if kind == "mla" else GroupKind.ATTENTION)
    config = TierStoreConfig(root=str(tmp_path), io_threads=2, odirect="off")
    keys = [i.to_bytes(4, "little") * 4 for i in range(6)]
    with IOEngine(tmp_path, ns, 0, config=config, staging_slots=4) as engine:
        pipes = bk.WorkerPipelines(case, engine, PageTransfer(copier, "cpu"), batch=2, tokens=32)
        pipes.run("store", keys, case.ids)
        assert pipes.counters["store_pages_ok"] == 6 and all(engine.contains(k) for k in keys)
        for v in views:
            v[case.block_ids_flat] = 0
        pipes.run("load", keys, case.ids)
        assert pipes.counters["load_pages_ok"] == 6 and engine.free_slots == 4
    got = torch.zeros_like(want)
    copier.gather(case.ids, got)
    assert torch.equal(got, want)
    with IOEngine(tmp_path, ns, 0, config=config, staging_slots=4) as engine:
        pipes = bk.WorkerPipelines(case, engine, PageTransfer(copier, "cpu"), batch=2, tokens=32)
        with pytest.raises(RuntimeError, match="load job failed"):
            pipes.run("load", [b"missing-page-key"], case.ids[:1])


def test_default_slots_never_below_the_vllm_workers_floor() -> None:
    """The transfer benchmark stages as deep as the worker does (spec.staging_slots_for's floor
    is 4 x io_threads + 8), and three batches when that is more."""
    assert bk.default_slots(8, 16) == 72  # 24 slots (3 x batch) would be under the floor
    assert bk.default_slots(32, 4) == 96
    assert bk.default_slots(1, 1) == 12
