"""Test helpers for tierstore (importing the package needs no vLLM, GPU or torch).

``tierstore.testing.pages`` builds namespaces (a realistic hybrid: two attention groups and a
Mamba-state group, several dtypes; one-group ones) and fills a root with deterministic page
files; ``tierstore.testing.tiny_models`` builds tiny local Hugging Face models (needs torch).
Users: the tests, ``tierstore.demo`` and the benchmarks (``tierstore.bench``, tools/); the
library proper (engine, tiers, vLLM adapter) never imports this package.

Imports: errors, fs, format, store, kernels, rootstore; never vllm (test helpers load without it).
"""

from tierstore.testing.pages import (
    StoredPage,
    corrupt_flip_bit,
    fill_pages,
    hybrid_namespace,
    layout_namespace,
    page_bytes,
    page_key,
    page_meta,
    read_stored,
    simple_namespace,
    write_page,
)

__all__ = [
    "StoredPage",
    "corrupt_flip_bit",
    "fill_pages",
    "hybrid_namespace",
    "layout_namespace",
    "page_bytes",
    "page_key",
    "page_meta",
    "read_stored",
    "simple_namespace",
    "write_page",
]
