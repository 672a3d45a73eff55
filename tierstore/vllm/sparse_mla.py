"""Sparse MLA / DSA pages (DeepSeek-V3.2, GLM-5): the MLA latent and the lightning indexer's
key cache of every layer, in one page.

vLLM 0.32/0.33 put both caches of a DSA model in ONE KV-cache group (a
``UniformTypeKVCacheSpecs`` of ``MLAAttentionSpec``s, block size 64, prefix-cached by the full
attention manager): per layer ``model.layers.<i>.self_attn.attn`` (the latent, ``[nb, 1, 64,
C]``: 576 model-dtype values per token, kv_lora_rank 512 + rope 64; or ``fp8_ds_mla``: 656 bytes
per token, 512 fp8 + 4 fp32 scales + 64 bf16 rope) and ``model.layers.<i>.self_attn.indexer.
k_cache`` (``cache_role=INDEXER``, ``[nb, 1, 64, 132]`` uint8). The page of such a group is an
MLA page with one ``[T, C]`` section per layer, in the group's layer order; each section's bytes
are the blocks' bytes as vLLM keeps them. For the latent that is token-major rows. For the
indexer it is NOT: each 64-token block holds the 64 x 128 fp8 values first, then the 64 fp32
scales (DeepGEMM's paged layout), and the section keeps that order (a ``[T, 132]`` section
whose rows are the block's bytes in 132-byte steps). Both caches are replicated on every TP
rank (``max_tp_shards`` 1): one ``r0`` file per page, as for a dense latent.

The scheduler's KV-cache config holds only the first layer's spec of such a group (vLLM's
``generate_scheduler_kv_cache_config``), so the layout is derived from the model's config on
both sides (``dsa_layout``: latent width from ``kv_lora_rank`` and ``qk_rope_head_dim``, indexer
width from ``index_head_dim``) and the worker checks it against every layer's spec
(``check_dsa_specs``), refusing at startup with what differs.

Pure functions; no threading concerns.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from tierstore.errors import ConfigError
from tierstore.format.layout import mla_rows_layout
from tierstore.format.page_layout import PageLayout
from tierstore.vllm.deepseek_v4 import V4_REFUSAL

INDEXER_SUFFIX = ".indexer.k_cache"  # the indexer cache's layer name, V3.2 and GLM-5 alike
INDEXER_QUANT_BLOCK = 128  # one fp32 scale per 128 fp8 values of an indexer key
# Latent caches of a DSA model tierstore stores: kv_cache_dtype -> bytes per token (None: the
# model dtype's kv_lora_rank + rope values). fp8_ds_mla keeps its scales inside each token's row.
DSA_LATENT_DTYPES: dict[str, int | None] = {"auto": None, "fp8_ds_mla": 656}


def is_indexer_layer(name: str) -> bool:
    return name.endswith(INDEXER_SUFFIX)


def _role(spec: Any) -> str:
    return str(getattr(getattr(spec, "cache_role", None), "value", "sparse"))


def is_indexer_spec(spec: Any) -> bool:
    """Whether a spec is a DSA indexer's key cache (``cache_role=INDEXER``)."""
    return _role(spec) == "indexer"


def layer_specs(spec: Any) -> list[Any]:
    """The distinct per-layer specs of a group's spec (``UniformTypeKVCacheSpecs`` or one)."""
    inner = getattr(spec, "kv_cache_specs", None)
    out: list[Any] = []
    for s in (inner.values() if inner else [spec]):
        if s not in out:
            out.append(s)
    return out


def is_dsa_group(spec: Any, layer_names: Sequence[str]) -> bool:
    """Whether a KV-cache group holds a DSA model's latent and indexer caches: an indexer layer
    by name, or a spec that leads or is an indexer (the scheduler sees one spec of the group)."""
    return (any(is_indexer_layer(n) for n in layer_names)
            or any(_role(s) == "indexer" or getattr(s, "is_index_group_leader", False) for s in layer_specs(spec)))


def dsa_refusal(spec: Any) -> str | None:
    """Why tierstore cannot store one spec of a DSA group (None: it can): a latent of another
    kv_cache_dtype than ``DSA_LATENT_DTYPES``, an indexer that is not fp8 keys with fp32 scales,
    several tokens per state (DeepSeek-V4), padded pages."""
    if getattr(spec, "tokens_per_state", 1) != 1 or getattr(spec, "model_version", None) is not None:
        return f"a compressed DSA cache (several tokens per state). {V4_REFUSAL}"
    if spec.num_kv_heads != 1 or getattr(spec, "num_head_slots", None) is not None:
        return f"a DSA cache of {spec.num_kv_heads} heads (vLLM keeps one) is not implemented"
    if getattr(spec, "page_size_padded", None) is not None or getattr(spec, "alignment", None) is not None:
        return "a DSA cache with padded (aligned) blocks is not proven"
    if _role(spec) == "indexer":
        if spec.dtype != torch.uint8 or spec.head_size % (INDEXER_QUANT_BLOCK + 4):
            return (f"an indexer key cache of {spec.head_size} {spec.dtype} per token is not the fp8 keys "
                    "with fp32 scales tierstore stores (MXFP4 indexer keys are not implemented)")
        return None
    cache_dtype = str(getattr(spec, "cache_dtype_str", None) or "auto")
    if cache_dtype not in DSA_LATENT_DTYPES:
        return (f"a sparse MLA latent of kv_cache_dtype={cache_dtype} is not implemented "
                f"(stored: {', '.join(DSA_LATENT_DTYPES)})")
    return None


def indexer_row_bytes(hf_config: Any) -> int:
    """Bytes per token of the indexer key cache (vLLM's DeepseekV32IndexerCache): the fp8 key
    plus one fp32 scale per 128 values."""
    dim = int(getattr(hf_config, "index_head_dim", 128))
    return dim + dim // INDEXER_QUANT_BLOCK * 4


def latent_row(hf_config: Any, cache_dtype: str | None, model_dtype: str) -> tuple[int, str]:
    """(bytes or values per token, dtype name) of a DSA model's latent cache."""
    name = str(cache_dtype or "auto")
    if name not in DSA_LATENT_DTYPES:
        raise ConfigError(
            f"tierstore cannot store a sparse MLA latent of kv_cache_dtype={name}: stored are "
            f"{', '.join(DSA_LATENT_DTYPES)}. Set --kv-cache-dtype to one of them, or remove the "
            "kv_transfer_config (TierStoreConnector)")
    packed = DSA_LATENT_DTYPES[name]
    if packed is not None:
        return packed, "uint8"
    return int(hf_config.kv_lora_rank) + int(hf_config.qk_rope_head_dim), model_dtype


def dsa_layout(layer_names: Sequence[str], tokens: int, latent: tuple[int, str], indexer_bytes: int) -> PageLayout:
    """The page of a DSA group: one ``[tokens, C]`` section per layer, in the group's order."""
    return mla_rows_layout([(n, indexer_bytes, "uint8") if is_indexer_layer(n) else (n, *latent)
                            for n in layer_names], tokens)


def spec_row(spec: Any) -> tuple[int, str]:
    """(row width, dtype name) of one layer's cache as vLLM allocates it."""
    width = getattr(spec, "state_content_bytes", None)
    dtype = str(spec.dtype).removeprefix("torch.")
    return (int(width), "uint8") if width else (int(spec.head_size), dtype)


def check_dsa_specs(specs: Mapping[str, Any], layout: PageLayout) -> None:
    """The worker's check: every layer's spec (``UniformTypeKVCacheSpecs.kv_cache_specs``)
    has the row ``dsa_layout`` derived from the model's config. Raises ConfigError naming the
    first layer that does not."""
    for section in layout.sections:
        spec = specs.get(section.name)
        if spec is None:
            continue  # a group of one spec (no per-layer specs): dsa_refusal checked it
        want = (section.shape[1], section.dtype)
        if spec_row(spec) != want or (_role(spec) == "indexer") != is_indexer_layer(section.name):
            raise ConfigError(
                f"tierstore derived a {want[0]}-wide {want[1]} row for {section.name} from the model's "
                f"config, but vLLM allocated {spec_row(spec)} ({_role(spec)} cache): this DSA model's "
                "cache is not the one tierstore knows; remove the kv_transfer_config (TierStoreConnector)")
