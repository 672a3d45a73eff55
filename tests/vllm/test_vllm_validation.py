"""Startup validation and namespace derivation of the vLLM adapter (no engine started)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

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
from tierstore.format.page import GroupKind  # noqa: E402
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


def test_mla_and_sparse_mla_are_refused_naming_the_spec() -> None:
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, SlidingWindowMLASpec

    # dense MLA is stored (tests/vllm/test_vllm_mla.py); sparse MLA / DSA is refused
    mla = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576, dtype=torch.bfloat16,
                           is_index_group_leader=True)
    with pytest.raises(ConfigError, match=r"MLAAttentionSpec\(block_size=64.*head_size=576.*sparse MLA / DSA"):
        validate_engine(*setup([mla]), cfg())
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
