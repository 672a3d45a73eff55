"""The scheduler's start-up writes under the root: the namespace manifest and the stale-temp
sweep run on a thread, so a hung export delays the connector's constructor by at most
``shared_deadline_s``; an error within the deadline is still raised there.

The connector is built as vLLM's scheduler builds it (``KVConnectorFactory.create_connector``
with the engine's ``VllmConfig`` and a ``KVCacheConfig``), for the tiny Llama, without an engine.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

import torch  # noqa: E402
from vllm.config import KVTransferConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402

from tierstore.errors import ConfigError  # noqa: E402
from tierstore.format.identity import MANIFEST_NAME  # noqa: E402
from tierstore.vllm import connector  # noqa: E402

DEADLINE_S = 1.0  # shared_deadline_s
HANG_S = 30.0  # how long the hung export keeps the manifest write waiting, unless released


@pytest.fixture(scope="module")
def engine_config() -> VllmConfig:
    """The tiny Llama's engine configuration, as ``LLM(...)`` would build it (no engine)."""
    from vllm.engine.arg_utils import EngineArgs

    from tierstore.testing.tiny_models import cached_tiny_model

    args = EngineArgs(model=str(cached_tiny_model("llama")), dtype="bfloat16", enforce_eager=True,
                      enable_prefix_caching=True, max_model_len=512)
    return args.create_engine_config()


def _kv_cache_config(cfg: VllmConfig) -> KVCacheConfig:
    """The tiny Llama's KV cache: one full-attention group over its layers."""
    model = cfg.model_config
    spec = FullAttentionSpec(block_size=cfg.cache_config.block_size,
                             num_kv_heads=model.get_num_kv_heads(cfg.parallel_config),
                             head_size=model.get_head_size(), dtype=torch.bfloat16)
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(model.get_num_layers(cfg.parallel_config))]
    return KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(layers, spec)])


def _scheduler_connector(cfg: VllmConfig, root: Path) -> Any:
    """The scheduler side's connector on ``root``, built the way vLLM's scheduler builds it."""
    cfg.kv_transfer_config = KVTransferConfig(
        kv_connector="TierStoreConnector", kv_connector_module_path="tierstore.vllm", kv_role="kv_both",
        kv_connector_extra_config={"root": str(root), "shared_deadline_s": DEADLINE_S})
    return KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, _kv_cache_config(cfg))


def _timed_start(cfg: VllmConfig, root: Path) -> tuple[Any, float]:
    t0 = time.monotonic()
    built = _scheduler_connector(cfg, root)
    return built, time.monotonic() - t0


def test_a_hung_root_delays_the_start_by_at_most_the_deadline(engine_config: VllmConfig, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # The same constructor on a root that answers: what the start costs without waiting.
    answering, normal_s = _timed_start(engine_config, tmp_path / "answers")
    answering.shutdown()
    assert (tmp_path / "answers" / answering.namespace.digest / MANIFEST_NAME).exists()

    released = threading.Event()
    swept: list[str] = []
    real_write = connector.write_manifest

    def hanging_write(root: object, ns: object) -> object:
        released.wait(HANG_S)  # the export does not answer until released
        return real_write(root, ns)  # type: ignore[arg-type]

    monkeypatch.setattr(connector, "write_manifest", hanging_write)
    monkeypatch.setattr(connector, "sweep_at_start", lambda root, digest, local: swept.append(digest))
    root = tmp_path / "hung"
    hung, hung_s = _timed_start(engine_config, root)
    try:
        # It waited for the manifest up to the deadline (an error within it would be raised
        # here), then went on: no longer than the deadline beyond an answering root's start.
        assert DEADLINE_S <= hung_s < DEADLINE_S + normal_s + 2.0, (hung_s, normal_s)
        digest = hung.namespace.digest
        chores = [t for t in threading.enumerate() if t.name == "tierstore-root-start" and t.is_alive()]
        assert chores and swept == [] and not (root / digest / MANIFEST_NAME).exists()
        released.set()  # the export answers: the manifest is written, then the sweep runs
        for t in chores:
            t.join(10)
        assert (root / digest / MANIFEST_NAME).exists() and swept == [digest]
    finally:
        released.set()
        hung.shutdown()


def test_a_manifest_error_within_the_deadline_is_raised(engine_config: VllmConfig, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(root: object, ns: object) -> object:
        raise ConfigError("refusing the cache tree: a symlink")

    monkeypatch.setattr(connector, "write_manifest", refuse)
    with pytest.raises(ConfigError, match="symlink"):
        _scheduler_connector(engine_config, tmp_path)
