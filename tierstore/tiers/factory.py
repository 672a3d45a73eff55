"""The tiers of a chain, from specs: which tiers a config asks for, and building them.

``tier_specs(config)`` lists the tiers a configuration asks for, fastest first, as
``TierSpec`` values (data, no I/O): ``host`` (``host_bytes`` > 0), ``local`` (``local_root``)
the root, named ``shared`` when a faster tier stands in front of it and ``root`` when it is
alone, and ``object`` (``object_url``) behind the root, or in its place when ``root`` is unset. ``build_tiers(specs, ...)`` builds them into a ``BuiltTiers``. A lone ``root`` is a list
of one: a ``SharedTier`` named ``root`` with the lone root's deadline (``deadline_s``), so a
lone root is counted, reported, health-checked and gc'd by the same code as every chain.

Failure policy: a root in front (no local tier) that did not open within its deadline is
logged and built down (its loads miss and its stores are skipped until it answers: an engine
starts while the export hangs); one whose open failed within the deadline raises that error
(``ConfigError``: a symlinked or untrusted root), as does any tier's constructor (a local index
it cannot open); tiers built before the failure are closed first.
Threading: call from one thread; no shared state.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any

from tierstore.config import TierStoreConfig
from tierstore.format.identity import Namespace
from tierstore.index.local_index import LocalIndex
from tierstore.metrics import MetricsRegistry
from tierstore.tiers.host import HostStore, HostTier
from tierstore.tiers.local import LocalTier
from tierstore.tiers.object import ObjectTier
from tierstore.tiers.shared import SharedTier
from tierstore.tiers.tier import ChainTier

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TierSpec:
    """One tier a configuration asks for: its kind (also the metrics name it reports under) and
    its engine's per-operation deadline (directories and caps are the config's)."""

    kind: str  # "host", "local", "shared" (the root behind a faster tier) or "root" (a lone root)
    deadline_s: float | None  # per-operation deadline of its engine (None: host memory, no engine)

    @property
    def name(self) -> str:
        return self.kind


def tier_specs(config: TierStoreConfig, *, with_host: bool = True, with_root: bool = True) -> list[TierSpec]:
    """The tiers ``config`` asks for, fastest first. ``with_host``/``with_root`` leave the host
    tier or the root out (tests of one tier; a chain without a process-wide host tier)."""
    specs: list[TierSpec] = []
    if with_host and config.host_bytes > 0:
        specs.append(TierSpec("host", None))
    if config.local_root:
        specs.append(TierSpec("local", config.deadline_s))
    if with_root and config.root is not None:
        lone = not specs
        specs.append(TierSpec("root" if lone else "shared", config.deadline_s if lone else config.shared_deadline_s))
    if config.object_url is not None:
        specs.append(TierSpec("object", config.object_deadline_s))
    return specs


def root_tier_name(config: TierStoreConfig) -> str:
    """The metrics name of ``root``'s tier: ``root`` when it is alone, else ``shared``; the
    object tier's (``object``) when there is no ``root``."""
    return next(s.name for s in tier_specs(config) if s.kind in ("root", "shared", "object"))


@dataclass
class BuiltTiers:
    """A chain's tiers, fastest first, and the ones the chain drives by role."""

    tiers: list[ChainTier]
    front: ChainTier  # the first durable tier: callers fill its staging slots
    host: HostStore | None
    local: LocalTier | None
    root: SharedTier | None  # the root's tier ("shared" or "root")
    object: ObjectTier | None = None  # the bucket behind the root (``object_url``)


def build_tiers(specs: list[TierSpec], config: TierStoreConfig, namespace: Namespace, group_index: int,
                rank: int, metrics: MetricsRegistry, *, host: HostTier | None = None,
                local_index: LocalIndex | None = None, **engine_kwargs: Any) -> BuiltTiers:
    """Build ``specs`` (``tier_specs``'s answer) for one (namespace, group, rank); see the
    module's failure policy. ``host``: the process-wide host memory the host tier draws from
    (no host tier without it)."""
    by_kind = {s.kind: s for s in specs}
    tokens = namespace.groups[group_index].tokens_per_chunk
    local = root = obj = None
    try:
        if "local" in by_kind:
            local = LocalTier(config, namespace, group_index, rank, metrics.tier("local"), local_index,
                              **engine_kwargs)
        spec = by_kind.get("shared") or by_kind.get("root")
        if spec is not None:
            root = SharedTier(config, namespace, group_index, rank, metrics.tier(spec.name), name=spec.name,
                              deadline_s=spec.deadline_s, **engine_kwargs)
        if "object" in by_kind:
            obj = ObjectTier(config, namespace, group_index, rank, metrics.tier("object"), **engine_kwargs)
        front: ChainTier | None = local or root or obj
        if front is None:
            raise ValueError("a chain needs a durable tier: local_root, the root or object_url")
        if front is root and root.engine() is None:
            if root.open_error is not None and not root.open_failed_transiently:
                raise root.open_error  # it answered, with an error: the user's to fix
            setting = "deadline_s" if root.name == "root" else "shared_deadline_s"
            if root.open_error is None:  # (a transient error was said by the tier itself)
                log.warning('tierstore: the root %s did not open within %s (%.1f s); starting with it down: '
                            "every load misses and every store is skipped until it answers (check the mount)",
                            config.root, setting, root.deadline_s)
    except BaseException:
        for tier in (local, root, obj):
            if tier is not None:
                with contextlib.suppress(Exception):
                    tier.close(0.1)
        raise
    host_store = None
    if "host" in by_kind and host is not None:
        # the host tier's keys: the front tier's directory (``r<rank>``, or a slice's ``h<s>-<c>``)
        host_store = HostStore(host, "/".join(front.mapper.dir_parts), front, metrics.tier("host"), tokens)
    tiers: list[ChainTier] = [t for t in (host_store, local, root, obj) if t is not None]
    return BuiltTiers(tiers, front, host_store, local, root, obj)
