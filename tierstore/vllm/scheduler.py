"""TierStoreConnectorScheduler: vLLM's offloading scheduler with prefix lookups in one call.

vLLM 0.32's ``OffloadingConnectorScheduler._maximal_prefix_lookup`` asks the manager once per
key, in prefix order, on the scheduler thread: for a 32k-token prompt with two KV-cache groups,
4,096 calls of about 1 µs each the first time its keys are seen. This subclass hands the
whole run of keys to ``TierStoreManager.lookup_prefix`` (same answers: leading HITs, None when
a key answered RETRY before the first MISS), which decides the leading hits in one vectorized
pass over the in-memory indexes. Everything else (hybrid hit planning, sliding windows, the
Mamba boundary, stores) is vLLM's.

With KV-cache events on (``kv_events_config``), vLLM records each HIT key as it is found; the
loop is then vLLM's own, unchanged.

Threading: vLLM calls it from the scheduler thread only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
    OffloadingConnectorScheduler,
)
from vllm.v1.kv_offload.base import OffloadKey, ReqContext


class TierStoreConnectorScheduler(OffloadingConnectorScheduler):
    def _maximal_prefix_lookup(self, keys: Iterable[OffloadKey], req_context: ReqContext, req: Any,
                               group_config: Any, start_chunk_idx: int) -> int | None:
        lookup_prefix = getattr(self.manager, "lookup_prefix", None)
        if lookup_prefix is None or getattr(self._events_tracker, "self_describing_enabled", True):
            # (Named, not super(): benchmarks and tests call it on a stand-in ``self``.)
            return OffloadingConnectorScheduler._maximal_prefix_lookup(
                self, keys, req_context, req, group_config, start_chunk_idx)
        return lookup_prefix(keys if isinstance(keys, Sequence) else list(keys), req_context)
