"""Gated DeltaNet states as slices (tierstore/format/head_slices.py; issue 13, reuse across a TP
change for a GDN hybrid such as Qwen3-Next).

The reference is written here independently of the segment code: a random full (TP=1) state
per layer, a conv state ``(conv_dim, K-1)`` whose channels are the q, k, v projections
concatenated and a temporal state ``(num_v_heads, head_v_dim, head_k_dim)``, and rank ``r`` of
``t`` holding what vLLM 0.32 gives it (``mamba_v2_sharded_weight_loader`` with one shard spec
per projection: ``[q_r, k_r, v_r]`` channels; ``num_v_heads / t`` value heads). Splitting with
``slice_layout``/``copy_heads`` must give those bytes, and assembling rank files written at one
TP for a reader at another must give the reader's reference bytes, every file verified.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tierstore.errors import PageError
from tierstore.format.head_slices import (
    HeadRange,
    copy_heads,
    cover,
    rank_heads,
    segments,
    slice_layout,
    slice_units,
)
from tierstore.format.header import GroupKind
from tierstore.format.layout import attention_layout, mamba_layout
from tierstore.format.page_layout import PageLayout
from tierstore.testing.pages import corrupt_flip_bit, layout_namespace, page_key, write_slice_page
from tierstore.tiers.assembly import assemble

H = HeadRange
# Unequal head sizes (head_k 4, head_v 6) so that a mixed-up axis changes the answer.
NK, NV, HK, HV, K1 = 4, 8, 4, 6, 3
KEY_DIM, VALUE_DIM = NK * HK, NV * HV
CONV_DIM = 2 * KEY_DIM + VALUE_DIM
LAYERS = ("model.layers.0.linear_attn", "model.layers.1.linear_attn")
ELEM = 2  # bfloat16 bytes


def gdn_layout(tp: int = 1) -> PageLayout:
    """The page layout of one rank of ``tp`` (the namespace's canonical state order)."""
    return mamba_layout(LAYERS, [("conv", (CONV_DIM // tp, K1), "bfloat16"),
                                 ("temporal", (NV // tp, HV, HK), "bfloat16")])


def full_states(seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per layer: (conv rows [CONV_DIM, K1*ELEM], temporal rows [NV, HV*HK*ELEM]) random bytes."""
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, 256, (CONV_DIM, K1 * ELEM), dtype=np.uint8),
             rng.integers(0, 256, (NV, HV * HK * ELEM), dtype=np.uint8)) for _ in LAYERS]


def vllm_rank_bytes(states: list[tuple[np.ndarray, np.ndarray]], tp: int, rank: int) -> bytes:
    """Rank ``rank`` of ``tp``'s page: what it holds, cut the way vLLM shards the weights (module
    doc), each state at its section's offset (the layout aligns sections: gaps stay zero)."""
    out = []
    for conv, temporal in states:
        q, k, v = conv[:KEY_DIM], conv[KEY_DIM : 2 * KEY_DIM], conv[2 * KEY_DIM :]
        kq, kv = KEY_DIM // tp, VALUE_DIM // tp
        out.append(np.concatenate([q[rank * kq : (rank + 1) * kq], k[rank * kq : (rank + 1) * kq],
                                   v[rank * kv : (rank + 1) * kv]]).tobytes())
        nv = NV // tp
        out.append(temporal[rank * nv : (rank + 1) * nv].tobytes())
    layout = gdn_layout(tp)
    page = bytearray(layout.nbytes)
    for data, offset in zip(out, layout.offsets, strict=True):
        page[offset : offset + len(data)] = data
    return bytes(page)


def test_segments_of_a_gdn_layout_and_refusals() -> None:
    units, segs = segments(gdn_layout())
    assert units == NK and [[g.rows for g in sec] for sec in segs] == [[KEY_DIM, KEY_DIM, VALUE_DIM], [NV]] * 2
    assert all(g.blocks == NK for sec in segs for g in sec)  # every segment split by key heads
    assert slice_units(gdn_layout(2)) == NK // 2  # a rank's layout: its own key heads
    assert slice_units(attention_layout(LAYERS, 2, 16, 32, "bfloat16")) == 2
    unknown = mamba_layout(LAYERS, [("state0", (CONV_DIM, K1), "bfloat16")])
    assert slice_units(unknown) is None  # states of unknown meaning: not sliceable, stays per-TP
    with pytest.raises(ValueError, match="cannot be stored as slices"):
        slice_layout(unknown, H(0, 1))
    with pytest.raises(ValueError):
        slice_layout(gdn_layout(), H(2, 4))  # units beyond the group's


@pytest.mark.parametrize("tp", [2, 4])
def test_split_matches_vllm_sharding(tp: int) -> None:
    states = full_states(1)
    full_layout, full = gdn_layout(), vllm_rank_bytes(states, 1, 0)
    for r in range(tp):
        heads = rank_heads(NK, tp, r)
        layout = slice_layout(full_layout, heads)
        assert layout == gdn_layout(tp)  # the rank's own (namespace) layout at that TP
        out = bytearray(layout.nbytes)
        copied = copy_heads(full_layout, memoryview(full), H(0, NK), memoryview(out), heads)
        assert bytes(out) == vllm_rank_bytes(states, tp, r)
        assert copied == sum(s.nbytes for s in layout.sections)  # alignment gaps are not copied


@pytest.mark.parametrize(("writer_tp", "reader_tp"), [(2, 1), (1, 2), (4, 2), (2, 4), (4, 1), (1, 4)])
def test_assemble_across_a_tp_change_gives_the_readers_vllm_bytes(tmp_path: Path, writer_tp: int,
                                                                    reader_tp: int) -> None:
    ns = layout_namespace(gdn_layout(), 1152, kind=GroupKind.MAMBA, layer_names=LAYERS)
    states, key = full_states(2), page_key(5)
    written = [rank_heads(NK, writer_tp, r) for r in range(writer_tp)]
    files = {h: write_slice_page(tmp_path, ns, vllm_rank_bytes(states, writer_tp, r), h, key)
             for r, h in enumerate(written)}
    for r in range(reader_tp):
        need = rank_heads(NK, reader_tp, r)
        plan = cover(need, written)
        assert plan is not None
        out = memoryview(bytearray(slice_layout(ns.groups[0].layout, need).nbytes))
        cost = assemble(need, plan, ns.groups[0].layout, out, files.__getitem__)
        assert bytes(out) == vllm_rank_bytes(states, reader_tp, r)
        assert cost.files == len(plan) == max(1, writer_tp // reader_tp)
        # Read: each covering file's payload whole (verified whole); used: the reader's states.
        assert cost.bytes_read == sum(slice_layout(ns.groups[0].layout, h).nbytes for h in plan)
        assert cost.bytes_scattered == sum(s.nbytes for s in slice_layout(ns.groups[0].layout, need).sections)


def test_a_damaged_rank_file_is_a_typed_error_and_wrong_bytes_change_the_result(tmp_path: Path) -> None:
    ns = layout_namespace(gdn_layout(), 1152, kind=GroupKind.MAMBA, layer_names=LAYERS)
    states, key = full_states(3), page_key(6)
    files = {H(2 * r, 2): write_slice_page(tmp_path, ns, vllm_rank_bytes(states, 2, r), H(2 * r, 2), key)
             for r in (0, 1)}
    out = memoryview(bytearray(gdn_layout().nbytes))
    corrupt_flip_bit(files[H(2, 2)][0], -60)
    with pytest.raises(PageError) as err:
        assemble(H(0, 4), [H(0, 2), H(2, 2)], ns.groups[0].layout, out, files.__getitem__)
    assert err.value.kind == "checksum"
    # The reference is sensitive to the split: rank 1's bytes where rank 0's belong differ.
    assert vllm_rank_bytes(states, 2, 0) != vllm_rank_bytes(states, 2, 1)


def test_fsck_walk_accepts_a_gdn_slice_directory() -> None:
    from tierstore.admin.namespace_dirs import sliced_group_spec

    ns = layout_namespace(gdn_layout(), 1152, kind=GroupKind.MAMBA, layer_names=LAYERS)
    got = sliced_group_spec(ns.groups[0], (2, 2))
    assert got is not None and got.layout == gdn_layout(2)
    assert sliced_group_spec(ns.groups[0], (4, 1)) is None  # beyond the group's 4 key heads
