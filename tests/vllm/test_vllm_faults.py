"""Fail-safe loads and hybrid hit planning on real vLLM-CPU engines (hybrid models).

Every fault leaves the engine's tokens identical to the cold run (the damaged tokens are
recomputed), is counted by kind in the connector's stats and logged. Removing one group's
page for a chunk shrinks the hit to what every group can restore.

Gemma3 groups: g0 = sliding window, g1 = full attention. Qwen3-Next: g0..g2 = GDN (Mamba)
states, g3 = full attention; pages at 1152-token boundaries.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from vllm_helpers import (  # noqa: E402
    MODELS,
    chunk_keys,
    copy_root,
    failures,
    page_path,
    pages,
    prompt_ids,
    rewrite_page,
    run_engine,
)

DENSE_RETENTION = {"prefix_cache_retention_interval": None}


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory):
    cache: dict = {}

    def get(kind: str):
        if kind not in cache:
            root = tmp_path_factory.mktemp(f"faults-{kind}")
            ids = prompt_ids(kind)
            run = run_engine(kind, root, [{"prompt_token_ids": ids}], **DENSE_RETENTION)
            n = MODELS[kind]["N"]
            cache[kind] = (root, ids, run.outputs[0].tokens, chunk_keys(ids, n, n))
        return cache[kind]

    return get


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x40  # inside the last section's payload
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def foreign(path: Path) -> None:
    rewrite_page(path, lambda buf: None, namespace=b"\x11" * 16)


@pytest.mark.parametrize(("fault", "group", "chunk", "kind_counted", "cached_after"), [
    (flip_byte, 1, 1, "checksum", 128),    # full attention, chunk 1: prefix falls back to chunk 0
    (truncate, 0, 3, "truncated", 384),    # sliding window, last chunk: window ends one chunk earlier
    (foreign, 1, 0, "foreign", 0),         # full attention, chunk 0: nothing left to restore
])
def test_damaged_page_is_recomputed_counted_and_logged(stored, tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                       fault, group, chunk, kind_counted, cached_after) -> None:
    root, ids, cold, keys = stored("gemma3")
    work = copy_root(root, tmp_path / "r")
    fault(page_path(work, group, keys[chunk]))
    with caplog.at_level(logging.WARNING, logger="tierstore.vllm"):
        run = run_engine("gemma3", work, [{"prompt_token_ids": ids}], **DENSE_RETENTION)
    assert run.outputs[0].tokens == cold
    assert failures(run.worker) == {kind_counted: 1}, run.worker
    assert run.outputs[0].cached == cached_after
    assert any(kind_counted in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_timed_out_loads_are_recomputed(stored, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tierstore.rootstore.page_files import PageFiles

    root, ids, cold, _ = stored("gemma3")
    slow_load, slow_loads = PageFiles.load, PageFiles.load_many

    def stalled(self, *a):  # a file system that hangs longer than the deadline
        time.sleep(0.3)
        return slow_load(self, *a)

    def stalled_batch(self, items):  # the same, for a batch an I/O thread took
        time.sleep(0.3)
        return slow_loads(self, items)

    monkeypatch.setattr(PageFiles, "load", stalled)  # every engine the connector builds
    monkeypatch.setattr(PageFiles, "load_many", stalled_batch)
    run = run_engine("gemma3", copy_root(root, tmp_path / "r"), [{"prompt_token_ids": ids}],
                     extra={"deadline_s": 0.05, "io_loop": "python"}, **DENSE_RETENTION)  # stalls wrap the Python path
    assert run.outputs[0].tokens == cold
    assert failures(run.worker).get("timeout", 0) >= 1, run.worker
    assert run.outputs[0].cached == 0  # timed-out keys are skipped on the retry


@pytest.mark.parametrize("group", [0, 1])
def test_one_groups_pages_deleted_gives_no_hit_and_identical_tokens(stored, tmp_path: Path, group: int) -> None:
    root, ids, cold, _ = stored("gemma3")
    work = copy_root(root, tmp_path / "r")
    for page in pages(work, group):
        page.unlink()
    run = run_engine("gemma3", work, [{"prompt_token_ids": ids}], **DENSE_RETENTION)
    assert run.outputs[0].tokens == cold
    assert run.outputs[0].cached == 0
    assert run.worker.get("load_jobs_ok", 0) == 0 and not failures(run.worker)


def test_sliding_window_page_missing_for_last_chunk_shrinks_hit(stored, tmp_path: Path) -> None:
    root, ids, cold, keys = stored("gemma3")
    work = copy_root(root, tmp_path / "r")
    page_path(work, 0, keys[3]).unlink()
    run = run_engine("gemma3", work, [{"prompt_token_ids": ids}], **DENSE_RETENTION)
    assert run.outputs[0].tokens == cold
    assert run.outputs[0].cached == 3 * 128
    assert not failures(run.worker)


def test_mamba_state_missing_for_last_chunk_shrinks_hit(stored, tmp_path: Path) -> None:
    root, ids, cold, keys = stored("qwen3next")
    assert len(keys) == 2  # states after 1152 and 2304 tokens
    work = copy_root(root, tmp_path / "r")
    page_path(work, 1, keys[1]).unlink()  # one GDN layer's state at 2304 only
    run = run_engine("qwen3next", work, [{"prompt_token_ids": ids}], **DENSE_RETENTION)
    assert run.outputs[0].tokens == cold
    assert run.outputs[0].cached == 1152
    assert not failures(run.worker)


def test_corrupt_mamba_state_is_recomputed(stored, tmp_path: Path) -> None:
    root, ids, cold, keys = stored("qwen3next")
    work = copy_root(root, tmp_path / "r")
    flip_byte(page_path(work, 2, keys[1]))
    run = run_engine("qwen3next", work, [{"prompt_token_ids": ids}], **DENSE_RETENTION)
    assert run.outputs[0].tokens == cold
    assert failures(run.worker) == {"checksum": 1}, run.worker
    assert run.outputs[0].cached == 1152


def test_page_headers_record_chunk_tokens_and_state_positions(stored) -> None:
    from tierstore.rootstore.page_read import inspect_page

    root, ids, _, keys = stored("qwen3next")
    attention = {inspect_page(page_path(root, 3, k)).meta.token_count for k in keys}
    states = [inspect_page(page_path(root, 0, k)).meta.token_count for k in keys]
    assert attention == {1152}  # each attention page holds one chunk
    assert states == [1152, 2304]  # a state page is the state after its boundary


def test_mamba_pages_hold_the_models_own_states(stored) -> None:
    """A GDN page is the model's state after its boundary, in canonical orientation: the conv
    state (dim, kernel-1) whatever vLLM keeps in memory ("SD" on CPU), the temporal state
    [H, Dk, Dv]. Reference: the same model in transformers after the same 1152 tokens."""
    import torch
    from transformers import AutoModelForCausalLM
    from vllm_helpers import model_dir

    from tierstore.rootstore.page_read import inspect_page, read_page

    root, ids, _, keys = stored("qwen3next")
    path = page_path(root, 0, keys[0])
    header = inspect_page(path)
    buf = bytearray(header.layout.nbytes)
    read_page(path, None, memoryview(buf))
    (conv_spec, temp_spec), (conv_off, temp_off) = header.layout.sections[:2], header.layout.offsets[:2]
    assert conv_spec.name.endswith(".conv") and temp_spec.name.endswith(".temporal")
    layer = int(conv_spec.name.split(".")[2])
    conv = torch.frombuffer(buf, dtype=torch.bfloat16, offset=conv_off, count=conv_spec.nbytes // 2).view(*conv_spec.shape)
    temp = torch.frombuffer(buf, dtype=torch.float32, offset=temp_off, count=temp_spec.nbytes // 4).view(*temp_spec.shape)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir("qwen3next")), dtype=torch.bfloat16)
    with torch.no_grad():
        cache = model(torch.tensor([ids[:1152]]), use_cache=True).past_key_values.layers[layer]
    ref_conv = next(iter(cache.conv_states.values()))[0]  # [dim, kernel]
    ref_temp = next(iter(cache.recurrent_states.values()))[0].float()
    width = conv.shape[1]
    assert torch.allclose(conv.float(), ref_conv[:, -width:].float(), atol=0.05)
    assert torch.corrcoef(torch.stack([temp.flatten(), ref_temp.flatten()]))[0, 1] > 0.999


MP_SCRIPT = """
import json, sys
sys.path.insert(0, {here!r})
import conftest  # noqa: F401  (environment; VLLM_ENABLE_V1_MULTIPROCESSING is overridden below)
from vllm_helpers import run_engine

if __name__ == "__main__":
    run = run_engine("gemma3", {root!r}, [{{"prompt_token_ids": {ids!r}}}], shutdown_right_after=True,
                     prefix_cache_retention_interval=None)
    print("RESULT " + json.dumps({{"tokens": run.outputs[0].tokens, "cached": run.outputs[0].cached}}))
"""


@pytest.mark.slow  # vLLM's default multiprocess engine: ~75 s on the 2-core machine
def test_multiprocess_engine_recovers_from_a_corrupt_page(stored, tmp_path: Path) -> None:
    """vLLM's default engine (scheduler and worker in other processes): the failed key must
    cross from the worker process to the scheduler's manager, or the retry would load the
    same corrupt page again and again."""
    import json
    import subprocess
    import sys

    root, ids, cold, keys = stored("gemma3")
    work = copy_root(root, tmp_path / "r")
    flip_byte(page_path(work, 1, keys[1]))
    script = tmp_path / "mp_engine.py"
    script.write_text(MP_SCRIPT.format(here=str(Path(__file__).parent), root=str(work), ids=ids))
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1", PYTHONPATH=str(Path(__file__).parents[2]))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert result["tokens"] == cold
    assert result["cached"] == 128  # chunk 0 restored on the retry, the corrupt chunk 1 skipped
    assert "checksum" in proc.stderr  # the worker process logged the fault
