"""Startup checks of a vLLM engine configured with TierStoreConnector.

``validate_engine`` raises ``ConfigError`` (naming the setting and what to do) for setups that
cannot work, logs warnings for setups that work badly, and returns the chunk size in tokens.
It runs in every process that builds the connector, before anything touches the disk.

Checks:
- every offloaded group's KV-cache spec is one tierstore can store (``namespace.refusal``:
  sparse MLA/DSA, DeepSeek-V4's latents, quantized MLA, packed or per-token-quantized caches and
  the rest are refused, naming the spec; a dense MLA latent is stored);
- a dense MLA model runs with no parallelism but TP (its pages are TP-independent: PP, DCP and
  PCP split the latent in ways not proven);
- an MLA model on vLLM-CPU with the in-place rotary custom op on gets a warning naming the
  flag that turns it off (the op leaves MLA keys un-rotated: restored prefixes diverge);
- a Mamba/GDN hybrid needs prefix caching in "align" mode (states exist only at block ends);
- ``chunk_tokens`` must be a multiple of the unified block size N (every group's block), and
  equal to N when the model has sliding-window or Mamba layers (their loads and stores cover
  single blocks inside a chunk);
- ``max_num_batched_tokens`` outside [N, 2N) is warned about for Mamba hybrids: align mode
  materialises a state only at the end of a scheduler step that ends on a block boundary, so a
  budget >= 2N skips boundary states (fewer restorable points) and one < N cannot finish a
  block per step; 2N-1 keeps one full block of prefill per step and leaves N-1 tokens of
  budget for the decodes of other requests in the same step;
- an xxhash-family block hash without PYTHONHASHSEED hashes differently in every process: a
  warning (nothing stored can ever be hit again) and a namespace marker (``hash_seed``).

No threading concerns.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from tierstore.config import TierStoreConfig
from tierstore.errors import ConfigError
from tierstore.format.header import GroupKind
from tierstore.vllm.namespace import group_kind, hash_seed_marker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger("tierstore.vllm")


def _is_full_attention(spec: object) -> bool:
    """Full attention or a dense MLA latent: every token's KV kept, so a page may span blocks."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    inner = getattr(spec, "kv_cache_specs", None)
    specs = list(inner.values()) if inner else [spec]
    return all(type(s) in (FullAttentionSpec, MLAAttentionSpec) for s in specs)


def cpu_rotary_op_enabled(vllm_config: VllmConfig) -> bool:
    """Whether a CPU engine runs vLLM's in-place rotary custom op (``custom_ops`` "all" or
    "+rotary_embedding", not "-rotary_embedding"); False off CPU or when unknown."""
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return False
    except ImportError:
        return False
    ops = list(getattr(getattr(vllm_config, "compilation_config", None), "custom_ops", None) or [])
    if "-rotary_embedding" in ops:
        return False
    return "+rotary_embedding" in ops or "all" in ops


def offloaded_block_sizes(kv_cache_config: KVCacheConfig) -> dict[int, int]:
    """vLLM group id -> tokens per block, for the groups vLLM's offloading would store."""
    ids = kv_cache_config.prefix_cacheable_group_ids
    return {gid: kv_cache_config.kv_cache_groups[gid].kv_cache_spec.block_size for gid in ids}


def validate_engine(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, cfg: TierStoreConfig) -> int:
    """Check the engine setup; returns tokens per stored chunk."""
    from vllm.v1.kv_cache_interface import MambaSpec

    cache = vllm_config.cache_config
    groups = kv_cache_config.kv_cache_groups
    kinds = [group_kind(groups[gid].kv_cache_spec)  # refusals first: one clear error
             for gid in kv_cache_config.prefix_cacheable_group_ids]
    _refuse_split_mla(vllm_config, kinds)
    mamba = [g for g in groups if isinstance(g.kv_cache_spec, MambaSpec)]
    _refuse_mamba_without_align(mamba, cache.enable_prefix_caching)
    _say_mla_and_prefix_caching(vllm_config, kinds)
    chunk, unified = _chunk_tokens(kv_cache_config, cfg)
    budget = vllm_config.scheduler_config.max_num_batched_tokens
    if mamba:
        _warn_mamba_step_budget(budget, unified)
    _warn_unstable_hash(str(cache.prefix_caching_hash_algo))
    return chunk


def _refuse_split_mla(vllm_config: VllmConfig, kinds: list[GroupKind]) -> None:
    """An MLA latent is stored with tensor parallelism only: PP, DCP and PCP are refused."""
    par = getattr(vllm_config, "parallel_config", None)
    split = {name: getattr(par, name, 1) for name in ("pipeline_parallel_size", "decode_context_parallel_size",
                                                      "prefill_context_parallel_size")}
    if GroupKind.MLA in kinds and any(n != 1 for n in split.values()):
        raise ConfigError(
            f"tierstore stores an MLA latent with tensor parallelism only; this engine sets "
            f"{', '.join(f'{k}={v}' for k, v in split.items() if v != 1)}: set them to 1, or remove "
            "the kv_transfer_config (TierStoreConnector)"
        )


def _refuse_mamba_without_align(mamba: list[Any], prefix_caching: bool) -> None:
    """A Mamba/GDN group's states exist only at block ends: prefix caching in 'align' mode."""
    for g in mamba:
        mode = getattr(g.kv_cache_spec, "mamba_cache_mode", "none")
        if mode != "align" or not prefix_caching:
            raise ConfigError(
                "TierStoreConnector needs prefix caching in 'align' mode for Mamba/GDN hybrid "
                f"models (found mamba_cache_mode={mode!r}, enable_prefix_caching="
                f"{prefix_caching}): start vLLM with --enable-prefix-caching "
                "(it selects mamba_cache_mode='align'), or remove the kv_transfer_config"
            )


def _say_mla_and_prefix_caching(vllm_config: VllmConfig, kinds: list[GroupKind]) -> None:
    """Warn about vLLM-CPU's rotary op on an MLA model, and say when prefix caching is off."""
    prefix_caching = vllm_config.cache_config.enable_prefix_caching
    if GroupKind.MLA in kinds and cpu_rotary_op_enabled(vllm_config):
        logger.warning(
            "tierstore: vLLM-CPU's in-place rotary op mangles MLA keys (it assumes contiguous k_pe "
            "rows): the cached KV then depends on how a prompt was split into steps, so a restored "
            "prefix continues differently from a cold run. Start vLLM with --compilation-config "
            "'{\"custom_ops\": [\"-rotary_embedding\"]}' (tests/vllm/test_vllm_mla.py shows why)"
        )
    if not prefix_caching and GroupKind.MLA in kinds:
        logger.info(
            "tierstore: prefix caching is off (vLLM-CPU turns it off for MLA models): every prefix "
            "shared between requests, in this engine too, is loaded from tierstore's pages"
        )
    elif not prefix_caching:
        logger.warning(
            "tierstore: prefix caching is off (--enable-prefix-caching not set); pages are "
            "still stored and restored, but vLLM will not reuse restored blocks between requests"
        )


def _chunk_tokens(kv_cache_config: KVCacheConfig, cfg: TierStoreConfig) -> tuple[int, int]:
    """(tokens per stored chunk, the unified block size N), ``chunk_tokens`` checked against
    the groups' block sizes and layers."""
    sizes = offloaded_block_sizes(kv_cache_config)
    if not sizes:
        raise ConfigError("TierStoreConnector found no prefix-cacheable KV-cache group to store")
    distinct = sorted(set(sizes.values()))
    unified = max(distinct)
    chunk = cfg.chunk_tokens if cfg.chunk_tokens is not None else unified
    if len(distinct) > 1 and cfg.chunk_tokens is not None:
        raise ConfigError(
            f'setting "chunk_tokens" needs every KV-cache group to use one block size; this '
            f"model's groups use {distinct}: remove \"chunk_tokens\" (one block per page)"
        )
    if chunk % unified:
        raise ConfigError(
            f'setting "chunk_tokens" ({chunk}) must be a multiple of the engine\'s unified KV '
            f"block size N={unified} tokens: use {((chunk + unified - 1) // unified) * unified} "
            'or remove "chunk_tokens" (default: one block per page)'
        )
    groups = kv_cache_config.kv_cache_groups
    windowed = [g for g in groups if g.kv_cache_spec.block_size and not _is_full_attention(g.kv_cache_spec)]
    if chunk != unified and windowed:
        raise ConfigError(
            f'setting "chunk_tokens" ({chunk}) must equal the block size N={unified} for models '
            "with sliding-window or Mamba/GDN layers (their pages are restored block by block): "
            'remove "chunk_tokens"'
        )
    return chunk, unified


def _warn_mamba_step_budget(budget: int, unified: int) -> None:
    """A Mamba hybrid's ``max_num_batched_tokens`` outside [N, 2N) (the module docstring says why)."""
    if not unified <= budget < 2 * unified:
        logger.warning(
            "tierstore: max_num_batched_tokens=%d is outside [N, 2N) = [%d, %d) for this Mamba "
            "hybrid: align-mode states exist only where a scheduler step ends on a block "
            "boundary, so %s. Set --max-num-batched-tokens %d (2N-1: one full block of prefill "
            "per step plus N-1 tokens for other requests' decodes).",
            budget, unified, 2 * unified,
            "some block boundaries get no stored state (shorter restores)" if budget >= 2 * unified
            else "a step cannot finish a block",
            2 * unified - 1,
        )


def _warn_unstable_hash(algo: str) -> None:
    """A block hash seeded at random in every process: nothing stored now can be hit again."""
    stable, _ = hash_seed_marker(algo)
    if not stable:
        logger.warning(
            "tierstore: prefix_caching_hash_algo=%r without PYTHONHASHSEED hashes blocks with a "
            "random seed in every process, so pages stored now can never be hit after a restart "
            "or on another node. Set PYTHONHASHSEED to the same value everywhere, or use "
            "--prefix-caching-hash-algo sha256_cbor. The namespace is marked unstable.",
            algo,
        )
