"""Tiny random-weight Hugging Face models and a local tokenizer, built offline.

``build_tiny_model(kind, out_dir, **overrides)`` writes a complete model folder (config,
safetensors weights, byte-level BPE tokenizer trained on an in-memory corpus, chat template)
that vLLM and transformers load with ``HF_HUB_OFFLINE=1``. Nothing is downloaded.

Kinds: ``llama``, ``qwen3`` (dense), ``gemma3`` (sliding window + full attention),
``qwen3next`` (Gated DeltaNet + full attention; linear head dim 128, the only size vLLM 0.32's
CPU kernels take), ``gptoss`` (sliding window + full, MoE), ``gemma4``, ``granitehybrid``
(Mamba2 + full attention, MoE: Granite 4.0-H's shape), ``lfm2`` (short conv + full attention),
``deepseekv2`` (MLA: latent 512 + rope 64 = the 576-wide cache vLLM 0.32's CPU_MLA backend
takes; small nope/value heads, no q LoRA, dense MLPs: DeepSeek-V2/V3's and Kimi K2's attention). Sizes: ``size="tiny"`` (default:
hidden 128, head dim 32, the smallest head size vLLM 0.32's CPU attention takes) or
``size="small"`` (hidden 1024 x 8 layers, head dim 64: the 4k-token prefill measurement). Any other override is a
config field (``num_hidden_layers=4``) or one of ``seed``, ``dtype``, ``vocab_size``.

Builds are deterministic (fixed seed, forked RNG so the caller's RNG is untouched) and cached
by a content key: the folder carries ``tierstore-tiny.json`` with the key, and building the
same model into a folder that already holds it is a no-op. A folder is built beside its
final name and renamed into place, so a reader never sees a half-written model and two
processes building the same folder at once both end with a complete one.

Threading: no shared state; safe from several processes (see above). Not thread-safe within
one process only in the sense that torch's global RNG is forked while a model is built.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

BUILDER_VERSION = 1
STAMP_NAME = "tierstore-tiny.json"
KINDS = ("llama", "qwen3", "gemma3", "qwen3next", "gptoss", "gemma4", "granitehybrid", "lfm2", "deepseekv2")
SIZES = ("tiny", "small")
DEFAULT_VOCAB = 1024
DEFAULT_SEED = 0
DEFAULT_DTYPE = "bfloat16"
# Words the tokenizer is trained on; demo prompts are built from the same words so that a
# prompt's token count is predictable (about one token per word).
WORDS: tuple[str, ...] = (
    "the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "hello", "world",
    "this", "is", "a", "tiny", "tokenizer", "for", "testing", "kv", "cache", "offload", "with",
    "a", "long", "shared", "prefix", "and", "several", "different", "questions", "about",
    "pages", "files", "disks", "nodes", "restarts", "hits", "misses", "checksums", "layers",
    "heads", "tokens",
)

_SIZE_PRESETS: dict[str, dict[str, Any]] = {
    # head_dim 32: the smallest head size vLLM's CPU attention takes.
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                 initializer_range=0.1),
    # initializer_range above the HF default (0.02): greedy output then depends on the context
    # instead of repeating one token, so "identical output" and negative controls mean something.
    "small": dict(hidden_size=1024, intermediate_size=2048, num_hidden_layers=8,
                  num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                 initializer_range=0.05),
}


def _layer_pattern(pattern: list[str], n: int) -> list[str]:
    return [pattern[i % len(pattern)] for i in range(n)]


def _kind_config(kind: str, size: str, vocab: int, fields: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(config class name, config kwargs) for one kind; ``fields`` (overrides) win."""
    cfg: dict[str, Any] = dict(
        vocab_size=vocab, max_position_embeddings=8192, bos_token_id=0, eos_token_id=1,
        pad_token_id=2, tie_word_embeddings=False,
    )
    cfg.update(_SIZE_PRESETS[size])
    if kind == "llama":
        cls = "LlamaConfig"
    elif kind == "qwen3":
        cls = "Qwen3Config"
    elif kind == "gemma3":
        cls = "Gemma3TextConfig"
        cfg.update(num_hidden_layers=max(4, cfg["num_hidden_layers"]), sliding_window=32)
    elif kind == "gptoss":
        cls = "GptOssConfig"
        cfg.update(sliding_window=32, num_local_experts=4, num_experts_per_tok=2,
                   intermediate_size=cfg["hidden_size"] // 2,
                   # YaRN as in the real checkpoints, with a factor that matches the context
                   # (transformers warns about a mismatch otherwise).
                   rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 2.0,
                                    "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                    "original_max_position_embeddings": 4096})
    elif kind == "gemma4":
        cls = "Gemma4TextConfig"
        # Gemma 4's shape: 5 sliding layers per full one (here 2:1), full layers with twice the
        # head size (per_layer_config), per-layer input embeddings, sliding window 32 tokens.
        cfg.update(num_hidden_layers=max(3, cfg["num_hidden_layers"]), sliding_window=32,
                   hidden_size_per_layer_input=16, vocab_size_per_layer_input=vocab,
                   hidden_activation="gelu_pytorch_tanh")
    elif kind == "qwen3next":
        cls = "Qwen3NextConfig"
        cfg.update(num_hidden_layers=max(4, cfg["num_hidden_layers"]), linear_num_value_heads=4,
                   linear_num_key_heads=2, linear_key_head_dim=128, linear_value_head_dim=128,
                   linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
                   moe_intermediate_size=cfg["hidden_size"] // 4,
                   shared_expert_intermediate_size=cfg["hidden_size"] // 4,
                   decoder_sparse_step=1, full_attention_interval=4)
    elif kind == "granitehybrid":
        cls = "GraniteMoeHybridConfig"
        # Mamba2 + full attention (Granite 4.0-H's shape): 8 Mamba2 heads of 32 in one group (the
        # B/C projections replicated on every TP rank), state size 16, one attention layer in 4.
        cfg.update(num_hidden_layers=max(4, cfg["num_hidden_layers"]), mamba_n_heads=8, mamba_d_head=32,
                   mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=64,
                   num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=cfg["hidden_size"],
                   position_embedding_type="rope")
    elif kind == "lfm2":
        cls = "Lfm2Config"
        # short conv + full attention (LFM2's shape): conv over all hidden channels, kernel 3
        cfg.update(num_hidden_layers=max(4, cfg["num_hidden_layers"]), conv_dim=cfg["hidden_size"], conv_L_cache=3,
                   block_dim=cfg["hidden_size"],
                   conv_bias=False, block_auto_adjust_ff_dim=False)
    elif kind == "deepseekv2":
        cls = "DeepseekV2Config"
        # MLA (DeepSeek-V2/V3, Kimi K2): the cache holds one latent per token, kv_lora_rank 512
        # plus the 64-wide rope key (576: the only width vLLM 0.32's CPU_MLA decode kernel
        # takes). Small per-head nope/value dims; every layer dense (first_k_dense_replace =
        # layers): vLLM-CPU's MoE path is not what this model is for.
        cfg.update(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
                   head_dim=64, q_lora_rank=None, num_key_value_heads=cfg["num_attention_heads"],
                   n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                   moe_intermediate_size=cfg["intermediate_size"] // 4,
                   rope_interleave=True)
        cfg["first_k_dense_replace"] = fields.get("num_hidden_layers", cfg["num_hidden_layers"])
    else:
        raise ValueError(f"unknown tiny model kind {kind!r}; choose one of {KINDS}")
    cfg.update(fields)
    _add_layer_types(kind, cfg, fields)
    return cls, cfg


def _add_layer_types(kind: str, cfg: dict[str, Any], fields: dict[str, Any]) -> None:
    """Set ``cfg``'s per-layer pattern (``layer_types``, and Gemma 4's ``per_layer_config``) for
    a hybrid ``kind``, unless ``fields`` (the overrides) set it."""
    n = cfg["num_hidden_layers"]
    if "layer_types" not in fields:
        if kind in ("gemma3", "gptoss"):
            cfg["layer_types"] = _layer_pattern(["sliding_attention", "full_attention"], n)
        elif kind == "gemma4":
            cfg["layer_types"] = _layer_pattern(["sliding_attention"] * 2 + ["full_attention"], n)
        elif kind in ("qwen3next", "granitehybrid"):  # Granite names its Mamba layers linear_attention too
            cfg["layer_types"] = _layer_pattern(["linear_attention"] * 3 + ["full_attention"], n)
        elif kind == "lfm2":
            cfg["layer_types"] = _layer_pattern(["conv"] * 3 + ["full_attention"], n)
    if kind == "gemma4" and "per_layer_config" not in fields:
        cfg["per_layer_config"] = {f"{i:02d}": {"head_dim": 2 * cfg["head_dim"]}
                                   for i, t in enumerate(cfg["layer_types"]) if t == "full_attention"}


_MODEL_CLASSES = {
    "LlamaConfig": "LlamaForCausalLM",
    "Qwen3Config": "Qwen3ForCausalLM",
    "Gemma3TextConfig": "Gemma3ForCausalLM",
    "Gemma4TextConfig": "Gemma4ForCausalLM",
    "GptOssConfig": "GptOssForCausalLM",
    "Qwen3NextConfig": "Qwen3NextForCausalLM",
    "GraniteMoeHybridConfig": "GraniteMoeHybridForCausalLM",
    "Lfm2Config": "Lfm2ForCausalLM",
    "DeepseekV2Config": "DeepseekV2ForCausalLM",
}


def model_spec(kind: str, **overrides: Any) -> dict[str, Any]:
    """Everything that determines the model folder's bytes (the content key's input)."""
    import tokenizers
    import torch
    import transformers

    size = overrides.pop("size", "tiny")
    if size not in SIZES:
        raise ValueError(f"unknown tiny model size {size!r}; choose one of {SIZES}")
    seed = int(overrides.pop("seed", DEFAULT_SEED))
    dtype = str(overrides.pop("dtype", DEFAULT_DTYPE))
    vocab = int(overrides.pop("vocab_size", DEFAULT_VOCAB))
    if vocab < 300:
        raise ValueError(f"vocab_size must be >= 300 (256 bytes + merges + specials), got {vocab}")
    config_class, config = _kind_config(kind, size, vocab, overrides)
    return {
        "builder_version": BUILDER_VERSION,
        "kind": kind,
        "size": size,
        "seed": seed,
        "dtype": dtype,
        "config_class": config_class,
        "config": config,
        "tokenizer": {"vocab_size": vocab, "words": list(WORDS)},
        # Other library versions may initialise or serialise differently.
        "versions": {
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
            "torch": torch.__version__.split("+")[0],
        },
    }


def content_key(spec: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:20]


def _read_stamp(model_dir: Path) -> str | None:
    try:
        return json.loads((model_dir / STAMP_NAME).read_text()).get("key")
    except (OSError, ValueError, AttributeError):
        return None


def build_tokenizer(vocab_size: int = DEFAULT_VOCAB) -> Any:
    """A byte-level BPE tokenizer trained on WORDS (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    sentence = " ".join(WORDS)
    corpus = [sentence, sentence.upper(), "".join(chr(c) for c in range(32, 127))] * 50
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 8, special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    return fast


def _write_model(spec: dict[str, Any], dest: Path) -> None:
    import torch
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    config = getattr(transformers, spec["config_class"])(**spec["config"])
    model_cls = getattr(transformers, _MODEL_CLASSES[spec["config_class"]])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec["seed"])
        model = model_cls(config)
    model = model.to(getattr(torch, spec["dtype"]))
    model.save_pretrained(dest)
    build_tokenizer(spec["tokenizer"]["vocab_size"]).save_pretrained(dest)


def build_tiny_model(kind: str, out_dir: str | os.PathLike[str], **overrides: Any) -> Path:
    """Build (or reuse) a tiny model of ``kind`` in the folder ``out_dir``; returns it."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out = Path(out_dir)
    spec = model_spec(kind, **overrides)
    key = content_key(spec)
    if _read_stamp(out) == key:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.building"
    try:
        _write_model(spec, tmp)
        (tmp / STAMP_NAME).write_text(json.dumps({"key": key, **spec}, indent=1, sort_keys=True) + "\n")
        if out.exists():
            if _read_stamp(out) == key:  # another process finished the same build first
                return out
            trash = out.parent / f".{out.name}.{uuid.uuid4().hex[:8]}.old"
            os.rename(out, trash)
            shutil.rmtree(trash, ignore_errors=True)
        try:
            os.rename(tmp, out)
        except OSError:
            if _read_stamp(out) != key:
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def default_cache_dir() -> Path:
    """Where ``cached_tiny_model`` keeps models: $TIERSTORE_TINY_CACHE or ~/.cache/tierstore/tiny-models."""
    env = os.environ.get("TIERSTORE_TINY_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tierstore" / "tiny-models"


def cached_tiny_model(kind: str, cache_dir: str | os.PathLike[str] | None = None, **overrides: Any) -> Path:
    """``build_tiny_model`` into ``cache_dir/<kind>-<size>-<key>`` (shared between runs)."""
    spec = model_spec(kind, **dict(overrides))
    name = f"{kind}-{spec['size']}-{content_key(spec)}"
    where = Path(cache_dir or default_cache_dir())
    try:
        where.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a read-only or missing HOME: say which setting moves the cache
        raise OSError(exc.errno, f"cannot create the tiny-model cache {where} ({exc.strerror}): set "
                                 "TIERSTORE_TINY_CACHE (or XDG_CACHE_HOME) to a writable directory") from exc
    return build_tiny_model(kind, where / name, **overrides)


def make_prompt(n_words: int, offset: int = 0) -> str:
    """A prompt of ``n_words`` words from the tokenizer's corpus, starting at word ``offset``."""
    return " ".join(WORDS[(offset + i) % len(WORDS)] for i in range(n_words))


def prompt_token_ids(tokenizer: Any, n_tokens: int, offset: int = 0) -> list[int]:
    """Exactly ``n_tokens`` token ids of corpus text starting at word ``offset`` (no specials)."""
    n_words = n_tokens + 8
    while True:
        ids: list[int] = tokenizer.encode(make_prompt(n_words, offset), add_special_tokens=False)
        if len(ids) >= n_tokens:
            return ids[:n_tokens]
        n_words *= 2
