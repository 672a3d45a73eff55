"""Test helpers for tierstore (no vLLM, no GPU, no torch).

``tierstore.testing.pages`` builds a realistic hybrid ``Namespace`` (two attention groups
and a Mamba-state group, several dtypes) and fills a root with deterministic page files.
Other packages' tests import from here; nothing in the library imports this package.
"""

from tierstore.testing.pages import (
    StoredPage,
    corrupt_flip_bit,
    fill_pages,
    hybrid_namespace,
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
    "page_bytes",
    "page_key",
    "page_meta",
    "read_stored",
    "simple_namespace",
    "write_page",
]
