"""Mamba2, Mamba1 and short-conv states as slices (tierstore/format/head_slices.py; issue 13,
reuse across a TP change for Mamba hybrids such as Granite 4.0-H, Nemotron-H, Jamba, LFM2).

The reference is written here independently of the segment code, from how vLLM 0.32 shards
the weights that produce each state (``mamba_v2_sharded_weight_loader``,
``MergedColumnParallelLinear``): every state is a list of parts along its outermost
dimension, and rank ``r`` of ``t`` holds the ``r``-th ``t``-th of a sharded part and all of a
replicated one. Mamba2's conv channels are x (heads x head_dim), B and C (groups x state):
with ``n_groups % t == 0`` all three are sharded; with one group B and C are replicated. Its
ssm state is sharded by heads. Mamba1 and short conv shard their channels. Splitting with
``slice_layout``/``copy_heads`` must give the reference bytes, and assembling rank files written
at one TP for a reader at another must give the reader's, every file verified whole.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

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
from tierstore.format.layout import mamba_layout
from tierstore.format.page_layout import PageLayout
from tierstore.testing.pages import layout_namespace, page_key, write_slice_page
from tierstore.tiers.assembly import assemble
from tierstore.vllm.namespace import head_sliced, scaled_layout

H = HeadRange
LAYERS = ("model.layers.0.mixer", "model.layers.1.mixer")
ELEM = 2  # bfloat16 bytes
K1 = 3  # conv kernel - 1
# Mamba2: 8 heads of head_dim 4, state 3 (unequal sizes: a mixed-up axis changes the answer)
HEADS, HEAD_DIM, STATE = 8, 4, 3
CHANNELS = 16  # Mamba1 intermediate size / short-conv dim; Mamba1 state 3


def model(kind: str) -> dict:
    """Per state: (name, trailing shape, [(rows, sharded?)] parts along the outermost dimension)."""
    if kind.startswith("mamba2"):
        groups = int(kind.removeprefix("mamba2_g"))
        bc = (groups * STATE, groups > 1)  # one group: B and C replicated on every rank
        return {"states": [("conv", (K1,), [(HEADS * HEAD_DIM, True), bc, bc]),
                           ("ssm", (HEAD_DIM, STATE), [(HEADS, True)])]}
    if kind == "mamba1":
        return {"states": [("conv", (K1,), [(CHANNELS, True)]), ("ssm", (STATE,), [(CHANNELS, True)])]}
    return {"states": [("conv", (K1,), [(CHANNELS, True)])]}  # short conv


def rank_layout(kind: str, tp: int) -> PageLayout:
    """Rank layout at ``tp`` as vLLM sizes it (``mamba2_state_shape`` etc.)."""
    return mamba_layout(LAYERS, [(name, (sum(rows // tp if sharded else rows for rows, sharded in parts), *rest),
                                  "bfloat16") for name, rest, parts in model(kind)["states"]])


def full_states(kind: str, seed: int) -> list[list[np.ndarray]]:
    """Per layer, per state: the TP=1 rows as random bytes."""
    rng = np.random.default_rng(seed)
    return [[rng.integers(0, 256, (sum(r for r, _ in parts), int(np.prod(rest)) * ELEM), dtype=np.uint8)
             for _, rest, parts in model(kind)["states"]] for _ in LAYERS]


def vllm_rank_bytes(kind: str, states: list[list[np.ndarray]], tp: int, rank: int) -> bytes:
    """Rank ``rank`` of ``tp``'s page: each part sharded or replicated (module docstring)."""
    out = []
    for layer in states:
        for (_, _, parts), full in zip(model(kind)["states"], layer, strict=True):
            pieces, base = [], 0
            for rows, sharded in parts:
                lo, hi = (base + rank * rows // tp, base + (rank + 1) * rows // tp) if sharded else (base, base + rows)
                pieces.append(full[lo:hi])
                base += rows
            out.append(np.concatenate(pieces).tobytes())
    layout = rank_layout(kind, tp)
    page = bytearray(layout.nbytes)
    for data, offset in zip(out, layout.offsets, strict=True):
        page[offset : offset + len(data)] = data
    return bytes(page)


KINDS = {"mamba2_g1": 8, "mamba2_g4": 4, "mamba1": 16, "shortconv": 16}  # kind -> units
TPS = {"mamba2_g1": (2, 4, 8), "mamba2_g4": (2, 4), "mamba1": (2, 4, 8, 16), "shortconv": (2, 4, 8)}


@pytest.mark.parametrize("kind", KINDS)
def test_units_and_segments(kind: str) -> None:
    units, segs = segments(rank_layout(kind, 1))
    assert units == KINDS[kind]
    if kind == "mamba2_g1":  # x split by heads; B and C one block each (held by every slice)
        assert [[(g.rows, g.blocks) for g in sec] for sec in segs] == [
            [(HEADS * HEAD_DIM, HEADS), (STATE, 1), (STATE, 1)], [(HEADS, HEADS)]] * 2


@pytest.mark.parametrize("kind", KINDS)
def test_split_matches_vllm_sharding(kind: str) -> None:
    states, full_layout = full_states(kind, 1), rank_layout(kind, 1)
    full, units = vllm_rank_bytes(kind, states, 1, 0), KINDS[kind]
    for tp in TPS[kind]:
        for r in range(tp):
            heads = rank_heads(units, tp, r)
            layout = slice_layout(full_layout, heads)
            assert layout == rank_layout(kind, tp), (tp, r)  # the engine's rank layout at that TP
            out = bytearray(layout.nbytes)
            copied = copy_heads(full_layout, memoryview(full), H(0, units), memoryview(out), heads)
            assert bytes(out) == vllm_rank_bytes(kind, states, tp, r), (tp, r)
            assert copied == sum(s.nbytes for s in layout.sections)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("writer_tp", "reader_tp"), [(2, 1), (1, 2), (4, 2), (2, 4), (4, 1), (1, 4)])
def test_assemble_across_a_tp_change_gives_the_readers_vllm_bytes(tmp_path: Path, kind: str, writer_tp: int,
                                                                    reader_tp: int) -> None:
    ns = layout_namespace(rank_layout(kind, 1), 128, kind=GroupKind.MAMBA, layer_names=LAYERS)
    full_layout, units = ns.groups[0].layout, KINDS[kind]
    states, key = full_states(kind, 2), page_key(5)
    written = [rank_heads(units, writer_tp, r) for r in range(writer_tp)]
    files = {h: write_slice_page(tmp_path, ns, vllm_rank_bytes(kind, states, writer_tp, r), h, key)
             for r, h in enumerate(written)}
    for r in range(reader_tp):
        need = rank_heads(units, reader_tp, r)
        plan = cover(need, written)
        assert plan is not None
        out = memoryview(bytearray(slice_layout(full_layout, need).nbytes))
        cost = assemble(need, plan, full_layout, out, files.__getitem__)
        assert bytes(out) == vllm_rank_bytes(kind, states, reader_tp, r)
        assert cost.files == len(plan) == max(1, writer_tp // reader_tp)
        assert cost.bytes_read == sum(slice_layout(full_layout, h).nbytes for h in plan)
        # Used: the reader's states, a replicated block once (the first covering file's)
        assert cost.bytes_scattered == sum(s.nbytes for s in slice_layout(full_layout, need).sections)


def test_replicated_groups_read_more_than_they_use_going_down() -> None:
    """Mamba2 with one group, TP 2 -> 1: both rank files hold B and C, the reader uses one copy."""
    full = rank_layout("mamba2_g1", 1)
    half = slice_layout(full, H(0, 4))
    bc = 2 * STATE * K1 * ELEM * len(LAYERS)  # bytes of B and C in one file
    assert sum(s.nbytes for s in half.sections) * 2 - bc == sum(s.nbytes for s in full.sections)


def parallel(tp: int) -> SimpleNamespace:
    return SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1, decode_context_parallel_size=1)


def test_namespace_slices_only_a_tp_whose_slices_are_the_engines_pages() -> None:
    full = rank_layout("mamba2_g1", 1)
    for tp in (1, 2, 4, 8):
        assert head_sliced([full], [rank_layout("mamba2_g1", tp)], [GroupKind.MAMBA], parallel(tp))
    assert not head_sliced([full], [rank_layout("mamba2_g1", 1)], [GroupKind.MAMBA], parallel(2))  # not its rank
    g4 = rank_layout("mamba2_g4", 1)
    assert not head_sliced([g4], [g4], [GroupKind.MAMBA], parallel(8))  # 8 does not divide its 4 groups
    # The fallback without the model's TP=1 shapes (rows x TP) names a layout of its own for a
    # replicated B/C: its slices are the rank's pages, but no other TP shares its namespace.
    tp2 = rank_layout("mamba2_g1", 2)
    guess = scaled_layout(tp2, 2)
    assert head_sliced([guess], [tp2], [GroupKind.MAMBA], parallel(2)) and guess != full
    assert scaled_layout(rank_layout("mamba2_g4", 2), 2) == g4  # sharded groups: the fallback is exact


def test_fsck_walk_accepts_a_mamba_slice_directory() -> None:
    from tierstore.admin.namespace_dirs import sliced_group_spec

    ns = layout_namespace(rank_layout("mamba2_g1", 1), 128, kind=GroupKind.MAMBA, layer_names=LAYERS)
    got = sliced_group_spec(ns.groups[0], (4, 4))
    assert got is not None and got.layout == rank_layout("mamba2_g1", 2)
    assert sliced_group_spec(ns.groups[0], (8, 1)) is None  # beyond the group's 8 units
    assert slice_units(rank_layout("mamba1", 1)) == 16
