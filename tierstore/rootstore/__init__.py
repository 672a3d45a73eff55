"""One root's PageStore: the engine, its job queue, staging slots, the rank directory's files and the flat page operations.

Imports: errors, metrics, fs, config, store, format, native, index; never tiers, admin, vllm.
"""
