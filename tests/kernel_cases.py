"""Shared cases for the copy-kernel tests (CPU interpreter and compiled GPU).

Imported by tests/test_kernels.py and tests/test_kernels_gpu.py; sets no environment, so the
importer decides whether Triton is interpreted. Each case builds the same logical KV in
several physical layouts / kernel block sizes and checks canonical pages against an
expected page built directly from the logical tokens (independent of both copy paths).
"""

from __future__ import annotations

from pathlib import Path

import torch

from tierstore.format.header import GroupKind
from tierstore.format.identity import GroupSpec, Namespace
from tierstore.format.layout import attention_layout, mamba_layout, mla_layout
from tierstore.format.page_layout import PageLayout
from tierstore.kernels import GroupCopier
from tierstore.kernels.geometry import INT_DTYPE_BY_SIZE
from tierstore.kernels.views import make_attention_caches, mamba_state_views
from tierstore.rootstore.engine import IOEngine

DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.uint8,  # fp8 handled as bytes
}


def random_values(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random bit patterns (never zeros, never NaN-only) in ``dtype``."""
    item = dtype.itemsize
    if dtype == torch.uint8:
        return torch.randint(1, 255, shape, generator=gen, dtype=torch.uint8)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=gen) * 3 + 0.5).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=gen, dtype=INT_DTYPE_BY_SIZE[item]).view(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    """Same memory as a same-size integer tensor: compare bit patterns, not values."""
    return t.view(INT_DTYPE_BY_SIZE[t.element_size()])


class AttentionCase:
    """Logical KV of ``layers`` x ``n_pages`` chunks of ``tokens`` tokens, written into caches."""

    def __init__(self, dtype_name: str, *, layers: int = 2, heads: int = 2, head_size: int = 8,
                 tokens: int = 8, n_pages: int = 3, seed: int = 0) -> None:
        self.dtype_name = dtype_name
        self.dtype = DTYPES[dtype_name]
        self.layers, self.heads, self.head_size, self.tokens, self.n_pages = layers, heads, head_size, tokens, n_pages
        gen = torch.Generator().manual_seed(seed)
        # tokens[l, page] = [H, T, 2, D]: the canonical section content of layer l, page p
        self.logical = random_values((layers, n_pages, heads, tokens, 2, head_size), self.dtype, gen)
        self.layout: PageLayout = attention_layout([f"layer.{i}" for i in range(layers)], heads, tokens,
                                                   head_size, dtype_name)

    def engine(self, root: Path, slots: int, *, pin: bool = False) -> IOEngine:
        """An IOEngine for this case's pages (one attention group, one chunk per page)."""
        names = tuple(s.name for s in self.layout.sections)
        group = GroupSpec(GroupKind.ATTENTION, self.tokens, self.tokens, names, self.layout)
        ns = Namespace(model="test/kernels", dtype=self.dtype_name, groups=(group,), hash_algo="sha256")
        return IOEngine(root, ns, 0, staging_slots=slots, pin=pin)

    def expected_pages(self) -> torch.Tensor:
        pages = torch.zeros(self.n_pages, self.layout.nbytes, dtype=torch.uint8)
        for li, off in enumerate(self.layout.offsets):
            sec = self.logical[li].reshape(self.n_pages, -1).contiguous().view(torch.uint8)
            pages[:, off : off + sec.shape[1]] = sec
        return pages

    def build(self, layout: str, block_tokens: int, device: str, seed: int = 1,
              num_blocks: int | None = None) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Caches in ``layout`` with kernel blocks of ``block_tokens``; returns (views, block ids).

        Block ids are a random permutation, so pages never sit in consecutive blocks."""
        bpp = self.tokens // block_tokens
        need = self.n_pages * bpp
        nb = num_blocks or need + 3
        _, views = make_attention_caches(layout, self.layers, nb, self.heads, block_tokens, self.head_size,
                                         self.dtype, device)
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randperm(nb, generator=gen)[:need].view(self.n_pages, bpp)
        for li, v in enumerate(views):
            # [pages, H, T, 2, D] -> [pages, H, bpp, Nk, 2, D] -> [pages*bpp, H, Nk, 2, D]
            blocks = self.logical[li].unflatten(2, (bpp, block_tokens)).movedim(2, 1).reshape(
                need, self.heads, block_tokens, 2, self.head_size)
            v[ids.reshape(-1).to(device)] = blocks.to(device)
        return views, ids

    def logical_from(self, views: list[torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
        """Read the logical KV back out of caches (inverse of ``build``)."""
        bpp = ids.shape[1]
        out = []
        for v in views:
            blocks = v[ids.reshape(-1).to(v.device)].cpu()  # [pages*bpp, H, Nk, 2, D]
            out.append(blocks.unflatten(0, (self.n_pages, bpp)).movedim(1, 2).reshape(
                self.n_pages, self.heads, self.tokens, 2, self.head_size))
        return torch.stack(out)

    def copier(self, views: list[torch.Tensor], bpp: int, backend: str) -> GroupCopier:
        return GroupCopier(views, self.layout, bpp, [1] * self.layers, backend=backend)


def gather_pages(copier: GroupCopier, ids: torch.Tensor, nbytes: int, device: str) -> torch.Tensor:
    """Gather into poisoned page buffers (0xA5 everywhere, so unwritten bytes show: the whole
    page, alignment gaps included, must be written)."""
    pages = torch.full((ids.shape[0], nbytes), 0xA5, dtype=torch.uint8, device=device)
    copier.gather(ids.to(device), pages)
    return pages.cpu()


class MambaCase:
    """GDN-like states: conv [dim, k-1] (model dtype) + temporal [heads, dv, dk] (fp32)."""

    def __init__(self, *, layers: int = 2, conv_dim: int = 12, conv_len: int = 3, heads: int = 2,
                 dv: int = 4, dk: int = 4, n_pages: int = 3, pad_bytes: int = 40, seed: int = 0) -> None:
        self.layers, self.n_pages, self.pad_bytes = layers, n_pages, pad_bytes
        self.states = [("conv", (conv_dim, conv_len), torch.bfloat16), ("temporal", (heads, dv, dk), torch.float32)]
        self.layout = mamba_layout([f"mamba.{i}" for i in range(layers)],
                                   [(n, s, str(t).removeprefix("torch.")) for n, s, t in self.states])
        gen = torch.Generator().manual_seed(seed)
        self.logical = [[random_values((n_pages, *shape), dt, gen) for _, shape, dt in self.states]
                        for _ in range(layers)]
        self.real_bytes = sum(torch.empty(s, dtype=t).nbytes for _, s, t in self.states)

    def expected_pages(self) -> torch.Tensor:
        pages = torch.zeros(self.n_pages, self.layout.nbytes, dtype=torch.uint8)
        k = 0
        for li in range(self.layers):
            for si in range(len(self.states)):
                off = self.layout.offsets[k]
                b = self.logical[li][si].reshape(self.n_pages, -1).contiguous().view(torch.uint8)
                pages[:, off : off + b.shape[1]] = b
                k += 1
        return pages

    def build(self, conv_layout: str, device: str, num_blocks: int = 7, seed: int = 1
              ) -> tuple[list[torch.Tensor], torch.Tensor, list[torch.Tensor]]:
        """Raw padded per-layer caches (page = real bytes + pad, like vLLM's padded Mamba pages)."""
        page = self.real_bytes + self.pad_bytes
        raws, views = [], []
        for _ in range(self.layers):
            raw = torch.zeros(num_blocks, page, dtype=torch.uint8, device=device)
            vs = mamba_state_views(raw, self.states, conv_state="conv", conv_layout=conv_layout)
            raws.append(raw)
            views.extend(vs)
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randperm(num_blocks, generator=gen)[: self.n_pages].view(self.n_pages, 1)
        for li in range(self.layers):
            for si in range(len(self.states)):
                views[li * len(self.states) + si][ids.reshape(-1).to(device)] = self.logical[li][si].to(device)
        return views, ids, raws


class MLACase:
    """MLA latent pages: per layer [T, C] from kernel blocks [Nk, C] (concat dim 0)."""

    def __init__(self, *, layers: int = 2, tokens: int = 8, latent: int = 12, n_pages: int = 2, seed: int = 0):
        self.layers, self.tokens, self.latent, self.n_pages = layers, tokens, latent, n_pages
        self.layout = mla_layout([f"mla.{i}" for i in range(layers)], tokens, latent, "bfloat16")
        gen = torch.Generator().manual_seed(seed)
        self.logical = random_values((layers, n_pages, tokens, latent), torch.bfloat16, gen)

    def expected_pages(self) -> torch.Tensor:
        pages = torch.zeros(self.n_pages, self.layout.nbytes, dtype=torch.uint8)
        for li, off in enumerate(self.layout.offsets):
            b = self.logical[li].reshape(self.n_pages, -1).contiguous().view(torch.uint8)
            pages[:, off : off + b.shape[1]] = b
        return pages

    def build(self, block_tokens: int, device: str, padded_c: int | None = None) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Caches [nb, Nk, Cpad] (padding after the latent, as some backends align), viewed [nb, Nk, C]."""
        bpp = self.tokens // block_tokens
        need = self.n_pages * bpp
        nb = need + 2
        cpad = padded_c or self.latent
        ids = torch.randperm(nb, generator=torch.Generator().manual_seed(3))[:need].view(self.n_pages, bpp)
        views = []
        for li in range(self.layers):
            raw = torch.zeros(nb, block_tokens, cpad, dtype=torch.bfloat16, device=device)
            v = raw[:, :, : self.latent]
            blocks = self.logical[li].unflatten(1, (bpp, block_tokens)).reshape(need, block_tokens, self.latent)
            v[ids.reshape(-1).to(device)] = blocks.to(device)
            views.append(v)
        return views, ids


# ------------------------------------------------------------------ checks (device, backend)

ATTN_LAYOUT_PAIRS = [("LBHNC", 4), ("LBNHC", 2), ("SPLIT_NHD", 8), ("BLNHC", 4), ("SPLIT_HND", 2)]


def check_attention_canonical(dtype_name: str, device: str, backend: str) -> None:
    """Same logical KV in several layouts and kernel block sizes -> identical page bytes."""
    case = AttentionCase(dtype_name)
    want = case.expected_pages()
    for layout, block_tokens in ATTN_LAYOUT_PAIRS:
        views, ids = case.build(layout, block_tokens, device)
        copier = case.copier(views, ids.shape[1], backend)
        got = gather_pages(copier, ids, case.layout.nbytes, device)
        assert torch.equal(got, want), (layout, block_tokens, dtype_name)


def check_attention_round_trip(dtype_name: str, device: str, backend: str,
                               src=("LBNHC", 2), dst=("SPLIT_HND", 4)) -> None:
    """Gather from one layout, scatter into a zeroed cache of another: same logical KV, nothing else touched."""
    case = AttentionCase(dtype_name, seed=5)
    views, ids = case.build(src[0], src[1], device)
    pages = gather_pages(case.copier(views, ids.shape[1], backend), ids, case.layout.nbytes, device)
    bpp2 = case.tokens // dst[1]
    nb2 = case.n_pages * bpp2 + 5
    _, views2 = make_attention_caches(dst[0], case.layers, nb2, case.heads, dst[1], case.head_size, case.dtype, device)
    ids2 = torch.randperm(nb2, generator=torch.Generator().manual_seed(9))[: case.n_pages * bpp2].view(case.n_pages, bpp2)
    case.copier(views2, bpp2, backend).scatter(pages.to(device), ids2.to(device))
    assert torch.equal(bits(case.logical_from(views2, ids2)), bits(case.logical))
    untouched = torch.ones(nb2, dtype=torch.bool)
    untouched[ids2.reshape(-1)] = False
    for v in views2:
        assert not bits(v[untouched.to(device)]).any()


def check_mamba(device: str, backend: str) -> None:
    """Conv state stored SD or DS gives the same (dim-first) page; padding never copied; round trip."""
    case = MambaCase()
    want = case.expected_pages()
    pages_by_layout = {}
    for conv_layout in ("SD", "DS"):
        views, ids, _ = case.build(conv_layout, device)
        copier = GroupCopier(views, case.layout, 1, [None] * len(views), backend=backend)
        got = gather_pages(copier, ids, case.layout.nbytes, device)
        assert torch.equal(got, want), conv_layout
        pages_by_layout[conv_layout] = got
    # scatter SD-made pages into a DS cache: states equal, padding bytes stay zero
    views, ids, raws = case.build("DS", device, seed=4)
    for raw in raws:
        raw.zero_()
    GroupCopier(views, case.layout, 1, [None] * len(views), backend=backend).scatter(
        pages_by_layout["SD"].to(device), ids.to(device))
    for li in range(case.layers):
        for si in range(len(case.states)):
            got = views[li * len(case.states) + si][ids.reshape(-1).to(device)].cpu()
            assert torch.equal(bits(got), bits(case.logical[li][si]))
        assert not raws[li][:, case.real_bytes :].any(), "padding bytes were written"


def check_mla(device: str, backend: str) -> None:
    case = MLACase()
    want = case.expected_pages()
    for block_tokens, cpad in ((4, None), (2, 16)):
        views, ids = case.build(block_tokens, device, cpad)
        copier = GroupCopier(views, case.layout, ids.shape[1], [0] * case.layers, backend=backend)
        got = gather_pages(copier, ids, case.layout.nbytes, device)
        assert torch.equal(got, want), (block_tokens, cpad)


def check_page_list(device: str, backend: str) -> None:
    """Separate page buffers (staging slots) get the same bytes as one page tensor."""
    case = AttentionCase("bfloat16", seed=2)
    views, ids = case.build("LBNHC", 4, device)
    copier = case.copier(views, ids.shape[1], backend)
    whole = gather_pages(copier, ids, case.layout.nbytes, device)
    slots = [torch.full((case.layout.nbytes,), 0x5A, dtype=torch.uint8, device=device) for _ in range(case.n_pages)]
    copier.gather(ids.to(device), slots)
    assert torch.equal(torch.stack([s.cpu() for s in slots]), whole)
    # scatter from the slots into a fresh cache gives the logical KV back
    _, views2 = make_attention_caches("LBHNC", case.layers, ids.numel() + 1, case.heads, 4, case.head_size,
                                      case.dtype, device)
    ids2 = torch.arange(ids.numel()).view_as(ids)
    case.copier(views2, ids.shape[1], backend).scatter(slots, ids2.to(device))
    assert torch.equal(bits(case.logical_from(views2, ids2)), bits(case.logical))
