"""Which page indexes the scheduler's lookup (``IndexedLookup``) consults, per KV-cache group.

Contract: pure functions of the lookup's tiers (in lookup order: local, the shared root, a
listed tier such as the object tier), each returning, per group, a pair of lists: the indexes
to consult while the shared tier is up, and while it is down. A tier's indexes answer while it
is live (``live``): the local tier always, the shared tier in the first list only, a listed
tier while its own health is up (the lookup rebuilds the views when that changes).

- ``plain_views``: for a one-rank group that is not head slices, its index on each live tier
  (the hot path: ``page_index.contains_any``); None for other groups.
- ``own_views``: for a head-sliced group whose current ranks each have a slice directory of
  their own, that slice's index on each live tier, per rank; None otherwise.
- ``every_view``: per group, every index that may hold a page (not listed yet, not empty, or a
  current rank's own), widest slices first: a key none of them has is a miss in one pass.

No I/O, no threads: the lookup calls these on its threads and assigns the results.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

IndexPair = tuple[list[Any], list[Any]]  # (shared tier up, shared tier down)


class ViewedTier(Protocol):
    """What the views read of a lookup tier (``indexed_lookup.TierIndexes``)."""

    health: Any
    indexes: Sequence[Sequence[Any]]  # [group][rank or slice] -> PageIndex

    @property
    def up(self) -> bool: ...


def live(tier: ViewedTier, shared: ViewedTier, shared_down: bool) -> bool:
    """Whether ``tier``'s indexes answer in the view for the shared tier up or down."""
    if tier is shared:
        return not shared_down
    return tier.health is None or tier.up


def plain_views(tiers: Sequence[ViewedTier], shared: ViewedTier, slices: Sequence[Any]) -> list[IndexPair | None]:
    return [None if slices[g] is not None or len(ranks) != 1
            else ([t.indexes[g][0] for t in tiers if live(t, shared, False)],
                  [t.indexes[g][0] for t in tiers if live(t, shared, True)])
            for g, ranks in enumerate(shared.indexes)]


def own_views(tiers: Sequence[ViewedTier], shared: ViewedTier,
              slices: Sequence[Any]) -> list[tuple[list[list[Any]], list[list[Any]]] | None]:
    out: list[tuple[list[list[Any]], list[list[Any]]] | None] = []
    for group, sg in enumerate(slices):
        if sg is None or any(n not in sg.have for n in sg.need):
            out.append(None)
            continue
        at = [sg.have.index(n) for n in sg.need]
        out.append(([[t.indexes[group][i] for t in tiers if live(t, shared, False)] for i in at],
                    [[t.indexes[group][i] for t in tiers if live(t, shared, True)] for i in at]))
    return out


def every_view(tiers: Sequence[ViewedTier], shared: ViewedTier, slices: Sequence[Any],
               own_lists: Sequence[tuple[list[list[Any]], list[list[Any]]] | None]) -> list[IndexPair]:
    out = []
    for g in range(len(shared.indexes)):
        sg = slices[g]
        order = (sorted(range(len(sg.have)), key=lambda i, sg=sg: -sg.have[i].count) if sg is not None
                 else range(len(shared.indexes[g])))
        own = {id(ix) for ixs in (own_lists[g] or ([], []))[0] for ix in ixs}
        keep = [t.indexes[g][i] for i in order for t in tiers if live(t, shared, False)
                if id(t.indexes[g][i]) in own or not t.indexes[g][i].loaded or len(t.indexes[g][i])]
        healthy = {id(ix) for t in tiers if live(t, shared, True) for ix in t.indexes[g]}
        out.append((keep, [ix for ix in keep if id(ix) in healthy]))
    return out
