"""Golden page files: a small fixed set of pages that pins the bytes of the page format.

Contract:

- ``golden_pages()`` defines the pages from fixed logical content (values derived from
  SHAKE-256 of the page name, so no random generator's stream is involved): attention bf16
  and fp8 with kernel-block splits, sliding-window bf16, a Mamba/GDN page whose sections leave
  alignment gaps, an MLA page (padded latent), the GDN page with codec ZSTD, a sparse MLA /
  DSA page (latent and indexer key cache per layer) and DeepSeek-V4 opaque block pages.
- ``build_files(device, backend, path, fill)`` produces each file's bytes through a real copy
  path: the engine-layout KV caches are filled from the logical content, the copier gathers
  into page buffers pre-filled with ``fill`` (garbage: canonical pages must not depend on it),
  ``path="transfer"`` goes through ``PageTransfer`` (GPU scratch pre-filled too), and
  ``format.encode_page`` makes the file. Any device/backend/path/fill must give the same bytes.
- ``write(dir)`` writes the files, ``SHA256SUMS`` (``sha256sum -c`` format) and
  ``MANIFEST.json`` (format version, zstd library version and level, per-file sha256 and
  identity); ``check(dir)`` lists every difference as a sentence. A file whose bytes differ
  while the recorded format version equals ``format.FORMAT_VERSION`` is reported as "file
  bytes changed without a format version change".

Command line (regeneration is one command; commit tests/golden/ with the version change):

    python -m tierstore.testing.golden --write    # regenerate tests/golden/
    python -m tierstore.testing.golden --check    # exit 1 and say what differs

Needs torch (the copiers); no vLLM. Threading: plain functions; not for concurrent use on one
directory.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zstandard

from tierstore.format.header import FORMAT_VERSION, Codec, GroupKind, PageExpectation, PageMeta
from tierstore.format.identity import GroupSpec, Namespace
from tierstore.format.layout import attention_layout, mamba_layout, mla_layout, mla_rows_layout
from tierstore.format.page import encode_page
from tierstore.format.page_layout import PageLayout
from tierstore.kernels import GroupCopier
from tierstore.kernels.views import block_bytes_view, make_attention_caches, mamba_state_views

GOLDEN_DIR = Path(__file__).resolve().parents[2] / "tests" / "golden"
MANIFEST = "MANIFEST.json"
SUMS = "SHA256SUMS"
ZSTD_LEVEL = 3
SUFFIX = ".kvp"
FORMAT_CHANGED = "file bytes changed without a format version change"

Sources = tuple[list[torch.Tensor], torch.Tensor, list[int | None], int]  # views, ids, concat dims, bpp


@dataclass(frozen=True)
class GoldenPage:
    """One golden page: its identity, codec, canonical buffer and how caches hold it."""

    name: str
    namespace: Namespace
    meta: PageMeta
    codec: Codec
    expected: bytes  # the canonical page buffer, built directly from the logical content
    caches: Callable[[str], Sources]  # device -> engine-layout caches holding the page

    @property
    def layout(self) -> PageLayout:
        return self.namespace.groups[0].layout

    @property
    def filename(self) -> str:
        return self.name + SUFFIX

    def expectation(self) -> PageExpectation:
        return PageExpectation(self.namespace.digest_bytes, self.meta.key, 0, 0, self.layout)


def _values(salt: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Finite, non-zero-heavy values in ``dtype`` derived only from ``salt`` (no RNG stream)."""
    n = int(np.prod(shape))
    raw = np.frombuffer(hashlib.shake_256(salt.encode()).digest(2 * n), dtype="<u2").astype(np.int64)
    vals = torch.from_numpy(((raw % 2001) - 1000).astype(np.float32) / 64.0).view(shape)
    return vals.to(dtype)  # round to nearest even: the same bits on every machine


def _bytes_of(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _block_ids(nb: int, bpp: int) -> torch.Tensor:
    """[1, bpp] distinct kernel block ids in descending order (never the identity mapping)."""
    return torch.arange(nb - 1, nb - 1 - bpp, -1).view(1, bpp)


def _expected(layout: PageLayout, sections: list[torch.Tensor]) -> bytes:
    buf = bytearray(layout.nbytes)  # gaps stay zero
    for (o, e), t in zip(layout.spans, sections, strict=True):
        buf[o:e] = _bytes_of(t)
    return bytes(buf)


def _page(name: str, kind: GroupKind, dtype: str, layout: PageLayout, tokens: int, block: int,
          sections: list[torch.Tensor], caches: Callable[[str], Sources], codec: Codec = Codec.NONE,
          window: int | None = None) -> GoldenPage:
    names = tuple(s.name for s in layout.sections)
    group = GroupSpec(kind, block, tokens, names, layout, sliding_window=window)
    ns = Namespace(model=f"tierstore/golden/{name}", dtype=dtype, groups=(group,), hash_algo="sha256")
    key = hashlib.sha256(f"tierstore golden page {name}".encode()).digest()
    meta = PageMeta(ns.digest_bytes, key, 0, kind, tokens)
    return GoldenPage(name, ns, meta, codec, _expected(layout, sections), caches)


def _attention(name: str, dtype: torch.dtype, phys: str, block: int, kind: GroupKind = GroupKind.ATTENTION,
               window: int | None = None) -> GoldenPage:
    layers, heads, tokens, head = 2, 2, 16, 8
    dname = str(dtype).removeprefix("torch.")
    layout = attention_layout([f"{name}.layer.{i}" for i in range(layers)], heads, tokens, head, dname)
    logical = [_values(f"{name}/{i}", (heads, tokens, 2, head), dtype) for i in range(layers)]
    store = torch.uint8 if dtype.itemsize == 1 else dtype  # fp8 caches are bytes to the copier
    bpp = tokens // block

    def caches(device: str) -> Sources:
        nb = bpp + 3
        _, views = make_attention_caches(phys, layers, nb, heads, block, head, store, device)
        ids = _block_ids(nb, bpp)
        for v, t in zip(views, logical, strict=True):
            blocks = t.view(store).unflatten(1, (bpp, block)).movedim(1, 0)  # [bpp, H, Nk, 2, D]
            v[ids.view(-1).to(device)] = blocks.to(device)
        return views, ids, [1] * layers, bpp

    return _page(name, kind, dname, layout, tokens, block, logical, caches, window=window)


def _gdn(name: str, codec: Codec) -> GoldenPage:
    """Conv state bf16 [12, 3] (72 bytes: a 56-byte gap) stored transposed, SSM state fp32."""
    layers = 2
    states = [("conv", (12, 3), torch.bfloat16), ("temporal", (2, 4, 4), torch.float32)]
    layout = mamba_layout([f"gdn.{i}" for i in range(layers)],
                          [(n, s, str(t).removeprefix("torch.")) for n, s, t in states])
    logical = [_values(f"gdn/{li}/{n}", s, t) for li in range(layers) for n, s, t in states]
    real = sum(int(np.prod(s)) * t.itemsize for _, s, t in states)

    def caches(device: str) -> Sources:
        nb, views = 4, []
        for _ in range(layers):
            raw = torch.zeros(nb, real + 40, dtype=torch.uint8, device=device)  # padded blocks
            views.extend(mamba_state_views(raw, states, conv_state="conv", conv_layout="SD"))
        ids = torch.tensor([[2]])
        for v, t in zip(views, logical, strict=True):
            v[ids.view(-1).to(device)] = t.unsqueeze(0).to(device)
        return views, ids, [None] * len(views), 1

    return _page(name, GroupKind.MAMBA, "bfloat16", layout, 16, 16, logical, caches, codec)


def _mla(name: str) -> GoldenPage:
    """Latent 12 bf16 per token in blocks of 4 tokens padded to 16 elements."""
    layers, tokens, latent, block, cpad = 2, 16, 12, 4, 16
    layout = mla_layout([f"mla.{i}" for i in range(layers)], tokens, latent, "bfloat16")
    logical = [_values(f"mla/{i}", (tokens, latent), torch.bfloat16) for i in range(layers)]
    bpp = tokens // block

    def caches(device: str) -> Sources:
        nb, views = bpp + 2, []
        ids = _block_ids(nb, bpp)
        for t in logical:
            v = torch.zeros(nb, block, cpad, dtype=torch.bfloat16, device=device)[:, :, :latent]
            v[ids.view(-1).to(device)] = t.view(bpp, block, latent).to(device)
            views.append(v)
        return views, ids, [0] * layers, bpp

    return _page(name, GroupKind.MLA, "bfloat16", layout, tokens, block, logical, caches)


def _dsa(name: str) -> GoldenPage:
    """A sparse MLA / DSA page: per layer a bf16 latent (12 per token) and the indexer's key
    cache (132 bytes per token, vLLM's block order kept), blocks of 4 tokens, 2 blocks a page."""
    layers, tokens, block, latent, indexer = 2, 8, 4, 12, 132
    rows = [row for i in range(layers) for row in ((f"model.layers.{i}.self_attn.attn", latent, "bfloat16"),
                                                   (f"model.layers.{i}.self_attn.indexer.k_cache", indexer, "uint8"))]
    layout = mla_rows_layout(rows, tokens)
    logical = [_values(f"dsa/{n}", (tokens, width), torch.bfloat16).view(torch.uint8)[:, :indexer].contiguous()
               if dtype == "uint8" else _values(f"dsa/{n}", (tokens, width), torch.bfloat16)
               for n, width, dtype in rows]
    bpp = tokens // block

    def caches(device: str) -> Sources:
        nb, views = bpp + 2, []
        ids = _block_ids(nb, bpp)
        for t in logical:
            v = torch.zeros(nb, block, t.shape[1], dtype=t.dtype, device=device)
            v[ids.view(-1).to(device)] = t.view(bpp, block, t.shape[1]).to(device)
            views.append(v)
        return views, ids, [0] * len(views), bpp

    return _page(name, GroupKind.MLA, "bfloat16", layout, tokens, block, logical, caches)


def _v4(name: str) -> GoldenPage:
    """DeepSeek-V4 opaque block pages: two layers of one packed allocation (a shared block
    stride, each page padded), an fp8_ds_mla-like uint8 page and an fp32 state page, 2 blocks."""
    bpp, stride, pages = 2, 320, [("model.layers.2.attn", 4, 20, torch.uint8, 0),
                                  ("model.layers.2.attn.compressor.state_cache", 2, 6, torch.float32, 96)]
    rows = [(n, k * c * t.itemsize, "uint8") for n, k, c, t, _ in pages]
    layout = mla_rows_layout(rows, bpp)
    logical = [_values(f"v4/{n}", (bpp, width // 2), torch.bfloat16).view(torch.uint8).view(bpp, width)
               for n, width, _ in rows]

    def caches(device: str) -> Sources:
        nb = bpp + 2
        ids = _block_ids(nb, bpp)
        buf = torch.zeros(nb * stride, dtype=torch.uint8, device=device)
        views = []
        for (_, k, c, t, offset), page in zip(pages, logical, strict=True):
            typed = torch.as_strided(buf.view(t), (nb, 1, k, c), (stride // t.itemsize, k * c, c, 1), offset // t.itemsize)
            view = block_bytes_view(typed)
            view[ids.view(-1).to(device), 0] = page.to(device)
            views.append(view)
        return views, ids, [0] * len(views), bpp

    return _page(name, GroupKind.MLA, "uint8", layout, 256 * bpp, 256, logical, caches)


def golden_pages() -> list[GoldenPage]:
    return [
        _attention("attn_bf16_lbnhc_k4", torch.bfloat16, "LBNHC", 4),
        _attention("attn_fp8_split_hnd_k8", torch.float8_e4m3fn, "SPLIT_HND", 8),
        _attention("swa_bf16_lbhnc_k16", torch.bfloat16, "LBHNC", 16, GroupKind.SLIDING_WINDOW, window=32),
        _gdn("gdn_gaps", Codec.NONE),
        _mla("mla_bf16_k4"),
        _gdn("gdn_gaps_zstd", Codec.ZSTD),
        _dsa("dsa_latent_indexer_k4"),
        _v4("deepseek_v4_block_pages"),
    ]


def page_buffer(gp: GoldenPage, device: str = "cpu", backend: str = "torch", path: str = "gather",
                fill: int = 0xAA) -> tuple[bytes, list[int] | None]:
    """The page as a copy path leaves it in a buffer pre-filled with ``fill`` (0..255, or -1 for
    random bytes); also the GPU's section checksums on the transfer path (else None)."""
    views, ids, dims, bpp = gp.caches(device)
    copier = GroupCopier(views, gp.layout, bpp, dims, backend=backend)
    n = gp.layout.nbytes
    gen = torch.Generator().manual_seed(abs(fill))

    def garbage(dev: str) -> torch.Tensor:
        if fill < 0:
            return torch.randint(0, 256, (1, n), generator=gen, dtype=torch.uint8).to(dev)
        return torch.full((1, n), fill, dtype=torch.uint8, device=dev)

    if path == "gather":
        pages = garbage(device)
        copier.gather(ids.to(device), pages)
        return _bytes_of(pages.cpu()), None
    if path != "transfer":
        raise ValueError(f"path must be 'gather' or 'transfer', got {path!r}")
    from tierstore.kernels.transfer import PageTransfer

    transfer = PageTransfer(copier, scratch_pages=2)
    if transfer.on_gpu:
        transfer.scratch.copy_(garbage(device).expand(2, n))
    slot = garbage("cpu")[0]
    if transfer.on_gpu:
        slot = slot.pin_memory()
    handle = transfer.start_store(ids, [slot])
    assert handle is not None
    handle.synchronize()
    sums = handle.sums
    return _bytes_of(slot), (list(sums[0]) if sums else None)


def file_bytes(gp: GoldenPage, page: bytes) -> bytes:
    """The page file ``format.encode_page`` writes for ``page``."""
    comp = zstandard.ZstdCompressor(level=ZSTD_LEVEL) if gp.codec == Codec.ZSTD else None
    header, pieces = encode_page(gp.meta, gp.layout, page, gp.codec, comp)
    return header + b"".join(bytes(p) for p in pieces)


def build_files(device: str = "cpu", backend: str = "torch", path: str = "gather",
                fill: int = 0xAA) -> dict[str, bytes]:
    """File name -> bytes of every golden page through one copy path."""
    return {gp.filename: file_bytes(gp, page_buffer(gp, device, backend, path, fill)[0]) for gp in golden_pages()}


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def manifest(files: dict[str, bytes]) -> dict[str, Any]:
    pages = {gp.filename: gp for gp in golden_pages()}
    return {
        "tierstore_golden": 1,
        "format_version": FORMAT_VERSION,
        "zstandard": zstandard.__version__,
        "zstd": ".".join(map(str, zstandard.ZSTD_VERSION)),
        "zstd_level": ZSTD_LEVEL,
        "files": {name: {"sha256": _sha(data), "bytes": len(data), "codec": pages[name].codec.name.lower(),
                         "group_kind": pages[name].meta.group_kind.name.lower(),
                         "namespace": pages[name].namespace.digest, "key": pages[name].meta.key.hex()}
                  for name, data in sorted(files.items())},
    }


def write(directory: Path = GOLDEN_DIR) -> dict[str, bytes]:
    """Regenerate the golden files (CPU, torch copier) with their SHA256SUMS and manifest."""
    directory.mkdir(parents=True, exist_ok=True)
    files = build_files()
    for old in directory.glob("*" + SUFFIX):
        if old.name not in files:
            old.unlink()
    for name, data in files.items():
        (directory / name).write_bytes(data)
    (directory / SUMS).write_text("".join(f"{_sha(d)}  {n}\n" for n, d in sorted(files.items())))
    (directory / MANIFEST).write_text(json.dumps(manifest(files), indent=2, sort_keys=True) + "\n")
    return files


def check(directory: Path = GOLDEN_DIR, files: dict[str, bytes] | None = None) -> list[str]:
    """Every way ``files`` (default: built on the CPU) differ from the committed golden files."""
    regen = "run `python -m tierstore.testing.golden --write` and commit tests/golden/"
    try:
        recorded = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        return [f"no readable golden manifest in {directory} ({exc}): {regen}"]
    if recorded.get("format_version") != FORMAT_VERSION:
        return [f"the golden files are of page format {recorded.get('format_version')}, this tierstore writes "
                f"format {FORMAT_VERSION}: {regen} (the version change is what allows new bytes)"]
    files = build_files() if files is None else files
    zstd_now = ".".join(map(str, zstandard.ZSTD_VERSION))
    problems = []
    for name in sorted(set(recorded["files"]) - set(files)):
        problems.append(f"{name}: recorded but no longer built: {FORMAT_CHANGED} ({regen} with a new version)")
    for name, data in sorted(files.items()):
        want = recorded["files"].get(name)
        if want is None:
            problems.append(f"{name}: built but not recorded: {regen}")
            continue
        on_disk = directory / name
        if not on_disk.is_file() or _sha(on_disk.read_bytes()) != want["sha256"]:
            problems.append(f"{name}: the committed file does not match its recorded sha256: {regen}")
        if _sha(data) == want["sha256"]:
            continue
        if want["codec"] == "zstd" and recorded.get("zstd") != zstd_now:
            problems.append(f"{name}: zstd frames differ; this zstd library is {zstd_now}, the golden file was "
                            f"written with {recorded.get('zstd')} (compare with that version)")
            continue
        problems.append(f"{name}: {FORMAT_CHANGED} (format {FORMAT_VERSION}; sha256 {_sha(data)[:16]}.. "
                        f"!= recorded {want['sha256'][:16]}..). If the change is intended, bump "
                        f"format.FORMAT_VERSION and {regen}")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tierstore.testing.golden", description=__doc__.split("\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="regenerate the golden files")
    mode.add_argument("--check", action="store_true", help="rebuild on the CPU and compare")
    ap.add_argument("--dir", type=Path, default=GOLDEN_DIR, help=f"golden directory (default {GOLDEN_DIR})")
    args = ap.parse_args(argv)
    if args.write:
        files = write(args.dir)
        print(f"wrote {len(files)} golden pages ({sum(map(len, files.values()))} bytes, format "
              f"{FORMAT_VERSION}) to {args.dir}")
        return 0
    problems = check(args.dir)
    for p in problems:
        print(p)
    print("golden files: " + ("OK" if not problems else f"{len(problems)} problem(s)"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
