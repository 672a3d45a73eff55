"""tierstore as one child of vLLM's ``MultiConnector``: its name in vLLM's connector registry, and
the one setting the wrapper keeps for itself.

``MultiConnector`` builds each child from a copy of the engine's config whose
``kv_transfer_config`` is the child's own entry of ``"connectors"``. Two things follow:

- **Names.** It reports each child's statistics keyed by the child's class name and rebuilds
  them in the API server with ``KVConnectorFactory.get_connector_class_by_name``: a connector
  loaded by module path alone is not in that registry, and every stats update raised
  ``Connector 'TierStoreConnector' is not registered`` (HTTP 500 on every request).
  ``register_with_factory`` registers the name; ``tierstore.vllm.connector`` calls it when it is
  imported, which every process that builds or names the connector does (the module path loads
  it). vLLM's factory refuses a second registration of a name (``ValueError``): a re-import, or
  an operator's own registration, is left as it is.
- **The failure policy.** vLLM's scheduler reads ``kv_load_failure_policy`` from the outer config
  (the MultiConnector's; default ``"fail"``), never from a child's. Alone, tierstore owns the
  engine's config and sets it to ``"recompute"``: a page that fails to load costs a recompute,
  never a failed request. Inside a MultiConnector the setting is engine-wide and also decides
  what a partner's failed transfer does (a P/D decode node that recomputes instead of failing),
  which is not tierstore's to change behind the operator's back: ``check_failure_policy``
  refuses to start unless the outer config says ``"recompute"``, naming the setting.
  ``enclosing_transfer_config`` finds the outer config: vLLM hands a child nothing but its own
  copy, so it is read from the MultiConnector whose constructor is on the call stack (its
  ``_kv_transfer_config``, set by ``KVConnectorBase_V1.__init__`` before the children are built,
  in vLLM 0.32 and 0.33). Nested MultiConnectors: the outermost one's, the one the scheduler
  reads.

Imports vLLM. Threading: called from the connector's constructor (one thread) and at import.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

CONNECTOR_NAME = "TierStoreConnector"
MODULE_PATH = "tierstore.vllm"
RECOMPUTE = "recompute"


def register_with_factory() -> bool:
    """Register ``TierStoreConnector`` (module ``tierstore.vllm``) in vLLM's connector registry.
    True if this call registered it; False if the name was registered before (by an earlier
    import or by the operator), which vLLM's factory refuses to do twice."""
    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, MODULE_PATH, CONNECTOR_NAME)
    except ValueError:
        return False
    return True


def enclosing_transfer_config(frame: FrameType | None = None) -> Any | None:
    """The ``KVTransferConfig`` of the outermost vLLM ``MultiConnector`` being built or called on
    the call stack from ``frame`` up (default: the caller's frame), or None when there is none
    (tierstore alone)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    f = frame if frame is not None else sys._getframe(1)
    found = None
    while f is not None:
        owner = f.f_locals.get("self")
        if isinstance(owner, MultiConnector):
            found = getattr(owner, "_kv_transfer_config", None) or found
        f = f.f_back
    return found


def check_failure_policy(outer: Any) -> None:
    """Refuse to start inside a MultiConnector whose ``kv_load_failure_policy`` is not
    ``"recompute"`` (``outer``: its KVTransferConfig), with the setting to change."""
    policy = getattr(outer, "kv_load_failure_policy", None)
    if policy == RECOMPUTE:
        return
    names = [str(c.get("kv_connector")) for c in (outer.kv_connector_extra_config or {}).get("connectors", [])
             if isinstance(c, dict)]
    raise ValueError(
        f"tierstore inside {outer.kv_connector} (children: {', '.join(names) or 'none'}): vLLM's scheduler applies "
        f"the outer kv_transfer_config's kv_load_failure_policy ({policy!r}) to every child's failed loads, so a "
        f"tierstore page that fails to load would fail its request instead of being recomputed. Set "
        f"\"kv_load_failure_policy\": \"recompute\" in the outer kv_transfer_config (beside \"kv_connector\": "
        f"\"{outer.kv_connector}\", not in tierstore's entry of \"connectors\"); it applies to every connector in it")
