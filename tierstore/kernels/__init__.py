"""Copies between vLLM's KV-cache views and canonical page buffers (one KV-cache group).

``GroupCopier(sources, layout, blocks_per_page, concat_dims, backend)`` is the contract
(docs/DESIGN.md §6, checksums and the GPU path): ``sources[i]`` is a strided view
``[num_blocks, *block_shape]`` feeding ``layout.sections[i]``; the adapter expresses every
physical layout (LBHNC, LBNHC, split K/V planes, kernel-block splits, transposed conv
states) as such a view, so the canonical bytes never depend on it. A gather writes every byte
of each page buffer, the zero alignment gaps between sections included (format.py, "Canonical
bytes"), so what a reused buffer held before never reaches a file.

Backends: ``"triton"`` (one stride-generic kernel family; compiled on CUDA, the interpreter
on CPU when ``TRITON_INTERPRET=1`` was set before import), ``"torch"`` (reference.py; any
device, the test oracle), ``"auto"`` = triton for CUDA sources, torch otherwise (and torch
when the Triton path cannot take a view, with the reason in ``fallback_reason``).

Threading: a copier may be used from several threads on disjoint pages/blocks; GPU copies
are queued on the calling thread's current CUDA stream.

Imports: errors, fs, format (torch and triton besides); never the I/O layers above.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tierstore.errors import ConfigError
from tierstore.format.page_layout import PageLayout
from tierstore.kernels.geometry import PagesArg, PlannedCopier
from tierstore.kernels.reference import ReferenceCopier

BACKENDS = ("auto", "torch", "triton")


class GroupCopier:
    """Gather KV blocks into canonical pages and scatter pages back, for one KV-cache group.

    ``backend`` ("torch" or "triton"), ``device`` (the sources') and ``fallback_reason`` say
    what was chosen; both implementations are ``geometry.PlannedCopier`` subclasses.
    """

    def __init__(
        self,
        sources: Sequence[torch.Tensor],
        layout: PageLayout,
        blocks_per_page: int,
        concat_dims: Sequence[int | None],
        backend: str = "auto",
    ) -> None:
        if backend not in BACKENDS:
            raise ConfigError(f"kernel backend {backend!r} unknown; use one of {BACKENDS}")
        self.layout = layout
        self.blocks_per_page = blocks_per_page
        self.fallback_reason: str | None = None
        self._sources = list(sources)
        self._concat_dims = list(concat_dims)
        on_cuda = bool(sources) and sources[0].device.type == "cuda"
        if backend == "torch" or (backend == "auto" and not on_cuda):
            self._impl: PlannedCopier = self._reference()
        else:
            self._impl = self._triton(strict=backend == "triton")
        self.backend: str = self._impl.backend
        self.device: torch.device = self._impl.device
        self._fallback: ReferenceCopier | None = None

    def _reference(self) -> ReferenceCopier:
        return ReferenceCopier(self._sources, self.layout, self.blocks_per_page, self._concat_dims)

    def _triton(self, strict: bool) -> PlannedCopier:
        """The Triton copier; unless ``strict``, the torch one (and why) when Triton cannot serve."""
        try:
            from tierstore.kernels.triton_kernels import TritonCopier
        except ImportError as exc:
            if strict:
                raise ConfigError(f"kernel backend 'triton' needs the triton package: {exc}") from exc
            self.fallback_reason = f"triton not importable: {exc}"
            return self._reference()
        try:
            return TritonCopier(self._sources, self.layout, self.blocks_per_page, self._concat_dims)
        except ValueError as exc:
            if strict or isinstance(exc, ConfigError):
                raise
            self.fallback_reason = str(exc)
            return self._reference()

    def _for_pages(self, pages: PagesArg) -> PlannedCopier:
        """The Triton path reads/writes host page buffers directly only when they are pinned
        (mapped into the GPU's address space); pageable host buffers go through torch."""
        if self.backend != "triton" or self._sources[0].device.type != "cuda":
            return self._impl
        bufs = [pages] if isinstance(pages, torch.Tensor) else list(pages)
        if all(b.device.type == "cuda" or b.is_pinned() for b in bufs):
            return self._impl
        if self._fallback is None:
            self._fallback = self._reference()
        return self._fallback

    def gather(self, block_ids: torch.Tensor, pages: PagesArg) -> None:
        """Copy blocks ``block_ids`` [n_pages, blocks_per_page] into ``pages`` (uint8 [n_pages, nbytes]
        or a list of n_pages 1-D uint8 buffers), each row a canonical page buffer.

        With CUDA sources, pages may be device memory or pinned host memory (the kernel writes
        over PCIe; queued on the current stream: synchronize before reading them on the host)."""
        self._for_pages(pages).gather(block_ids, pages)

    def scatter(self, pages: PagesArg, block_ids: torch.Tensor) -> None:
        """Inverse of ``gather``: write each page's sections into its blocks."""
        self._for_pages(pages).scatter(pages, block_ids)


__all__ = ["BACKENDS", "GroupCopier", "ReferenceCopier"]
