"""GIL-free page I/O: the kernels' ABI (abi), the compiled kernels (kernels), their loader (loader), one page per call (page), the I/O lane (lane)."""
