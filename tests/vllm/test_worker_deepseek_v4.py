"""DeepSeek-V4 pages at the worker, on CPU and on a CUDA device (tierstore/vllm/deepseek_v4.py).

No engine runs V4 here (vLLM-CPU's V4 kernels need AMX), so the caches are what vLLM 0.32's own
planner and allocator make for a small V4-Flash-shaped model (five layers, compress ratios
0, 0, 4, 128, 4; fp8_ds_mla; layout BLHNC): ``get_kv_cache_groups``,
``get_kv_cache_config_from_groups`` and ``allocate_kv_cache`` give six groups (sliding-window
latents in three, split by layer pattern; compressed latents with the indexer's keys; the
compressors' states in blocks of 4 and of 8 tokens) over ONE packed allocation whose block
stride every layer shares. That plan is recorded in tests/data/deepseek_v4_plan.json, so the device (no vLLM) builds the same
tensors; with vLLM installed, the first test checks the record still matches what vLLM makes.

Each group's pages are stored from some blocks of one allocation and loaded into other blocks
of a zeroed one through a fresh worker and chain: every page byte comes back, the file's
sections are the pages as vLLM keeps them, and no byte outside the loaded pages (the pads,
the other layers packed in the block, other blocks) is written.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from worker_import import import_worker, run_job

from tierstore.config import TierStoreConfig
from tierstore.format.identity import GroupSpec, Namespace
from tierstore.kernels import GroupCopier
from tierstore.kernels.transfer import PageTransfer
from tierstore.kernels.views import block_bytes_view
from tierstore.tiers import TierChain, close_shared_state

worker_mod, _, _ = import_worker()
from tierstore.vllm.deepseek_v4 import v4_group_layout  # noqa: E402

PLAN = Path(__file__).resolve().parents[1] / "data" / "deepseek_v4_plan.json"
DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (compiled Triton)"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="TRITON_INTERPRET=1 is set")])]
RATIOS = [0, 0, 4, 128, 4]  # V4-Flash's pattern: two window-only layers, then 4 / 128 alternating


def v4_specs() -> dict[str, Any]:
    """The per-layer specs vLLM 0.32 builds for V4 (models/deepseek_v4: attention.py,
    compressor.py; v1/attention/backends/mla/sparse_swa.py) with kv_cache_dtype fp8_ds_mla."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, SlidingWindowMLASpec, get_kv_quant_mode

    quant = get_kv_quant_mode("fp8_ds_mla")
    specs: dict[str, Any] = {}
    for i, r in enumerate(RATIOS):
        p = f"model.layers.{i}.attn"
        specs[f"{p}.swa_cache"] = SlidingWindowMLASpec(
            block_size=64, num_kv_heads=1, max_tp_shards=1, head_size=512, dtype=torch.uint8, sliding_window=128,
            cache_dtype_str="fp8_ds_mla", state_content_bytes=584, alignment=576, model_version="deepseek_v4",
            kv_quant_mode=quant)
        if r > 1:
            specs[p] = MLAAttentionSpec(
                block_size=256, num_kv_heads=1, max_tp_shards=1, head_size=512, dtype=torch.uint8, tokens_per_state=r,
                cache_dtype_str="fp8_ds_mla", alignment=576, model_version="deepseek_v4", kv_quant_mode=quant,
                state_content_bytes=584)
            coff = 1 + (r == 4)
            specs[f"{p}.compressor.state_cache"] = SlidingWindowMLASpec(
                block_size=4 if r == 4 else 8, num_kv_heads=1, max_tp_shards=1, head_size=2 * coff * 512,
                dtype=torch.float32, sliding_window=coff * r, alignment=576)
        if r == 4:
            specs[f"{p}.indexer.k_cache"] = MLAAttentionSpec(
                block_size=256, num_kv_heads=1, max_tp_shards=1, head_size=132, dtype=torch.uint8, tokens_per_state=4,
                alignment=576)
            specs[f"{p}.indexer.compressor.state_cache"] = SlidingWindowMLASpec(
                block_size=4, num_kv_heads=1, max_tp_shards=1, head_size=2 * 2 * 128, dtype=torch.float32,
                sliding_window=8, alignment=576)
    return specs


def vllm_plan(memory: int = 24 << 20) -> dict[str, Any]:
    """What vLLM's planner and allocator make of ``v4_specs()``: groups, and every layer's view."""
    from vllm.config import DeviceConfig, VllmConfig
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    cfg = VllmConfig(device_config=DeviceConfig("cpu"))
    cfg.cache_config.kv_cache_layout = "BLHNC"
    cfg.scheduler_config.disable_hybrid_kv_cache_manager = False
    groups = kv_cache_utils.get_kv_cache_groups(cfg, v4_specs())
    conf = kv_cache_utils.get_kv_cache_config_from_groups(cfg, groups, memory)
    views = allocate_kv_cache(conf, torch.device("cpu"), KVCacheLayout["BLHNC"], None)
    plan: dict[str, Any] = {"num_blocks": conf.num_blocks, "bytes": 0, "groups": []}
    for g in groups:
        specs = g.kv_cache_spec.kv_cache_specs if isinstance(g.kv_cache_spec, UniformTypeKVCacheSpecs) else {
            n: g.kv_cache_spec for n in g.layer_names}
        layers = []
        for name in g.layer_names:
            t, spec = views[name], specs[name]
            layers.append({"name": name, "shape": list(t.shape), "stride": list(t.stride()),
                           "offset": t.storage_offset(), "dtype": str(t.dtype).removeprefix("torch."),
                           "page_bytes": spec.unpadded_page_size_bytes,
                           "sliding_window": getattr(spec, "sliding_window", None),
                           "prefix_cacheable": spec.prefix_cacheable})
            plan["bytes"] = max(plan["bytes"], t.untyped_storage().nbytes())
        plan["groups"].append({"block_size": g.kv_cache_spec.block_size, "layers": layers})
    return plan


@dataclass(frozen=True)
class RecordedSpec:
    """The fields of a vLLM spec ``v4_group_layout`` reads, from the recorded plan."""

    unpadded_page_size_bytes: int
    sliding_window: int | None
    prefix_cacheable: bool


def caches(plan: dict[str, Any], device: str, fill: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The packed allocation and every layer's view, as the plan records them."""
    buf = torch.zeros(plan["bytes"], dtype=torch.int8, device=device)
    if fill:
        gen = torch.Generator().manual_seed(4)
        buf.copy_(torch.randint(-128, 128, (buf.numel(),), generator=gen, dtype=torch.int8).to(device))
    views = {}
    for g in plan["groups"]:
        for lay in g["layers"]:
            typed = buf.view(getattr(torch, lay["dtype"]))
            views[lay["name"]] = torch.as_strided(typed, lay["shape"], lay["stride"], lay["offset"])
    return buf, views


def test_the_recorded_plan_is_what_vllm_makes() -> None:
    pytest.importorskip("vllm.v1.kv_cache_interface")
    made = vllm_plan()
    if os.environ.get("TIERSTORE_WRITE_V4_PLAN") == "1":
        PLAN.write_text(json.dumps(made, indent=1) + "\n")
    assert made == json.loads(PLAN.read_text()), "vLLM plans V4's caches differently now: rewrite the record " \
        "(TIERSTORE_WRITE_V4_PLAN=1) and check the page mapping still holds"
    # window latents (64-token blocks, split by layer pattern), compressed latents + indexer
    # keys (256), the compressors' states (4 and 8)
    assert sorted({g["block_size"] for g in made["groups"]}) == [4, 8, 64, 256]
    strides = {lay["stride"][0] * torch.empty((), dtype=getattr(torch, lay["dtype"])).element_size()
               for g in made["groups"] for lay in g["layers"]}
    assert len(strides) == 1, strides  # one block stride for every layer: a packed allocation


def test_vllm_v4_specs_map_to_opaque_block_pages() -> None:
    pytest.importorskip("vllm.v1.kv_cache_interface")
    from vllm.v1.kv_cache_interface import CircularBufferSpec

    from tierstore.errors import ConfigError
    from tierstore.format.header import GroupKind

    specs = v4_specs()
    kind, layout, window = v4_group_layout({n: s for n, s in specs.items() if n.endswith("swa_cache")}, 1)
    assert kind == GroupKind.SLIDING_WINDOW and window == 128
    assert {s.shape for s in layout.sections} == {(1, 64 * 584)}  # unpadded: 37,376 of the 37,440-byte page
    compressed = {n: s for n, s in specs.items() if n.endswith(".attn") or n.endswith("indexer.k_cache")}
    kind, layout, window = v4_group_layout(compressed, 2)
    assert kind == GroupKind.MLA and window is None
    assert {s.name: s.shape for s in layout.sections} == {
        "model.layers.2.attn": (2, 64 * 584), "model.layers.3.attn": (2, 2 * 584),
        "model.layers.4.attn": (2, 64 * 584), "model.layers.2.attn.indexer.k_cache": (2, 64 * 132),
        "model.layers.4.attn.indexer.k_cache": (2, 64 * 132)}
    ring = CircularBufferSpec(block_size=8, num_kv_heads=1, head_size=1024, head_size_v=0, dtype=torch.float32)
    with pytest.raises(ConfigError, match="not prefix-cacheable"):
        v4_group_layout({"model.layers.2.attn.compressor.state_cache": ring}, 1)


def page_of(view: torch.Tensor, block: int) -> bytes:
    return block_bytes_view(view)[block, 0].cpu().numpy().tobytes()


@pytest.mark.parametrize("device", DEVICES)
def test_every_v4_group_round_trips_through_the_worker(tmp_path: Path, device: str) -> None:
    plan = json.loads(PLAN.read_text())
    nb = plan["num_blocks"]
    _, source = caches(plan, device, fill=True)
    target_buf, target = caches(plan, device, fill=False)
    written = torch.zeros(plan["bytes"], dtype=torch.bool)  # the bytes loads may write
    for gi, g in enumerate(plan["groups"]):
        specs = {lay["name"]: RecordedSpec(lay["page_bytes"], lay["sliding_window"], lay["prefix_cacheable"])
                 for lay in g["layers"]}
        kind, layout, window = v4_group_layout(specs, 1)
        group = GroupSpec(kind, g["block_size"], g["block_size"], tuple(specs), layout, sliding_window=window)
        ns = Namespace(model="test/deepseek-v4", dtype="uint8", groups=(group,), hash_algo="sha256")
        src_blocks, dst_blocks = [nb - 1 - gi, 1 + gi], [gi + 7, nb - 8 - gi]  # a block belongs to one group
        keys = [bytes([gi + 1, k]) * 8 for k in range(len(src_blocks))]
        sources = [block_bytes_view(source[n]) for n in specs]
        for store, views, blocks, job in ((True, sources, src_blocks, 1), (False, None, dst_blocks, 2)):
            if views is None:
                views = [block_bytes_view(target[n]) for n in specs]
            copier = GroupCopier(views, layout, 1, [0] * len(views))
            chain = TierChain(TierStoreConfig(root=str(tmp_path)), ns, 0, staging_slots=8, pin=device == "cuda")
            wg = worker_mod.WorkerGroup(index=0, vllm_group_id=gi, copier=copier, store=chain, blocks_per_chunk=1,
                                        kernel_ratio=1, device=torch.device(device), tokens_per_page=g["block_size"],
                                        transfer=PageTransfer(copier, torch.device(device), scratch_pages=4))
            worker = worker_mod.TierStoreWorker([wg], flush_timeout_s=30.0, defer_limit_s=30.0)
            try:
                run_job(worker, job, store, blocks, keys, g["block_size"])
                if not store:  # the file holds each layer's page as vLLM keeps it
                    [res] = chain.wait([chain.submit_load(keys[0])], 30)
                    assert res.ok, res.error
                    page = bytes(res.slot.view)
                    chain.release_slot(res.slot)
                    for name, (start, end) in zip(specs, layout.spans, strict=True):
                        assert page[start:end] == page_of(source[name], src_blocks[0]), name
            finally:
                worker.shutdown()
                chain.close()
                close_shared_state()
        for lay in g["layers"]:
            for src, dst in zip(src_blocks, dst_blocks, strict=True):
                assert page_of(target[lay["name"]], dst) == page_of(source[lay["name"]], src), (lay["name"], dst)
                start = target[lay["name"]][dst].storage_offset() * target[lay["name"]].element_size()
                written[start:start + lay["page_bytes"]] = True
    # nothing else was written: the pads, the other layers packed in a block, other blocks
    assert not target_buf.view(torch.uint8).cpu()[~written].any()
    assert written.sum() == sum(2 * lay["page_bytes"] for g in plan["groups"] for lay in g["layers"])
