"""The TP scripts' forkserver start (``engine_start.py``): a child runs with its starter's
environment at ``start()``, not with the server's (a plain forkserver child's), which the
scripts rely on for the per-engine thread binding and vLLM for the variables it sets around a
start. No vLLM here: the server imports nothing heavy."""

from __future__ import annotations

import multiprocessing
import os
from multiprocessing import context as mp_context

import engine_start
import pytest

VAR = "TIERSTORE_TEST_ENGINE_START_PROBE"


def report_var(out: multiprocessing.SimpleQueue) -> None:
    out.put(os.environ.get(VAR))


def test_a_forkserver_child_runs_with_its_starters_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = engine_start.EnvForkServerContext()
    out = ctx.SimpleQueue()
    monkeypatch.setenv(VAR, "at-server-start")

    def child_sees(process_class: type) -> str | None:
        p = process_class(target=report_var, args=(out,))
        p.start()
        p.join(60)
        assert p.exitcode == 0
        return out.get()

    assert child_sees(engine_start.EnvProcess) == "at-server-start"  # starts the server
    monkeypatch.setenv(VAR, "changed-after")
    assert child_sees(mp_context.ForkServerProcess) == "at-server-start"  # why EnvProcess exists
    assert child_sees(engine_start.EnvProcess) == "changed-after"


def test_an_unknown_start_method_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERSTORE_TEST_START_METHOD", "thread")
    with pytest.raises(ValueError, match="TIERSTORE_TEST_START_METHOD"):
        engine_start.method(vllm_defaults=False)
    assert engine_start.method(vllm_defaults=True) == "spawn"
