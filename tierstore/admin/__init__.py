"""Operating a cache directory: fsck and its readers, the root walk (stats, ls), gc, the CLI.

Imports: errors, metrics, fs, config, store, format, native, index, rootstore, tiers (everything below it); never vllm, bench.
"""
