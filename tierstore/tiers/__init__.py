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

Every chain of one process shares one ``HostTier`` (so ``host_bytes`` caps the whole process)
and one ``LocalIndex`` per local root. With ``max_bytes`` and ``gc_interval_s`` set, one
background gc thread per process keeps ``root`` under the cap (``tierstore.tiers.gc``).
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
    from tierstore.index.local_index import LocalIndex
    from tierstore.tiers.chain import TierChain
    from tierstore.tiers.host import HostTier

__all__ = ["TierChain", "HostTier", "LocalIndex", "open_group_store", "close_shared_state"]

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
        key = (id(metrics), config.root)
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
    if config.gc_interval_s and config.max_bytes:  # the one place the root's gc daemon starts
        from tierstore.tiers.gc import GcDaemon

        GcDaemon.ensure(config.root, config.max_bytes, config.gc_interval_s, reg.tier(root_tier_name(config)))
    return TierChain(config, namespace, group_index, rank=rank, host=_host_tier(config, reg),
                     local_index=_local_index(config), metrics=reg, **engine_kwargs)


def close_shared_state() -> None:
    """Close the process-wide local indexes and drop host tiers (tests, shutdown)."""
    with _guard:
        for idx in _indexes.values():
            idx.close()
        _indexes.clear()
        _hosts.clear()
