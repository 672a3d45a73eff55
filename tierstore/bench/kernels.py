"""``tierstore bench kernels``: canonical-page copy kernels and the GPU transfer path, against
baselines measured in the same run.

Needs a CUDA device. For page shapes of real models (a dense 8B-class model, a
Qwen3.5-0.8B-class hybrid with 544-token unified blocks, a Gemma3-class sliding-window group,
a DeepSeek-V3-class MLA latent group):

- ``kernels``: GroupCopier gather (cache -> device pages) and scatter (pages -> cache) GB/s,
  Triton and the torch reference, against ``torch.index_select`` / ``index_copy_`` moving the
  same bytes (whole physical block rows of every layer, no reordering) into/out of a dense
  buffer. Ratio = GroupCopier GB/s / baseline GB/s (target >= 0.9).
- ``transfer`` (``tierstore.bench.transfer``): the vLLM worker's own store and load pipelines
  (GPU cache -> gather -> pinned staging slot -> IOEngine page file and back), against raw
  PCIe and raw file write/read of the same bytes measured in the same run. Ratio = pipeline
  GB/s / min(PCIe, raw file) GB/s (target >= 0.85). Loads are measured warm (page cache) and,
  when the page cache can be dropped (root), cold.

GB/s counts page payload bytes once (10^9 bytes/s). Timings: CUDA events / triton.testing
``do_bench`` medians for kernels; wall clock with a final synchronize for transfers.

Run: ``python -m tierstore.bench.kernels --json`` (or ``tierstore bench kernels``).
Threading: the benchmark drives its own threads; nothing here is used by the library.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import platform
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tierstore.bench.transfer import GB, median_run, raw_files, raw_pcie, transfer_pipeline
from tierstore.kernels.scratch import transfer_scratch_pages


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- model shapes
@dataclass(frozen=True)
class AttnShape:
    name: str
    layers: int  # layers in the group
    heads: int
    head_size: int
    kernel_tokens: int  # tokens per kernel block
    blocks_per_page: int
    dtype: torch.dtype
    layouts: tuple[str, ...]


@dataclass(frozen=True)
class MambaShape:
    name: str
    layers: int
    conv_dim: int
    conv_len: int
    heads: int
    head_v: int
    head_k: int
    conv_dtype: torch.dtype
    ssm_dtype: torch.dtype
    page_padded: int  # bytes per block in the cache (the attention page it is padded to)


@dataclass(frozen=True)
class MlaShape:
    name: str
    layers: int
    latent: int  # kv_lora_rank + the rope dims: one [N, C] row per token and layer
    kernel_tokens: int
    blocks_per_page: int
    dtype: torch.dtype


Shape = AttnShape | MambaShape | MlaShape


def model_shapes() -> list[Shape]:
    # Qwen3.5-0.8B-class hybrid: 6 attention layers (2 KV heads x 256) + 18 GDN layers
    # (16 k/v heads x 128, conv kernel 4, fp32 SSM state) -> Mamba page 1,085,440 B; attention
    # needs 2,048 B/token/layer -> unified block 544 tokens (1,114,112 B, Mamba padded to it).
    gdn_conv_dim = 2 * 128 * 16 + 128 * 16
    attn_token_bytes = 2 * 256 * 2 * 2
    return [
        AttnShape("dense-8B (32L, 8x128, 16-tok kernel blocks, 64-tok pages)", 32, 8, 128, 16, 4,
                  torch.bfloat16, ("LBHNC", "LBNHC", "SPLIT_NHD")),
        AttnShape("dense-8B (32L, 8x128, 16-tok pages)", 32, 8, 128, 16, 1, torch.bfloat16, ("LBNHC",)),
        AttnShape("hybrid-0.8B attention (6L, 2x256, 544-tok blocks)", 6, 2, 256, 544, 1, torch.bfloat16,
                  ("LBHNC", "LBNHC")),
        AttnShape("hybrid-0.8B attention (6L, 2x256, 544 = 17 x 32-tok kernel blocks)", 6, 2, 256, 32, 17,
                  torch.bfloat16, ("LBNHC",)),
        MambaShape("hybrid-0.8B GDN group (6L, conv 6144x3 bf16 SD, ssm 16x128x128 fp32)", 6, gdn_conv_dim, 3,
                   16, 128, 128, torch.bfloat16, torch.float32, 544 * attn_token_bytes),
        AttnShape("gemma3-12B sliding window (8L, 8x256, 16-tok kernel blocks, 64-tok pages)", 8, 8, 256, 16, 4,
                  torch.bfloat16, ("LBNHC",)),
        # DeepSeek-V3 / Kimi K2: 61 layers of a 512 + 64 latent, FlashMLA's 64-token blocks
        MlaShape("deepseek-v3 MLA latent (61L, 576, 64-tok blocks and pages)", 61, 576, 64, 1, torch.bfloat16),
    ]


# ---------------------------------------------------------------------------- case building
@dataclass
class Case:
    label: str
    layout_name: str
    copier_args: tuple[list[torch.Tensor], Any, int, list[int | None]]
    page_layout: Any
    ids: torch.Tensor  # [n_pages, bpp] on the device
    baseline_rows: list[tuple[torch.Tensor, torch.Tensor]]  # (src rows [nb, bytes], dense out [n, bytes])
    block_ids_flat: torch.Tensor


def build_attention(shape: AttnShape, layout: str, n_pages: int, device: str) -> Case:
    from tierstore.format.layout import attention_layout
    from tierstore.kernels.views import make_attention_caches

    bpp = shape.blocks_per_page
    nb = n_pages * bpp + 8
    backing, views = make_attention_caches(layout, shape.layers, nb, shape.heads, shape.kernel_tokens,
                                           shape.head_size, shape.dtype, device)
    torch.manual_seed(1)
    for b in backing:
        b.view(torch.uint8).random_(0, 256)  # random bits (never zeros: they hide unwritten bytes)
    gen = torch.Generator().manual_seed(1)
    dtype_name = str(shape.dtype).removeprefix("torch.")
    lay = attention_layout([f"layer.{i}" for i in range(shape.layers)], shape.heads, shape.kernel_tokens * bpp,
                           shape.head_size, dtype_name)
    ids = torch.randperm(nb, generator=gen)[: n_pages * bpp].view(n_pages, bpp).to(device)
    flat = ids.reshape(-1)
    # baseline: whole physical block rows of the same bytes
    base: list[tuple[torch.Tensor, torch.Tensor]] = []
    if layout.startswith("SPLIT_"):
        for b in backing:  # [2, nb, ...]: K plane and V plane rows
            rows = b.view(torch.uint8).view(2, nb, -1)
            for plane in rows:
                base.append((plane, torch.empty(flat.numel(), plane.shape[1], dtype=torch.uint8, device=device)))
    elif layout[0] == "L":
        for b in backing:  # one allocation [L, ...]: per layer rows
            per_layer = b.view(torch.uint8).view(shape.layers, -1)
            if layout[1] == "B":
                for li in range(shape.layers):
                    rows = per_layer[li].view(nb, -1)
                    base.append((rows, torch.empty(flat.numel(), rows.shape[1], dtype=torch.uint8, device=device)))
            else:
                raise ValueError(f"no baseline for {layout}")
    else:  # block-outer: one row per block holds every layer
        b = backing[0].view(torch.uint8).view(nb, -1)
        base.append((b, torch.empty(flat.numel(), b.shape[1], dtype=torch.uint8, device=device)))
    label = f"{shape.name} [{layout}]"
    return Case(label, layout, (views, lay, bpp, [1] * shape.layers), lay, ids, base, flat)


def build_mamba(shape: MambaShape, n_pages: int, device: str) -> Case:
    from tierstore.format.layout import mamba_layout
    from tierstore.kernels.views import mamba_state_views

    nb = n_pages + 8
    states = [("conv", (shape.conv_dim, shape.conv_len), shape.conv_dtype),
              ("temporal", (shape.heads, shape.head_v, shape.head_k), shape.ssm_dtype)]
    real = sum(torch.empty(s, dtype=t).nbytes for _, s, t in states)
    gen = torch.Generator().manual_seed(2)
    views: list[torch.Tensor] = []
    base: list[tuple[torch.Tensor, torch.Tensor]] = []
    for _ in range(shape.layers):
        raw = torch.empty(nb, shape.page_padded, dtype=torch.uint8, device=device).random_(0, 256)
        views.extend(mamba_state_views(raw, states, conv_state="conv", conv_layout="SD"))
        rows = raw[:, :real]
        base.append((rows, torch.empty(n_pages, real, dtype=torch.uint8, device=device)))
    lay = mamba_layout([f"gdn.{i}" for i in range(shape.layers)],
                       [(n, s, str(t).removeprefix("torch.")) for n, s, t in states])
    ids = torch.randperm(nb, generator=gen)[:n_pages].view(n_pages, 1).to(device)
    return Case(f"{shape.name} [raw int8 pages]", "mamba", (views, lay, 1, [None] * len(views)), lay, ids,
                base, ids.reshape(-1))


def build_mla(shape: MlaShape, n_pages: int, device: str) -> Case:
    """MLA latent caches as vLLM hands them to the connector (``[nb, 1, N, C]`` per layer, read
    through ``kernels.views.mla_view``); the baseline moves whole block rows of every layer."""
    from tierstore.format.layout import mla_layout
    from tierstore.kernels.views import mla_view

    bpp = shape.blocks_per_page
    nb = n_pages * bpp + 8
    gen = torch.Generator().manual_seed(3)
    views: list[torch.Tensor] = []
    base: list[tuple[torch.Tensor, torch.Tensor]] = []
    for _ in range(shape.layers):
        raw = torch.empty(nb, 1, shape.kernel_tokens, shape.latent, dtype=shape.dtype, device=device)
        raw.view(torch.uint8).random_(0, 256)
        views.append(mla_view(raw, shape.latent))
        rows = raw.view(torch.uint8).view(nb, -1)
        base.append((rows, torch.empty(n_pages * bpp, rows.shape[1], dtype=torch.uint8, device=device)))
    lay = mla_layout([f"mla.{i}" for i in range(shape.layers)], shape.kernel_tokens * bpp, shape.latent,
                     str(shape.dtype).removeprefix("torch."))
    ids = torch.randperm(nb, generator=gen)[: n_pages * bpp].view(n_pages, bpp).to(device)
    return Case(f"{shape.name} [MLA]", "mla", (views, lay, bpp, [0] * shape.layers), lay, ids, base,
                ids.reshape(-1))


# ---------------------------------------------------------------------------- timing helpers
def _bench_ms(fn: Callable[[], Any], reps: int) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=max(20, reps), return_mode="median"))


def kernel_rows(case: Case, reps: int, configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from tierstore.kernels import GroupCopier
    from tierstore.kernels.triton_kernels import TritonCopier

    views, lay, bpp, cds = case.copier_args
    n = case.ids.shape[0]
    data = lay.data_bytes * n
    pages = torch.empty(n, lay.nbytes, dtype=torch.uint8, device=views[0].device)
    ids = case.ids
    flat = case.block_ids_flat
    out: list[dict[str, Any]] = []

    def gbps(ms: float) -> float:
        return data / (ms / 1e3) / GB

    base_bytes = sum(o.numel() for _, o in case.baseline_rows)
    sel = _bench_ms(lambda: [torch.index_select(src, 0, flat, out=o) for src, o in case.baseline_rows], reps)
    cpy = _bench_ms(lambda: [src.index_copy_(0, flat, o) for src, o in case.baseline_rows], reps)
    sel_gbps = base_bytes / (sel / 1e3) / GB
    cpy_gbps = base_bytes / (cpy / 1e3) / GB
    ref = GroupCopier(views, lay, bpp, cds, backend="torch")
    results: list[tuple[str, float, float, dict[str, int]]] = []
    for cfg in configs:
        tri = TritonCopier(views, lay, bpp, cds, **cfg)
        g = _bench_ms(lambda t=tri: t.gather(ids, pages), reps)
        s = _bench_ms(lambda t=tri: t.scatter(pages, ids), reps)
        plan = tri.describe()
        results.append(("triton", g, s, {**cfg, "launches": len(plan), "vec": max(p["vec"] for p in plan)}))
    g = _bench_ms(lambda: ref.gather(ids, pages), reps)
    s = _bench_ms(lambda: ref.scatter(pages, ids), reps)
    results.append(("torch", g, s, {}))
    for backend, g, s, cfg in results:
        out.append({
            "case": case.label, "backend": backend, "config": cfg, "pages": n, "page_bytes": lay.nbytes,
            "bytes": data, "gather_gbps": round(gbps(g), 1), "scatter_gbps": round(gbps(s), 1),
            "index_select_gbps": round(sel_gbps, 1), "index_copy_gbps": round(cpy_gbps, 1),
            "gather_ratio": round(gbps(g) / sel_gbps, 3), "scatter_ratio": round(gbps(s) / cpy_gbps, 3),
        })
    return out


def host_direct_row(case: Case, reps: int, pcie: dict[str, float]) -> dict[str, Any]:
    """Triton gather/scatter straight between the cache and pinned host pages (over PCIe),
    against a plain pinned<->device copy of the same size."""
    from tierstore.kernels.triton_kernels import TritonCopier

    views, lay, bpp, cds = case.copier_args
    n = case.ids.shape[0]
    host = torch.empty(n, lay.nbytes, dtype=torch.uint8).pin_memory()
    tri = TritonCopier(views, lay, bpp, cds)
    g = _bench_ms(lambda: tri.gather(case.ids, host), reps)
    s = _bench_ms(lambda: tri.scatter(host, case.ids), reps)
    data = lay.data_bytes * n
    out = {"case": case.label, "pages": n, "gather_to_pinned_gbps": round(data / (g / 1e3) / GB, 2),
           "scatter_from_pinned_gbps": round(data / (s / 1e3) / GB, 2)}
    out["gather_vs_d2h"] = round(out["gather_to_pinned_gbps"] / pcie["d2h_gbps"], 3)
    out["scatter_vs_h2d"] = round(out["scatter_from_pinned_gbps"] / pcie["h2d_gbps"], 3)
    return out


# ---------------------------------------------------------------------------- driver
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--json-out", default=None, help="also write the JSON report to this file")
    parser.add_argument("--root", default=None, help="scratch directory for the transfer benchmark (default: a temp dir)")
    parser.add_argument("--mib", type=int, default=512, help="payload MiB per kernel measurement (default 512)")
    parser.add_argument("--transfer-mib", type=int, default=1024, help="payload MiB per transfer measurement (default 1024)")
    parser.add_argument("--batch", type=int, default=None,
                        help="pages per transfer batch (default: --batch-mib worth of pages)")
    parser.add_argument("--batch-mib", type=int, default=None,
                        help="payload per transfer batch when --batch is not given (default: the pages of the "
                             "vLLM worker's automatic transfer scratch at this io-threads count, "
                             "kernels.scratch.transfer_scratch_pages)")
    parser.add_argument("--io-threads", default="4",
                        help="IOEngine and raw-file threads; a comma list (1,4,8,16) sweeps them (default 4)")
    parser.add_argument("--scratch-batches", type=int, default=2,
                        help="transfer: device scratch in batches (transfers in flight at most; default 2)")
    parser.add_argument("--slots", type=int, default=0, help="IOEngine staging slots (default max(3 x batch, 4 x io-threads + 8), the vLLM "
                             "worker's floor)")
    parser.add_argument("--io-batch-pages", type=int, default=None,
                        help="IOEngine io_batch_pages (default: the setting's default; 1 = no batches)")
    parser.add_argument("--io-loop", default=None, choices=("native", "python"),
                        help="IOEngine io_loop (default: the setting's default, native)")
    parser.add_argument("--encryption-key-file", default=None, metavar="PATH",
                        help="IOEngine encryption_key_file: the transfer path with sealed pages")
    parser.add_argument("--skip-kernels", action="store_true", help="transfer path only")
    parser.add_argument("--rep-s", type=float, default=0.1, metavar="SECONDS",
                        help="time each kernel is repeated for (triton's do_bench rep; default 0.1)")
    parser.add_argument("--reps", type=int, default=None, help=argparse.SUPPRESS)  # the old name, in ms
    parser.add_argument("--sweep", action="store_true", help="also try other Triton tile sizes / warps (first case)")
    parser.add_argument("--skip-transfer", action="store_true", help="kernels only")
    parser.add_argument("--no-cold", action="store_true", help="do not drop the page cache for cold loads")
    parser.add_argument("--repeats", type=int, default=3,
                        help="transfer: raw-then-pipeline pairs per case; medians reported (default 3)")


def _print(rep: dict[str, Any]) -> None:
    print(f"device: {rep['device']}  torch {rep['torch']}  triton {rep['triton']}")
    print("\nkernels (GB/s of page payload; ratio = vs index_select / index_copy_ on the same bytes)")
    print(f"{'case':<88} {'backend':<7} {'gather':>7} {'isel':>7} {'ratio':>6} {'scatter':>7} {'icopy':>7} {'ratio':>6}")
    for r in rep["kernels"]:
        c = r["config"]
        cfg = f"t{c['tile_words']}w{c['num_warps']}v{c['vec']}" if c else ""
        print(f"{r['case'][:72] + ' ' + cfg:<88} {r['backend']:<7} {r['gather_gbps']:>7} {r['index_select_gbps']:>7} "
              f"{r['gather_ratio']:>6} {r['scatter_gbps']:>7} {r['index_copy_gbps']:>7} {r['scatter_ratio']:>6}")
    if rep.get("host_direct"):
        print("\nTriton straight to/from pinned host pages (GB/s; ratio vs a plain pinned copy)")
        for r in rep["host_direct"]:
            print(f"{r['case'][:80]:<82} gather {r['gather_to_pinned_gbps']} (x{r['gather_vs_d2h']}) "
                  f"scatter {r['scatter_from_pinned_gbps']} (x{r['scatter_vs_h2d']})")
    if rep.get("transfer"):
        print(f"\nraw PCIe: {rep['raw_pcie']}  (ratio = pipeline / min(PCIe, raw file) of the same direction)")
        for t in rep["transfer"]:
            print(f"  raw files for the next case: {t['raw_files']}")
            spread = {k: (min(r[k] for r in t["per_repeat"]), max(r[k] for r in t["per_repeat"]))
                      for k in ("store_ratio", "load_warm_ratio", "load_cold_ratio") if k in t["per_repeat"][0]}
            print(f"{t['case'][:70]:<72} verified={t.get('verified')} gpu checksums={t.get('checksums_on_gpu')} "
                  f"medians of {t['repeats']}: store {t['store_gbps']} GB/s (x{t['store_ratio']}), "
                  f"load warm {t['load_warm_gbps']} (x{t['load_warm_ratio']})"
                  + (f", cold {t['load_cold_gbps']} (x{t.get('load_cold_ratio')})" if "load_cold_gbps" in t else "")
                  + "; per-repeat ratio ranges " + ", ".join(f"{k} {a}-{b}" for k, (a, b) in spread.items()))
            census = {ph: " ".join(f"{k[len(ph) + 7:]} {v}" for k, v in t.items() if k.startswith(f"{ph}_slots_"))
                      for ph in ("store", "load_warm")}
            print(f"  slot census (pages, time-weighted, of {t.get('staging_slots')}; scratch {t.get('scratch_pages')} "
                  f"pages): store: {census['store']}; load: {census['load_warm']}")
        _print_sweep(rep)


def _print_sweep(rep: dict[str, Any]) -> None:
    """The transfer rows as one markdown table: per case and thread count, pipeline GB/s, raw
    parallel file I/O GB/s (same pages, same threads), PCIe GB/s, ratio to min(PCIe, raw)."""
    pcie = rep["raw_pcie"]
    print("\n| case | thr | store | raw write | PCIe d2h | ratio | load warm | raw read | PCIe h2d | ratio "
          "| engine-only store | engine-only load | io batch | jobs in batches | native loop | direct launches "
          "| I/O busy st/ld | engine-only I/O busy st/ld |")
    print("|" + "---|" * 18)
    for t in rep["transfer"]:
        raw = t["raw_files"]
        print(f"| {t['case'][:48]} | {t['io_threads']} | {t['store_gbps']} | {raw['write_gbps']} | {pcie['d2h_gbps']} "
              f"| {t['store_ratio']} | {t['load_warm_gbps']} | {raw['read_warm_gbps']} | {pcie['h2d_gbps']} "
              f"| {t['load_warm_ratio']} | {t.get('engine_only_store_gbps')} | {t.get('engine_only_load_warm_gbps')} "
              f"| {t.get('io_batch_pages')} | {t.get('batched_job_share')} | {t.get('native_loop_share')} "
              f"| {t.get('direct_launch_share')} "
              f"| {t.get('store_io_busy')}/{t.get('load_warm_io_busy')} "
              f"| {t.get('engine_only_store_io_busy')}/{t.get('engine_only_load_warm_io_busy')} |")


def _per_page(shape: Shape) -> int:
    """Payload bytes of one page of ``shape``."""
    if isinstance(shape, MlaShape):
        return shape.layers * shape.kernel_tokens * shape.blocks_per_page * shape.latent * 2
    if isinstance(shape, MambaShape):
        return shape.layers * (shape.conv_dim * shape.conv_len * 2 + shape.heads * shape.head_v * shape.head_k * 4)
    return shape.layers * shape.heads * shape.kernel_tokens * shape.blocks_per_page * 2 * shape.head_size * 2


def _kernel_cases(mib: int, device: str) -> list[Case]:
    cases: list[Case] = []
    for shape in model_shapes():
        n = max(4, mib * 2**20 // _per_page(shape))
        if isinstance(shape, MambaShape):
            cases.append(build_mamba(shape, n, device))
        elif isinstance(shape, MlaShape):
            cases.append(build_mla(shape, n, device))
        else:
            cases.extend(build_attention(shape, layout, n, device) for layout in shape.layouts)
    return cases


def _transfer_case_makers(mib: int, device: str) -> list[Callable[[], Case]]:
    """Builders (a case holds device memory: one at a time) of the transfer cases."""
    makers: list[Callable[[], Case]] = []
    for shape in model_shapes():
        n = max(8, mib * 2**20 // _per_page(shape))
        if isinstance(shape, MambaShape):
            makers.append(lambda s=shape, n=n: build_mamba(s, n, device))
        elif isinstance(shape, MlaShape):
            makers.append(lambda s=shape, n=n: build_mla(s, n, device))
        elif shape.blocks_per_page in (4, 17):
            layout = shape.layouts[-1] if shape.layouts[-1] != "SPLIT_NHD" else "LBNHC"
            makers.append(lambda s=shape, n=n, lo=layout: build_attention(s, lo, n, device))
    return makers


def _run_kernels(args: argparse.Namespace, rep: dict[str, Any], device: str, save: Callable[[], None]) -> None:
    configs: list[dict[str, Any]] = [{"tile_words": 4096, "num_warps": 4},
                                     {"tile_words": 4096, "num_warps": 4, "vector_hints": False}]
    sweep = configs + [{"tile_words": 2048, "num_warps": 4}, {"tile_words": 8192, "num_warps": 8},
                       {"tile_words": 16384, "num_warps": 8}]
    rep_ms = round(args.rep_s * 1000)  # triton's do_bench takes milliseconds
    if args.reps is not None:  # one unit for durations: seconds
        print("tierstore bench kernels: --reps is deprecated; use --rep-s (seconds)", file=sys.stderr)
        rep_ms = args.reps
    cases = _kernel_cases(args.mib, device)
    for i, case in enumerate(cases):
        _log(f"kernels: {case.label}")
        rep["kernels"].extend(kernel_rows(case, rep_ms, sweep if i == 0 and args.sweep else configs))
        save()
    pcie = raw_pcie(256 * 2**20, device)
    rep["host_direct"] = [host_direct_row(c, rep_ms, pcie) for c in cases if c.layout_name in ("LBNHC", "mamba")]
    _log(f"host direct {rep['host_direct']}")
    save()


def _random_pages(n: int, page: int) -> tuple[torch.Tensor, list[memoryview]]:
    """A pinned slab of ``n`` random pages and a view of each (the raw-file baseline's bytes)."""
    slab = torch.empty(n * page, dtype=torch.uint8).pin_memory()
    slab.copy_(torch.randint(0, 256, (1 << 20,), dtype=torch.uint8).repeat(n * page >> 20)[: n * page]
               if (n * page) % (1 << 20) == 0 else torch.randint(0, 256, (n * page,), dtype=torch.uint8))
    return slab, [memoryview(slab.numpy())[i * page : (i + 1) * page] for i in range(n)]


def _transfer_repeat(args: argparse.Namespace, case: Case, tmp: Path, bufs: list[memoryview],
                     pcie: dict[str, float], repeat: int) -> dict[str, Any]:
    """One raw-files-then-pipeline pair (paired: drift hits both alike), with its ratios."""
    _log(f"transfer: {case.label}: repeat {repeat + 1}/{args.repeats}: raw files")
    raw = raw_files(tmp, bufs, args.io_threads, cold=not args.no_cold)
    _log(f"raw files {raw}; pipeline")
    page = case.page_layout.nbytes
    # by default the worker's automatic scratch, with no slot cap (the bench sizes slots from it)
    batch = args.batch or (max(1, (args.batch_mib << 20) // page) if args.batch_mib
                           else transfer_scratch_pages(1 << 30, page, None, args.io_threads))
    t = transfer_pipeline(case, tmp, batch, args.io_threads, cold=not args.no_cold, slots=args.slots,
                          io_batch_pages=args.io_batch_pages, scratch_pages=args.scratch_batches * batch,
                          io_loop=args.io_loop, encryption_key_file=args.encryption_key_file)
    t["raw_files"] = raw
    t["store_ratio"] = round(t["store_gbps"] / min(pcie["d2h_gbps"], raw["write_gbps"]), 3)
    t["load_warm_ratio"] = round(t["load_warm_gbps"] / min(pcie["h2d_gbps"], raw["read_warm_gbps"]), 3)
    t["store_vs_engine_only"] = round(t["store_gbps"] / t["engine_only_store_gbps"], 3)
    t["load_warm_vs_engine_only"] = round(t["load_warm_gbps"] / t["engine_only_load_warm_gbps"], 3)
    if "load_cold_gbps" in t and "read_cold_gbps" in raw:
        t["load_cold_ratio"] = round(t["load_cold_gbps"] / min(pcie["h2d_gbps"], raw["read_cold_gbps"]), 3)
    return t


def _run_transfers(args: argparse.Namespace, rep: dict[str, Any], device: str, save: Callable[[], None]) -> None:
    tmp = Path(args.root) if args.root else Path(tempfile.mkdtemp(prefix="tierstore-bench-"))
    tmp.mkdir(parents=True, exist_ok=True)
    faulthandler.dump_traceback_later(150, repeat=True)  # a hang shows where
    try:
        _log("raw PCIe")
        rep["raw_pcie"] = raw_pcie(args.transfer_mib * 2**20, device)
        _log(f"raw PCIe {rep['raw_pcie']}")
        thread_counts = [int(x) for x in str(args.io_threads).split(",") if x.strip()]
        for make in _transfer_case_makers(args.transfer_mib, device):
            case = make()
            slab, bufs = _random_pages(case.ids.shape[0], case.page_layout.nbytes)
            for threads in thread_counts:
                args.io_threads = threads
                runs = [_transfer_repeat(args, case, tmp, bufs, rep["raw_pcie"], r) for r in range(args.repeats)]
                t = median_run(runs)
                rep["transfer"].append(t)
                _log(f"pipeline {t}")
                save()
            args.io_threads = ",".join(map(str, thread_counts))
            del bufs, slab
            del case
            torch.cuda.empty_cache()
    finally:
        faulthandler.cancel_dump_traceback_later()
        if not args.root:
            shutil.rmtree(tmp, ignore_errors=True)


def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("tierstore bench kernels: needs a CUDA device (the kernels' CPU path is the torch "
              "reference, measured by the tests only)", file=sys.stderr)
        return 2
    import triton

    from tierstore.native import loader as native

    device = "cuda"
    native.start(wait=True)  # measure the engine's settled path, not its compile second
    rep: dict[str, Any] = {
        "tierstore_bench_kernels": 1, "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "host": platform.node(), "kernels": [], "transfer": [],
        "native": "on" if native.ready() else f"off ({native.failure() or 'TIERSTORE_NATIVE=0'})",
    }

    def save() -> None:
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(rep, indent=2) + "\n")

    if not args.skip_kernels:
        _run_kernels(args, rep, device, save)
    if not args.skip_transfer:
        _run_transfers(args, rep, device, save)
    save()
    if args.json:
        json.dump(rep, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        _print(rep)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tierstore bench kernels", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    threading.current_thread().name = "bench"
    sys.exit(main())
