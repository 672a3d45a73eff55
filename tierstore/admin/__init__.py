"""Operating a cache directory: fsck and its readers, inventory (stats, ls), gc, the CLI.

Imports: errors, metrics, fs, config, store, format, native, index, rootstore, tiers (everything below it); never vllm, bench.
"""
