"""Build tierstore's Namespace (and each group's page layout) from a vLLM engine's config.

Contract: ``build_namespace`` is a pure function of the vLLM config, the KV-cache config, the
offloading config and the tierstore config, so the scheduler process and every worker process
derive the same digest without talking to each other. It records everything that changes the
meaning of a page: model id and revision, KV dtype, per offloaded KV-cache group its kind,
block size, tokens per chunk, layer names and canonical page layout (``tierstore.format.layout``),
the prefix-cache hash algorithm and the seed its first hash depends on, the parallel sizes and
the user's ``namespace_tag``. A model whose offloaded groups are attention / sliding window,
Gated DeltaNet, Mamba1/2 or short conv is stored as slices readable at any tensor-parallel size
(``head_sliced``; docs/DESIGN.md §9, ``format/head_slices.py``): its namespace records the full
(TP=1) layouts and ``tp_size`` 1 whatever the engine's TP, so it is the TP=1 namespace,
unchanged. A TP whose slices would not be the engine's rank pages (a Mamba group's units not
divisible by it, states sharded another way) keeps its TP in the namespace. A quantized
(per-tensor fp8) KV cache adds its element type (``kv_cache_dtype``: float8_e4m3fn /
float8_e5m2, also the sections' dtype and the namespace dtype) and what fixes its per-layer
scales (``kv_scales``: "unit" or a digest of the checkpoint's scale tensors), so fp8 and bf16
pages, or pages quantized with other scales, never share a namespace. Other KV quantization modes are refused at startup.
A dense MLA latent (DeepSeek-V2/V3, Kimi K2: vLLM's ``MLAAttentionSpec``) is an MLA group, one
``[T, kv_lora_rank + rope]`` section per layer (``mla_refusal`` names what is refused: sparse
MLA / DSA and its indexer cache, DeepSeek-V4, quantized or padded latents). The latent is
replicated on every TP rank, so an all-MLA model's namespace records ``tp_size`` 1 at any TP
(``mla_replicated``): one ``r0`` file per page, written by rank 0, read by every rank.

Mamba/GDN states are described in the canonical orientation (conv state ``(dim, state_len)``)
whatever ``VLLM_SSM_CONV_STATE_LAYOUT`` the engine uses; ``MambaStates`` tells the worker how
to view its raw pages.

No threading concerns (pure functions over immutable values).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import xxhash

from tierstore.config import TierStoreConfig
from tierstore.errors import ConfigError
from tierstore.format.head_slices import rank_heads, slice_layout, slice_units
from tierstore.format.header import GroupKind
from tierstore.format.identity import STABLE_HASH_ALGOS, GroupSpec, Namespace, ParallelLayout
from tierstore.format.layout import attention_layout, mamba_layout, mla_layout
from tierstore.format.page_layout import PageLayout, SectionSpec
from tierstore.format.sealing import PageSealer
from tierstore.vllm.deepseek_v4 import V4_REFUSAL
from tierstore.vllm.sparse_mla import (
    dsa_layout,
    dsa_refusal,
    indexer_row_bytes,
    is_dsa_group,
    is_indexer_spec,
    latent_row,
    layer_specs,
)

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


# Spec classes tierstore refuses, by name (checked before the classes they derive from):
# what the pages would need that tierstore does not have yet.
REFUSED_SPECS: dict[str, str] = {
    "SlidingWindowMLASpec": f"a sliding-window MLA cache (DeepSeek-V4). {V4_REFUSAL}",
    "HiddenStateCacheSpec": "a hidden-state cache (extract_hidden_states), not a KV cache",
    "CircularBufferSpec": "a compressor ring buffer (DeepSeek-V4.1): one block per request, never "
                          "prefix-cached, so nothing to store",
    "HiSparseHotSpec": "a HiSparse hot cache: per-request, not prefix-cacheable",
    "HiSparseResidentSpec": "a HiSparse resident cache: not prefix-cacheable by token blocks",
    "ChunkedLocalAttentionSpec": "chunked local attention (Llama 4): loads would have to follow "
                                 "the attention chunks, not implemented",
    "RSWASpec": "reference sliding-window attention: vLLM evicts gap blocks mid-request",
    "EncoderOnlyAttentionSpec": "an encoder-only cache: nothing to reuse across requests",
    "CrossAttentionSpec": "a cross-attention (encoder) cache: nothing to reuse across requests",
}


def describe_spec(spec: Any) -> str:
    """One line naming a KV-cache spec and the fields that decide its page layout."""
    fields = ("block_size", "num_kv_heads", "head_size", "head_size_v", "dtype", "kv_quant_mode",
              "sliding_window", "sink_len", "tokens_per_state", "num_head_slots", "cache_dtype_str",
              "model_version")
    parts = [f"{f}={getattr(spec, f)}" for f in fields if getattr(spec, f, None) not in (None, 1) or f == "block_size"]
    return f"{type(spec).__name__}({', '.join(parts)})"


def mla_refusal(spec: Any) -> str | None:
    """Why tierstore cannot store an ``MLAAttentionSpec`` (None: a dense MLA latent it can).

    Stored: DeepSeek-V2/V3's and Kimi K2's dense latent cache, one ``[T, C]`` section per layer
    (C = kv_lora_rank + rope dim, ``head_size``), one latent per token, model dtype; and sparse
    MLA / DSA groups (DeepSeek-V3.2, GLM-5), latent and indexer keys (``sparse_mla.dsa_refusal``).
    Refused, naming what is missing: DeepSeek-V4's latent (``model_version``, compressed
    states), quantized dense latents, aligned/padded pages and DCP-sharded tokens."""
    if is_dsa_group(spec, ()):  # sparse MLA / DSA: the latent and the indexer's keys (sparse_mla.py)
        return dsa_refusal(spec)
    if getattr(spec, "model_version", None) is not None:
        return f"an MLA cache of model_version={spec.model_version!r}. {V4_REFUSAL}"
    if getattr(spec, "tokens_per_state", 1) != 1:
        return f"a compressed MLA cache (several tokens per stored state, DeepSeek-V4). {V4_REFUSAL}"
    if spec.num_kv_heads != 1 or getattr(spec, "num_head_slots", None) is not None:
        return f"an MLA cache of {spec.num_kv_heads} latent heads (dense MLA keeps one) is not implemented"
    quant = getattr(getattr(spec, "kv_quant_mode", None), "name", "NONE")
    if (quant != "NONE" or getattr(spec, "state_content_bytes", None) is not None
            or str(getattr(spec, "cache_dtype_str", None) or "auto") != "auto"):
        return (f"a quantized MLA latent (kv_cache_dtype={getattr(spec, 'cache_dtype_str', None)}, "
                f"kv_quant_mode={quant}) is not proven: use kv_cache_dtype=auto")
    if getattr(spec, "page_size_padded", None) is not None or getattr(spec, "alignment", None) is not None:
        return "an MLA cache with padded (aligned) blocks is not proven"
    return None


def refusal(spec: Any) -> str | None:
    """Why tierstore cannot store a KV-cache spec (None: it can)."""
    for cls in type(spec).__mro__:
        if cls.__name__ in REFUSED_SPECS:
            return REFUSED_SPECS[cls.__name__]
        if cls.__name__ == "MLAAttentionSpec":  # after its refused subclasses (V4 window, hidden states)
            return mla_refusal(spec)
    if not hasattr(spec, "num_kv_heads"):  # Mamba/GDN: states, no attention fields
        return None
    if getattr(spec, "sink_len", None):
        return "a static-sink cache (sink_len tokens kept outside the token blocks) is not implemented"
    if getattr(spec, "num_head_slots", None) is not None or getattr(spec, "state_content_bytes", None) is not None:
        return "a backend-packed page (num_head_slots / state_content_bytes) has no canonical [H, T, 2, D] form yet"
    if getattr(spec, "tokens_per_state", 1) != 1:
        return "a compressed cache (several tokens per stored state) is not implemented"
    quant = getattr(getattr(spec, "kv_quant_mode", None), "name", "NONE")
    if quant not in SUPPORTED_KV_QUANT:
        return (f"kv_quant_mode={quant} keeps per-token scales or packed codes beside the KV bytes, "
                "which tierstore does not copy yet (supported: kv_cache_dtype auto, fp8, fp8_e4m3, fp8_e5m2)")
    head_size = getattr(spec, "head_size", None)
    if head_size is not None and getattr(spec, "head_size_v", head_size) not in (None, head_size):
        return "K and V of different head sizes have no [H, T, 2, D] page yet"
    return None


def is_mla(spec: Any) -> bool:
    """Whether a KV-cache spec is (derives from) vLLM's ``MLAAttentionSpec``."""
    return any(cls.__name__ == "MLAAttentionSpec" for cls in type(spec).__mro__)


def group_kind(spec: KVCacheSpec) -> GroupKind:
    """The kind of a group's pages from its spec (a ``UniformTypeKVCacheSpecs`` too: every
    layer's spec must be storable). Raises ConfigError naming the first spec that is not."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    for one in layer_specs(spec):
        if (why := refusal(one)) is not None:
            spec = one
            break
    else:
        spec = representative_spec(spec)
        why = None
    if why is None and is_mla(spec):
        return GroupKind.MLA
    if why is None and isinstance(spec, MambaSpec):
        return GroupKind.MAMBA
    if why is None and isinstance(spec, SlidingWindowSpec):
        return GroupKind.SLIDING_WINDOW
    if why is None and isinstance(spec, FullAttentionSpec):
        return GroupKind.ATTENTION
    raise ConfigError(
        f"tierstore cannot store this model's KV cache {describe_spec(spec)}: "
        f"{why or 'an unknown KV-cache spec'}. Supported: full attention, sliding window, "
        "Mamba/GDN groups (model dtype or per-tensor fp8) and dense MLA latents (model dtype). "
        "Remove the kv_transfer_config (TierStoreConnector) for this model; README 'Supported models and refusals' lists the rest"
    )


def representative_spec(spec: KVCacheSpec) -> KVCacheSpec:
    """One per-layer spec of a group (UniformTypeKVCacheSpecs holds several equal ones; a DSA
    group's latent and indexer specs: the first latent's, ``sparse_mla``)."""
    specs = layer_specs(spec)
    if len(specs) > 1 and is_dsa_group(spec, ()) and all(is_mla(s) for s in specs):
        return next((s for s in specs if not is_indexer_spec(s)), specs[0])
    if len(specs) > 1:
        raise ConfigError("tierstore needs the layers of one KV-cache group to share one spec")
    return specs[0]


def group_layout(spec: KVCacheSpec, layer_names: tuple[str, ...], tokens_per_chunk: int,
                 kv_dtype: str | None = None, num_kv_heads: int | None = None) -> tuple[GroupKind, PageLayout]:
    """Canonical page layout of one group (one page = ``tokens_per_chunk`` tokens).

    ``kv_dtype``: element type of a quantized cache's bytes (``kv_storage_dtype``), recorded as
    the attention sections' dtype instead of the engine's byte tensors' uint8.
    ``num_kv_heads``: the heads of an attention page (the model's total for head slices; by
    default the rank's, ``spec.num_kv_heads``)."""
    spec = representative_spec(spec)
    kind = group_kind(spec)
    if kind == GroupKind.MAMBA:
        st = mamba_states(spec)
        states = [(n, sh, dtype_name(dt)) for n, sh, dt in zip(st.names, st.canonical_shapes, st.dtypes, strict=True)]
        return kind, mamba_layout(layer_names, states)
    if kind == GroupKind.MLA:  # one latent per token, replicated on every TP rank
        return kind, mla_layout(layer_names, tokens_per_chunk, spec.head_size, dtype_name(spec.dtype))  # type: ignore[attr-defined]
    quant = getattr(getattr(spec, "kv_quant_mode", None), "name", "NONE")
    dtype = dtype_name(spec.dtype)  # type: ignore[attr-defined]
    if kv_dtype is not None and quant != "NONE":
        dtype = kv_dtype  # the engine keeps fp8 as bytes (uint8): record what the bytes are
    heads = num_kv_heads if num_kv_heads is not None else spec.num_kv_heads  # type: ignore[attr-defined]
    return kind, attention_layout(
        layer_names, heads, tokens_per_chunk, spec.head_size, dtype,  # type: ignore[attr-defined]
    )


# KV quantization modes whose pages are the cache bytes alone: one scale per layer (k_scale,
# v_scale), fixed once the weights are loaded and recorded in the namespace (``kv_scales_marker``).
SUPPORTED_KV_QUANT = frozenset({"NONE", "FP8_PER_TENSOR"})
# vLLM's kv_cache_dtype names of per-tensor fp8 caches -> the element type of the stored bytes.
FP8_KV_DTYPES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
# Checkpoint tensors vLLM loads as per-layer KV-cache scales (kv_scale is remapped to k and v).
KV_SCALE_SUFFIXES = (".k_scale", ".v_scale", ".kv_scale")


def kv_storage_dtype(cache_dtype: str | None) -> str | None:
    """Element type of a quantized KV cache's bytes (``kv_cache_dtype`` fp8*); None otherwise.

    "fp8" means the platform's preferred e4m3 variant (fnuz on ROCm)."""
    name = str(cache_dtype or "auto")
    if name not in FP8_KV_DTYPES:
        return None
    if name != "fp8_e5m2":
        try:
            from vllm.platforms import current_platform

            return dtype_name(current_platform.fp8_dtype())
        except (ImportError, AttributeError):
            pass
    return FP8_KV_DTYPES[name]


def _checkpoint_files(model: Any) -> list[Path]:
    """The local safetensors files of the engine's checkpoint (a folder, or the HF cache)."""
    path = Path(str(model.model))
    if not path.is_dir():
        try:
            from huggingface_hub import snapshot_download

            path = Path(snapshot_download(str(model.model), revision=getattr(model, "revision", None),
                                          local_files_only=True, allow_patterns=["*.safetensors"]))
        except Exception as exc:  # noqa: BLE001 - any failure means: not readable here
            raise ConfigError(
                f"tierstore needs the fp8 KV-cache scales of the quantized checkpoint {model.model!r} "
                f"to name its pages, and cannot find its files locally ({exc}): start vLLM from a local "
                "model folder, or use kv_cache_dtype=auto"
            ) from exc
    return sorted(path.glob("*.safetensors"))


def kv_scales_marker(model: Any, cache_dtype: str | None) -> str | None:
    """What fixes the per-layer k_scale/v_scale an fp8 KV cache is quantized with; None when the
    cache is not quantized (scales unused).

    - "unit": no quantization config, so vLLM keeps every scale at 1.0 (``set_default_quant_scales``);
      the worker checks it (``check_kv_scales``).
    - "checkpoint:<digest>": xxh3-128 over the checkpoint's ``*.k_scale``/``*.v_scale``/``*.kv_scale``
      tensors (names and bytes, sorted): the values vLLM loads; another checkpoint revision with
      other scales gets another namespace. A quantized checkpoint without such tensors is "unit".
    Read from the checkpoint files, not the loaded layers, so the scheduler derives the same value.
    """
    if kv_storage_dtype(cache_dtype) is None:
        return None
    if not getattr(model, "quantization", None):
        return "unit"
    from safetensors import safe_open

    h = xxhash.xxh3_128()
    found = 0
    for f in _checkpoint_files(model):
        with safe_open(str(f), framework="pt") as st:
            for name in sorted(k for k in st.keys() if k.endswith(KV_SCALE_SUFFIXES)):  # noqa: SIM118
                t = st.get_tensor(name).float().contiguous()
                h.update(name.encode() + b"\0" + t.numpy().tobytes())
                found += 1
    return f"checkpoint:{h.hexdigest()}" if found else "unit"


def check_kv_scales(marker: str | None, scales: dict[str, tuple[float, float]]) -> None:
    """Worker-side check of the loaded layers' (k_scale, v_scale) against the namespace marker:
    "unit" promises 1.0 everywhere; a page quantized with other scales must never be served."""
    if marker != "unit":
        return
    off = {name: kv for name, kv in scales.items() if kv != (1.0, 1.0)}
    if off:
        name, (k, v) = next(iter(off.items()))
        raise ConfigError(
            f"fp8 KV cache: {len(off)} attention layers (e.g. {name}: k_scale={k}, v_scale={v}) do not "
            "use the unit scales the namespace records for a checkpoint without a quantization "
            "config; tierstore cannot name these pages. Use kv_cache_dtype=auto, or report this setup"
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
    and a random per-process value for xxhash*. The marker says which of these applies and
    flags namespaces that cannot be reused. It records nothing of the seed's value: the seed
    is at most 32 bits, so any digest of it in manifest.json (or in the namespace digest that
    names the directory) could be brute-forced, giving back the secret that keeps block hashes
    (page names) from being computed from a guessed prompt. Pages of different seeds may share
    a namespace; their block hashes differ, so they never hit each other.

    Failure policy: none (reads the environment only).
    """
    if os.environ.get("PYTHONHASHSEED") is not None:
        return True, "PYTHONHASHSEED"
    if hash_algo in STABLE_HASH_ALGOS:
        return True, "default"
    return False, f"random:{os.getpid()}"


def kv_head_range(total_kv_heads: int, tp_size: int, rank: int) -> tuple[int, int]:
    """(head_start, head_count) of the KV heads a tensor-parallel rank holds, as vLLM shards
    them: ``total // tp`` heads each when they divide; when TP exceeds the KV-head count each
    head is replicated on ``tp // total`` consecutive ranks (one head per rank). (0, 0) at
    TP=1: the page holds every KV head (format.py: 0 means "the whole group")."""
    if tp_size <= 1:
        return 0, 0
    heads = rank_heads(total_kv_heads, tp_size, rank)
    return heads.start, heads.count


def _attention_isa(spec: Any, cache_dtype: str | None) -> str | None:
    spec = representative_spec(spec)
    if not hasattr(spec, "head_size") or not hasattr(spec, "num_kv_heads"):
        return None  # Mamba
    return cpu_attention_isa(spec, cache_dtype)


def head_sliced(full_layouts: list[PageLayout], rank_layouts: list[PageLayout], kinds: list[GroupKind],
                parallel: Any) -> bool:
    """Whether pages are stored as slices readable at any TP (docs/DESIGN.md §9): no other
    parallelism splits the cache, and every offloaded group's full (TP=1) layout is sliceable
    (``head_slices.slice_units``: attention / sliding window, Gated DeltaNet, Mamba1/2, short
    conv) with this TP's slices (``rank_heads``) giving exactly the engine's rank layout. A
    Mamba group also needs the TP to divide its units (attention replicates KV heads past
    their count; Mamba states cannot be). The rank-layout check keeps a model whose states are
    sharded some other way on per-TP pages instead of serving it wrongly split ones. A host or
    local tier keeps the rank's slice directory too (``TierChain`` passes it to every tier)."""
    others = (parallel.pipeline_parallel_size, parallel.decode_context_parallel_size,
              getattr(parallel, "prefill_context_parallel_size", 1))
    if not full_layouts or any(n != 1 for n in others):
        return False
    tp = parallel.tensor_parallel_size
    for full, mine, kind in zip(full_layouts, rank_layouts, kinds, strict=True):
        units = slice_units(full)
        if units is None or (kind == GroupKind.MAMBA and units % tp):
            return False
        if tp > 1 and any(slice_layout(full, rank_heads(units, tp, r)) != mine for r in range(tp)):
            return False
    return True


def mla_replicated(kinds: list[GroupKind], parallel: Any) -> bool:
    """Whether every offloaded group is a dense MLA latent and nothing but TP splits the cache:
    the latent is then replicated on every TP rank, so a page is TP-independent. Such a
    namespace records ``tp_size`` 1; every rank reads the one ``r0`` file of a page, and only
    rank 0 writes it (``TierStoreOffloadingSpec``: the other ranks' store pages are skipped)."""
    others = (parallel.pipeline_parallel_size, parallel.decode_context_parallel_size,
              getattr(parallel, "prefill_context_parallel_size", 1))
    return bool(kinds) and all(k == GroupKind.MLA for k in kinds) and all(n == 1 for n in others)


class _With:
    """``obj`` with some attributes replaced (read-only view)."""

    def __init__(self, obj: Any, **fields: Any) -> None:
        self._obj, self._fields = obj, fields

    def __getattr__(self, name: str) -> Any:
        return self._fields[name] if name in self._fields else getattr(self._obj, name)


def tp1_mamba_shapes(vllm_config: Any) -> tuple[tuple[int, ...], ...] | None:
    """The model's Mamba state shapes at tensor_parallel_size 1 (engine orientation), from its
    model class's ``get_mamba_state_shape_from_config`` (what vLLM sizes the cache with): the
    only place that knows how a state is sharded (Mamba2 with one group replicates B and C,
    which a rank's shape cannot tell). None when the class does not say (several Mamba
    layouts, an older vLLM): the caller then falls back to ``scaled_layout``."""
    try:
        from vllm.model_executor.models import ModelRegistry

        model_cls, _ = ModelRegistry.resolve_model_cls(vllm_config.model_config.architecture,
                                                       model_config=vllm_config.model_config)
        if hasattr(model_cls, "get_mamba_specs_from_config") or not hasattr(
                model_cls, "get_mamba_state_shape_from_config"):
            return None
        at_tp1 = _With(vllm_config, parallel_config=_With(vllm_config.parallel_config, tensor_parallel_size=1))
        return tuple(tuple(int(d) for d in shape) for shape in model_cls.get_mamba_state_shape_from_config(at_tp1))
    except Exception:  # noqa: BLE001 - any failure means: not known, stay per-TP
        return None


def full_mamba_layout(spec: Any, layer_names: tuple[str, ...], tp1_shapes: tuple[tuple[int, ...], ...] | None,
                      ) -> PageLayout | None:
    """The TP=1 layout of a Mamba/GDN group whose rank spec is ``spec`` (states in canonical
    orientation, the rank's dtypes); None if the TP=1 shapes are unknown or do not match the
    spec's states."""
    spec = representative_spec(spec)
    if tp1_shapes is None or len(tp1_shapes) != len(spec.shapes):
        return None
    st = mamba_states(_With(spec, shapes=tp1_shapes))
    return mamba_layout(layer_names, [(n, sh, dtype_name(dt))
                                      for n, sh, dt in zip(st.names, st.canonical_shapes, st.dtypes, strict=True)])


def scaled_layout(layout: PageLayout, tp_size: int) -> PageLayout:
    """A rank's Mamba layout with every state's outermost dimension times ``tp_size``: the TP=1
    layout of states split evenly across ranks (Gated DeltaNet, Mamba1, short conv, Mamba2
    with TP dividing its groups). The fallback when the model class gives no TP=1 shapes: for a
    state replicated on every rank (Mamba2's B and C with one group) it names a layout no
    other TP has, so such pages are shared by no other TP, never served split wrongly."""
    return PageLayout(tuple(SectionSpec(s.name, s.dtype, (s.shape[0] * tp_size, *s.shape[1:]))
                            for s in layout.sections))


def rank_group_layout(vllm_config: Any, spec: KVCacheSpec, layer_names: tuple[str, ...], tokens_per_chunk: int,
                      model_dtype: torch.dtype | str) -> tuple[GroupKind, PageLayout]:
    """``group_layout`` of one offloaded group as this rank holds it; a DSA group's from the
    model's config (the scheduler's KV-cache config holds only one of its specs)."""
    cache_dtype = getattr(vllm_config.cache_config, "cache_dtype", None)
    if not is_dsa_group(spec, layer_names):
        return group_layout(spec, layer_names, tokens_per_chunk, kv_storage_dtype(cache_dtype))
    hf_config = vllm_config.model_config.hf_config
    return group_kind(spec), dsa_layout(layer_names, tokens_per_chunk,
                                        latent_row(hf_config, cache_dtype, dtype_name(model_dtype)),
                                        indexer_row_bytes(hf_config))


def build_namespace(
    vllm_config: VllmConfig,
    kv_cache_config: KVCacheConfig,
    offloading_config: OffloadingConfig,
    ts_config: TierStoreConfig,
) -> Namespace:
    cache_dtype = getattr(vllm_config.cache_config, "cache_dtype", None)
    par = vllm_config.parallel_config
    tp = par.tensor_parallel_size
    vgroups = [kv_cache_config.kv_cache_groups[g.group_id] for g in offloading_config.groups]
    chunks = [g.tokens_per_block * offloading_config.cache.blocks_per_chunk for g in offloading_config.groups]
    kv_dtype = kv_storage_dtype(cache_dtype)
    # The rank's layouts (what this engine's pages hold), and the full (TP=1) ones: attention
    # with every KV head, Mamba states at TP=1 (a page is the full one at TP=1 in either case).
    ranked = [rank_group_layout(vllm_config, vg.kv_cache_spec, tuple(g.layer_names), n, offloading_config.model.dtype)
              for vg, g, n in zip(vgroups, offloading_config.groups, chunks, strict=True)]
    kinds, rank_layouts = [k for k, _ in ranked], [lay for _, lay in ranked]
    total_heads = (vllm_config.model_config.get_total_num_kv_heads()
                   if any(k != GroupKind.MAMBA for k in kinds) else None)
    tp1_shapes = tp1_mamba_shapes(vllm_config) if tp > 1 and GroupKind.MAMBA in kinds else None
    full_layouts: list[PageLayout] = []
    for vg, g, n, kind, mine in zip(vgroups, offloading_config.groups, chunks, kinds, rank_layouts, strict=True):
        if tp == 1 or kind == GroupKind.MLA:  # the MLA latent is the same on every rank
            full_layouts.append(mine)
        elif kind == GroupKind.MAMBA:
            full_layouts.append(full_mamba_layout(vg.kv_cache_spec, tuple(g.layer_names), tp1_shapes)
                                or scaled_layout(mine, tp))
        else:
            full_layouts.append(group_layout(vg.kv_cache_spec, tuple(g.layer_names), n, kv_dtype, total_heads)[1])
    sliced = head_sliced(full_layouts, rank_layouts, kinds, par)
    replicated = mla_replicated(kinds, par)
    groups = []
    for vg, g, n, kind, mine, full in zip(vgroups, offloading_config.groups, chunks, kinds, rank_layouts, full_layouts,
                                          strict=True):
        # A Mamba page holds the state after a chunk boundary; an attention page the chunk's KV.
        spec = representative_spec(vg.kv_cache_spec)
        groups.append(GroupSpec(
            kind=kind,
            block_size=g.tokens_per_block,
            tokens_per_chunk=n,
            layer_names=tuple(g.layer_names),
            layout=full if sliced else mine,  # slices: the full (TP=1) page
            sliding_window=getattr(spec, "sliding_window", None) if kind == GroupKind.SLIDING_WINDOW else None,
        ))
    cache = vllm_config.cache_config
    hash_algo = str(cache.prefix_caching_hash_algo)
    stable, marker = hash_seed_marker(hash_algo)
    extra: list[tuple[str, str]] = [("hash_seed", marker), ("tokens_per_hash", str(offloading_config.cache.tokens_per_hash))]
    if ts_config.namespace_tag:
        extra.append(("tag", ts_config.namespace_tag))
    if ts_config.encryption_key_file:  # sealed trees of one key only: never plain ones or another key's
        extra.append(("encryption", PageSealer.from_key_file(ts_config.encryption_key_file).namespace_marker))
    scales = kv_scales_marker(vllm_config.model_config, cache_dtype)
    if scales is not None:  # quantized KV: the bytes mean nothing without the dtype and scales
        extra += [("kv_cache_dtype", str(kv_storage_dtype(cache_dtype))), ("kv_scales", scales)]
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
        dtype=kv_storage_dtype(cache_dtype) or dtype_name(offloading_config.model.dtype),
        groups=tuple(groups),
        hash_algo=hash_algo,
        hash_stable=stable,
        parallel=ParallelLayout(
            # head slices or a replicated MLA latent: every TP shares the namespace
            tp_size=1 if sliced or replicated else par.tensor_parallel_size,
            pp_size=par.pipeline_parallel_size,
            dcp_size=par.decode_context_parallel_size,
            pcp_size=getattr(par, "prefill_context_parallel_size", 1),
        ),
        extra=tuple(extra),
    )
