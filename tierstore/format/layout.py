"""Canonical page layouts per group kind.

The canonical page is what makes files byte-identical across GPUs, backends and kernel block
sizes. Per layer of a group, in the group's layer order:

- attention / sliding window: one section ``<layer>`` of shape ``[H, T, 2, D]`` in the model
  dtype: H = KV heads of this rank's slice, T = tokens in the chunk, index 0 = K, 1 = V.
  (vLLM 0.33's logical per-block view ``[H, N, 2*D]`` concatenated over blocks along N.)
- MLA: one section ``<layer>`` of shape ``[T, C]`` (latent + rope, as the backend packs it).
  A sparse MLA / DSA group (``mla_rows_layout``) has a row width and dtype per layer: its
  indexer key cache ``[T, C]`` uint8 holds each block's bytes as vLLM keeps them (per block of
  N tokens: N x 128 fp8 values, then N fp32 scales), not token-major rows.
- Mamba / GDN: one section per state tensor, ``<layer>.<state>``, unpadded, in the state's
  own dtype; conv state in the orientation named by ``CONV_ORIENTATION``.

Pure functions; no threading concerns.
"""

from __future__ import annotations

from collections.abc import Sequence

from tierstore.format.page_layout import PageLayout, SectionSpec

# Conv states are stored as [conv_dim, kernel_width - 1] ("channels first"), whatever the
# engine uses internally; the adapter transposes views to this orientation.
CONV_ORIENTATION = "dim_first"


def attention_layout(
    layer_names: Sequence[str], num_kv_heads: int, tokens: int, head_size: int, dtype: str
) -> PageLayout:
    """Page layout of an attention (or sliding-window) group."""
    return PageLayout(tuple(SectionSpec(n, dtype, (num_kv_heads, tokens, 2, head_size)) for n in layer_names))


def mla_layout(layer_names: Sequence[str], tokens: int, latent_size: int, dtype: str) -> PageLayout:
    return PageLayout(tuple(SectionSpec(n, dtype, (tokens, latent_size)) for n in layer_names))


def mla_rows_layout(rows: Sequence[tuple[str, int, str]], tokens: int) -> PageLayout:
    """Page layout of an MLA group whose layers differ: ``rows`` = (layer, row width, dtype)."""
    return PageLayout(tuple(SectionSpec(n, dtype, (tokens, width)) for n, width, dtype in rows))


def mamba_layout(
    layer_names: Sequence[str], states: Sequence[tuple[str, tuple[int, ...], str]]
) -> PageLayout:
    """Page layout of a Mamba/GDN group; ``states`` = (state name, shape, dtype) per tensor."""
    return PageLayout(
        tuple(SectionSpec(f"{n}.{state}", dtype, tuple(shape)) for n in layer_names for state, shape, dtype in states)
    )
