"""Promotion: which faster tiers of a chain get a copy of a page that a slower tier served.

Contract: ``targets(tiers, served)`` lists the tiers that receive a copy of a page served by
``tiers[served]`` (the default: every faster tier: host memory gets a copy, the local disk a
background store). A load whose page will be copied is verified by the tier that serves it,
whatever the caller asked: a damaged page must never be copied into another tier with fresh
checksums (``needs_verify``). ``stored`` counts a promotion that landed (``promotions``). A
promotion that finds no free staging slot is skipped and counted as ``promotion_skipped``.

Threading: stateless; any thread.
"""

from __future__ import annotations

from collections.abc import Sequence

from tierstore.store import IOResult
from tierstore.tiers.tier import ChainTier

NO_SLOT_KIND = "promotion_skipped"


class Promotion:
    """Copy every hit into every faster tier (see the module docstring)."""

    def targets(self, tiers: Sequence[ChainTier], served: int) -> list[ChainTier]:
        return [t for t in tiers[:served] if t.available]

    def needs_verify(self, tiers: Sequence[ChainTier], served: int) -> bool:
        return bool(tiers[:served])

    def stored(self, tier: ChainTier, result: IOResult) -> None:
        if result.ok and result.stored:
            tier.metrics.add("promotions")
