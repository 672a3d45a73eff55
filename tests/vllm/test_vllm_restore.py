"""End to end on real vLLM-CPU engines: store with engine 1, restore with a fresh engine 2.

Per model (dense Llama, Gemma3 sliding window + full, Qwen3-Next GDN + full in align mode):
engine 2 restores at least 90% of the stored prefix and generates exactly engine 1's tokens.
Also: the cross-process case (engine 2 in a new Python process), the negative control
(pages rewritten with other valid bytes change the output), a different cache_salt never
hits, and a max_tokens=1 request followed by an immediate shutdown is still stored.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from vllm_helpers import MODELS, copy_root, failures, pages, prompt_ids, rewrite_page, run_engine  # noqa: E402

# Hybrids keep every chunk boundary restorable (not only vLLM's default "semantic
# checkpoints"), so the groups-disagree and fault tests have earlier boundaries to fall back to.
HYBRID_KW = {"prefix_cache_retention_interval": None}


def engine_kw(kind: str) -> dict:
    return HYBRID_KW if kind != "llama" else {}


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Per kind (lazily): a root written by engine 1, its prompt and its cold output."""
    cache: dict = {}

    def get(kind: str) -> tuple[Path, list[int], object]:
        if kind not in cache:
            root = tmp_path_factory.mktemp(f"root-{kind}")
            ids = prompt_ids(kind)
            run = run_engine(kind, root, [{"prompt_token_ids": ids}], **engine_kw(kind))
            assert run.outputs[0].cached == 0
            assert run.worker.get("store_pages_ok", 0) > 0, run.worker
            cache[kind] = (root, ids, run)
        return cache[kind]

    return get  # type: ignore[return-value]


def stored_prefix(kind: str, n_prompt: int) -> int:
    """Tokens engine 1 stores: whole chunks, and a hybrid's hit stays below the last token."""
    n = MODELS[kind]["N"]
    limit = n_prompt - 1 if kind != "llama" else n_prompt
    return limit // n * n


@pytest.mark.parametrize("kind", ["llama", "gemma3", "qwen3next"])
def test_fresh_engine_restores_prefix_with_identical_tokens(stored, tmp_path: Path, kind: str) -> None:
    root, ids, first = stored(kind)
    second = run_engine(kind, copy_root(root, tmp_path / "r"), [{"prompt_token_ids": ids}], **engine_kw(kind))
    out = second.outputs[0]
    assert out.tokens == first.outputs[0].tokens
    assert out.cached >= 0.9 * stored_prefix(kind, len(ids)) > 0, (out.cached, len(ids))
    assert second.worker.get("load_jobs_ok", 0) == 1 and not failures(second.worker), second.worker
    assert second.scheduler["lookup_hits"] > 0


@pytest.mark.slow  # a second Python process importing vLLM: ~40 s on the 2-core machine
def test_restore_in_a_new_process(stored, tmp_path: Path) -> None:
    root, ids, first = stored("llama")
    work = copy_root(root, tmp_path / "r")
    script = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import conftest  # noqa: F401  (environment)
        from vllm_helpers import run_engine
        run = run_engine("llama", {str(work)!r}, [{{"prompt_token_ids": {ids!r}}}])
        print("RESULT " + json.dumps({{"tokens": run.outputs[0].tokens, "cached": run.outputs[0].cached}}))
    """)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[2]))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert result["tokens"] == first.outputs[0].tokens
    assert result["cached"] >= 0.9 * stored_prefix("llama", len(ids))


def test_negative_control_other_valid_bytes_change_the_output(stored, tmp_path: Path) -> None:
    """Pages rewritten with other (valid, checksummed) KV must change the tokens: the loaded
    KV is really what the engine attends to."""
    root, ids, first = stored("llama")
    work = copy_root(root, tmp_path / "r")

    def scramble(buf: bytearray) -> None:
        # Reverse the bf16 values: still finite numbers, other keys and values.
        import torch

        t = torch.frombuffer(buf, dtype=torch.bfloat16)
        t.copy_(t.flip(0))

    for page in pages(work):
        rewrite_page(page, scramble)
    second = run_engine("llama", work, [{"prompt_token_ids": ids}])
    assert second.outputs[0].cached > 0 and not failures(second.worker), second.worker
    assert second.outputs[0].tokens != first.outputs[0].tokens


def test_other_cache_salt_never_hits(stored, tmp_path: Path) -> None:
    root, ids, first = stored("llama")
    work = copy_root(root, tmp_path / "r")
    run = run_engine("llama", work, [
        {"prompt_token_ids": ids, "cache_salt": "tenant-b"},
        {"prompt_token_ids": ids},  # positive control in the same engine: unsalted pages hit
    ])
    salted, plain = run.outputs
    assert salted.cached == 0
    assert plain.cached >= 0.9 * stored_prefix("llama", len(ids))
    assert salted.tokens == plain.tokens == first.outputs[0].tokens  # same model, same prompt


@pytest.mark.parametrize("kind", ["llama", "qwen3next"])
def test_shutdown_right_after_a_one_token_request_keeps_its_pages(tmp_path: Path, kind: str) -> None:
    ids = prompt_ids(kind, offset=3)
    root = tmp_path / "r"
    first = run_engine(kind, root, [{"prompt_token_ids": ids}], max_tokens=1, shutdown_right_after=True,
                       **engine_kw(kind))
    # Every chunk of the prompt, in every group (vLLM's stock deferral loses the last step's).
    n_chunks = stored_prefix(kind, len(ids)) // MODELS[kind]["N"]
    n_groups = 4 if kind == "qwen3next" else 1
    assert len(pages(root)) == n_chunks * n_groups, "stores queued at exit did not reach the disk"
    second = run_engine(kind, root, [{"prompt_token_ids": ids}], max_tokens=1, **engine_kw(kind))
    assert second.outputs[0].cached >= 0.9 * stored_prefix(kind, len(ids)) > 0
    assert second.outputs[0].tokens == first.outputs[0].tokens


def test_chunks_of_several_blocks(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """chunk_tokens = 2 blocks: one page holds 256 tokens; restore is whole pages. A namespace
    of the same model with one-block pages (another node's setting) is named at start, with
    what differs (``tierstore.vllm.siblings``)."""
    import dataclasses
    import logging

    from tierstore.format.identity import read_manifest, write_manifest

    ids = prompt_ids("llama", offset=5)
    root = tmp_path / "r"
    extra = {"chunk_tokens": 256}
    first = run_engine("llama", root, [{"prompt_token_ids": ids}], extra=extra)
    assert len(pages(root)) == len(ids) // 256
    (mine,) = [read_manifest(d / "manifest.json") for d in root.iterdir() if d.is_dir()]
    other = dataclasses.replace(mine, groups=(dataclasses.replace(mine.groups[0], tokens_per_chunk=128),))
    write_manifest(root, other)
    with caplog.at_level(logging.WARNING, logger="tierstore.vllm"):
        second = run_engine("llama", root, [{"prompt_token_ids": ids}], extra=extra)
    said = [r.getMessage() for r in caplog.records if other.digest in r.getMessage()]
    assert len(said) == 1 and "group 0 (attention) tokens_per_chunk: 256 vs 128" in said[0], said
    assert second.outputs[0].tokens == first.outputs[0].tokens
    assert second.outputs[0].cached == len(ids) // 256 * 256
    assert not failures(second.worker)


def test_more_pages_per_step_than_staging_slots(tmp_path: Path) -> None:
    """17 pages stored in one step and loaded in one job with 16 staging slots per group (the
    ``staging_slots`` setting; sized from the budget it would be 40): stores go out in batches
    of free slots (a page finding none is deferred, never waited for: whether one does depends
    on how fast the first writes finish), loads wait in the worker for slots."""
    ids = prompt_ids("llama", 17 * 128 + 40, offset=11)
    root = tmp_path / "r"
    kw = {"extra": {"io_threads": 1, "staging_slots": 16}, "max_model_len": 2400, "max_num_batched_tokens": 2400}
    first = run_engine("llama", root, [{"prompt_token_ids": ids}], **kw)
    assert len(pages(root)) == 17 and not failures(first.worker)
    assert first.worker["store_pages_ok"] == 17, first.worker
    assert not any(k.startswith("store_dropped") for k in first.worker), first.worker
    second = run_engine("llama", root, [{"prompt_token_ids": ids}], **kw)
    assert second.outputs[0].cached == 17 * 128
    assert second.outputs[0].tokens == first.outputs[0].tokens
    assert second.worker["load_pages_ok"] == 17 and not failures(second.worker)


def test_pages_hold_the_models_own_keys_and_values(stored) -> None:
    """The canonical promise: section [H, T, 2, D] of a layer is the model's K (index 0) and V
    (index 1) for the chunk's tokens, whatever the backend keeps in memory (vLLM's CPU kernels
    store K transposed). Reference: the same model in transformers."""
    import torch
    from transformers import AutoModelForCausalLM
    from vllm_helpers import chunk_keys, model_dir, page_path

    from tierstore.rootstore.page_read import inspect_page, read_page

    root, ids, _ = stored("llama")
    model = AutoModelForCausalLM.from_pretrained(str(model_dir("llama")), dtype=torch.bfloat16)
    with torch.no_grad():
        cache = model(torch.tensor([ids[:256]]), use_cache=True).past_key_values
    for chunk, key in enumerate(chunk_keys(ids, 128, 128)[:2]):
        path = page_path(root, 0, key)
        header = inspect_page(path)
        buf = bytearray(header.layout.nbytes)
        read_page(path, None, memoryview(buf))
        for layer, (sec, off) in enumerate(zip(header.layout.sections, header.layout.offsets, strict=True)):
            page = torch.frombuffer(buf, dtype=torch.bfloat16, offset=off, count=sec.nbytes // 2).view(*sec.shape)
            tokens = slice(chunk * 128, (chunk + 1) * 128)
            k_ref = cache.layers[layer].keys[0, :, tokens].float()
            v_ref = cache.layers[layer].values[0, :, tokens].float()
            assert torch.allclose(page[:, :, 0].float(), k_ref, atol=0.1), (chunk, layer, "K")
            assert torch.allclose(page[:, :, 1].float(), v_ref, atol=0.1), (chunk, layer, "V")
