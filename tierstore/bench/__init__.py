"""Benchmarks of tierstore (``tierstore bench ...``); each prints ratios against a baseline
measured in the same run. ``io``: the IOEngine against raw file I/O and vLLM's fs tier."""
