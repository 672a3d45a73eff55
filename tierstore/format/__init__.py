"""Bytes only: the page file format, the canonical layouts, namespace identity, the MAC, zstd.

Imports: errors, fs (the name patterns of FileMapper); never native, index, rootstore or above: bytes only, no I/O layer.
"""
