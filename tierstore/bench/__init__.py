"""Benchmarks of tierstore (``tierstore bench ...``); each prints ratios against a baseline
measured in the same run. ``io``: the IOEngine against raw file I/O and vLLM's fs tier; ``scale``:
the whole-root tools against plain directory walks; ``gil``: the engine against raw files beside a
busy Python thread.

Imports: anything of tierstore (the top floor, with demo); nothing imports it but the CLI.
"""
