"""A ``vllm serve`` process on 127.0.0.1 for tests and benchmarks: start, wait, query, scrape, stop.

``VllmServer(model, root=...)`` runs ``python -m tierstore.vllm.serve`` (``tierstore.vllm.serve``:
plain ``vllm serve`` on a GPU build) in its own session, with the tierstore connector when
``root`` is given (``None``: no connector, the reference server), logging to a file.
``complete()`` posts an OpenAI completion (plain HTTP, token-id prompts), ``metrics()`` parses
the live ``/metrics`` into ``{"name{labels}": value}`` summed over the ``engine``/``model_name``
labels, ``stop()`` sends SIGTERM (a normal stop) and waits.

Threading: ``complete`` and ``metrics`` may be called from several threads at once; start and
stop from one.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

_SCRAPE_DROP_LABELS = ("engine", "model_name")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class VllmServer:
    def __init__(self, model: str | os.PathLike[str], *, root: str | os.PathLike[str] | None,
                 log_path: str | os.PathLike[str], extra_config: dict[str, Any] | None = None,
                 args: list[str] | None = None, env: dict[str, str] | None = None) -> None:
        self.model = str(model)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path)
        cmd = [sys.executable, "-m", "tierstore.vllm.serve", self.model, "--host", "127.0.0.1",
               "--port", str(self.port), "--disable-uvicorn-access-log", *(args or [])]
        if root is not None:
            ktc = {"kv_connector": "TierStoreConnector", "kv_connector_module_path": "tierstore.vllm",
                   "kv_role": "kv_both", "kv_connector_extra_config": {"root": str(root), **(extra_config or {})}}
            cmd += ["--kv-transfer-config", json.dumps(ktc)]
        self.cmd = cmd
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None

    # ------------------------------------------------------------ lifecycle
    def start(self, timeout_s: float = 600.0) -> VllmServer:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode} during start; "
                                   f"log: {self.log_path}\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        self.kill()
        raise TimeoutError(f"vllm serve not ready after {timeout_s:.0f} s; log: {self.log_path}")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 120.0) -> int:
        """Send ``sig`` to the API server (a normal stop) and wait for the whole session to end."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            rc = self.proc.wait()
        self._wait_session_gone(timeout_s=30.0)
        return rc

    def _wait_session_gone(self, timeout_s: float) -> None:
        """vLLM's engine and worker processes may outlive the API server by a moment."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)
        self.kill()

    def kill(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.stop()

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    # ------------------------------------------------------------ HTTP
    def complete(self, prompt: list[int] | str, *, max_tokens: int, logprobs: int | None = None,
                 timeout_s: float = 600.0) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                                "temperature": 0.0, "ignore_eos": True,
                                # "token_id:N" keys: byte tokens that decode alike stay apart
                                "return_tokens_as_token_ids": True}
        if logprobs is not None:
            body["logprobs"] = logprobs
        req = urllib.request.Request(self.url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return json.loads(r.read())

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name.endswith("_created"):
                    continue
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in _SCRAPE_DROP_LABELS)
                key = f"{s.name}{{{labels}}}" if labels else s.name
                out[key] = out.get(key, 0.0) + float(s.value)
        return out


def metric(scrape: dict[str, float], name: str) -> float:
    """Sum of every sample of ``name`` (all label values)."""
    return sum(v for k, v in scrape.items() if k == name or k.startswith(name + "{"))
