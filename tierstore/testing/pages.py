"""Deterministic namespaces and page files for tests and demos.

Contract:

- ``hybrid_namespace()`` returns a realistic hybrid ``Namespace`` (the shape of Qwen3-Next or
  Gemma 3 in miniature): group 0 full attention, group 1 sliding-window attention (both in
  the model dtype, canonical ``[H, T, 2, D]`` sections), group 2 Mamba/GDN states (a conv
  state in the model dtype and an SSM state in float32). Every argument changes the digest.
  ``layer_names`` replaces the three groups' layer names (the demo's deeper hybrid).
- ``simple_namespace(dtype)`` returns a one-group namespace, handy for dtype sweeps (fp8 too).
- ``layout_namespace(layout, ...)`` returns a one-group namespace around an existing page
  layout (the benchmarks' model shapes). These three are the only namespace builders: the
  tests, the demo and the benchmarks all use them.
- ``page_key(i)`` is a 32-byte key (like vLLM's sha256 block hashes); ``page_bytes`` is a
  page buffer with values that look like KV data (normal floats in the section's dtype,
  zero padding between sections), derived only from (layout, key, group, seed): the same
  arguments give the same bytes in any process.
- ``write_page`` encodes and atomically publishes one page exactly as the engine does
  (``format.encode_page`` + ``publish.publish_page`` at ``FileMapper.path_for``);
  ``fill_pages`` writes the manifest and N pages per group and rank;
  ``read_stored`` reads a page back through ``page_read.read_page`` with the full expectation;
  ``write_slice_page`` writes one tensor-parallel slice's file of a one-group namespace (its
  units ``heads`` of the full layout, ``head_slices``) under ``<dir>/h<start>-<count>/``.

Only numpy, xxhash and zstandard are needed (no torch, no vLLM). Page sizes stay small by
default (a few KiB) so tests are fast. Threading: pure functions plus file writes; callers
that write from several threads must use distinct keys or accept "already stored".
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash
import zstandard

from tierstore.format.header import Codec, GroupKind, PageExpectation, PageMeta
from tierstore.format.identity import GroupSpec, Namespace, ParallelLayout, write_manifest
from tierstore.format.layout import attention_layout, mamba_layout
from tierstore.format.page import encode_page
from tierstore.format.page_layout import DTYPES, PageLayout
from tierstore.fs.mapper import FileMapper
from tierstore.rootstore.page_read import read_page
from tierstore.rootstore.publish import publish_page


def hybrid_namespace(
    *,
    model: str = "tierstore-test/tiny-hybrid",
    revision: str | None = "r0",
    dtype: str = "bfloat16",
    block_size: int = 16,
    tokens_per_chunk: int = 32,
    num_kv_heads: int = 2,
    head_size: int = 16,
    sliding_window: int = 64,
    conv_dim: int = 64,
    conv_width: int = 4,
    ssm_heads: int = 2,
    ssm_head_dim: int = 16,
    ssm_state_size: int = 16,
    ssm_dtype: str = "float32",
    hash_algo: str = "sha256",
    tp_size: int = 1,
    extra: Sequence[tuple[str, str]] = (),
    layer_names: tuple[Sequence[str], Sequence[str], Sequence[str]] | None = None,
) -> Namespace:
    """A three-group hybrid namespace: full attention, sliding window, Mamba states.
    ``layer_names``: (full, sliding, mamba) layer names instead of two layers each."""
    full_layers: Sequence[str] = ("model.layers.1.self_attn", "model.layers.3.self_attn")
    swa_layers: Sequence[str] = ("model.layers.0.self_attn", "model.layers.2.self_attn")
    mamba_layers: Sequence[str] = ("model.layers.4.linear_attn", "model.layers.5.linear_attn")
    if layer_names is not None:
        full_layers, swa_layers, mamba_layers = (tuple(names) for names in layer_names)
    states = [
        ("conv", (conv_dim, conv_width - 1), dtype),
        ("ssm", (ssm_heads, ssm_head_dim, ssm_state_size), ssm_dtype),
    ]
    groups = (
        GroupSpec(
            kind=GroupKind.ATTENTION,
            block_size=block_size,
            tokens_per_chunk=tokens_per_chunk,
            layer_names=full_layers,
            layout=attention_layout(full_layers, num_kv_heads, tokens_per_chunk, head_size, dtype),
        ),
        GroupSpec(
            kind=GroupKind.SLIDING_WINDOW,
            block_size=block_size,
            tokens_per_chunk=tokens_per_chunk,
            layer_names=swa_layers,
            layout=attention_layout(swa_layers, num_kv_heads, tokens_per_chunk, head_size, dtype),
            sliding_window=sliding_window,
        ),
        GroupSpec(
            kind=GroupKind.MAMBA,
            block_size=tokens_per_chunk,
            tokens_per_chunk=tokens_per_chunk,
            layer_names=mamba_layers,
            layout=mamba_layout(mamba_layers, states),
        ),
    )
    return Namespace(
        model=model,
        revision=revision,
        dtype=dtype,
        groups=groups,
        hash_algo=hash_algo,
        parallel=ParallelLayout(tp_size=tp_size),
        extra=tuple(extra),
    )


def simple_namespace(
    dtype: str = "float16",
    *,
    kind: GroupKind = GroupKind.ATTENTION,
    model: str = "tierstore-test/tiny-dense",
    tokens_per_chunk: int = 16,
    num_layers: int = 2,
    num_kv_heads: int = 2,
    head_size: int = 16,
) -> Namespace:
    """A one-group attention namespace in ``dtype`` (any name in ``format.DTYPES``)."""
    layers = tuple(f"model.layers.{i}.self_attn" for i in range(num_layers))
    layout = attention_layout(layers, num_kv_heads, tokens_per_chunk, head_size, dtype)
    return layout_namespace(layout, tokens_per_chunk, kind=kind, model=model, dtype=dtype, layer_names=layers)


def layout_namespace(
    layout: PageLayout,
    tokens_per_chunk: int,
    *,
    kind: GroupKind = GroupKind.ATTENTION,
    model: str = "tierstore-test/layout",
    dtype: str = "bfloat16",
    layer_names: Sequence[str] | None = None,
) -> Namespace:
    """A one-group namespace whose pages have ``layout`` (layer names: the section names
    unless given; a sliding-window group gets a window of 4 pages)."""
    group = GroupSpec(
        kind=kind,
        block_size=tokens_per_chunk,
        tokens_per_chunk=tokens_per_chunk,
        layer_names=tuple(layer_names) if layer_names is not None else tuple(s.name for s in layout.sections),
        layout=layout,
        sliding_window=4 * tokens_per_chunk if kind == GroupKind.SLIDING_WINDOW else None,
    )
    return Namespace(model=model, dtype=dtype, groups=(group,), hash_algo="sha256")


def page_key(index: int, *, seed: int = 0) -> bytes:
    """A 32-byte key, distinct for every (index, seed)."""
    return hashlib.sha256(f"tierstore-test-key:{seed}:{index}".encode()).digest()


def _section_values(rng: np.random.Generator, dtype: str, count: int) -> bytes:
    """``count`` elements of ``dtype`` that look like activations, as raw bytes."""
    if dtype in ("float32", "float64", "float16"):
        return rng.standard_normal(count, dtype=np.float32).astype(dtype).tobytes()
    if dtype == "bfloat16":
        f32 = rng.standard_normal(count, dtype=np.float32)
        return (f32.view(np.uint32) >> 16).astype(np.uint16).tobytes()
    if dtype.startswith("float8"):
        # fp8 is only bytes to tierstore: small magnitudes, no NaN encodings.
        return (rng.integers(0, 0x70, count, dtype=np.uint8) | (rng.integers(0, 2, count, dtype=np.uint8) << 7)).tobytes()
    itemsize = DTYPES[dtype][1]
    return rng.integers(-100, 100, count, dtype=np.int64).astype(f"<i{itemsize}" if dtype != "uint8" else "u1").tobytes()


def page_bytes(layout: PageLayout, key: bytes, group_index: int = 0, *, seed: int = 0) -> bytes:
    """The page buffer (``layout.nbytes``) for ``key``: deterministic, zero padding."""
    buf = bytearray(layout.nbytes)
    for spec, off in zip(layout.sections, layout.offsets, strict=True):
        rng_seed = xxhash.xxh3_64_intdigest(key + f":{group_index}:{seed}:{spec.name}".encode())
        rng = np.random.Generator(np.random.PCG64(rng_seed))
        count = spec.nbytes // spec.itemsize
        buf[off : off + spec.nbytes] = _section_values(rng, spec.dtype, count)
    return bytes(buf)


def page_meta(
    ns: Namespace, group_index: int, key: bytes, *, rank: int = 0, token_count: int | None = None
) -> PageMeta:
    """The ``PageMeta`` the engine would write for this page."""
    group = ns.groups[group_index]
    return PageMeta(
        namespace=ns.digest_bytes,
        key=key,
        group_index=group_index,
        group_kind=group.kind,
        token_count=group.tokens_per_chunk if token_count is None else token_count,
        rank=rank,
    )


@dataclass(frozen=True)
class StoredPage:
    """One page written by ``write_page``: where it is and what it holds."""

    path: Path
    group_index: int
    rank: int
    key: bytes
    token_count: int
    data: bytes  # the page buffer (what a verified read must return)
    stored: bool  # False if the file already existed


def write_page(
    root: str | os.PathLike[str],
    ns: Namespace,
    group_index: int,
    key: bytes,
    *,
    rank: int = 0,
    codec: Codec = Codec.NONE,
    data: bytes | None = None,
    token_count: int | None = None,
    seed: int = 0,
    fsync: bool = False,
) -> StoredPage:
    """Encode and publish one page at its canonical path (manifest not written)."""
    layout = ns.groups[group_index].layout
    if data is None:
        data = page_bytes(layout, key, group_index, seed=seed)
    meta = page_meta(ns, group_index, key, rank=rank, token_count=token_count)
    compressor = zstandard.ZstdCompressor(level=1) if codec == Codec.ZSTD else None
    header, pieces = encode_page(meta, layout, data, codec, compressor)
    mapper = FileMapper(root, ns.digest, group_index, rank)
    path = mapper.path_for(key)
    stored = publish_page(path, mapper.temp_path_for(key), header, pieces, fsync=fsync, key=key)
    return StoredPage(path, group_index, rank, key, meta.token_count, bytes(data), stored)


def fill_pages(
    root: str | os.PathLike[str],
    ns: Namespace,
    pages_per_group: int = 4,
    *,
    groups: Iterable[int] | None = None,
    ranks: Iterable[int] = (0,),
    codec: Codec = Codec.NONE,
    seed: int = 0,
) -> list[StoredPage]:
    """Write ``ns``'s manifest and ``pages_per_group`` pages per group and rank.

    Keys are ``page_key(i, seed=seed)`` for i in range(pages_per_group), shared across
    groups (as in vLLM, where every group of a chunk uses the same block hash).
    """
    write_manifest(root, ns)
    out = []
    group_ids = range(len(ns.groups)) if groups is None else list(groups)
    for rank in ranks:
        for g in group_ids:
            for i in range(pages_per_group):
                out.append(write_page(root, ns, g, page_key(i, seed=seed), rank=rank, codec=codec, seed=seed))
    return out


def read_stored(root: str | os.PathLike[str], ns: Namespace, page: StoredPage) -> bytes:
    """Read ``page`` back as the engine would (full expectation); raises a typed PageError."""
    layout = ns.groups[page.group_index].layout
    out = bytearray(layout.nbytes)
    expect = PageExpectation(ns.digest_bytes, page.key, page.group_index, page.rank, layout)
    path = FileMapper(root, ns.digest, page.group_index, page.rank).path_for(page.key)
    read_page(path, expect, memoryview(out), zstandard.ZstdDecompressor())
    return bytes(out)


def corrupt_flip_bit(path: str | os.PathLike[str], offset: int, bit: int = 0) -> None:
    """Flip one bit of a file in place (offset may be negative: from the end)."""
    with open(path, "r+b") as f:
        size = f.seek(0, os.SEEK_END)
        pos = offset if offset >= 0 else size + offset
        f.seek(pos)
        byte = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([byte ^ (1 << bit)]))


def write_slice_page(directory: str | os.PathLike[str], ns: Namespace, data: bytes, heads: Any, key: bytes,
                     ) -> tuple[Path, PageExpectation]:
    """Publish the slice ``heads`` (a ``head_slices.HeadRange``) of group 0's page ``key`` with
    the payload ``data`` (the slice layout's bytes) as the writer rank ``start // count`` would,
    and return its path and that writer's expectation."""
    from tierstore.format.head_slices import slice_layout, split_dir_name

    group = ns.groups[0]
    layout = slice_layout(group.layout, heads)
    meta = PageMeta(ns.digest_bytes, key, 0, group.kind, group.tokens_per_chunk, heads.start // heads.count,
                    heads.start, heads.count)
    header, pieces = encode_page(meta, layout, data, Codec.NONE, None)
    path = Path(directory) / split_dir_name(heads) / f"{key.hex()}.kvp"
    path.parent.mkdir(parents=True, exist_ok=True)
    publish_page(path, path.with_name(path.name + ".tmp"), header, pieces, key=key)
    return path, PageExpectation(ns.digest_bytes, key, 0, meta.rank, layout)
