"""GIL-free page I/O: the kernels' ABI (abi), the compiled kernels (kernels), their loader (loader), one page per call (page). The I/O lane that runs them is rootstore/lane.py.

Imports: errors, fs, format and, in the kernels, only native.abi (numba caches the kernels keyed on their own file); never index, rootstore or above.
"""
