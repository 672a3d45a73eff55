"""What is on a root without reading it: page fingerprints, the local tier's sqlite index and scan, lookups.

Imports: errors, metrics, fs, config, format, native (its page hashing); never rootstore, tiers or above (those own the index, and tell it about pages through hooks).
"""
