"""The native lane's compiled I/O loop (``rootstore/lane.py``): sequentially consistent atomics
on shared arrays, the claim of a ring entry, and ``lane_serve`` / ``lane_publish`` /
``lane_cancel`` / ``lane_await`` / ``lane_stop``, cached on disk by numba as ``page_kernels`` is.

Imported only by ``loader._build`` (it imports numba). Every kernel is compiled for an explicit
signature at import, or loaded from numba's cache (where ``page_kernels`` says).
``lane_serve`` runs ``page_kernels.load_page`` and ``store_page`` on each entry, and numba
compiles them into this file's kernels; numba's cache of this file is keyed on this file alone
(its path, size and time stamp) and the CPU. So ``PAGE_KERNELS_DIGEST`` below records a digest
of ``native/page_kernels.py`` (whose ``ABI_DIGEST`` line ties in ``native/abi.py``, the source of
every constant compiled in here too): a changed page_kernels.py without a new digest here stops
the import (the Python path serves), and the edit of that line renews this file's cache.

A fault build (``TIERSTORE_LANE_FAULTS``, tests only, ``lane_faults``) compiles this file's
kernels for its own process, outside the cache; ``page_kernels`` is the same in every build.

Threading: ``lane_serve`` and ``lane_await`` hold no GIL (``nogil=True``); ``lane_publish``,
``lane_cancel`` and ``lane_stop`` are short and keep it. The lane's rings, states and futex
words are shared by its threads and the Python side: every access to them is an atomic here.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numba
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from tierstore.native import abi as native_abi
from tierstore.native import page_kernels
from tierstore.native.abi import (
    CTL_DONE_WAITER,
    CTL_HEAD,
    CTL_SLEEPERS,
    CTL_STOP,
    CTL_TAIL,
    ENTRY_DONE,
    ENTRY_FREE,
    ENTRY_READY,
    ENTRY_RUNNING,
    F_ARG,
    F_CODE,
    F_DEADLINE,
    F_DIRECT_LEN,
    F_FLAG,
    F_GEN,
    F_OFF,
    F_OP,
    F_RANK_FD,
    F_T0,
    F_T1,
    FAULT_BEFORE_DONE,
    FAULT_BEFORE_IO,
    FAULT_BEFORE_RUNNING,
    FAULT_CLAIM,
    FAULT_COUNT,
    FAULT_EVERY,
    FAULT_FIELDS,
    FAULT_PAUSE_NS,
    LANE_EXPIRED,
    MAX_BYPASS,
    OP_STORE,
    WORD_DONE,
    WORD_JOBS,
)
from tierstore.native.page_kernels import (
    bytes_ro,
    c_function,
    frame_t,
    i64,
    load_page,
    rows,
    stats_t,
    store_page,
    syscall,
    t,
    u8,
    vec,
)


def lane_faults(env: Mapping[str, str]) -> int:
    """The fault build ``TIERSTORE_LANE_FAULTS`` asks for (tests only): 0 none ("" or "0", the
    production kernels); 1 ("1") the lane's fault-injection pauses (native_abi.FAULT_*) with
    today's claim and RUNNING mark; 2 ("unfixed") the pauses with the claim and RUNNING mark that
    had the wrong-page races (the ring cell read after the claim's CAS, the RUNNING mark and
    stop's cancel as plain stores), to prove the race tests can fail. Either fault build's lane
    kernels are compiled for this process only, never read from or written to numba's cache.

    Failure policy: any other value, and a fault build ("1" or "unfixed") without
    ``TIERSTORE_LANE_FAULTS_TESTS_ONLY=1`` beside it (the lane's race tests set both), raise
    ``RuntimeError`` naming the setting: the kernels do not load (the loader reports why and
    the Python path serves), so a stray variable never compiles a fault build, let alone the
    known race, into an install."""
    value = env.get("TIERSTORE_LANE_FAULTS", "")
    level = {"": 0, "0": 0, "1": 1, "unfixed": 2}.get(value)
    if level is None:
        raise RuntimeError(f"TIERSTORE_LANE_FAULTS={value!r} is not a known value ('' or '0': the production kernels; "
                           "'1' and 'unfixed': fault builds for tests only); unset it")
    if level and env.get("TIERSTORE_LANE_FAULTS_TESTS_ONLY") != "1":
        what = "a known wrong-page race" if level == 2 else "fault-injection pauses"
        raise RuntimeError(f"TIERSTORE_LANE_FAULTS={value} compiles {what} into the lane's kernels and is for the "
                           "lane's race tests only: set TIERSTORE_LANE_FAULTS_TESTS_ONLY=1 beside it there, and unset "
                           "TIERSTORE_LANE_FAULTS everywhere else")
    return level


LANE_FAULTS = lane_faults(os.environ)
UNFIXED = 1 if LANE_FAULTS == 2 else 0


def page_kernels_digest() -> str:
    """The digest of ``native/page_kernels.py`` that ``PAGE_KERNELS_DIGEST`` records."""
    return hashlib.sha256(Path(page_kernels.__file__).read_bytes()).hexdigest()[:16]


# page_kernels_digest() of the page kernels compiled into this file's (load_page, store_page, the
# C functions they and this file call, and through ABI_DIGEST native_abi's constants). numba
# keys this file's cache on this file alone, so a change to page_kernels.py must change this
# line too (which renews the cache); until it does, the kernels refuse to load and the Python
# path serves. Checked only where the kernels are cached: compiled for one process, they are
# built from what is on disk.
PAGE_KERNELS_DIGEST = "07750958dc8a530c"
_LANE_CACHE = native_abi.cache_kernels and LANE_FAULTS == 0  # a fault build never meets the production cache
if _LANE_CACHE and page_kernels_digest() != PAGE_KERNELS_DIGEST:
    raise RuntimeError(f"tierstore/native/page_kernels.py changed (digest {page_kernels_digest()}) since the lane's "
                       f"kernels were last built against it ({PAGE_KERNELS_DIGEST}): set PAGE_KERNELS_DIGEST in "
                       "tierstore/native/lane_kernels.py to the new digest")


# Atomics on one element of a 1-D integer array (sequentially consistent): the lane's rings,
# states and futex words are shared by its threads and the Python side.
def _operands(context: Any, builder: Any, sig: Any, args: Any) -> tuple[Any, list[Any]]:
    """The pointer to ``args[0][args[1]]`` and the further arguments cast to its type."""
    aryty, dt = sig.args[0], sig.args[0].dtype
    arr = context.make_array(aryty)(context, builder, args[0])
    i = context.cast(builder, args[1], sig.args[1], types.intp)
    ptr = cgutils.get_item_pointer(context, builder, aryty, arr, [i], wraparound=False)
    return ptr, [context.cast(builder, v, t, dt) for v, t in zip(args[2:], sig.args[2:], strict=True)]


def _atomic_typer(ary: Any, idx: Any) -> bool:
    return isinstance(ary, types.Array) and ary.ndim == 1 and isinstance(ary.dtype, types.Integer) \
        and isinstance(idx, types.Integer)


@intrinsic
def atomic_load(typingctx: Any, ary: Any, idx: Any) -> Any:
    if not _atomic_typer(ary, idx):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        ptr, _ = _operands(context, builder, sig, args)
        return builder.load_atomic(ptr, "seq_cst", sig.args[0].dtype.bitwidth // 8)

    return ary.dtype(ary, idx), codegen


@intrinsic
def atomic_store(typingctx: Any, ary: Any, idx: Any, val: Any) -> Any:
    if not _atomic_typer(ary, idx) or not isinstance(val, types.Integer):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        ptr, (v,) = _operands(context, builder, sig, args)
        builder.store_atomic(v, ptr, "seq_cst", sig.args[0].dtype.bitwidth // 8)
        return context.get_dummy_value()

    return types.void(ary, idx, val), codegen


@intrinsic
def atomic_add(typingctx: Any, ary: Any, idx: Any, val: Any) -> Any:
    """Add ``val``; the old value."""
    if not _atomic_typer(ary, idx) or not isinstance(val, types.Integer):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        ptr, (v,) = _operands(context, builder, sig, args)
        return builder.atomic_rmw("add", ptr, v, "seq_cst")

    return ary.dtype(ary, idx, val), codegen


@intrinsic
def atomic_cas(typingctx: Any, ary: Any, idx: Any, expected: Any, new: Any) -> Any:
    """Compare and swap; the old value (== ``expected``: swapped)."""
    if not _atomic_typer(ary, idx) or not isinstance(expected, types.Integer) or not isinstance(new, types.Integer):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        ptr, (cmp, v) = _operands(context, builder, sig, args)
        return builder.extract_value(builder.cmpxchg(ptr, cmp, v, "seq_cst", "seq_cst"), 0)

    return ary.dtype(ary, idx, expected, new), codegen


clock_gettime = c_function("clock_gettime", "i32", ("i32", "i64"))
nanosleep = c_function("nanosleep", "i32", ("i64", "i64"))

SYS_FUTEX, FUTEX_WAIT_PRIVATE, FUTEX_WAKE_PRIVATE = 202, 128, 129

ctl_t = t.Array(i64, 1, "C")
words_t = t.Array(t.int32, 1, "C")
desc_t = t.Array(i64, 2, "C")
names_t = t.Array(u8, 2, "C")
u64_2d = t.Array(t.uint64, 2, "C")
u64_1d = t.Array(t.uint64, 1, "C")
timespec_t = t.Array(i64, 1, "C", readonly=True)


@numba.njit(inline="always")
def now_ns(clock: Any) -> int:
    clock_gettime(1, clock.ctypes.data)  # CLOCK_MONOTONIC: time.monotonic()'s clock
    return clock[0] * 1_000_000_000 + clock[1]


@numba.njit(inline="always")
def fault_pause(faults: Any, point: int, clock: Any) -> None:
    # A fault build's pause at ``point`` (native_abi.FAULT_*), on every Nth pass through it;
    # clock[2:4] is the thread's timespec. Compiled out (LANE_FAULTS is 0) otherwise.
    if LANE_FAULTS != 0 and faults.shape[0] > 0:
        at = point * FAULT_FIELDS
        every = faults[at + FAULT_EVERY]
        if every > 0 and atomic_add(faults, at + FAULT_COUNT, 1) % every == every - 1:
            ns = faults[at + FAULT_PAUSE_NS]
            clock[2] = ns // 1_000_000_000
            clock[3] = ns % 1_000_000_000
            nanosleep(clock.ctypes.data + 16, 0)


@numba.njit(inline="always")
def claim(ctl: Any, ring: Any, q: int, cap: int, faults: Any, clock: Any) -> int:
    # The next entry of queue q (ring cells q * cap .. q * cap + cap - 1), or -1 when it is
    # empty (a lost race retries). The cell is read before the CAS of head: while head is
    # still h, position h + cap cannot be published (at most cap entries exist, and one is at
    # position h), so the cell read is the entry the CAS takes. Read after the CAS, a thread
    # descheduled in between could find the cell already reused for another job.
    while True:
        h = atomic_load(ctl, CTL_HEAD + 2 * q)
        if h >= atomic_load(ctl, CTL_TAIL + 2 * q):
            return -1
        if UNFIXED:
            if atomic_cas(ctl, CTL_HEAD + 2 * q, h, h + 1) == h:
                fault_pause(faults, FAULT_CLAIM, clock)
                return atomic_load(ring, q * cap + h % cap)
            continue
        e = atomic_load(ring, q * cap + h % cap)
        fault_pause(faults, FAULT_CLAIM, clock)
        if atomic_cas(ctl, CTL_HEAD + 2 * q, h, h + 1) == h:
            return e


@numba.njit(inline="always")
def queued(ctl: Any, q: int) -> bool:
    return atomic_load(ctl, CTL_HEAD + 2 * q) < atomic_load(ctl, CTL_TAIL + 2 * q)


@numba.njit(inline="always")
def take(states: Any, e: int) -> bool:
    # READY -> RUNNING for the thread that claimed e; False: stop withdrew the entry first
    # (lane_cancel), and it must not run.
    if UNFIXED:
        atomic_store(states, e, ENTRY_RUNNING)
        return True
    return atomic_cas(states, e, ENTRY_READY, ENTRY_RUNNING) == ENTRY_READY


@numba.njit(i64(ctl_t, words_t, ctl_t, ctl_t, desc_t, names_t, names_t, frame_t,
                i64, i64, i64, i64, i64, i64, i64, i64, i64, i64, i64, i64, i64,
                rows, rows, bytes_ro, rows, vec, i64, i64, i64, rows, rows, rows,
                u64_2d, u64_2d, u64_2d, stats_t, u64_1d, timespec_t, ctl_t, ctl_t), nogil=True, cache=_LANE_CACHE)
def lane_serve(ctl: Any, words: Any, states: Any, ring: Any, desc: Any, snames: Any, lnames: Any, slab: Any,
               s_tmp_at: int, s_final_at: int, s_key_at: int, l_file_at: int, l_key_at: int, dir_flags: int,
               store_flags: int, load_flags: int, mode: int, length: int, size: int, do_fsync: int, piece: int,
               spans: Any, gaps: Any, blank: Any, const_ranges: Any, sum_offsets: Any, key_off: int,
               token_off: int, sum_off: int, plan_verify: Any, plan_raw: Any, no_spans: Any, given: Any, sums: Any,
               header_sums: Any, scratch: Any, no_given: Any, timeout: Any, faults: Any, clock: Any) -> int:
    # One I/O thread of a lane, until CTL_STOP: take an entry (loads first, a store after
    # MAX_BYPASS loads taken past waiting stores), run store_page / load_page on it, mark it
    # done; sleep on the jobs futex word when both queues are empty. ``clock``: this thread's
    # 4 int64s (clock_gettime's timespec, a fault pause's).
    cap = states.shape[0]
    bypass = 0
    while atomic_load(ctl, CTL_STOP) == 0:
        first = 1 if bypass >= MAX_BYPASS else 0
        e = claim(ctl, ring, first, cap, faults, clock)
        q = first
        if e < 0:
            q = 1 - first
            e = claim(ctl, ring, q, cap, faults, clock)
        if e < 0:
            seq = atomic_load(words, WORD_JOBS)
            atomic_add(ctl, CTL_SLEEPERS, 1)
            if not queued(ctl, 0) and not queued(ctl, 1) and atomic_load(ctl, CTL_STOP) == 0:
                syscall(SYS_FUTEX, words.ctypes.data + 4 * WORD_JOBS, FUTEX_WAIT_PRIVATE, seq, timeout.ctypes.data)
            atomic_add(ctl, CTL_SLEEPERS, -1)
            continue
        if q == 0 and queued(ctl, 1):
            bypass += 1
        elif q == 1:
            bypass = 0
        fault_pause(faults, FAULT_BEFORE_RUNNING, clock)
        if not take(states, e):
            continue
        t0 = now_ns(clock)
        desc[e, F_T0] = t0
        if t0 > desc[e, F_DEADLINE]:
            code = LANE_EXPIRED  # the queue completed it as timed out: do not start it late
        elif desc[e, F_OP] == OP_STORE:
            fault_pause(faults, FAULT_BEFORE_IO, clock)
            g = given[e] if desc[e, F_FLAG] != 0 else no_given
            code = store_page(desc[e, F_RANK_FD], snames[e], s_tmp_at, s_final_at, s_key_at, dir_flags, store_flags,
                              mode, slab, desc[e, F_OFF], length, size, do_fsync, piece, spans, gaps, blank, sum_offsets,
                              key_off, token_off, sum_off, desc[e, F_ARG], g, sums[e], scratch[e])
        else:
            fault_pause(faults, FAULT_BEFORE_IO, clock)
            plan = plan_verify if desc[e, F_ARG] != 0 else plan_raw
            load_spans = spans if desc[e, F_ARG] != 0 else no_spans
            code = load_page(desc[e, F_RANK_FD], lnames[e], l_file_at, l_key_at, dir_flags, load_flags, size,
                             desc[e, F_FLAG], desc[e, F_DIRECT_LEN], slab, desc[e, F_OFF], plan, load_spans, gaps,
                             blank, const_ranges, sum_offsets, key_off, sum_off, sums[e], header_sums[e], scratch[e])
        desc[e, F_CODE] = code
        desc[e, F_T1] = now_ns(clock)
        fault_pause(faults, FAULT_BEFORE_DONE, clock)
        atomic_store(states, e, ENTRY_DONE)
        atomic_add(words, WORD_DONE, 1)
        if atomic_load(ctl, CTL_DONE_WAITER) != 0:
            syscall(SYS_FUTEX, words.ctypes.data + 4 * WORD_DONE, FUTEX_WAKE_PRIVATE, 1, 0)
    return 0


@numba.njit(t.void(ctl_t, words_t, ctl_t, ctl_t, i64, i64), nogil=False, cache=_LANE_CACHE)
def lane_publish(ctl: Any, words: Any, states: Any, ring: Any, q: int, e: int) -> None:
    # Called with the queue's lock held (one producer at a time): entry e (its fields written)
    # goes to the tail of queue q; a sleeping lane thread is woken.
    cap = states.shape[0]
    atomic_store(states, e, ENTRY_READY)
    tail = atomic_load(ctl, CTL_TAIL + 2 * q)
    atomic_store(ring, q * cap + tail % cap, e)
    atomic_store(ctl, CTL_TAIL + 2 * q, tail + 1)
    atomic_add(words, WORD_JOBS, 1)
    if atomic_load(ctl, CTL_SLEEPERS) > 0:
        syscall(SYS_FUTEX, words.ctypes.data + 4 * WORD_JOBS, FUTEX_WAKE_PRIVATE, 1, 0)


@numba.njit(i64(ctl_t, ctl_t), nogil=False, cache=_LANE_CACHE)
def lane_cancel(states: Any, won: Any) -> int:
    # stop's withdrawal: every READY entry that no thread has marked RUNNING goes to FREE (a
    # CAS, so an entry is either run by its claimer or withdrawn here, never both); their
    # numbers go to won[:n], n returned.
    n = 0
    for e in range(states.shape[0]):
        if UNFIXED:
            if atomic_load(states, e) == ENTRY_READY:
                atomic_store(states, e, ENTRY_FREE)
                won[n] = e
                n += 1
        elif atomic_cas(states, e, ENTRY_READY, ENTRY_FREE) == ENTRY_READY:
            won[n] = e
            n += 1
    return n


@numba.njit(i64(ctl_t, words_t, ctl_t, desc_t, ctl_t, timespec_t, timespec_t), nogil=True, cache=_LANE_CACHE)
def lane_await(ctl: Any, words: Any, states: Any, desc: Any, seen: Any, delay: Any, timeout: Any) -> int:
    # The lane's harvest thread, without the GIL: return 1 once some entry has been done and
    # not harvested for at least ``delay`` (the driver's own polls usually harvest first, and
    # then this thread never asks for the GIL), 0 at CTL_STOP.
    n = states.shape[0]
    while atomic_load(ctl, CTL_STOP) == 0:
        seq = atomic_load(words, WORD_DONE)
        found = 0
        for e in range(n):
            if atomic_load(states, e) == ENTRY_DONE:
                seen[found] = e
                seen[n + found] = desc[e, F_GEN]
                found += 1
        if found == 0:
            atomic_store(ctl, CTL_DONE_WAITER, 1)
            syscall(SYS_FUTEX, words.ctypes.data + 4 * WORD_DONE, FUTEX_WAIT_PRIVATE, seq, timeout.ctypes.data)
            atomic_store(ctl, CTL_DONE_WAITER, 0)
            continue
        nanosleep(delay.ctypes.data, 0)
        for j in range(found):
            e = seen[j]
            if atomic_load(states, e) == ENTRY_DONE and desc[e, F_GEN] == seen[n + j]:
                return 1
    return 0


@numba.njit(t.void(ctl_t, words_t), nogil=False, cache=_LANE_CACHE)
def lane_stop(ctl: Any, words: Any) -> None:
    atomic_store(ctl, CTL_STOP, 1)
    atomic_add(words, WORD_JOBS, 1)
    atomic_add(words, WORD_DONE, 1)
    syscall(SYS_FUTEX, words.ctypes.data + 4 * WORD_JOBS, FUTEX_WAKE_PRIVATE, 1 << 30, 0)
    syscall(SYS_FUTEX, words.ctypes.data + 4 * WORD_DONE, FUTEX_WAKE_PRIVATE, 1 << 30, 0)

