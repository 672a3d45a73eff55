"""Strided views that express vLLM's physical KV layouts in the GroupCopier's terms.

Attention: the copier wants, per layer, ``[num_kernel_blocks, H, Nk, 2, D]`` (index 0 = K,
1 = V) whatever the physical order. ``attention_view`` turns vLLM 0.33's logical per-layer
view ``[nb, H, Nk, 2*D]`` (any stride order: LBHNC, LBNHC, LHBNC, BLHNC, ...) into it;
``split_kv_view`` does the same for pre-0.33 caches that keep K and V in separate planes
(``[2, nb, Nk, H, D]`` "NHD" or ``[2, nb, H, Nk, D]`` "HND"). ``make_attention_caches`` builds
real backing tensors in each layout (tests and benchmarks). Canonical section shape is
``[H, blocks_per_page * Nk, 2, D]`` with concat dim 1.

MLA: ``mla_view`` turns a dense latent cache (vLLM 0.32/0.33's logical ``[nb, 1, N, C]``, one
latent "head" per token; CPU_MLA and the CUDA MLA backends alike, any block stride) into the
copier's ``[nb, N, C]``; canonical section ``[blocks_per_page * N, C]`` with concat dim 0.

Opaque block pages (DeepSeek-V4): ``block_bytes_view`` turns a layer's logical ``[nb, H, N, C]``
view of a packed allocation (any block stride, the page itself contiguous) into ``[nb, 1,
page bytes]`` uint8: one row per block, copied as it is; canonical section ``[blocks_per_page,
page bytes]`` with concat dim 0. Bytes past the page (its padding, the next layer) are never
touched.

Mamba/GDN: ``mamba_state_views`` slices each block's raw (possibly padded) page bytes into
the named states, unpadded, and transposes a conv state stored ``(state_len, dim)`` ("SD")
to the canonical ``(dim, state_len)`` orientation (``layout.CONV_ORIENTATION``).

Pure functions returning views (no copies); no threading concerns.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

# Physical orders of one attention cache, named as vLLM's KVCacheLayout (L, B, H, N, C).
ATTENTION_LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC", "SPLIT_NHD", "SPLIT_HND")


def attention_view(cache: torch.Tensor, head_size: int) -> torch.Tensor:
    """``[nb, H, N, 2*D]`` (vLLM 0.33 logical per-layer view, any strides) -> ``[nb, H, N, 2, D]``."""
    if cache.dim() != 4 or cache.shape[-1] != 2 * head_size:
        raise ValueError(f"expected [num_blocks, H, N, 2*{head_size}], got {tuple(cache.shape)}")
    return cache.unflatten(-1, (2, head_size))


def mla_view(cache: torch.Tensor, latent_size: int) -> torch.Tensor:
    """A dense MLA latent cache ``[nb, 1, N, C]`` (or ``[nb, N, C]``) -> ``[nb, N, C]``.

    Raises ValueError for any other shape, or a token row that is not contiguous (the copier
    reads each token's C elements as one run)."""
    if cache.dim() == 4 and cache.shape[1] == 1:
        cache = cache[:, 0]
    if cache.dim() != 3 or cache.shape[-1] != latent_size or cache.stride(-1) != 1:
        raise ValueError(f"expected an MLA cache [num_blocks, 1, N, {latent_size}] with contiguous latents, "
                         f"got {tuple(cache.shape)} strides {cache.stride()}")
    return cache


def block_bytes_view(cache: torch.Tensor) -> torch.Tensor:
    """A layer's ``[nb, H, N, C]`` page view (one block's page contiguous, blocks any stride
    apart) -> ``[nb, 1, H*N*C*itemsize]`` uint8. Raises ValueError when a block's page is not
    one contiguous run."""
    if cache.dim() != 4:
        raise ValueError(f"expected a [num_blocks, H, N, C] page view, got {tuple(cache.shape)}")
    nb, h, n, c = cache.shape
    if cache.stride()[1:] != (n * c, c, 1) and not (h == 1 and cache.stride()[2:] == (c, 1)):
        raise ValueError(f"a block's page is not contiguous: shape {tuple(cache.shape)} strides {cache.stride()}")
    page = h * n * c * cache.element_size()
    # the uint8 view keeps the layer's storage offset; strides in bytes
    return torch.as_strided(cache.view(torch.uint8), (nb, 1, page), (cache.stride(0) * cache.element_size(), page, 1))


def split_kv_view(cache: torch.Tensor, order: str) -> torch.Tensor:
    """Pre-0.33 K/V-plane cache -> ``[nb, H, N, 2, D]``. ``order``: "NHD" for
    ``[2, nb, N, H, D]``, "HND" for ``[2, nb, H, N, D]``."""
    if cache.dim() != 5 or cache.shape[0] != 2:
        raise ValueError(f"expected [2, num_blocks, ., ., D], got {tuple(cache.shape)}")
    if order == "NHD":
        return cache.permute(1, 3, 2, 0, 4)
    if order == "HND":
        return cache.permute(1, 2, 3, 0, 4)
    raise ValueError(f"order must be 'NHD' or 'HND', got {order!r}")


def make_attention_caches(
    layout: str,
    num_layers: int,
    num_blocks: int,
    num_heads: int,
    block_tokens: int,
    head_size: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Allocate caches in a physical ``layout``; returns (backing tensors, per-layer copier views)."""
    L, B, H, N, C = num_layers, num_blocks, num_heads, block_tokens, 2 * head_size
    if layout not in ATTENTION_LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; known: {ATTENTION_LAYOUTS}")
    if layout.startswith("SPLIT_"):
        order = layout.removeprefix("SPLIT_")
        shape = (2, B, N, H, head_size) if order == "NHD" else (2, B, H, N, head_size)
        backing = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(L)]
        return backing, [split_kv_view(t, order) for t in backing]
    phys = {"L": L, "B": B, "H": H, "N": N}
    order = layout[:4]  # e.g. "BLHN"; C is always innermost
    one = torch.zeros([phys[a] for a in order] + [C], dtype=dtype, device=device)
    # permute to logical [L, B, H, N, C]
    logical = one.permute(*[order.index(a) for a in "LBHN"], 4)
    views = [attention_view(logical[i], head_size) for i in range(L)]
    return [one], views


def mamba_state_views(
    raw: torch.Tensor,
    states: Sequence[tuple[str, tuple[int, ...], torch.dtype]],
    conv_state: str | None = None,
    conv_layout: str = "DS",
) -> list[torch.Tensor]:
    """Per-state views ``[nb, *canonical_shape]`` of a raw ``[nb, page_bytes]`` uint8/int8 cache.

    ``states`` are (name, canonical shape, dtype) in page order; the states are packed from
    byte 0 of each block, unpadded. For the state named ``conv_state`` with ``conv_layout``
    "SD", the memory holds ``(state_len, dim)`` and the view is transposed to ``(dim, state_len)``.
    """
    if raw.dim() != 2 or raw.element_size() != 1 or raw.stride(1) != 1:
        raise ValueError(f"expected a [num_blocks, page_bytes] byte tensor, got {raw.dtype} {tuple(raw.shape)}")
    views = []
    pos = 0
    for name, shape, dtype in states:
        item = dtype.itemsize
        n = math.prod(shape)
        if pos % item:
            raise ValueError(f"state {name!r} at byte {pos} is not aligned to its {item}-byte dtype")
        if raw.stride(0) % item:
            raise ValueError(f"block stride {raw.stride(0)} is not a multiple of state {name!r}'s item size")
        chunk = raw[:, pos : pos + n * item].view(dtype)
        if name == conv_state and conv_layout == "SD":
            dim, state_len = shape
            v = chunk.unflatten(1, (state_len, dim)).transpose(1, 2)
        elif name == conv_state and conv_layout != "DS":
            raise ValueError(f"conv_layout must be 'DS' or 'SD', got {conv_layout!r}")
        else:
            v = chunk.unflatten(1, tuple(shape))
        views.append(v)
        pos += n * item
    if pos > raw.shape[1]:
        raise ValueError(f"states need {pos} bytes per block, the cache has {raw.shape[1]}")
    return views
