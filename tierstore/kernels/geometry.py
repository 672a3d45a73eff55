"""Geometry of one group copy: which source view feeds which page section, and how.

``plan_sections`` validates the GroupCopier arguments once and returns one ``SectionCopy``
per page section; ``PlannedCopier`` is the base both copy paths share (the plan, and the
checks of each gather/scatter batch). A section of shape ``S`` is fed by a source view ``[num_blocks, *B]``:
with ``concat_dim = d`` the ``blocks_per_page`` kernel blocks of a page are laid side by side
along dim ``d`` (``S[d] = blocks_per_page * B[d]``, every other dim equal); with ``None`` the
page holds exactly one block and ``S == B`` (Mamba states). Both copy paths (torch reference
and Triton) use this plan, so they agree on what the canonical bytes are.

Every gather writes whole page buffers: sections and the zero alignment gaps between them
(``PageLayout.gaps``), so a reused page buffer (a staging slot, a scratch row) never passes an
earlier page's bytes on to a file. Scatters read sections only.

Pure functions over tensor metadata; a PlannedCopier is immutable after construction except
for a per-device cache of the gap index (``gap_index``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tierstore.errors import ConfigError
from tierstore.format.page_layout import PageLayout, SectionSpec

PagesArg = torch.Tensor | Sequence[torch.Tensor]

# Same-size integer dtypes: every copy is a bit copy, so sources are reinterpreted as these.
INT_DTYPE_BY_SIZE: dict[int, torch.dtype] = {
    1: torch.uint8,
    2: torch.int16,
    4: torch.int32,
    8: torch.int64,
}


@dataclass(frozen=True)
class SectionCopy:
    """How one page section is filled from one source view."""

    index: int
    spec: SectionSpec
    offset: int  # byte offset of the section in a page buffer
    source: torch.Tensor  # [num_blocks, *block_shape], any strides, section's item size
    concat_dim: int | None
    blocks_per_page: int

    @property
    def block_shape(self) -> tuple[int, ...]:
        return tuple(self.source.shape[1:])

    @property
    def int_source(self) -> torch.Tensor:
        """The source reinterpreted as a same-size integer dtype (same memory, same strides)."""
        return self.source.view(INT_DTYPE_BY_SIZE[self.spec.itemsize])


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def plan_sections(
    sources: Sequence[torch.Tensor],
    layout: PageLayout,
    blocks_per_page: int,
    concat_dims: Sequence[int | None],
) -> list[SectionCopy]:
    """Validate the copier's arguments; one ``SectionCopy`` per section, in layout order."""
    sections = layout.sections
    if not (len(sources) == len(sections) == len(concat_dims)):
        raise ConfigError(
            f"GroupCopier needs one source view and one concat dim per page section: got "
            f"{len(sources)} sources, {len(concat_dims)} concat dims, {len(sections)} sections"
        )
    if blocks_per_page < 1:
        raise ConfigError(f"blocks_per_page must be >= 1, got {blocks_per_page}")
    if not sections:
        raise ConfigError("the page layout has no sections")
    device = sources[0].device
    out: list[SectionCopy] = []
    for i, (src, spec, off, d) in enumerate(zip(sources, sections, layout.offsets, concat_dims, strict=True)):
        where = f"section {i} ({spec.name!r})"
        if src.device != device:
            raise ConfigError(f"{where}: source is on {src.device}, section 0's on {device}; all must share a device")
        if src.dim() != len(spec.shape) + 1:
            raise ConfigError(
                f"{where}: source view has shape {tuple(src.shape)}, expected [num_blocks, ...] "
                f"with {len(spec.shape)} block dims for section shape {spec.shape}"
            )
        name = _dtype_name(src.dtype)
        fp8_as_bytes = spec.itemsize == 1 and src.dtype in (torch.uint8, torch.int8)
        if name != spec.dtype and not fp8_as_bytes:
            raise ConfigError(f"{where}: source dtype {name} differs from the section's {spec.dtype}")
        if src.element_size() != spec.itemsize:
            raise ConfigError(f"{where}: source item size {src.element_size()} != {spec.itemsize}")
        block = tuple(src.shape[1:])
        if d is None:
            if blocks_per_page != 1:
                raise ConfigError(f"{where}: concat_dim None (one block per page) needs blocks_per_page 1, got {blocks_per_page}")
            if block != spec.shape:
                raise ConfigError(f"{where}: block shape {block} != section shape {spec.shape}")
        else:
            if not 0 <= d < len(block):
                raise ConfigError(f"{where}: concat_dim {d} out of range for block shape {block}")
            want = list(block)
            want[d] *= blocks_per_page
            if tuple(want) != spec.shape:
                raise ConfigError(
                    f"{where}: {blocks_per_page} blocks of shape {block} joined on dim {d} give "
                    f"{tuple(want)}, not the section shape {spec.shape}"
                )
        out.append(SectionCopy(i, spec, off, src, d, blocks_per_page))
    return out


def check_block_ids(block_ids: torch.Tensor, blocks_per_page: int) -> int:
    """Validate a block-id batch; returns the number of pages."""
    if block_ids.dim() != 2 or block_ids.shape[1] != blocks_per_page:
        raise ValueError(f"block_ids must be [n_pages, {blocks_per_page}], got {tuple(block_ids.shape)}")
    if block_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"block_ids must be int64 (or int32), got {block_ids.dtype}")
    return int(block_ids.shape[0])


def check_pages(pages: PagesArg, n_pages: int, nbytes: int) -> None:
    """Pages are a uint8 [n_pages, nbytes] tensor (rows contiguous) or n_pages 1-D uint8 buffers."""
    if isinstance(pages, torch.Tensor):
        if pages.dtype != torch.uint8 or pages.dim() != 2 or tuple(pages.shape) != (n_pages, nbytes):
            raise ValueError(f"pages must be uint8 [{n_pages}, {nbytes}], got {pages.dtype} {tuple(pages.shape)}")
        if nbytes and pages.stride(1) != 1:
            raise ValueError("page rows must be contiguous (stride 1 along the byte dim)")
        return
    if len(pages) != n_pages:
        raise ValueError(f"got {len(pages)} page buffers for {n_pages} pages")
    for p in pages:
        if p.dtype != torch.uint8 or p.dim() != 1 or p.numel() != nbytes or (nbytes and p.stride(0) != 1):
            raise ValueError(f"each page buffer must be a contiguous 1-D uint8 tensor of {nbytes} bytes")


class PlannedCopier:
    """What both copy paths share: the validated section plan and the per-call checks."""

    backend: str  # "torch" or "triton", set by each subclass

    def __init__(
        self,
        sources: Sequence[torch.Tensor],
        layout: PageLayout,
        blocks_per_page: int,
        concat_dims: Sequence[int | None],
    ) -> None:
        self.layout = layout
        self.blocks_per_page = blocks_per_page
        self.sections = plan_sections(sources, layout, blocks_per_page, concat_dims)
        self.device = self.sections[0].source.device
        self._gap_index: dict[torch.device, torch.Tensor] = {}

    def gap_index(self, device: torch.device) -> torch.Tensor | None:
        """int64 byte indexes of every alignment gap of a page buffer (on ``device``), or None
        when the layout has no gaps. A gather writes zeros there (format.py: canonical bytes)."""
        if not self.layout.gaps:
            return None
        idx = self._gap_index.get(device)
        if idx is None:  # a benign race: two threads build the same small tensor
            idx = torch.cat([torch.arange(a, b, dtype=torch.int64) for a, b in self.layout.gaps]).to(device)
            self._gap_index[device] = idx
        return idx

    def check_batch(self, block_ids: torch.Tensor, pages: PagesArg) -> int:
        """Validate one gather/scatter call; returns the number of pages."""
        n_pages = check_block_ids(block_ids, self.blocks_per_page)
        check_pages(pages, n_pages, self.layout.nbytes)
        return n_pages

    def gather(self, block_ids: torch.Tensor, pages: PagesArg) -> None:
        raise NotImplementedError

    def scatter(self, pages: PagesArg, block_ids: torch.Tensor) -> None:
        raise NotImplementedError
