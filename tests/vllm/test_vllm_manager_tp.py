"""Scheduler-side lookups under tensor parallelism: a page is a hit only when every rank's file
is there, so a page one rank lost (its damaged file removed) is recomputed and stored again
instead of failing to load on that rank at every request (issue 13, bug (a))."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from test_vllm_manager import NS, VLLM_GROUP, ask, put  # noqa: E402
from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key  # noqa: E402

from tierstore.fs.mapper import FileMapper  # noqa: E402
from tierstore.vllm.manager import TierStoreManager  # noqa: E402


def make_tp2(root: Path, **kw: object) -> tuple[TierStoreManager, list[FileMapper]]:
    ranks = [FileMapper(root, NS, 0, r) for r in (0, 1)]
    return TierStoreManager([ranks], {VLLM_GROUP: 0}, [128], [False], **kw), ranks  # type: ignore[arg-type]


def test_a_page_is_a_hit_only_when_every_rank_has_its_file(tmp_path: Path) -> None:
    r0, r1 = FileMapper(tmp_path, NS, 0, 0), FileMapper(tmp_path, NS, 0, 1)
    both, only0 = b"b" * 32, b"o" * 32
    for key in (both, only0):
        put(r0, key)
    put(r1, both)
    manager, _ = make_tp2(tmp_path)
    ctx = ReqContext("r")
    try:
        assert ask(manager, make_offload_key(both, VLLM_GROUP), ctx) is LookupResult.HIT
        assert ask(manager, make_offload_key(only0, VLLM_GROUP), ctx) is LookupResult.MISS
        # a miss on one rank is stored again (rank 0's engine finds its file and skips it)
        out = manager.prepare_store([make_offload_key(only0, VLLM_GROUP)], ctx)
        assert out is not None and len(out.keys_to_store) == 1
    finally:
        manager.shutdown()


def test_one_ranks_damaged_page_misses_once_removed_then_hits_when_stored_again(tmp_path: Path) -> None:
    r0, r1 = FileMapper(tmp_path, NS, 0, 0), FileMapper(tmp_path, NS, 0, 1)
    key = b"d" * 32
    put(r0, key)
    damaged = put(r1, key)  # both written before the index's one listing starts
    manager, _ = make_tp2(tmp_path)
    okey = make_offload_key(key, VLLM_GROUP)
    ctx = ReqContext("r")
    try:
        assert ask(manager, okey, ctx) is LookupResult.HIT
        manager.mark_failed(okey, "checksum")  # rank 1's load failed; its engine removes the file
        assert manager.settle()
        damaged.unlink()
        # Rank 0's file is unchanged; before the fix the prober saw only it: the key kept
        # hitting in a fresh scheduler and failing on rank 1 forever.
        assert ask(manager, okey, ctx) is LookupResult.MISS
        assert manager.settle()  # the step's end: the prober sees rank 1's file gone
        skipped = manager.counters["skipped_failed"]
        assert ask(manager, okey, ctx) is LookupResult.MISS  # forgotten: a plain miss now
        assert manager.counters["skipped_failed"] == skipped
        out = manager.prepare_store([okey], ctx)
        assert out is not None and list(out.keys_to_store) == [okey]
        put(r1, key)  # rank 1 stores it again
        manager.complete_store([okey], ctx)
        assert ask(manager, okey, ctx) is LookupResult.HIT
    finally:
        manager.shutdown()

    fresh, _ = make_tp2(tmp_path)  # a restarted engine lists both ranks
    try:
        assert ask(fresh, okey, ctx) is LookupResult.HIT
        r1.path_for(key).unlink()
        fresh2, _ = make_tp2(tmp_path)
        try:
            assert ask(fresh2, okey, ctx) is LookupResult.MISS
        finally:
            fresh2.shutdown()
    finally:
        fresh.shutdown()


# ---------------------------------------------------------------- head slices (DESIGN §9)
def make_sliced(root: Path, tp: int, written: tuple[str, ...] = (), key: bytes = b"") -> tuple[
        TierStoreManager, dict[str, FileMapper]]:
    """A scheduler of an attention-only model with 2 KV heads at ``tp``: indexes every slice
    directory any TP writes (r0, h0-1, h1-1) and decides with head_slices.cover. ``key`` is
    written into the ``written`` directories first (before the index's one listing starts)."""
    from tierstore.format.head_slices import rank_heads, split_dir_name, tp_slices
    from tierstore.index.indexed_lookup import SliceGroup

    have = tp_slices(2)
    dirs = {("r0" if h.count == 2 else split_dir_name(h)): FileMapper(
        root, NS, 0, h.start // h.count, "r0" if h.count == 2 else split_dir_name(h)) for h in have}
    sg = SliceGroup(tuple(have), tuple(rank_heads(2, tp, r) for r in range(tp)))
    for d in written:
        put(dirs[d], key)
    return TierStoreManager([list(dirs.values())], {VLLM_GROUP: 0}, [128], [False], slices=[sg]), dirs


@pytest.mark.parametrize(("tp", "written", "hit"), [
    (1, ["h0-1", "h1-1"], True),  # TP=2 pages read at TP=1: two files tile the heads
    (1, ["h0-1"], False),  # one head missing
    (2, ["r0"], True),  # TP=1 pages read at TP=2: each rank uses its head of the full file
    (2, ["h1-1"], False),  # rank 0's head is nowhere
    (2, ["h0-1", "h1-1"], True),  # its own TP
])
def test_slice_groups_hit_when_every_ranks_heads_are_covered(tmp_path: Path, tp: int, written: list[str],
                                                           hit: bool) -> None:
    key = b"s" * 32
    manager, _ = make_sliced(tmp_path, tp, tuple(written), key)
    try:
        want = LookupResult.HIT if hit else LookupResult.MISS
        assert ask(manager, make_offload_key(key, VLLM_GROUP), ReqContext("r")) is want
    finally:
        manager.shutdown()
