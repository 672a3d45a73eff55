"""torch reference copy path: canonical pages <-> engine KV views, on any device.

This is the path used on CPU (vLLM's CPU platform) and the oracle the Triton kernels are
tested against. ``gather`` copies ``block_ids`` [n_pages, blocks_per_page] of every source view
into page buffers at the layout's section offsets and zeroes the alignment gaps between them
(canonical bytes: nothing of a reused buffer survives); ``scatter`` is the inverse. Every copy is a
bit copy (sources are reinterpreted as same-size integers), so fp8 and bf16 need no arithmetic
support from the device. One ``index_select`` per section per call; no Python loop over pages
when ``pages`` is one 2-D tensor.

Threading: a ReferenceCopier holds no mutable state; concurrent calls on disjoint pages and
blocks are safe (the caller orders them against the engine's own use of the blocks).
"""

from __future__ import annotations

import torch

from tierstore.kernels.geometry import INT_DTYPE_BY_SIZE, PagesArg, PlannedCopier, SectionCopy


def _gather_section(sec: SectionCopy, ids: torch.Tensor, n_pages: int) -> torch.Tensor:
    """The section's canonical bytes for each page: uint8 [n_pages, section nbytes]."""
    src = sec.int_source
    rows = torch.index_select(src, 0, ids)  # [n_pages * bpp, *B], contiguous
    if sec.concat_dim is not None:
        d = sec.concat_dim
        rows = rows.view(n_pages, sec.blocks_per_page, *sec.block_shape).movedim(1, d + 1)
    return rows.reshape(n_pages, -1).contiguous().view(torch.uint8)


def _scatter_section(sec: SectionCopy, raw: torch.Tensor, ids: torch.Tensor, n_pages: int) -> None:
    """Inverse of ``_gather_section``: ``raw`` uint8 [n_pages, section nbytes] into the source."""
    src = sec.int_source
    vals = raw.contiguous().view(INT_DTYPE_BY_SIZE[sec.spec.itemsize])
    shape = sec.spec.shape
    if sec.concat_dim is not None:
        d = sec.concat_dim
        bd = sec.block_shape[d]
        vals = vals.view(n_pages, *shape[:d], sec.blocks_per_page, bd, *shape[d + 1 :]).movedim(d + 1, 1)
    vals = vals.reshape(n_pages * sec.blocks_per_page, *sec.block_shape)
    src.index_copy_(0, ids, vals.to(src.device))


class ReferenceCopier(PlannedCopier):
    """GroupCopier implemented with torch indexing (see ``tierstore.kernels.GroupCopier``)."""

    backend = "torch"

    def _flat_ids(self, block_ids: torch.Tensor) -> torch.Tensor:
        return block_ids.reshape(-1).to(device=self.device, dtype=torch.int64)

    def gather(self, block_ids: torch.Tensor, pages: PagesArg) -> None:
        n = self.check_batch(block_ids, pages)
        if n == 0:
            return
        ids = self._flat_ids(block_ids)
        for sec in self.sections:
            data = _gather_section(sec, ids, n)
            end = sec.offset + sec.spec.nbytes
            if isinstance(pages, torch.Tensor):
                pages[:, sec.offset : end].copy_(data)
            else:
                for p, page in enumerate(pages):
                    page[sec.offset : end].copy_(data[p])
        self._zero_gaps(pages)

    def _zero_gaps(self, pages: PagesArg) -> None:
        """The gaps between sections are part of the page: zero them (one op per buffer)."""
        if not self.layout.gaps:
            return
        if isinstance(pages, torch.Tensor):
            pages.index_fill_(1, self.gap_index(pages.device), 0)
        else:
            for page in pages:
                page.index_fill_(0, self.gap_index(page.device), 0)

    def scatter(self, pages: PagesArg, block_ids: torch.Tensor) -> None:
        """Pages -> blocks. With CPU block ids, a page whose ids are negative is skipped (as in
        Triton). CUDA ids are not inspected: that would synchronize the host with the device
        (a load's scatter would wait for the forward pass). PageTransfer masks pages only
        with the Triton copier; a negative CUDA id here fails in ``index_copy_``, loudly."""
        n = self.check_batch(block_ids, pages)
        if n == 0:
            return
        if block_ids.device.type != "cpu":
            self._scatter(pages, block_ids, n)
            return
        keep = (block_ids.reshape(n, -1) >= 0).all(dim=1)
        if not bool(keep.all()):
            idx = keep.nonzero().view(-1).tolist()
            if not idx:
                return
            pages = pages[idx] if isinstance(pages, torch.Tensor) else [pages[i] for i in idx]
            block_ids = block_ids.reshape(n, -1)[torch.tensor(idx)]
            n = len(idx)
        self._scatter(pages, block_ids, n)

    def _scatter(self, pages: PagesArg, block_ids: torch.Tensor, n: int) -> None:
        ids = self._flat_ids(block_ids)
        for sec in self.sections:
            end = sec.offset + sec.spec.nbytes
            if isinstance(pages, torch.Tensor):
                raw = pages[:, sec.offset : end]
            else:
                raw = torch.stack([page[sec.offset : end] for page in pages])
            _scatter_section(sec, raw.to(self.device), ids, n)
