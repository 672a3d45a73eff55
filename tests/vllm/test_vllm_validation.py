"""Startup validation and namespace derivation of the vLLM adapter (no engine started)."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

import torch  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)

from tierstore.config import TierStoreConfig  # noqa: E402
from tierstore.errors import ConfigError  # noqa: E402
from tierstore.format.header import GroupKind  # noqa: E402
from tierstore.vllm.namespace import group_layout, hash_seed_marker  # noqa: E402
from tierstore.vllm.validation import validate_engine  # noqa: E402


def attn(block: int = 128) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)


def mamba(block: int, mode: str) -> MambaSpec:
    return MambaSpec(block_size=block, shapes=((3, 1024), (4, 128, 128)), dtypes=(torch.bfloat16, torch.float32),
                     mamba_cache_mode=mode)


def setup(specs: list, *, budget: int = 255, caching: bool = True, algo: str = "sha256"):
    kcc = KVCacheConfig(num_blocks=16, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec([f"layer{i}"], s) for i, s in enumerate(specs)])
    vcfg = SimpleNamespace(
        cache_config=SimpleNamespace(enable_prefix_caching=caching, prefix_caching_hash_algo=algo),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=budget),
    )
    return vcfg, kcc


def cfg(**kw) -> TierStoreConfig:
    return TierStoreConfig.from_dict({"root": "/tmp/unused", **kw})


def test_dense_defaults_to_one_block_per_page() -> None:
    assert validate_engine(*setup([attn()]), cfg()) == 128
    assert validate_engine(*setup([attn()]), cfg(chunk_tokens=512)) == 512


def test_chunk_not_a_multiple_of_the_block_size_is_refused() -> None:
    with pytest.raises(ConfigError, match=r'"chunk_tokens" \(200\).*N=128.*use 256'):
        validate_engine(*setup([attn()]), cfg(chunk_tokens=200))


def test_chunk_larger_than_a_block_only_for_full_attention_models() -> None:
    swa = SlidingWindowSpec(block_size=128, num_kv_heads=2, head_size=32, dtype=torch.bfloat16, sliding_window=32)
    with pytest.raises(ConfigError, match='"chunk_tokens" \\(256\\) must equal the block size N=128'):
        validate_engine(*setup([swa, attn()]), cfg(chunk_tokens=256))
    assert validate_engine(*setup([swa, attn()]), cfg(chunk_tokens=128)) == 128


def test_mamba_hybrid_needs_align_mode() -> None:
    with pytest.raises(ConfigError, match="--enable-prefix-caching"):
        validate_engine(*setup([mamba(1152, "none"), attn(1152)], budget=2303), cfg())
    assert validate_engine(*setup([mamba(1152, "align"), attn(1152)], budget=2303), cfg()) == 1152


@pytest.mark.parametrize(("budget", "warned"), [(1151, True), (1152, False), (2303, False), (2304, True), (8192, True)])
def test_batched_tokens_outside_n_2n_warns_for_mamba(caplog: pytest.LogCaptureFixture, budget: int, warned: bool) -> None:
    with caplog.at_level(logging.WARNING, logger="tierstore.vllm"):
        validate_engine(*setup([mamba(1152, "align"), attn(1152)], budget=budget), cfg())
    msgs = [r.getMessage() for r in caplog.records if "max_num_batched_tokens" in r.getMessage()]
    assert bool(msgs) == warned, msgs
    if warned:
        assert "--max-num-batched-tokens 2303" in msgs[0]


def test_xxhash_without_hash_seed_warns_and_marks_namespace(monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    with caplog.at_level(logging.WARNING, logger="tierstore.vllm"):
        validate_engine(*setup([attn()], algo="xxhash"), cfg())
    assert any("PYTHONHASHSEED" in r.getMessage() for r in caplog.records)
    stable, marker = hash_seed_marker("xxhash")
    assert not stable and marker.startswith("random:")
    monkeypatch.setenv("PYTHONHASHSEED", "42")
    assert hash_seed_marker("xxhash") == hash_seed_marker("sha256")
    assert hash_seed_marker("xxhash")[0] and hash_seed_marker("xxhash")[1] != "default"
    monkeypatch.delenv("PYTHONHASHSEED")
    assert hash_seed_marker("sha256") == (True, "default")


def test_group_layouts_are_canonical() -> None:
    kind, lay = group_layout(attn(), ("a", "b"), 256)
    assert kind == GroupKind.ATTENTION
    assert [s.shape for s in lay.sections] == [(2, 256, 2, 32)] * 2
    kind, lay = group_layout(SlidingWindowSpec(block_size=128, num_kv_heads=2, head_size=32, dtype=torch.bfloat16,
                                               sliding_window=32), ("s",), 128)
    assert kind == GroupKind.SLIDING_WINDOW
    kind, lay = group_layout(mamba(1152, "align"), ("m",), 1152)
    assert kind == GroupKind.MAMBA
    names = [s.name for s in lay.sections]
    assert names == ["m.conv", "m.ssm"]  # MambaSpec's default type is MAMBA2
    # The engine keeps conv states (state_len, dim) ("SD" on CPU); pages hold (dim, state_len).
    from tierstore.vllm.namespace import engine_conv_layout

    assert lay.sections[0].shape == ((1024, 3) if engine_conv_layout() == "SD" else (3, 1024))
    assert lay.data_bytes == 3 * 1024 * 2 + 4 * 128 * 128 * 4


# ------------------------------------------------------------------ fp8 KV and refusals
def fp8_attn(mode_name: str = "FP8_PER_TENSOR") -> FullAttentionSpec:
    from vllm.v1.kv_cache_interface import KVQuantMode

    return FullAttentionSpec(block_size=128, num_kv_heads=2, head_size=32, dtype=torch.uint8,
                             kv_quant_mode=KVQuantMode[mode_name])


def test_fp8_pages_record_the_element_type_of_their_bytes() -> None:
    from tierstore.vllm.namespace import kv_storage_dtype

    assert kv_storage_dtype("fp8") == kv_storage_dtype("fp8_e4m3") == "float8_e4m3fn"
    assert kv_storage_dtype("fp8_e5m2") == "float8_e5m2"
    assert kv_storage_dtype("auto") is None and kv_storage_dtype(None) is None
    _, e4m3 = group_layout(fp8_attn(), ("a",), 128, "float8_e4m3fn")
    _, e5m2 = group_layout(fp8_attn(), ("a",), 128, "float8_e5m2")
    _, bf16 = group_layout(attn(), ("a",), 128)
    assert [s.dtype for s in e4m3.sections] == ["float8_e4m3fn"]
    assert [s.dtype for s in e5m2.sections] == ["float8_e5m2"]
    assert 2 * e4m3.data_bytes == bf16.data_bytes


@pytest.mark.parametrize("mode", ["INT8_PER_TOKEN_HEAD", "FP8_PER_TOKEN_HEAD", "NVFP4"])
def test_kv_caches_with_scales_beside_the_bytes_are_refused(mode: str) -> None:
    with pytest.raises(ConfigError, match=rf"FullAttentionSpec\(.*kv_quant_mode.*{mode}.*per-token scales"):
        validate_engine(*setup([fp8_attn(mode)]), cfg())


def dsa_specs(latent_dtype: str = "auto") -> dict[str, Any]:
    """The per-layer specs vLLM 0.32/0.33 build for a DeepSeek-V3.2 / GLM-5 layer pair
    (mla_attention.py get_kv_cache_spec; deepseek_v2.py DeepseekV32IndexerCache)."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, SparseCacheRole, get_kv_quant_mode

    ds = latent_dtype == "fp8_ds_mla"
    latent = MLAAttentionSpec(block_size=64, num_kv_heads=1, max_tp_shards=1, head_size=576,
                              dtype=torch.uint8 if ds else torch.bfloat16, cache_dtype_str=latent_dtype,
                              kv_quant_mode=get_kv_quant_mode(latent_dtype),
                              state_content_bytes=656 if ds else None, is_index_group_leader=True)
    indexer = MLAAttentionSpec(block_size=64, num_kv_heads=1, max_tp_shards=1, head_size=132, dtype=torch.uint8,
                               cache_role=SparseCacheRole.INDEXER)
    return {**{f"model.layers.{i}.self_attn.attn": latent for i in range(2)},
            **{f"model.layers.{i}.self_attn.indexer.k_cache": indexer for i in range(2)}}


def dsa_configs(latent_dtype: str = "auto", first: str = "latent") -> tuple[Any, Any, Any]:
    """(vllm_config, the worker's KV-cache config, the scheduler's) of a DSA model: one group of
    latent and indexer layers; the scheduler's keeps one layer's spec, as vLLM's
    generate_scheduler_kv_cache_config does (``first``: which kind comes first)."""
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    specs = dsa_specs(latent_dtype)
    order = sorted(specs, key=lambda n: ("indexer" in n) == (first == "latent"))
    spec = UniformTypeKVCacheSpecs.from_specs({n: specs[n] for n in order})
    assert spec is not None
    worker = KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(order, spec)])
    scheduler = generate_scheduler_kv_cache_config([worker])
    vcfg = SimpleNamespace(
        cache_config=SimpleNamespace(enable_prefix_caching=True, prefix_caching_hash_algo="sha256",
                                     cache_dtype=latent_dtype),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=255),
        model_config=SimpleNamespace(hf_config=SimpleNamespace(kv_lora_rank=512, qk_rope_head_dim=64,
                                                               index_head_dim=128)))
    return vcfg, worker, scheduler


@pytest.mark.parametrize("latent_dtype", ["auto", "fp8_ds_mla"])
@pytest.mark.parametrize("first", ["latent", "indexer"])
def test_dsa_groups_get_one_layout_on_the_scheduler_and_the_worker(latent_dtype: str, first: str) -> None:
    """A DSA model's one group (latent + indexer per layer) is accepted as an MLA group; the
    scheduler, which sees one of its specs, derives the same page as the worker, which checks
    it against every layer's spec."""
    from tierstore.vllm.namespace import rank_group_layout
    from tierstore.vllm.sparse_mla import check_dsa_specs

    vcfg, worker, scheduler = dsa_configs(latent_dtype, first)
    assert validate_engine(vcfg, worker, cfg()) == 64 and validate_engine(vcfg, scheduler, cfg()) == 64
    layouts = [rank_group_layout(vcfg, kcc.kv_cache_groups[0].kv_cache_spec, tuple(kcc.kv_cache_groups[0].layer_names),
                                 64, torch.bfloat16) for kcc in (worker, scheduler)]
    assert layouts[0] == layouts[1] and layouts[0][0] == GroupKind.MLA
    widths = {s.name: (s.shape, s.dtype) for s in layouts[0][1].sections}
    latent = ((64, 656), "uint8") if latent_dtype == "fp8_ds_mla" else ((64, 576), "bfloat16")
    assert widths["model.layers.1.self_attn.attn"] == latent
    assert widths["model.layers.1.self_attn.indexer.k_cache"] == ((64, 132), "uint8")
    check_dsa_specs(worker.kv_cache_groups[0].kv_cache_spec.kv_cache_specs, layouts[0][1])
    # a model config that disagrees with what vLLM allocated is refused, naming the layer
    vcfg.model_config.hf_config.index_head_dim = 256
    wrong = rank_group_layout(vcfg, scheduler.kv_cache_groups[0].kv_cache_spec,
                              tuple(scheduler.kv_cache_groups[0].layer_names), 64, torch.bfloat16)[1]
    with pytest.raises(ConfigError, match=r"264-wide uint8 row for model.layers.0.self_attn.indexer.k_cache"):
        check_dsa_specs(worker.kv_cache_groups[0].kv_cache_spec.kv_cache_specs, wrong)


def test_unproven_mla_caches_are_refused_naming_the_spec() -> None:
    from vllm.v1.kv_cache_interface import (
        MLAAttentionSpec,
        SlidingWindowMLASpec,
        SparseCacheRole,
        get_kv_quant_mode,
    )

    nvfp4 = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576, dtype=torch.uint8,
                             cache_dtype_str="nvfp4_ds_mla", kv_quant_mode=get_kv_quant_mode("nvfp4_ds_mla"),
                             state_content_bytes=352, is_index_group_leader=True)
    with pytest.raises(ConfigError, match=r"MLAAttentionSpec\(.*sparse MLA latent of kv_cache_dtype=nvfp4_ds_mla"):
        validate_engine(*setup([nvfp4]), cfg())
    mxfp4 = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=68, dtype=torch.uint8,
                             cache_role=SparseCacheRole.INDEXER)
    with pytest.raises(ConfigError, match="MXFP4 indexer keys are not implemented"):
        validate_engine(*setup([mxfp4]), cfg())
    v4_latent = MLAAttentionSpec(block_size=256, num_kv_heads=1, head_size=512, dtype=torch.uint8,
                                 tokens_per_state=4, state_content_bytes=584, alignment=576,
                                 model_version="deepseek_v4")
    with pytest.raises(ConfigError, match="DeepSeek-V4"):
        validate_engine(*setup([v4_latent]), cfg())
    swa_mla = SlidingWindowMLASpec(block_size=64, num_kv_heads=1, head_size=512, dtype=torch.bfloat16,
                                   sliding_window=128)
    with pytest.raises(ConfigError, match=r"SlidingWindowMLASpec.*DeepSeek-V4"):
        group_layout(swa_mla, ("l",), 64)


def test_kv_scales_marker_follows_the_checkpoints_scale_tensors(tmp_path) -> None:
    from safetensors.torch import save_file

    from tierstore.vllm.namespace import check_kv_scales, kv_scales_marker

    plain = SimpleNamespace(model=str(tmp_path), quantization=None, revision=None)
    assert kv_scales_marker(plain, "auto") is None  # bf16: scales unused, nothing recorded
    assert kv_scales_marker(plain, "fp8") == "unit"
    quant = SimpleNamespace(model=str(tmp_path), quantization="fp8", revision=None)
    w = {"model.layers.0.self_attn.q_proj.weight": torch.zeros(2, 2)}
    save_file(w, str(tmp_path / "model.safetensors"))
    assert kv_scales_marker(quant, "fp8") == "unit"  # quantized weights, no KV scales: 1.0
    save_file({**w, "model.layers.0.self_attn.k_scale": torch.tensor(0.5)}, str(tmp_path / "model.safetensors"))
    half = kv_scales_marker(quant, "fp8")
    assert half is not None and half.startswith("checkpoint:")
    save_file({**w, "model.layers.0.self_attn.k_scale": torch.tensor(0.25)}, str(tmp_path / "model.safetensors"))
    assert kv_scales_marker(quant, "fp8") not in (half, "unit")
    check_kv_scales("unit", {"l0": (1.0, 1.0)})
    check_kv_scales(half, {"l0": (0.5, 1.0)})  # checkpoint scales: recorded by digest
    with pytest.raises(ConfigError, match=r"l1: k_scale=0.5.*kv_cache_dtype=auto"):
        check_kv_scales("unit", {"l0": (1.0, 1.0), "l1": (0.5, 1.0)})
