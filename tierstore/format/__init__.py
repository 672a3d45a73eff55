"""Bytes only: the page file format, the canonical layouts, namespace identity, the MAC, zstd."""
