"""What a stop of ``vllm serve`` does to queued stores, and the start-up sweep of leftover temps.

A stop of ``vllm serve`` (SIGTERM/SIGINT to the API server) goes: API server -> engine-core
process (SIGTERM, then SIGKILL after ``--shutdown-timeout`` seconds; 0, vLLM's default, means at
once) -> executor closes its workers' death pipe and waits ``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS``
(default 5), then SIGTERM, 4 s, SIGKILL. tierstore flushes queued stores in the worker's
connector shutdown (``flush_timeout_s``), which only runs inside those windows. So stores
queued at a stop survive when

    --shutdown-timeout  >= flush_timeout_s + time to drain in-flight requests
    VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS >= flush_timeout_s

``stop_warnings`` says, at engine start, which of these the configuration breaks. Pages that
were not written leave at most temp files, removed at the next start by ``sweep_at_start``
(the rule of ``tierstore.fs.stale_temps``).

Threading: called once from the scheduler-side connector's constructor.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tierstore.fs.stale_temps import SweepReport, sweep_stale_temps

WORKER_TIMEOUT_ENV = "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS"
DEFAULT_WORKER_TIMEOUT_S = 5.0


def stop_warnings(vllm_config: Any, flush_timeout_s: float, environ: dict[str, str] | None = None) -> list[str]:
    """Why stores still queued at a stop of this engine would be dropped (empty: they are not)."""
    env = os.environ if environ is None else environ
    if env.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0":
        return []  # in-process engine: shutdown runs in the caller's process, nothing kills it
    out: list[str] = []
    shutdown_timeout = float(getattr(vllm_config, "shutdown_timeout", 0) or 0)
    if shutdown_timeout < flush_timeout_s:
        what = "kills the engine at once" if shutdown_timeout == 0 else f"kills the engine after {shutdown_timeout:.0f} s"
        out.append(
            f"tierstore: a stop of this server {what} (--shutdown-timeout {shutdown_timeout:.0f}), so page "
            f"stores still queued then are dropped (flush_timeout_s={flush_timeout_s:g}); start vLLM with "
            f"--shutdown-timeout {int(flush_timeout_s) + 10} or more to keep them")
    try:
        worker_timeout = float(env.get(WORKER_TIMEOUT_ENV, DEFAULT_WORKER_TIMEOUT_S))
    except ValueError:
        worker_timeout = DEFAULT_WORKER_TIMEOUT_S
    if worker_timeout < flush_timeout_s:
        out.append(
            f"tierstore: vLLM kills its worker processes {worker_timeout:g} s into a stop "
            f"({WORKER_TIMEOUT_ENV}), before tierstore's flush of queued stores may end "
            f"(flush_timeout_s={flush_timeout_s:g}); set {WORKER_TIMEOUT_ENV}={int(flush_timeout_s)} or more")
    return out


def sweep_at_start(root: str, namespace_digest: str, local_root: str | None = None) -> SweepReport:
    """Remove this namespace's temp files whose writers are gone (killed engines), under ``root``
    and ``local_root``; never a temp of a live writer (another engine on a shared root)."""
    dirs = [Path(root) / namespace_digest]
    if local_root:
        dirs.append(Path(local_root) / namespace_digest)
    return sweep_stale_temps(*[d for d in dirs if d.is_dir()])
