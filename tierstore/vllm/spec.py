"""TierStoreOffloadingSpec: ties the scheduler-side manager and the worker-side copier/engines.

The spec is built by ``TierStoreConnector`` (not through vLLM's spec factory) from vLLM's
``OffloadingConfig`` (groups, chunking, parallel layout) plus the tierstore config and
Namespace. ``get_manager`` (scheduler process) needs only paths; ``build_worker`` (worker
process) turns vLLM's registered per-layer KV tensors into strided views in canonical order
(``tierstore.kernels.views``) and opens one page store per group with
``tierstore.tiers.open_rank_store`` (a ``TierChain``: host -> ``local_root`` -> ``root``, or
``root`` alone, a chain of one; head-sliced, inside a ``HeadSliceStore``).

Staging slots per group (``staging_slots_for``): enough for two scheduler steps' worth of
chunks at ``max_num_batched_tokens`` (so a step's stores never wait for a slot), at least
``max(16, 4 x io_threads + 8)``, at most ``STAGING_BYTES_CAP`` of pages; the adapter setting
``staging_slots`` overrides it.

Physical layouts handled: vLLM's logical attention view ``[nb, H, N, 2*D]`` with K|V packed
per token (CUDA backends), the CPU backend's reading of the same bytes as K and V planes per
head (``[H, 2, N, D]`` inside a block), kernel-block splits (``kernel_ratio``) and Mamba/GDN raw
pages (states packed from byte 0; the conv state transposed to ``(dim, state_len)``). Per-tensor fp8
caches are copied as bytes; before anything is stored, the attention layers' loaded k/v scales
are checked against the namespace's ``kv_scales`` (``check_kv_scales``).

Threading: construction only; the objects it returns document their own rules.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
)
from vllm.v1.kv_offload.config import OffloadingConfig

from tierstore.config import TierStoreConfig
from tierstore.errors import ConfigError
from tierstore.format.head_slices import (
    rank_heads,
    segments,
    slice_layout,
)
from tierstore.format.header import GroupKind
from tierstore.format.identity import Namespace
from tierstore.format.page_layout import PageLayout
from tierstore.format.sealing import KeyRing
from tierstore.kernels import GroupCopier
from tierstore.kernels.scratch import transfer_scratch_pages
from tierstore.kernels.transfer import PageTransfer
from tierstore.kernels.views import attention_view, mamba_state_views, mla_view
from tierstore.tiers import head_sliced, listed_tier, lookup_dirs, open_rank_store
from tierstore.vllm.manager import TierStoreManager
from tierstore.vllm.namespace import (
    CANONICAL_CPU_ISAS,
    check_kv_scales,
    cpu_attention_isa,
    kv_head_range,
    mamba_states,
    representative_spec,
)
from tierstore.vllm.page_names import PageNames
from tierstore.vllm.sparse_mla import check_dsa_specs
from tierstore.vllm.worker import TierStoreWorker, WorkerGroup

logger = logging.getLogger("tierstore.vllm")

# Attention backends that read a block's bytes as K and V planes per head ([H, 2, N, D])
# instead of vLLM's logical [H, N, 2*D] with K|V packed per token.
KV_PLANE_BACKENDS = frozenset({"CPU_ATTN"})

# Upper bound of one group's staging pool (pinned host memory on CUDA) when sized automatically.
STAGING_BYTES_CAP = 1 << 30

def staging_slots_for(max_num_batched_tokens: int, tokens_per_chunk: int, page_bytes: int,
                      io_threads: int, override: int | None = None) -> int:
    """Staging slots of one group: two steps' worth of chunks (+1 per step for a chunk a step
    completes that an earlier step started), within [max(16, 4 x io_threads + 8), the byte cap]."""
    if override is not None:
        return override
    floor = max(16, 4 * io_threads + 8)
    per_step = -(-max_num_batched_tokens // tokens_per_chunk) + 1
    cap = max(floor, STAGING_BYTES_CAP // max(page_bytes, 1))
    return min(max(floor, 2 * per_step), cap)


def kv_planes_view(cache: torch.Tensor, head_size: int) -> torch.Tensor:
    """``[nb, H, N, 2*D]`` read as K/V planes per head -> ``[nb, H, N, 2, D]``."""
    nb, heads, n, c = cache.shape
    if c != 2 * head_size or cache.stride(-1) != 1 or cache.stride(2) != c:
        raise ConfigError(f"unexpected CPU attention cache view {tuple(cache.shape)} strides {cache.stride()}")
    s0, s1 = cache.stride(0), cache.stride(1)
    return cache.as_strided((nb, heads, n, 2, head_size), (s0, s1, head_size, n * head_size, 1))


def attention_backend_name(vllm_config: Any, layer_name: str) -> str:
    ctx = getattr(vllm_config.compilation_config, "static_forward_context", {}) or {}
    layer = ctx.get(layer_name)
    backend = getattr(layer, "attn_backend", None)
    if backend is None and layer is not None and hasattr(layer, "get_attn_backend"):
        backend = layer.get_attn_backend()
    try:
        return str(backend.get_name()) if backend is not None else ""
    except Exception:  # noqa: BLE001 - a backend without a name: treat as the standard layout
        return ""


def layer_kv_scales(layer: Any) -> tuple[float, float]:
    """(k_scale, v_scale) an attention layer quantizes its KV with (1.0 when it has none)."""
    return (float(getattr(layer, "_k_scale_float", 1.0)), float(getattr(layer, "_v_scale_float", 1.0)))


class KTransposeFixup:
    """Canonical pages for vLLM's CPU attention kernels of the "vec" family.

    Those kernels keep, per head and block, the K plane transposed (``[D, N]``) and the V plane
    as ``[N, D]``; no single strided view yields ``[H, N, 2, D]`` for both. The copier gathers
    the planes as if both were ``[N, D]`` (V correct, K in K^T order); ``after_gather``
    transposes each block's K in the page buffer, ``before_scatter`` undoes it before a load is
    scattered. Host memory only (CPU backend), one pass over the K bytes.
    """

    def __init__(self, layout: PageLayout, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self.sections = [(off, sec) for off, sec in zip(layout.offsets, layout.sections, strict=True)]

    def _k_views(self, page: torch.Tensor):  # noqa: ANN202 - generator of tensors
        for off, sec in self.sections:
            heads, tokens, _, dim = sec.shape
            t = page[off : off + sec.nbytes].view(getattr(torch, sec.dtype)).view(heads, tokens, 2, dim)
            yield t[:, :, 0, :], heads, tokens // self.block_tokens, dim

    def after_gather(self, page: torch.Tensor) -> None:
        n = self.block_tokens
        for k, heads, blocks, dim in self._k_views(page):
            kt = k.reshape(heads, blocks, n * dim).view(heads, blocks, dim, n)  # K^T order
            k.copy_(kt.transpose(-1, -2).reshape(heads, blocks * n, dim))

    def before_scatter(self, page: torch.Tensor) -> None:
        n = self.block_tokens
        for k, heads, blocks, dim in self._k_views(page):
            kt = k.reshape(heads, blocks, n, dim).transpose(-1, -2).contiguous()
            k.copy_(kt.view(heads, blocks, n, dim).reshape(heads, blocks * n, dim))


class TierStoreOffloadingSpec(OffloadingSpec):
    def __init__(self, config: OffloadingConfig, ts_config: TierStoreConfig, namespace: Namespace,
                 vllm_config: Any, kv_cache_config: Any, staging_slots: int | None = None) -> None:
        super().__init__(config)
        self.staging_slots_override = staging_slots
        self.ts_config = ts_config
        self.namespace = namespace
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        # vLLM group id -> tierstore group index (the order of the offloaded groups)
        self.group_of = {g.group_id: i for i, g in enumerate(config.groups)}
        self.rank = config.parallel.rank
        self._manager: TierStoreManager | None = None
        self._worker: TierStoreWorker | None = None

    @property
    def head_sliced(self) -> bool:
        """Pages are slices readable at any TP (``tiers.head_sliced``)."""
        return head_sliced(self.namespace)

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            tp_size = self.config.parallel.tp_size
            mappers, local_mappers, slices = lookup_dirs(self.ts_config, self.namespace, tp_size)
            self._manager = TierStoreManager(
                mappers, self.group_of, [g.tokens_per_chunk for g in self.namespace.groups],
                [g.kind == GroupKind.MAMBA for g in self.namespace.groups], local_mappers=local_mappers,
                shared_deadline_s=self.ts_config.shared_deadline_s,
                index_refresh_s=self.ts_config.index_refresh_s, slices=slices,
                listed=listed_tier(self.ts_config, self.namespace, tp_size),
                names=PageNames(KeyRing.from_files(self.ts_config.encryption_key_file, self.ts_config.tenant_key_files)
                                if self.ts_config.encryption_key_file else None, self.ts_config.require_cache_salt),
            )
        return self._manager

    def _layer(self, name: str) -> Any:
        ctx = getattr(self.vllm_config.compilation_config, "static_forward_context", {}) or {}
        return ctx.get(name)

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        raise NotImplementedError("TierStoreConnector builds its worker from the raw per-layer caches (build_worker)")

    def build_worker(self, kv_caches: dict[str, torch.Tensor]) -> TierStoreWorker:
        """The worker for this rank, from vLLM's registered per-layer KV tensors."""
        if self._worker is not None:
            return self._worker
        groups = [self._build_group(i, gcfg, gspec, kv_caches)
                  for i, (gcfg, gspec) in enumerate(zip(self.config.groups, self.namespace.groups, strict=True))]
        self._worker = TierStoreWorker(groups, self.ts_config.flush_timeout_s,
                                       defer_limit_s=self.ts_config.deadline_s)
        return self._worker

    def _build_group(self, i: int, gcfg: Any, gspec: Any, kv_caches: dict[str, torch.Tensor]) -> WorkerGroup:
        """One KV-cache group's copier, page store and transfer, for this rank."""
        tp, total_heads = self.config.parallel.tp_size, self.vllm_config.model_config.get_total_num_kv_heads()
        layout = gspec.layout  # this rank's page: its heads of a head-sliced group
        if self.head_sliced and tp > 1:
            mine = rank_heads(segments(self.namespace.groups[i].layout)[0], tp, self.rank)
            layout = slice_layout(gspec.layout, mine)
        vspec = self.kv_cache_config.kv_cache_groups[gcfg.group_id].kv_cache_spec
        if gspec.kind == GroupKind.MAMBA:
            sources, concat = self._mamba_sources(gspec, vspec, kv_caches)
            ratio, k_transposed_tokens, bpp = 1, None, 1
        elif gspec.kind == GroupKind.MLA:  # [nb, N, C] latents (a DSA indexer's rows too), along tokens
            check_dsa_specs(getattr(vspec, "kv_cache_specs", None) or {}, layout)
            sources = [mla_view(kv_caches[sec.name], sec.shape[1]) for sec in layout.sections]
            concat, k_transposed_tokens = [0] * len(sources), None
            ratio = sources[0].shape[0] // self.kv_cache_config.num_blocks
            bpp = self.blocks_per_chunk * ratio
        else:
            sources, concat, ratio, k_transposed_tokens = self._attention_sources(gspec, layout, vspec, kv_caches)
            bpp = self.blocks_per_chunk * ratio
        device = sources[0].device
        copier = GroupCopier(sources, layout, bpp, concat)
        slots = staging_slots_for(self.vllm_config.scheduler_config.max_num_batched_tokens,
                                  gspec.tokens_per_chunk, layout.nbytes, self.ts_config.io_threads,
                                  self.staging_slots_override)
        if gspec.kind == GroupKind.MLA:  # the latent is replicated: every rank's page is the whole one
            heads = (0, 0)
        elif gspec.kind != GroupKind.MAMBA:
            heads = kv_head_range(total_heads, tp, self.rank)
        elif self.head_sliced and tp > 1:  # a Mamba/GDN slice: its units (TP=1 and per-TP: 0/0)
            heads = (mine.start, mine.count)
        else:
            heads = (0, 0)
        if gspec.kind != GroupKind.MAMBA and heads[1] and heads[1] != layout.sections[0].shape[0]:
            raise ConfigError(f"group {i}: rank {self.rank} holds {layout.sections[0].shape[0]} KV heads, "
                              f"expected {heads[1]} (of {total_heads} at tensor_parallel_size={tp})")
        # The header records which KV heads (Mamba/GDN slice: units) this rank's file holds.
        engine = open_rank_store(self.ts_config, self.namespace, i, rank=self.rank, tp_size=tp, layout=layout,
                                 heads=heads, staging_slots=slots, pin=device.type == "cuda")
        scratch_mib = self.ts_config.transfer_scratch_mib
        transfer = PageTransfer(copier, device,
                                scratch_pages=transfer_scratch_pages(
                                    slots, layout.nbytes, scratch_mib << 20 if scratch_mib is not None else None,
                                    self.ts_config.io_threads))
        transfer.warm_up()  # compile now: loading a kernel later could stall a forward pass
        logger.info("tierstore: group %d (%s, %d layers, %d-byte pages) -> %s%s, copier=%s, io=%s, "
                    "%d staging slots, %d transfer scratch pages", i, gspec.kind.name.lower(),
                    len(gspec.layer_names),
                    layout.nbytes, self.ts_config.root or self.ts_config.object_url,
                    f" (local tier {self.ts_config.local_root})" if self.ts_config.local_root else "",
                    copier.backend, engine.stats.get("io_mode"), slots, transfer.capacity)
        return WorkerGroup(
            index=i, vllm_group_id=gcfg.group_id, copier=copier, store=engine,
            blocks_per_chunk=1 if gspec.kind == GroupKind.MAMBA else self.blocks_per_chunk,
            kernel_ratio=ratio, device=device,
            fixup=KTransposeFixup(layout, k_transposed_tokens) if k_transposed_tokens else None,
            tokens_per_page=gspec.tokens_per_chunk,
            transfer=transfer,
            # a replicated MLA latent: rank 0 writes the one file, every rank reads it
            stores_pages=not (gspec.kind == GroupKind.MLA and self.rank > 0),
        )

    def _mamba_sources(self, gspec: Any, vspec: Any, kv_caches: dict[str, torch.Tensor],
                       ) -> tuple[list[torch.Tensor], list[int | None]]:
        """Per-state views of every layer's raw Mamba/GDN cache (canonical state order)."""
        num_blocks = self.kv_cache_config.num_blocks
        states = mamba_states(representative_spec(vspec))
        sources: list[torch.Tensor] = []
        concat: list[int | None] = []
        for layer in gspec.layer_names:
            cache = kv_caches[layer]
            raw = cache.reshape(cache.shape[0], -1) if cache.dim() > 2 else cache
            if raw.shape[0] != num_blocks:
                raise ConfigError(f"Mamba cache of {layer} has {raw.shape[0]} blocks, expected {num_blocks}")
            sources += mamba_state_views(
                raw, list(zip(states.names, states.canonical_shapes, states.dtypes, strict=True)),
                conv_state=states.conv_state, conv_layout=states.engine_conv_layout,
            )
            concat += [None] * len(states.names)
        return sources, concat

    def _attention_sources(self, gspec: Any, layout: Any, vspec: Any, kv_caches: dict[str, torch.Tensor],
                           ) -> tuple[list[torch.Tensor], list[int | None], int, int | None]:
        """Views of every layer's KV cache in the canonical plane order: (sources, concat,
        kernel blocks per vLLM block, tokens per block whose K plane is transposed or None)."""
        num_blocks = self.kv_cache_config.num_blocks
        check_kv_scales(dict(self.namespace.extra).get("kv_scales"),
                        {layer: layer_kv_scales(self._layer(layer)) for layer in gspec.layer_names})
        head_size = layout.sections[0].shape[3]
        isa = cpu_attention_isa(representative_spec(vspec), self.vllm_config.cache_config.cache_dtype)
        sources: list[torch.Tensor] = []
        concat: list[int | None] = []
        ratio, k_transposed_tokens = 1, None
        for layer in gspec.layer_names:
            cache = kv_caches[layer]
            if cache.dim() != 4 or cache.shape[0] % num_blocks:
                raise ConfigError(f"unexpected KV cache view for {layer}: {tuple(cache.shape)}")
            if cache.shape[1] != layout.sections[0].shape[0]:
                raise ConfigError(f"{layer}: this rank's KV cache holds {cache.shape[1]} heads, its pages "
                                  f"{layout.sections[0].shape[0]} (a model whose layers have different "
                                  "KV-head counts is not supported at this tensor_parallel_size)")
            ratio = cache.shape[0] // num_blocks
            if attention_backend_name(self.vllm_config, layer) in KV_PLANE_BACKENDS:
                layer_isa = getattr(self._layer(layer), "isa", isa)
                if layer_isa != isa:
                    raise ConfigError(f"{layer}: CPU attention kernel {layer_isa!r}, expected {isa!r}")
                sources.append(kv_planes_view(cache, head_size))
                if isa in CANONICAL_CPU_ISAS:
                    k_transposed_tokens = cache.shape[2]
            else:
                sources.append(attention_view(cache, head_size))
            concat.append(1)
        return sources, concat, ratio, k_transposed_tokens
