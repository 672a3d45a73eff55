"""A few CUDA driver calls made WITHOUT releasing the GIL, for the thread that drives transfers.

Why: torch's bindings (``Tensor.copy_``, ``Event.record``, ``Event.query``,
``Stream.wait_event``) release the GIL around each call. With 16 I/O threads waiting for it,
every such call costs the driving thread a wait to get the GIL back, and that thread's rate
caps the GPU path (docs/measurements/scaling.md). The calls below take a few
microseconds, so holding the GIL through them is cheaper than handing it over: they are
bound through ``ctypes.PyDLL`` (which keeps the GIL) to ``libcuda``. ``kernels.launch`` uses
``launch_kernel`` for Triton kernels on the same grounds.

Contract: ``driver()`` returns a ``Driver`` or None (no libcuda, a symbol missing, or
``TIERSTORE_CUDA_DRIVER=0``: callers then use torch's calls, same effect). Pointers are unified virtual addresses (device memory
or pinned host memory), streams and events the raw handles torch exposes
(``Stream.cuda_stream``, ``Event.cuda_event``). Every call only queues work or asks about it
(no synchronization) and raises ``RuntimeError`` with the CUDA error code on failure.
The calling thread must have the device's primary context current, which torch has made so
on any thread that already ran CUDA work through it (callers check once with ``usable``).

Threading: a Driver is immutable; calls may come from any thread.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

CUDA_SUCCESS = 0
CUDA_ERROR_NOT_READY = 600
CU_POINTER_ATTRIBUTE_DEVICE_POINTER = 3


class Driver:
    """GIL-holding bindings of cuMemcpyAsync, cuEventRecord, cuEventQuery, cuStreamWaitEvent,
    cuLaunchKernel, cuPointerGetAttribute."""

    def __init__(self, lib: ctypes.PyDLL) -> None:
        u64, vp, sz = ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t
        self._memcpy = lib.cuMemcpyAsync
        self._memcpy.argtypes, self._memcpy.restype = [u64, u64, sz, vp], ctypes.c_int
        self._record = lib.cuEventRecord
        self._record.argtypes, self._record.restype = [vp, vp], ctypes.c_int
        self._query = lib.cuEventQuery
        self._query.argtypes, self._query.restype = [vp], ctypes.c_int
        self._wait = lib.cuStreamWaitEvent
        self._wait.argtypes, self._wait.restype = [vp, vp, ctypes.c_uint], ctypes.c_int
        self._attr = lib.cuPointerGetAttribute
        self._attr.argtypes, self._attr.restype = [vp, ctypes.c_int, u64], ctypes.c_int
        ui = ctypes.c_uint
        self._launch = lib.cuLaunchKernel
        self._launch.argtypes = [vp, ui, ui, ui, ui, ui, ui, ui, vp, vp, vp]
        self._launch.restype = ctypes.c_int

    @staticmethod
    def _check(code: int, what: str) -> None:
        if code != CUDA_SUCCESS:
            raise RuntimeError(f"{what} failed: CUDA error {code}")

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """Queue a copy of ``nbytes`` between unified addresses on ``stream``."""
        self._check(self._memcpy(dst, src, nbytes, stream), "cuMemcpyAsync")

    def record(self, event: int, stream: int) -> None:
        self._check(self._record(event, stream), "cuEventRecord")

    def query(self, event: int) -> bool:
        """True once the work before the event's last record finished."""
        code = self._query(event)
        if code == CUDA_ERROR_NOT_READY:
            return False
        self._check(code, "cuEventQuery")
        return True

    def wait_event(self, stream: int, event: int) -> None:
        """Make ``stream`` wait (on the GPU) for the event's last record."""
        self._check(self._wait(stream, event, 0), "cuStreamWaitEvent")

    def device_pointer(self, host_ptr: int) -> int:
        """The device address of pinned host memory (under unified addressing the same number);
        raises ValueError for memory the GPU cannot reach (pageable), as Triton's launcher does."""
        out = ctypes.c_uint64()
        code = self._attr(ctypes.byref(out), CU_POINTER_ATTRIBUTE_DEVICE_POINTER, host_ptr)
        if code != CUDA_SUCCESS:
            raise ValueError(f"host pointer {host_ptr:#x} cannot be accessed from the GPU (not pinned?): "
                             f"CUDA error {code}")
        return out.value

    def launch_kernel(self, function: int, gx: int, gy: int, gz: int, block_x: int, shared: int, stream: int,
                      params: ctypes.Array[ctypes.c_void_p]) -> None:
        """Queue ``function`` (a CUfunction) on ``stream``: grid (gx, gy, gz) of ``block_x``
        threads, ``shared`` bytes of dynamic shared memory, ``params`` one pointer per kernel
        parameter (``kernels.launch`` builds them as Triton's launcher does)."""
        self._check(self._launch(function, gx, gy, gz, block_x, 1, 1, shared, stream, params, None), "cuLaunchKernel")


@functools.cache
def driver() -> Driver | None:
    """The process's libcuda bindings, or None where they cannot be had (or
    ``TIERSTORE_CUDA_DRIVER=0``: torch's calls, for paired measurements)."""
    if os.environ.get("TIERSTORE_CUDA_DRIVER") == "0":
        return None
    for name in ("libcuda.so.1", ctypes.util.find_library("cuda")):
        if name:
            try:
                return Driver(ctypes.PyDLL(name))
            except (OSError, AttributeError):
                continue
    return None
