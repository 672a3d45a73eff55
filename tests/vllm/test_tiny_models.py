"""Tiny offline models: every kind builds, loads, is deterministic and cached by content."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

pytest.importorskip("transformers")
from transformers import AutoConfig, AutoTokenizer  # noqa: E402

from tierstore.testing.tiny_models import (  # noqa: E402
    KINDS,
    STAMP_NAME,
    build_tiny_model,
    cached_tiny_model,
    content_key,
    model_spec,
    prompt_token_ids,
)

EXPECTED_LAYER_TYPES = {
    "gemma3": {"sliding_attention", "full_attention"},
    "gptoss": {"sliding_attention", "full_attention"},
    "gemma4": {"sliding_attention", "full_attention"},
    "qwen3next": {"linear_attention", "full_attention"},
    "granitehybrid": {"linear_attention", "full_attention"},  # Mamba2 layers are "linear_attention"
    "lfm2": {"conv", "full_attention"},
}


def _digests(d: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(d.iterdir())}


@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_builds_and_loads(kind: str, tmp_path: Path) -> None:
    path = build_tiny_model(kind, tmp_path / kind)
    assert (path / "model.safetensors").is_file()
    cfg = AutoConfig.from_pretrained(path)
    assert cfg.vocab_size == 1024
    assert cfg.hidden_size == 128
    if kind in EXPECTED_LAYER_TYPES:
        assert set(cfg.layer_types) == EXPECTED_LAYER_TYPES[kind]
        assert len(cfg.layer_types) == cfg.num_hidden_layers
    if kind == "gemma4":  # full layers: twice the head size of the sliding ones
        raw = json.loads((path / "config.json").read_text())
        full = [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"]
        per_layer = {int(k): v for k, v in raw["per_layer_config"].items()}
        assert full and all(per_layer[i]["head_dim"] == 2 * raw["head_dim"] for i in full)
    if kind == "qwen3next":
        assert cfg.linear_key_head_dim == 128 and cfg.linear_value_head_dim == 128
    tok = AutoTokenizer.from_pretrained(path)
    ids = prompt_token_ids(tok, 100)
    assert len(ids) == 100 and max(ids) < cfg.vocab_size
    assert tok.decode(tok.encode("hello world", add_special_tokens=False)) == "hello world"


def test_builds_are_deterministic(tmp_path: Path) -> None:
    a = build_tiny_model("gemma3", tmp_path / "a")
    b = build_tiny_model("gemma3", tmp_path / "b")
    assert _digests(a) == _digests(b)
    c = build_tiny_model("gemma3", tmp_path / "c", seed=1)
    assert _digests(c)["model.safetensors"] != _digests(a)["model.safetensors"]


def test_rebuild_is_noop_and_overrides_rebuild(tmp_path: Path) -> None:
    path = build_tiny_model("llama", tmp_path / "m")
    weights = path / "model.safetensors"
    os.utime(weights, (1, 1))  # a rewrite would give it a fresh mtime
    assert build_tiny_model("llama", tmp_path / "m") == path
    assert weights.stat().st_mtime == 1
    build_tiny_model("llama", tmp_path / "m", num_hidden_layers=3)
    assert AutoConfig.from_pretrained(path).num_hidden_layers == 3
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left


def test_cached_model_path_names_content(tmp_path: Path) -> None:
    a = cached_tiny_model("qwen3", tmp_path)
    assert a.parent == tmp_path and a.name.startswith("qwen3-tiny-")
    assert cached_tiny_model("qwen3", tmp_path) == a
    b = cached_tiny_model("qwen3", tmp_path, num_hidden_layers=1)
    assert b != a and (b / STAMP_NAME).is_file()


def test_small_size_and_bad_arguments() -> None:
    spec = model_spec("llama", size="small")
    assert spec["config"]["hidden_size"] == 1024 and spec["config"]["num_hidden_layers"] == 8
    assert content_key(spec) != content_key(model_spec("llama"))
    with pytest.raises(ValueError, match="kind"):
        model_spec("gpt2")
    with pytest.raises(ValueError, match="size"):
        model_spec("llama", size="huge")


# vLLM loading these models is covered by tests/test_demo.py (vllm mode) and tests/vllm/.


def test_an_unwritable_model_cache_names_the_setting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "a file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("TIERSTORE_TINY_CACHE", str(blocker / "models"))
    with pytest.raises(OSError, match="TIERSTORE_TINY_CACHE"):
        cached_tiny_model("llama")
