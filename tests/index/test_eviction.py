"""The one eviction policy (``tierstore.index.eviction``): least recently stamped first, ties in
scan order, victims until the bytes left reach the target and not one page more."""

from __future__ import annotations

from array import array

from tierstore.index import eviction


def test_lru_order_is_oldest_stamp_first_and_stable_on_ties() -> None:
    stamps = array("q", [30, 10, 20, 10, 5])
    assert list(eviction.lru_order(stamps)) == [4, 1, 3, 2, 0]


def test_victims_stop_at_the_target_and_leave_the_rest_of_the_order_unread() -> None:
    sizes = [4, 4, 4, 4, 4]
    order = iter([4, 1, 3, 2, 0])
    assert list(eviction.victims_until(order, sizes, live=20, target=11)) == [4, 1, 3]  # 20 -> 8
    assert list(order) == [2, 0]  # the next batch starts where this one stopped
    assert list(eviction.victims_until([0, 1], sizes, live=8, target=8)) == []
    assert list(eviction.victims_until([0, 1], sizes, live=100, target=0)) == [0, 1]  # the order runs out


def test_the_local_index_and_gc_use_the_same_order() -> None:
    """Both evictors name the policy's order: the local index's queries and gc's scan table."""
    from pathlib import Path

    import tierstore.index.local_index as local_index
    import tierstore.tiers.gc_scan as gc_scan

    local = Path(local_index.__file__).read_text()
    assert "ORDER BY stamp" not in local and "victims_until(" in local
    assert "eviction.lru_order(self.stamp)" in Path(gc_scan.__file__).read_text()
