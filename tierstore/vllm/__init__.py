"""tierstore's vLLM adapter: the only package that imports vllm.

Use it by configuration alone::

    KVTransferConfig(kv_connector="TierStoreConnector", kv_connector_module_path="tierstore.vllm",
                     kv_role="kv_both", kv_connector_extra_config={"root": "/path/to/cache"})

Layout: connector.py (the connector vLLM loads), spec.py (builds the scheduler and worker
sides), manager.py (scheduler side), worker.py (worker side: vLLM specs to pages), whose pages
go through group.py, store_pipeline.py, load_pipeline.py, pipelines.py and jobs.py (these
import nothing from vLLM: the benchmarks drive the same pipelines). The reasons are in
docs/DESIGN.md (the vLLM adapter section).

``TierStoreConnector`` is imported on first use (vLLM's ``getattr`` on this module), so the
vLLM-free modules above can be imported where vLLM is not installed.

Imports: anything of tierstore but bench and demo (it is the top of the library).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tierstore.vllm.connector import TierStoreConnector

__all__ = ["TierStoreConnector"]


def __getattr__(name: str) -> Any:
    if name == "TierStoreConnector":
        from tierstore.vllm.connector import TierStoreConnector

        return TierStoreConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
