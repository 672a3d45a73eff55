"""Benchmarks of tierstore (``tierstore bench ...``); each prints ratios against a baseline
measured in the same run. ``io``: the IOEngine against raw file I/O and vLLM's fs tier.

Imports: anything of tierstore (the top floor, with demo); nothing imports it but the CLI.
"""
