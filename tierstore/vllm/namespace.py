"""Build tierstore's Namespace (and each group's page layout) from a vLLM engine's config.

Contract: ``build_namespace`` is a pure function of the vLLM config, the KV-cache config, the
offloading config and the tierstore config, so the scheduler process and every worker process
derive the same digest without talking to each other. It records everything that changes the
meaning of a page: model id and revision, KV dtype, per offloaded KV-cache group its kind,
block size, tokens per chunk, layer names and canonical page layout (``tierstore.layout``),
the prefix-cache hash algorithm and the seed its first hash depends on, the parallel sizes and
the user's ``namespace_tag``.

Mamba/GDN states are described in the canonical orientation (conv state ``(dim, state_len)``)
whatever ``VLLM_SSM_CONV_STATE_LAYOUT`` the engine uses; ``MambaStates`` tells the worker how
to view its raw pages.

No threading concerns (pure functions over immutable values).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from tierstore.config import TierStoreConfig
from tierstore.errors import ConfigError
from tierstore.format import GroupKind, PageLayout
from tierstore.identity import STABLE_HASH_ALGOS, GroupSpec, Namespace, ParallelLayout
from tierstore.layout import attention_layout, mamba_layout

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec
    from vllm.v1.kv_offload.config import OffloadingConfig


def dtype_name(dtype: torch.dtype | str) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class MambaStates:
    """How one Mamba group's raw page splits into named states (page order)."""

    names: tuple[str, ...]
    canonical_shapes: tuple[tuple[int, ...], ...]  # conv state as (dim, state_len)
    dtypes: tuple[torch.dtype, ...]
    conv_state: str | None  # name of the conv state, if the first state is one
    engine_conv_layout: str  # "SD" or "DS": how the engine stores the conv state


# State names per Mamba kernel family; the first state of these families is a conv state.
_STATE_NAMES = {
    "GDN_ATTN": ("conv", "temporal"),
    "MAMBA1": ("conv", "ssm"),
    "MAMBA2": ("conv", "ssm"),
    "SHORT_CONV": ("conv",),
}


def engine_conv_layout() -> str:
    """The conv-state orientation the engine uses ("SD" = (state_len, dim), "DS")."""
    try:
        from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

        return "DS" if is_conv_state_dim_first() else "SD"
    except ImportError:  # older vLLM: always (state_len, dim)
        return "SD"


def mamba_states(spec: Any) -> MambaStates:
    """Named, canonically oriented states of a ``MambaSpec``."""
    kind = getattr(getattr(spec, "mamba_type", None), "name", "")
    shapes = tuple(tuple(int(d) for d in s) for s in spec.shapes)
    names = _STATE_NAMES.get(kind)
    if names is None or len(names) != len(shapes):
        names = tuple(f"state{i}" for i in range(len(shapes)))
        conv = None
    else:
        conv = "conv"
    layout = engine_conv_layout()
    canonical = list(shapes)
    if conv is not None and layout == "SD":
        state_len, dim = shapes[0]
        canonical[0] = (dim, state_len)
    return MambaStates(names, tuple(canonical), tuple(spec.dtypes), conv, layout)


def _group_kind(spec: KVCacheSpec) -> GroupKind:
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    if isinstance(spec, MambaSpec):
        return GroupKind.MAMBA
    if isinstance(spec, MLAAttentionSpec):
        return GroupKind.MLA
    if isinstance(spec, SlidingWindowSpec):
        return GroupKind.SLIDING_WINDOW
    if isinstance(spec, FullAttentionSpec):
        return GroupKind.ATTENTION
    raise ConfigError(
        f"tierstore cannot store KV-cache groups of type {type(spec).__name__} yet; "
        "use a model with full, sliding-window or Mamba/GDN layers"
    )


def representative_spec(spec: KVCacheSpec) -> KVCacheSpec:
    """One per-layer spec of a group (UniformTypeKVCacheSpecs holds several equal ones)."""
    inner = getattr(spec, "kv_cache_specs", None)
    if inner:
        specs = list(inner.values())
        first = specs[0]
        if any(s != first for s in specs[1:]):
            raise ConfigError("tierstore needs the layers of one KV-cache group to share one spec")
        return first
    return spec


def group_layout(spec: KVCacheSpec, layer_names: tuple[str, ...], tokens_per_chunk: int) -> tuple[GroupKind, PageLayout]:
    """Canonical page layout of one group (one page = ``tokens_per_chunk`` tokens)."""
    spec = representative_spec(spec)
    kind = _group_kind(spec)
    if kind == GroupKind.MAMBA:
        st = mamba_states(spec)
        states = [(n, sh, dtype_name(dt)) for n, sh, dt in zip(st.names, st.canonical_shapes, st.dtypes, strict=True)]
        return kind, mamba_layout(layer_names, states)
    if kind == GroupKind.MLA:
        raise ConfigError("tierstore does not support MLA KV caches yet (DeepSeek-style models)")
    head_size_v = getattr(spec, "head_size_v", spec.head_size)  # type: ignore[attr-defined]
    if head_size_v != spec.head_size:  # type: ignore[attr-defined]
        raise ConfigError("tierstore needs K and V of equal head size")
    quant = getattr(getattr(spec, "kv_quant_mode", None), "name", "NONE")
    if quant not in ("NONE",):
        raise ConfigError(f"tierstore does not support quantized KV caches ({quant}) yet; use kv_cache_dtype=auto")
    return kind, attention_layout(
        layer_names, spec.num_kv_heads, tokens_per_chunk, spec.head_size, dtype_name(spec.dtype),  # type: ignore[attr-defined]
    )


def cpu_attention_isa(spec: Any, cache_dtype: str | None) -> str | None:
    """The CPU attention kernel family vLLM picks for an attention spec; None off CPU.

    The CPU backend's cache layout inside a block depends on it. Verified canonical: "vec"
    (K plane stored transposed [D, N], V plane [N, D]; tests compare pages with the model's
    own K and V). Any other family is stored raw under a namespace marker, never shared.
    """
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return None
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        return str(_get_attn_isa(spec.dtype, spec.block_size, spec.head_size, cache_dtype))
    except (ImportError, AttributeError):
        return None


CANONICAL_CPU_ISAS = frozenset({"vec"})


def hash_seed_marker(hash_algo: str) -> tuple[bool, str]:
    """(stable across processes?, marker) for vLLM's first-block hash seed.

    vLLM seeds its hash chain with PYTHONHASHSEED when set, else a fixed string for sha256*
    and a random per-process value for xxhash*. The marker keeps pages of different seeds
    apart (they could never hit anyway) and flags namespaces that cannot be reused.
    """
    seed = os.environ.get("PYTHONHASHSEED")
    if seed is not None:
        return True, "PYTHONHASHSEED:" + hashlib.sha256(seed.encode()).hexdigest()[:12]
    if hash_algo in STABLE_HASH_ALGOS:
        return True, "default"
    return False, f"random:{os.getpid()}"


def _attention_isa(spec: Any, cache_dtype: str | None) -> str | None:
    spec = representative_spec(spec)
    if not hasattr(spec, "head_size") or not hasattr(spec, "num_kv_heads"):
        return None  # Mamba
    return cpu_attention_isa(spec, cache_dtype)


def build_namespace(
    vllm_config: VllmConfig,
    kv_cache_config: KVCacheConfig,
    offloading_config: OffloadingConfig,
    ts_config: TierStoreConfig,
) -> Namespace:
    groups = []
    for g in offloading_config.groups:
        vgroup = kv_cache_config.kv_cache_groups[g.group_id]
        tokens_per_chunk = g.tokens_per_block * offloading_config.cache.blocks_per_chunk
        # A Mamba page holds the state after a chunk boundary; an attention page the chunk's KV.
        kind, layout = group_layout(vgroup.kv_cache_spec, tuple(g.layer_names), tokens_per_chunk)
        spec = representative_spec(vgroup.kv_cache_spec)
        groups.append(GroupSpec(
            kind=kind,
            block_size=g.tokens_per_block,
            tokens_per_chunk=tokens_per_chunk,
            layer_names=tuple(g.layer_names),
            layout=layout,
            sliding_window=getattr(spec, "sliding_window", None) if kind == GroupKind.SLIDING_WINDOW else None,
        ))
    cache = vllm_config.cache_config
    hash_algo = str(cache.prefix_caching_hash_algo)
    stable, marker = hash_seed_marker(hash_algo)
    par = vllm_config.parallel_config
    extra: list[tuple[str, str]] = [("hash_seed", marker), ("tokens_per_hash", str(offloading_config.cache.tokens_per_hash))]
    if ts_config.namespace_tag:
        extra.append(("tag", ts_config.namespace_tag))
    raw = sorted({
        isa for g in offloading_config.groups
        if (isa := _attention_isa(kv_cache_config.kv_cache_groups[g.group_id].kv_cache_spec, cache.cache_dtype))
        and isa not in CANONICAL_CPU_ISAS
    })
    if raw:  # pages in a CPU kernel's private layout: keep them apart from canonical ones
        extra.append(("kv_layout", "cpu-raw-" + "-".join(raw)))
    model = vllm_config.model_config
    return Namespace(
        model=ts_config.model_id or str(model.model),
        revision=getattr(model, "revision", None),
        dtype=dtype_name(offloading_config.model.dtype),
        groups=tuple(groups),
        hash_algo=hash_algo,
        hash_stable=stable,
        parallel=ParallelLayout(
            tp_size=par.tensor_parallel_size,
            pp_size=par.pipeline_parallel_size,
            dcp_size=par.decode_context_parallel_size,
            pcp_size=getattr(par, "prefill_context_parallel_size", 1),
        ),
        extra=tuple(extra),
    )
