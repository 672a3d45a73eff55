"""Tiers: host memory -> local disk -> shared export, and the factory the adapter calls.

``open_group_store(config, namespace, group_index, rank=0, **engine_kwargs)`` returns the
``PageStore`` (``tierstore/store.py``) of one (namespace, KV-cache group, rank): a ``TierChain``
(chain.py) driving the tiers the config asks for, fastest first, built from specs by
factory.py: ``HostStore`` (host.py: host memory, ``host_bytes``), ``LocalTier`` (local.py: the
local disk, ``local_root`` + ``local_max_bytes``, admitted by ``LocalAdmission``, admission.py)
and ``SharedTier`` (shared.py: ``root``, with health, deadlines, background open and
touch-on-hit). With only ``root`` set the chain has one tier, named ``root`` (its deadline
``deadline_s``). Beside the chain: ``Promotion`` (promotion.py) and ``SharedBacklog``
(backlog.py). The engine tiers share ``EngineTier`` (tier.py).

``open_rank_store(config, namespace, group_index, rank=, tp_size=, layout=, ...)`` is the one
place stores are composed for an engine rank: a chain in the rank's own directory, or, for a
head-sliced namespace (``head_sliced``), a chain in the rank's slice directory wrapped in a
``HeadSliceStore`` that assembles the rank's heads from other TPs' slices on a miss.
``lookup_dirs`` gives the scheduler's index the same directories.

Every chain of one process shares one ``HostTier`` (so ``host_bytes`` caps the whole process)
and one ``LocalIndex`` per local root. With ``max_bytes`` and ``gc_interval_s`` set, one
background gc thread per process keeps ``root`` under the cap (``tierstore.tiers.gc_daemon``).
Threading: the factory is thread-safe.

Importing this package is light: the engine and the chain (and with them torch, for staging
memory) load at the first ``open_group_store`` or attribute access, so ``tierstore gc``
(``tierstore.tiers.gc``) starts without torch.

Imports: errors, metrics, fs, config, store, format, index, rootstore; never admin, vllm, bench.
"""

from __future__ import annotations

import sqlite3
import threading
from typing import TYPE_CHECKING, Any

from tierstore.errors import ConfigError
from tierstore.metrics import MetricsRegistry, default_registry

if TYPE_CHECKING:
    from tierstore.config import TierStoreConfig
    from tierstore.format.identity import Namespace
    from tierstore.fs.mapper import FileMapper
    from tierstore.index.indexed_lookup import ListedTier, SliceGroup
    from tierstore.index.local_index import LocalIndex
    from tierstore.store import PageStore
    from tierstore.tiers.chain import TierChain
    from tierstore.tiers.host import HostTier

__all__ = ["TierChain", "HostTier", "LocalIndex", "open_group_store", "open_rank_store", "lookup_dirs",
           "head_sliced", "close_shared_state"]

_LAZY = {"TierChain": "tierstore.tiers.chain", "HostTier": "tierstore.tiers.host",
         "LocalIndex": "tierstore.index.local_index"}


def __getattr__(name: str) -> Any:
    """``TierChain``, ``HostTier``, ``LocalIndex``: imported at first use (PEP 562)."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)

_guard = threading.Lock()
_hosts: dict[tuple[int, str], HostTier] = {}
_indexes: dict[str, LocalIndex] = {}


def _host_tier(config: TierStoreConfig, metrics: MetricsRegistry) -> HostTier | None:
    if config.host_bytes <= 0:
        return None
    from tierstore.tiers.host import HostTier

    with _guard:
        key = (id(metrics), config.root or config.object_url or "")
        h = _hosts.get(key)
        if h is None or h.cap_bytes != config.host_bytes:
            h = _hosts[key] = HostTier(config.host_bytes, metrics.tier("host"))
        return h


def _local_index(config: TierStoreConfig) -> LocalIndex | None:
    if not config.local_root:
        return None
    from tierstore.index.local_index import LocalIndex
    from tierstore.tiers.local import refuse_network_local_root

    refuse_network_local_root(config.local_root)  # before sqlite creates anything there
    with _guard:
        idx = _indexes.get(config.local_root)
        if idx is None or idx.cap_bytes != config.local_max_bytes:
            try:
                idx = _indexes[config.local_root] = LocalIndex(config.local_root, config.local_max_bytes)
            except (sqlite3.Error, OSError) as exc:
                raise ConfigError(f"cannot open the local tier's index under {config.local_root}: {exc}; "
                                  'free space there, fix its permissions, or unset "local_root"') from exc
        return idx


def open_group_store(
    config: TierStoreConfig,
    namespace: Namespace,
    group_index: int,
    rank: int = 0,
    *,
    metrics: MetricsRegistry | None = None,
    **engine_kwargs: Any,
) -> TierChain:
    """The page store of one (namespace, group, rank): a ``TierChain`` of the tiers the config
    asks for (``tiers.factory.tier_specs``; a lone root is a chain of one)."""
    from tierstore.tiers.chain import TierChain
    from tierstore.tiers.factory import root_tier_name

    reg = metrics if metrics is not None else default_registry()
    if config.gc_interval_s and config.max_bytes and config.root:  # the one place the root's gc daemon starts
        from tierstore.tiers.gc_daemon import GcDaemon

        GcDaemon.ensure(config.root, config.max_bytes, config.gc_interval_s, reg.tier(root_tier_name(config)))
    return TierChain(config, namespace, group_index, rank=rank, host=_host_tier(config, reg),
                     local_index=_local_index(config), metrics=reg, **engine_kwargs)


def head_sliced(namespace: Namespace) -> bool:
    """Whether the namespace's pages are head slices readable at any TP (``vllm.namespace``
    decided it at start: every group sliceable, and the namespace's TP is 1 whatever the
    engine's)."""
    from tierstore.format.head_slices import slice_units

    return namespace.parallel.tp_size == 1 and all(slice_units(g.layout) for g in namespace.groups)


def open_rank_store(config: TierStoreConfig, namespace: Namespace, group_index: int, *, rank: int, tp_size: int,
                    layout: Any, heads: tuple[int, int], **engine_kwargs: Any) -> PageStore:
    """The page store of group ``group_index`` for engine rank ``rank`` of ``tp_size``: per-rank
    files (``rank`` 0 when the namespace is TP-independent, an MLA latent replicated on every
    rank), or, head-sliced, the rank's slice directory and ``layout`` in every tier of the chain,
    wrapped in a ``HeadSliceStore``. ``heads``: (start, count) the header records for a
    per-rank file."""
    if not head_sliced(namespace):
        return open_group_store(config, namespace, group_index, rank=0 if namespace.parallel.tp_size == 1 else rank,
                                head_start=heads[0], head_count=heads[1], **engine_kwargs)
    from tierstore.format.head_slices import HeadRange, rank_heads, segments, split_dir_name
    from tierstore.fs.mapper import group_dir
    from tierstore.tiers.factory import tier_specs
    from tierstore.tiers.head_slice_store import DirectorySlices, HeadSliceStore

    full_layout = namespace.groups[group_index].layout
    full = segments(full_layout)[0]
    mine = rank_heads(full, tp_size, rank)
    if mine.count == full:  # TP=1: r0, the group's layout, headers as before
        inner = open_group_store(config, namespace, group_index, rank=0, **engine_kwargs)
    else:
        inner = open_group_store(config, namespace, group_index, rank=mine.start // mine.count,
                                 head_start=mine.start, head_count=mine.count, rank_dir=split_dir_name(mine),
                                 layout=layout, **engine_kwargs)
    if config.root is None:  # the covering slices are read from a root; a bucket alone serves its own slice
        return inner
    source = DirectorySlices(group_dir(config.root, namespace.digest, group_index), namespace.digest_bytes,
                             group_index, full_layout, refresh_s=config.index_refresh_s)
    # The covering files are on the root: its tier's deadline (a lone root's deadline_s, else
    # shared_deadline_s), as the factory gives that tier.
    deadline_s = next(s.deadline_s for s in tier_specs(config) if s.kind in ("root", "shared"))
    return HeadSliceStore(inner, HeadRange(mine.start, mine.count), full_layout, source, deadline_s=deadline_s)


def lookup_dirs(config: TierStoreConfig, namespace: Namespace, tp_size: int) -> tuple[
        list[list[FileMapper]], list[list[FileMapper]] | None, list[SliceGroup | None] | None]:
    """The directories the scheduler's index answers from, per group: (shared root mappers,
    ``local_root`` mappers or None, slice groups or None). Every rank's files answer a lookup
    (the scheduler runs beside rank 0): a page is a hit only when each rank can load its part.
    Head-sliced: one mapper per slice directory some TP writes, combined by ``SliceGroup``."""
    from tierstore.format.head_slices import rank_heads, segments, slice_mappers, tp_slices
    from tierstore.fs.mapper import FileMapper
    from tierstore.index.indexed_lookup import SliceGroup

    n, digest, local = len(namespace.groups), namespace.digest, config.local_root
    if config.root is None:  # the object tier is the scheduler's root: its stand-in (listed_tier)
        from tierstore.config import ObjectLocation
        from tierstore.objstore.listing import stand_in_root

        assert config.object_url is not None  # TierStoreConfig.validate
        config = config.replace(root=str(stand_in_root(ObjectLocation.parse(config.object_url))))
    if not head_sliced(namespace):
        ranks = range(namespace.parallel.tp_size)  # 1: a replicated MLA latent's r0
        mappers = [[FileMapper(config.root, digest, i, r) for r in ranks] for i in range(n)]
        local_mappers = [[FileMapper(local, digest, i, r) for r in ranks] for i in range(n)] if local else None
        return mappers, local_mappers, None
    units = [segments(g.layout)[0] for g in namespace.groups]
    mappers = [slice_mappers(config.root, digest, i, units[i]) for i in range(n)]
    local_mappers = [slice_mappers(local, digest, i, units[i]) for i in range(n)] if local else None
    slices: list[SliceGroup | None] = [
        SliceGroup(tuple(tp_slices(units[i])), tuple(rank_heads(units[i], tp_size, r) for r in range(tp_size)))
        for i in range(n)]
    return mappers, local_mappers, slices


def listed_tier(config: TierStoreConfig, namespace: Namespace, tp_size: int) -> ListedTier | None:
    """The object tier (``object_url``) as the scheduler's lookup sees it: its indexes named as
    ``lookup_dirs`` names the root's, under the tier's stand-in root, filled by listings of the
    bucket; None without ``object_url``."""
    if config.object_url is None:
        return None
    from tierstore.config import ObjectLocation
    from tierstore.index.indexed_lookup import ListedTier
    from tierstore.objstore.client import ObjectClient
    from tierstore.objstore.listing import health_key, index_lister, page_exists, stand_in_root

    location = ObjectLocation.parse(config.object_url)
    client = ObjectClient(location, config.object_deadline_s)
    mappers, _, _ = lookup_dirs(config.replace(root=str(stand_in_root(location)), local_root=None,
                                               local_max_bytes=None), namespace, tp_size)
    probe_key = health_key(location)
    return ListedTier("object", mappers, index_lister(client), lambda: client.head(probe_key),
                      config.object_deadline_s, page_exists(client), replaces_root=config.root is None)


def close_shared_state() -> None:
    """Close the process-wide local indexes and drop host tiers (tests, shutdown)."""
    with _guard:
        for idx in _indexes.values():
            idx.close()
        _indexes.clear()
        _hosts.clear()
