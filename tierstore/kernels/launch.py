"""Triton kernel launches that keep the GIL, for the thread that drives transfers.

Why: Triton's launcher (C) releases the GIL around ``cuLaunchKernelEx``. With 16 I/O threads
wanting the GIL, the driving thread then waits to get it back after every launch: 17% of its
samples at 16 threads, and ~6% more in Triton's Python per launch (binding the arguments,
the specialization key); docs/measurements/scaling.md. A launch only queues work
(a few microseconds), so holding the GIL through it is cheaper than handing it over, as for
the copies and events of ``cuda_driver``.

How: ``Launcher(jit_fn).launch(grid, *args, **constexprs)`` has the effect of
``jit_fn[grid](*args, **constexprs)``. The first launch of each specialization goes through
Triton, which compiles (or loads) and launches it, and returns its compiled kernel. That kernel
is kept under a key at least as fine as Triton's own specialization: per positional argument
a tensor's dtype and whether its address is 16-byte aligned, an int's width class, whether it
is 1, and whether it divides by 16; the keyword values; the device. A host tensor (pinned
memory the kernel writes over PCIe, as the hash and check results) gets its device address from
``cuPointerGetAttribute`` at each launch, as Triton's launcher does (pageable memory: ValueError). Equal keys therefore mean
the same compiled kernel. Later launches with that key pack the arguments by the compiled
kernel's own signature (pointers and i32/i64/u64 ints; constexpr entries skipped, then Triton's
two scratch pointers, null) into preallocated ctypes holders and call ``cuLaunchKernel``
through ``ctypes.PyDLL`` (``cuda_driver``): grid as given, ``32 * num_warps`` threads, the
compiled shared memory, the current torch stream, as Triton's launcher does.

Failure policy: anything this module cannot launch exactly as Triton would goes through
Triton, for good for that key: no libcuda binding, CPU tensors or the interpreter, a Triton
outside 3.5-3.x (the launch ABI checked: arguments, then global and profile scratch), launch
hooks set, a signature type other than those above, a kernel that needs global or profile
scratch, clusters, cooperative or PDL launches, tensor descriptors, a non-constexpr argument
passed by keyword. ``TIERSTORE_TRITON_LAUNCH=0`` sends every launch through Triton (paired
measurements). Errors of ``cuLaunchKernel`` raise ``RuntimeError`` with the CUDA code.

Threading: any thread may launch; a lock guards the key table and the argument holders.
``counts()`` says how many launches took each way, ``totals()`` the same for the process.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from dataclasses import dataclass
from typing import Any

import torch

from tierstore.kernels.cuda_driver import Driver, driver

_CTYPE = {"i32": ctypes.c_int32, "i64": ctypes.c_int64, "u64": ctypes.c_uint64, "u32": ctypes.c_uint32}
_ALL: list[Launcher] = []  # every Launcher made (module-level kernels: a handful), for totals()
_KNOWN_ABI = ((3, 5), (4, 0))  # Triton versions whose launcher passes args + global + profile scratch


def _triton_version() -> tuple[int, int]:
    import triton

    major, minor = triton.__version__.split(".")[:2]
    return int(major), int(minor)


@functools.cache
def enabled() -> bool:
    """Whether launches may bypass Triton's launcher in this process (CUDA, a bound libcuda, a
    known launch ABI, not turned off); decided once (``enabled.cache_clear()`` to decide again)."""
    if os.environ.get("TIERSTORE_TRITON_LAUNCH") == "0" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    try:
        version = _triton_version()
    except (ImportError, ValueError):
        return False
    return _KNOWN_ABI[0] <= version < _KNOWN_ABI[1] and torch.cuda.is_available() and driver() is not None


def _int_class(v: int) -> int:
    return 0 if -(2**31) <= v < 2**31 else 2 if 2**63 <= v < 2**64 else 1


def spec_key(args: tuple[Any, ...], constexprs: dict[str, Any]) -> tuple[Any, ...] | None:
    """A key at least as fine as Triton's specialization of these arguments, or None when an
    argument is of a kind this module does not launch (a float, a tuple, an object)."""
    parts: list[Any] = []
    for a in args:
        if isinstance(a, torch.Tensor):
            dev = a.device.type
            if dev not in ("cuda", "cpu"):
                return None
            parts.append((a.dtype, a.data_ptr() % 16 == 0, dev))  # cpu: pinned memory, checked per launch
        elif isinstance(a, bool):
            parts.append(("b", a))
        elif isinstance(a, int):
            parts.append(("i", a == 1, a % 16 == 0, _int_class(a)))
        else:
            return None
    return (*parts, *sorted(constexprs.items()))


@dataclass
class _Prepared:
    """One compiled kernel, launchable without Triton: where each parameter comes from."""

    function: int
    block_x: int
    shared: int
    positions: list[int]  # for each kernel parameter, the positional argument it takes
    is_pointer: list[bool]
    on_host: list[bool]  # a host tensor (pinned memory): its device address asked per launch
    holders: list[Any]  # ctypes values, refilled per launch (under the Launcher's lock)
    params: Any  # void*[] pointing at the holders and the two (null) scratch pointers


def prepare(kernel: Any, arg_names: list[str], args: tuple[Any, ...]) -> _Prepared | str:
    """The launch plan of a Triton CompiledKernel, or why it must go through Triton."""
    md = kernel.metadata
    for field, ok in (("num_ctas", 1), ("launch_cooperative_grid", False), ("launch_pdl", False),
                      ("global_scratch_size", 0), ("profile_scratch_size", 0)):
        if getattr(md, field, None) != ok:
            return f"{field}={getattr(md, field, 'absent')}"
    if getattr(md, "tensordesc_meta", None) or getattr(md, "instrumentation_mode", "") not in ("", None):
        return "tensor descriptors or instrumentation"
    signature = getattr(getattr(kernel, "src", None), "signature", None)
    function = getattr(kernel, "function", None)
    if not isinstance(signature, dict) or not function:
        return "no signature or function handle on the compiled kernel"
    positions: list[int] = []
    is_pointer: list[bool] = []
    holders: list[Any] = []
    for name, ty in signature.items():
        if ty == "constexpr":
            continue
        if not isinstance(ty, str) or name not in arg_names or arg_names.index(name) >= len(args):
            return f"parameter {name} ({ty}): a tuple, a descriptor, or passed by keyword"
        if ty.startswith("*"):
            holders.append(ctypes.c_uint64())
            is_pointer.append(True)
        elif ty in _CTYPE:
            holders.append(_CTYPE[ty]())
            is_pointer.append(False)
        else:
            return f"parameter {name} of type {ty}"
        positions.append(arg_names.index(name))
    scratch = [ctypes.c_uint64(0), ctypes.c_uint64(0)]
    holders += scratch
    params = (ctypes.c_void_p * len(holders))(*(ctypes.addressof(h) for h in holders))
    on_host = [ptr and isinstance(args[pos], torch.Tensor) and args[pos].device.type == "cpu"
               for pos, ptr in zip(positions, is_pointer, strict=True)]
    return _Prepared(int(function), 32 * int(md.num_warps), int(md.shared), positions, is_pointer, on_host,
                     holders, params)


def totals() -> dict[str, int]:
    """Launches of every Launcher of the process: through libcuda directly, and through Triton."""
    counts = [lw.counts() for lw in list(_ALL)]
    return {k: sum(c[k] for c in counts) for k in ("direct", "via_triton")}


def refusals() -> dict[str, int]:
    """Why specializations of the process's Launchers go through Triton (reason: how many)."""
    out: dict[str, int] = {}
    for lw in list(_ALL):
        for why, n in lw.refused.items():
            out[why] = out.get(why, 0) + n
    return out


class Launcher:
    """Launches of one ``@triton.jit`` function, through libcuda where the compiled kernel allows."""

    def __init__(self, jit_fn: Any) -> None:
        self.jit_fn = jit_fn
        self._arg_names: list[str] = list(getattr(jit_fn, "arg_names", []))
        self._lock = threading.Lock()
        self._prepared: dict[tuple[Any, ...], _Prepared | None] = {}  # None: Triton launches it
        self.refused: dict[str, int] = {}  # why a specialization goes through Triton, and how many
        self._direct = 0
        self._via_triton = 0
        _ALL.append(self)

    def counts(self) -> dict[str, int]:
        """Launches made through libcuda directly, and through Triton."""
        return {"direct": self._direct, "via_triton": self._via_triton}

    def launch(self, grid: tuple[int, ...], *args: Any, **constexprs: Any) -> None:
        drv = driver() if enabled() else None
        key = spec_key(args, constexprs) if drv is not None else None
        if drv is not None and key is not None:
            device = torch.cuda.current_device()
            key = (device, *key)
            with self._lock:
                plan = self._prepared.get(key)
                if plan is not None and not _hooks_set():
                    self._launch_direct(drv, plan, grid, args, device)
                    self._direct += 1
                    return
        kernel = self.jit_fn[grid](*args, **constexprs)
        with self._lock:
            self._via_triton += 1
            if key is not None and key not in self._prepared:
                if hasattr(kernel, "result"):
                    kernel = kernel.result()
                plan = prepare(kernel, self._arg_names, args)
                if isinstance(plan, str):
                    self.refused[plan] = self.refused.get(plan, 0) + 1
                self._prepared[key] = None if isinstance(plan, str) else plan

    @staticmethod
    def _launch_direct(drv: Driver, plan: _Prepared, grid: tuple[int, ...], args: tuple[Any, ...],
                       device: int) -> None:
        for holder, pos, ptr, host in zip(plan.holders, plan.positions, plan.is_pointer, plan.on_host, strict=False):
            a = args[pos]
            holder.value = (drv.device_pointer(a.data_ptr()) if host else a.data_ptr()) if ptr else a
        gx = grid[0]
        gy = grid[1] if len(grid) > 1 else 1
        gz = grid[2] if len(grid) > 2 else 1
        stream = torch._C._cuda_getCurrentRawStream(device)
        drv.launch_kernel(plan.function, gx, gy, gz, plan.block_x, plan.shared, stream, plan.params)


def _hooks_set() -> bool:
    """Whether Triton's launch hooks (a profiler's) are set: then Triton launches, to call them.
    Triton 3.6 keeps them as HookChain objects (a list of calls), older ones as None or a callable."""
    try:
        from triton import knobs

        hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    except (ImportError, AttributeError):
        return True
    return any(h is not None and getattr(h, "calls", True) for h in hooks)
