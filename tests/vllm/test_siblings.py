"""Other namespaces of the same model under a root: the start-up warning says what differs."""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from pathlib import Path

from tierstore.format.identity import write_manifest
from tierstore.testing.pages import hybrid_namespace, simple_namespace
from tierstore.vllm.siblings import (
    STATE_DTYPE_HINT,
    identity_differences,
    sibling_differences,
    start_check,
    warnings_for,
)


def test_a_state_dtype_difference_is_named_with_the_setting_to_pin(tmp_path: Path) -> None:
    mine = hybrid_namespace(ssm_dtype="float32")
    other = hybrid_namespace(ssm_dtype="bfloat16", tokens_per_chunk=64)  # bf16 states: another block size too
    write_manifest(tmp_path, mine)
    write_manifest(tmp_path, other)
    diffs = identity_differences(mine, other)
    assert any("group 2 (mamba) section model.layers.4.linear_attn.ssm" in d and '"float32"' in d
               and '"bfloat16"' in d for d in diffs), diffs
    assert any("tokens_per_chunk: 32 vs 64" in d for d in diffs), diffs
    (line,) = warnings_for(tmp_path, mine)
    assert other.digest in line and mine.digest in line and STATE_DTYPE_HINT in line, line


def test_the_same_namespace_and_other_models_are_not_reported(tmp_path: Path) -> None:
    mine = hybrid_namespace()
    write_manifest(tmp_path, mine)
    write_manifest(tmp_path, hybrid_namespace(model="someone/else", ssm_dtype="bfloat16"))
    write_manifest(tmp_path, hybrid_namespace(revision="r1"))  # another revision: another model
    assert sibling_differences(tmp_path, mine) == []
    other = dataclasses.replace(simple_namespace(dtype="float16", model=mine.model), revision=mine.revision)
    write_manifest(tmp_path, other)
    ((digest, diffs, state_dtype),) = sibling_differences(tmp_path, mine)
    assert digest == other.digest and not state_dtype
    assert 'dtype: "bfloat16" vs "float16"' in diffs and "groups: 3 vs 1" in diffs, diffs


def test_hostile_entries_are_skipped_and_values_escaped(tmp_path: Path) -> None:
    mine = hybrid_namespace()
    write_manifest(tmp_path, mine)
    (tmp_path / ("a" * 32)).mkdir()
    (tmp_path / ("a" * 32) / "manifest.json").write_text("{not json")
    (tmp_path / ("b" * 32)).mkdir()
    os.mkfifo(tmp_path / ("b" * 32) / "manifest.json")  # a FIFO must not hang the check
    os.symlink(tmp_path / mine.digest, tmp_path / ("c" * 32))  # a symlinked namespace dir
    evil = hybrid_namespace(hash_algo="sha256\x1b[31m\nforged log line")
    write_manifest(tmp_path, evil)
    (line,) = warnings_for(tmp_path, mine)
    assert "\x1b" not in line and "\n" not in line and "forged log line" in line, line


def test_start_check_logs_from_its_own_thread(tmp_path: Path) -> None:
    mine = hybrid_namespace()
    write_manifest(tmp_path, mine)
    write_manifest(tmp_path, hybrid_namespace(dtype="float16"))
    got: list[str] = []
    t = start_check(tmp_path, mine, got.append)
    t.join(30)
    assert t is not threading.current_thread() and not t.is_alive()
    assert len(got) == 1 and 'dtype: "bfloat16" vs "float16"' in got[0], got
    assert json.loads((tmp_path / mine.digest / "manifest.json").read_text())["namespace"] == mine.digest
