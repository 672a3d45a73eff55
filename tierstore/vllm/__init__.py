"""tierstore's vLLM adapter: the only package that imports vllm.

Use it by configuration alone::

    KVTransferConfig(kv_connector="TierStoreConnector", kv_connector_module_path="tierstore.vllm",
                     kv_role="kv_both", kv_connector_extra_config={"root": "/path/to/cache"})

See tierstore/vllm/connector.py for the design and docs/design/vllm.md for the reasons.
"""

from tierstore.vllm.connector import TierStoreConnector

__all__ = ["TierStoreConnector"]
