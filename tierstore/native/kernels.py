"""The compiled kernels of ``native`` and ``native_page``, cached on disk (numba ``cache=_CACHE``).

Imported only by ``loader._build`` (it imports numba; the package works without it). Every
function is compiled for an explicit signature at import, or loaded from numba's cache: the
``__pycache__`` beside this file when it is writable, else numba's per-user cache directory
(``NUMBA_CACHE_DIR`` overrides; where none is writable ``loader._build`` imports this module
again with caching off). Why cached: compiling took ~6 s of CPU in every process that
loads a page (each vLLM worker), mostly holding the GIL while the worker's first steps ran; at
TP=2 on the 2-core machine an engine's first step waited ~9 s, and an engine start took 37.7 s
against 26.6 s with the native path off (docs/DESIGN.md §6, the page store on one root). Loading the cache
takes a fraction of a second.

What makes caching possible: C functions are called by symbol through ``_c_function``'s
intrinsics (resolved by LLVM when the code is loaded), not through ctypes pointers, which numba
cannot cache. XXH3 is the loaded xxhash extension's own, ``XXH3_64bits_dispatch`` where it is
exported, else ``XXH3_64bits`` (``_xxh3_symbol``). ``loader._build`` makes its symbols visible with ``llvmlite.binding.load_library_permanently`` first, and checks the
compiled hash against ``xxhash.xxh3_64_intdigest`` before any use. The declarations match the
ctypes prototypes used before: ``openat`` always gets its mode argument (0 unless creating).

numba's cache is keyed on this file (its path, size and time stamp) and the CPU. The constants
compiled in come from ``native/abi.py`` alone, and ``ABI_DIGEST`` below ties that module to this
file: a changed constant without a new digest here stops the import (the Python path serves).
A fault build (``TIERSTORE_LANE_FAULTS``, tests only) compiles the lane's kernels for its own
process, outside the cache.

Threading: the kernels hold no GIL (``nogil=True``) and touch only the buffers they are given.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numba
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from tierstore.native import abi as native_abi
from tierstore.native.abi import (
    BAD_SECTION,
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
    LOAD_BAD_GAP,
    LOAD_BAD_HEADER,
    LOAD_BAD_SUM,
    LOAD_COLD,
    LOAD_NOT_PLAIN,
    LOAD_OPEN_FAILED,
    LOAD_READ_FAILED,
    MAX_BYPASS,
    OP_STORE,
    READ_ODIRECT,
    STORE_EXISTS,
    STORE_FAILED,
    STORE_NO_DIR,
    VERIFY_TOKENS,
    WORD_DONE,
    WORD_JOBS,
)

# native_abi.digest() of the constants compiled in below. numba keys its cache on this file
# alone, so a change to native_abi must change this line too (which renews the cache); until it
# does, the kernels refuse to load and the Python path serves.
ABI_DIGEST = "b57b8232ac8806db"
if native_abi.digest() != ABI_DIGEST:
    raise RuntimeError(f"tierstore/native/abi.py changed (digest {native_abi.digest()}) since the native kernels were "
                       f"last built against it ({ABI_DIGEST}): set ABI_DIGEST in tierstore/native/kernels.py to the "
                       "new digest, after checking every kernel that uses a changed constant")



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
_CACHE = native_abi.cache_kernels  # False: no writable cache directory (loader._build); compile only
_LL = {"i32": ir.IntType(32), "i64": ir.IntType(64)}


def _fit(builder: Any, value: Any, to: Any, signed: bool) -> Any:
    """``value`` (an LLVM integer) as the integer type ``to`` (truncated or extended)."""
    if value.type.width > to.width:
        return builder.trunc(value, to)
    if value.type.width < to.width:
        return builder.sext(value, to) if signed else builder.zext(value, to)
    return value


def _c_function(name: str, ret: str, params: tuple[str, ...], unsigned: bool = False) -> Any:
    """An intrinsic that calls the C function ``name`` (params and result: "i32" C int, "i64"
    long/ssize_t/size_t/off_t/pointer) with any integer arguments; the result is an int64
    (uint64 with ``unsigned``)."""
    result = types.uint64 if unsigned else types.int64

    def typer(typingctx: Any, *args: Any) -> Any:
        if len(args) != len(params) or not all(isinstance(a, types.Integer) for a in args):
            return None

        def codegen(context: Any, builder: Any, signature: Any, llargs: Any) -> Any:
            fnty = ir.FunctionType(_LL[ret], [_LL[p] for p in params])
            fn = cgutils.get_or_insert_function(builder.module, fnty, name)
            vals = [_fit(builder, v, _LL[p], a.signed) for v, p, a in zip(llargs, params, signature.args, strict=True)]
            return _fit(builder, builder.call(fn, vals), _LL["i64"], not unsigned)

        return result(*args), codegen

    # numba reads an intrinsic's arity from its typer's signature: one named parameter each.
    names = ", ".join(f"a{i}" for i in range(len(params)))
    scope: dict[str, Any] = {"typer": typer}
    exec(f"def {name}(typingctx{', ' if names else ''}{names}):\n    return typer(typingctx{', ' if names else ''}{names})",
         scope)
    return intrinsic(scope[name])


def _xxh3_symbol() -> str:
    """The XXH3-64 entry point the kernels call: xxhash's x86 builds export a dispatcher that
    picks AVX2/AVX-512 code where the CPU has it (what ``xxhash.xxh3_64_intdigest`` calls),
    while ``XXH3_64bits`` is the SSE2 build: 8.9 against 12.4 GB/s over 16 MiB on the 2-core
    EPYC, 12.4 against 16.2 GB/s over 64 KiB (docs/DESIGN.md §6, the page store on one root). Same digests.
    ``TIERSTORE_XXH3_SYMBOL=XXH3_64bits`` takes the SSE2 one (paired measurements; numba's cache
    keeps the symbol it compiled with, so give each choice its own ``NUMBA_CACHE_DIR``)."""
    import ctypes

    import xxhash._xxhash as ext

    if os.environ.get("TIERSTORE_XXH3_SYMBOL") == "XXH3_64bits":
        return "XXH3_64bits"
    return "XXH3_64bits_dispatch" if hasattr(ctypes.CDLL(ext.__file__), "XXH3_64bits_dispatch") else "XXH3_64bits"


XXH3_SYMBOL = _xxh3_symbol()
xxh3 = _c_function(XXH3_SYMBOL, "i64", ("i64", "i64"), unsigned=True)
openat = _c_function("openat", "i32", ("i32", "i64", "i32", "i32"))  # with its mode, as creating
close = _c_function("close", "i32", ("i32",))
fstat = _c_function("fstat", "i32", ("i32", "i64"))
fstatat = _c_function("fstatat", "i32", ("i32", "i64", "i64", "i32"))
pread = _c_function("pread", "i64", ("i32", "i64", "i64", "i64"))
pwrite = _c_function("pwrite", "i64", ("i32", "i64", "i64", "i64"))
fsync = _c_function("fsync", "i32", ("i32",))
ftruncate = _c_function("ftruncate", "i32", ("i32", "i64"))
renameat = _c_function("renameat", "i32", ("i32", "i64", "i32", "i64"))
unlinkat = _c_function("unlinkat", "i32", ("i32", "i64", "i32"))
fcntl = _c_function("fcntl", "i32", ("i32", "i32", "i64"))
syscall = _c_function("syscall", "i64", ("i64", "i64", "i64", "i64", "i64"))


# Explicit signatures: compiled (or loaded from the cache) at import, once, for exactly the
# types callers pass (read-only cached index arrays); a lazily specialised dispatcher compiled
# again at the first real call, with every I/O thread queued on numba's compiler lock (seen in
# the profile).
rows = numba.types.Array(numba.types.int64, 2, "C", readonly=True)
sums = numba.types.Array(numba.types.uint64, 1, "C")
i64 = numba.types.int64

@numba.njit(numba.types.void(i64, rows, i64, i64, sums), nogil=True, cache=_CACHE)
def hash_spans(base: int, spans: Any, first: int, end: int, out: Any) -> None:
    for i in range(first, end):
        out[i - first] = xxh3(base + spans[i, 0], spans[i, 1] - spans[i, 0])

@numba.njit(numba.types.void(i64, i64, i64, i64, sums), nogil=True, cache=_CACHE)
def hash_strided(base: int, n: int, stride: int, length: int, out: Any) -> None:
    # n records of ``stride`` bytes back to back: xxh3 of each one's first ``length``.
    for i in range(n):
        out[i] = xxh3(base + i * stride, length)

@numba.njit(i64(i64, i64, i64, rows, rows, sums), nogil=True, cache=_CACHE)
def read_pieces(fd: int, file_base: int, page_off: int, pieces: Any, spans: Any, out: Any) -> int:
    # pieces: (file start, file end, first section, end section); the page starts at
    # file offset page_off. Each piece is hashed right after it lands (still in cache).
    for p in range(pieces.shape[0]):
        off = pieces[p, 0]
        end = pieces[p, 1]
        while off < end:
            n = pread(fd, file_base + off, end - off, off)
            if n <= 0:
                return off if n == 0 else -1
            off += n
        for i in range(pieces[p, 2], pieces[p, 3]):
            out[i] = xxh3(file_base + page_off + spans[i, 0], spans[i, 1] - spans[i, 0])
    return pieces[pieces.shape[0] - 1, 1] if pieces.shape[0] else 0

@numba.njit(numba.types.boolean(i64, i64, i64, i64), nogil=True, cache=_CACHE)
def write_range(f: int, buf: int, off: int, end: int) -> bool:
    # bytes [off, end) of the file from buf + off; False on a failed write.
    while off < end:
        n = pwrite(f, buf + off, end - off, off)
        if n <= 0:
            return False
        off += n
    return True

@numba.njit(numba.types.boolean(i64, i64, i64, i64, i64, rows, sums), nogil=True, cache=_CACHE)
def write_hashed_in_pieces(f: int, base: int, hl: int, length: int, piece: int, spans: Any, out: Any) -> bool:
    # The page's bytes [hl, length) of the file from base, ``piece`` bytes per write, each
    # piece's sections (those starting in it, whole) hashed into ``out`` right before its
    # write, so the write's copy reads them from the CPU cache; False on a failed write.
    hashed = 0
    at = hl
    while at < length:
        end = min(at + piece, length)
        while hashed < spans.shape[0] and hl + spans[hashed, 0] < end:
            out[hashed] = xxh3(base + hl + spans[hashed, 0], spans[hashed, 1] - spans[hashed, 0])
            hashed += 1
        if not write_range(f, base, at, end):
            return False
        at = end
    return True

@numba.njit(i64(i64, i64, i64, i64, i64, i64, i64, numba.types.boolean), nogil=True, cache=_CACHE)
def publish_temp(d: int, f: int, tmp: int, final: int, length: int, exact_len: int, do_fsync: int,
                 ok: bool) -> int:
    # The written temp ``f``: cut the O_DIRECT padding, fsync if asked, close, rename over the
    # final name; on any failure (or ``ok`` False) the temp is removed, the final name untouched.
    if ok and exact_len < length and ftruncate(f, exact_len) != 0:
        ok = False
    if ok and do_fsync != 0 and fsync(f) != 0:
        ok = False
    if close(f) != 0:
        ok = False
    if ok and renameat(d, tmp, d, final) != 0:
        ok = False
    if not ok:
        unlinkat(d, tmp, 0)
    return 0 if ok else STORE_FAILED

@numba.njit(i64(i64, i64, i64, i64, i64, i64, i64, i64, i64), nogil=True, cache=_CACHE)
def write_file(d: int, tmp: int, final: int, file_flags: int, mode: int, buf: int, length: int, exact_len: int,
               do_fsync: int) -> int:
    # In the directory fd ``d``: create the temp (O_EXCL), write, publish (publish_temp).
    # ``tmp``/``final``: addresses of NUL-terminated names.
    f = openat(d, tmp, file_flags, mode)
    if f < 0:
        return STORE_FAILED
    return publish_temp(d, f, tmp, final, length, exact_len, do_fsync, write_range(f, buf, 0, length))


t = numba.types
i64, u8 = t.int64, t.uint8
rows = t.Array(i64, 2, "C", readonly=True)
vec = t.Array(i64, 1, "C", readonly=True)
bytes_ro = t.Array(u8, 1, "C", readonly=True)
frame_t = t.Array(u8, 1, "C")
sums_t = t.Array(t.uint64, 1, "C")
sums_ro = t.Array(t.uint64, 1, "C", readonly=True)
scratch_t = t.Array(i64, 1, "C")
f_getfl, f_setfl, o_direct = 3, 4, getattr(os, "O_DIRECT", 0)
load_open_failed, load_not_plain, load_cold, load_read_failed = LOAD_OPEN_FAILED, LOAD_NOT_PLAIN, LOAD_COLD, LOAD_READ_FAILED
store_exists, store_no_dir = STORE_EXISTS, STORE_NO_DIR
bad_header, bad_sum, bad_gap, bad_section = LOAD_BAD_HEADER, LOAD_BAD_SUM, LOAD_BAD_GAP, BAD_SECTION
verify_tokens = VERIFY_TOKENS

@numba.njit(inline="always")
def get_u64(a: Any, at: int) -> Any:  # little-endian, as format.py's structs
    v = numba.uint64(0)
    for b in range(8):
        v |= numba.uint64(a[at + b]) << numba.uint64(8 * b)
    return v

@numba.njit(inline="always")
def put_u64(a: Any, at: int, v: Any) -> None:
    for b in range(8):
        a[at + b] = numba.uint8((v >> numba.uint64(8 * b)) & numba.uint64(0xFF))

@numba.njit(i64(i64, bytes_ro, i64, i64, i64, i64, i64, i64, i64, frame_t, i64, rows, rows, rows, bytes_ro,
                rows, vec, i64, i64, sums_t, sums_t, scratch_t), nogil=True, cache=_CACHE)
def load_page(rank_fd: int, names: Any, file_at: int, key_at: int, dir_flags: int, file_flags: int, size: int,
              check_cache: int, direct_len: int, frame: Any, file_off: int, pieces: Any, spans: Any, gaps: Any,
              blank: Any, const_ranges: Any, sum_offsets: Any, key_off: int, sum_off: int, out: Any,
              header_sums: Any, scratch: Any) -> int:
    # scratch: [0:18] struct stat (x86_64), [18:20] cachestat range, [20:25] cachestat out,
    # [READ_ODIRECT] 1 when the file was read with O_DIRECT (a lane entry's row serves many loads).
    # file_at 0: ``rank_fd`` is the page's directory itself (fsck's checked fd), no open.
    scratch[READ_ODIRECT] = 0
    d = openat(rank_fd, names.ctypes.data, dir_flags, 0) if file_at > 0 else rank_fd
    if d < 0:
        return load_open_failed
    f = openat(d, names.ctypes.data + file_at, file_flags, 0)
    if file_at > 0:
        close(d)
    if f < 0:
        return load_open_failed
    stat_at = scratch.ctypes.data
    if fstat(f, stat_at) != 0 or (scratch[3] & 0o170000) != 0o100000 or scratch[2] > 1 or scratch[6] != size:
        close(f)
        return load_not_plain
    cold = False
    if check_cache != 0:
        scratch[18] = 0
        scratch[19] = 4096
        if syscall(451, f, stat_at + 18 * 8, stat_at + 20 * 8, 0) != 0 or scratch[20] == 0:
            # Not cached: read it with O_DIRECT in one request (pread_pieces' pieces would
            # each wait for the disk), or hand it back when that is not possible here.
            flags = fcntl(f, f_getfl, 0)
            if direct_len <= 0 or flags < 0 or fcntl(f, f_setfl, flags | o_direct) != 0:
                close(f)
                return load_cold
            cold = True
    hl = blank.shape[0]
    base = frame.ctypes.data + file_off
    if cold:
        got = 0
        while got < direct_len:
            n = pread(f, base + got, direct_len - got, got)
            if n <= 0:
                break
            got += n
        close(f)
        if got < size:  # EINVAL (refused here), an error or a short file: the Python path
            return load_cold if got == 0 else load_read_failed
        hash_spans(base + hl, spans, 0, spans.shape[0], out)
        scratch[READ_ODIRECT] = 1
        got = pieces[pieces.shape[0] - 1, 1]
    else:
        got = read_pieces(f, base, hl, pieces, spans, out)
        close(f)
    if got < 0:
        return load_read_failed
    if pieces.shape[0] and got != pieces[pieces.shape[0] - 1, 1]:
        return got  # the file ended early: the Python path names it
    # The header, byte for byte the template's (HeaderTemplate.parse).
    if xxh3(base, sum_off) != get_u64(frame, file_off + sum_off):
        return bad_header
    for i in range(names.shape[0] - key_at):
        if frame[file_off + key_off + i] != names[key_at + i]:
            return bad_header
    for r in range(const_ranges.shape[0]):
        for j in range(const_ranges[r, 0], const_ranges[r, 1]):
            if frame[file_off + j] != blank[j]:
                return bad_header
    for i in range(sum_offsets.shape[0]):
        header_sums[i] = get_u64(frame, file_off + sum_offsets[i])
    for i in range(spans.shape[0]):
        if out[i] != header_sums[i]:
            scratch[bad_section] = i
            return bad_sum
    page = file_off + hl
    for g in range(gaps.shape[0]):
        for j in range(gaps[g, 0], gaps[g, 1]):
            if frame[page + j] != 0:
                return bad_gap
    return got

@numba.njit(inline="always")
def fill_header(frame: Any, file_off: int, names: Any, key_at: int, blank: Any, key_off: int, token_off: int,
                sum_off: int, sum_offsets: Any, token_count: int, sums: Any) -> None:
    # HeaderTemplate.fill's bytes at frame[file_off:]: the blank, the key, the token count,
    # the section sums, then the header's own checksum.
    for j in range(blank.shape[0]):
        frame[file_off + j] = blank[j]
    for i in range(names.shape[0] - key_at):
        frame[file_off + key_off + i] = names[key_at + i]
    for b in range(4):
        frame[file_off + token_off + b] = numba.uint8((token_count >> (8 * b)) & 0xFF)
    for i in range(sum_offsets.shape[0]):
        put_u64(frame, file_off + sum_offsets[i], sums[i])
    put_u64(frame, file_off + sum_off, xxh3(frame.ctypes.data + file_off, sum_off))

@numba.njit(i64(i64, bytes_ro, i64, i64, i64, i64, i64, i64, frame_t, i64, i64, i64, i64, i64, rows, rows,
                bytes_ro, vec, i64, i64, i64, i64, sums_ro, sums_t, scratch_t), nogil=True, cache=_CACHE)
def store_page(rank_fd: int, names: Any, tmp_at: int, final_at: int, key_at: int, dir_flags: int,
               file_flags: int, mode: int, frame: Any, file_off: int, length: int, exact_len: int, do_fsync: int,
               piece: int, spans: Any, gaps: Any, blank: Any, sum_offsets: Any, key_off: int, token_off: int,
               sum_off: int, token_count: int, given: Any, sums: Any, scratch: Any) -> int:
    # names: fan-out dir, temp name, final name (NUL-terminated), then the key bytes.
    d = openat(rank_fd, names.ctypes.data, dir_flags, 0)
    if d < 0:
        return store_no_dir
    found = fstatat(d, names.ctypes.data + final_at, scratch.ctypes.data, 0x100)  # AT_SYMLINK_NOFOLLOW
    if found == 0:
        close(d)
        return store_exists
    hl = blank.shape[0]
    page = file_off + hl
    for g in range(gaps.shape[0]):  # canonical bytes whoever filled the slot
        for j in range(gaps[g, 0], gaps[g, 1]):
            frame[page + j] = 0
    base = frame.ctypes.data + file_off
    tmp = names.ctypes.data + tmp_at
    final = names.ctypes.data + final_at
    if given.shape[0] == 0 and 0 < piece < length - hl and (file_flags & o_direct) == 0:
        # Hashed here, in pieces: each piece's sections hashed right before the piece is
        # written, so the write's copy reads them from the CPU cache; the header last. Not
        # with O_DIRECT: the device reads the page from memory itself (no copy to spare), and
        # one large request keeps more of it in flight than a piece at a time.
        f = openat(d, tmp, file_flags, mode)
        if f < 0:
            close(d)
            return STORE_FAILED
        ok = write_hashed_in_pieces(f, base, hl, length, piece, spans, sums)
        if ok:
            fill_header(frame, file_off, names, key_at, blank, key_off, token_off, sum_off, sum_offsets, token_count,
                        sums)
            ok = write_range(f, base, 0, hl)
        code = publish_temp(d, f, tmp, final, length, exact_len, do_fsync, ok)
        close(d)
        return code
    if given.shape[0]:
        sums[:] = given
    else:
        hash_spans(base + hl, spans, 0, spans.shape[0], sums)
    fill_header(frame, file_off, names, key_at, blank, key_off, token_off, sum_off, sum_offsets, token_count, sums)
    code = write_file(d, tmp, final, file_flags, mode, base, length, exact_len, do_fsync)
    close(d)
    return code

pages_t = t.Array(u8, 2, "C", readonly=True)
stats_t = t.Array(i64, 2, "C")
codes_t = t.Array(i64, 1, "C")

@numba.njit(i64(i64, pages_t, i64, i64, i64, i64, i64, frame_t, rows, rows, rows, bytes_ro, rows, vec, i64, i64,
                i64, sums_t, sums_t, stats_t, codes_t), nogil=True, cache=_CACHE)
def verify_pages(dir_fd: int, names: Any, file_at: int, key_at: int, dir_flags: int, file_flags: int, size: int,
                 frame: Any, pieces: Any, spans: Any, gaps: Any, blank: Any, const_ranges: Any, sum_offsets: Any,
                 key_off: int, sum_off: int, token_off: int, out: Any, header_sums: Any, stats: Any,
                 codes: Any) -> int:
    # One load_page per row of ``names`` into the same frame; a good page's token count
    # goes to stats[i, VERIFY_TOKENS] (the frame is overwritten by the next page).
    good = 0
    end = pieces[pieces.shape[0] - 1, 1] if pieces.shape[0] else 0
    for i in range(names.shape[0]):
        got = load_page(dir_fd, names[i], file_at, key_at, dir_flags, file_flags, size, 0, 0, frame, 0, pieces,
                        spans, gaps, blank, const_ranges, sum_offsets, key_off, sum_off, out, header_sums,
                        stats[i])
        if got == end:
            v = 0
            for b in range(4):
                v |= numba.int64(frame[token_off + b]) << (8 * b)
            stats[i, verify_tokens] = v
            codes[i] = 0
            good += 1
        else:
            codes[i] = got if got < 0 else load_read_failed
    return good

offs_t = t.Array(i64, 1, "C", readonly=True)
outs_t = t.Array(t.uint64, 2, "C")

@numba.njit(i64(i64, pages_t, i64, i64, i64, i64, i64, i64, i64, frame_t, offs_t, rows, rows, rows, bytes_ro,
                rows, vec, i64, i64, outs_t, outs_t, stats_t, codes_t), nogil=True, cache=_CACHE)
def load_pages(rank_fd: int, names: Any, file_at: int, key_at: int, dir_flags: int, file_flags: int, size: int,
               check_cache: int, direct_len: int, slab: Any, file_offs: Any, pieces: Any, spans: Any, gaps: Any,
               blank: Any, const_ranges: Any, sum_offsets: Any, key_off: int, sum_off: int, outs: Any,
               header_sums: Any, scratch: Any, codes: Any) -> int:
    # One load_page per row of ``names``, each into the slab at its own offset; the raw
    # return value of each goes to codes[i] (the wrapper reads it as load_page's).
    for i in range(names.shape[0]):
        codes[i] = load_page(rank_fd, names[i], file_at, key_at, dir_flags, file_flags, size, check_cache,
                             direct_len, slab, file_offs[i], pieces, spans, gaps, blank, const_ranges,
                             sum_offsets, key_off, sum_off, outs[i], header_sums[i], scratch[i])
    return names.shape[0]


given_t = t.Array(t.uint64, 2, "C", readonly=True)

@numba.njit(i64(i64, pages_t, i64, i64, i64, i64, i64, i64, frame_t, offs_t, i64, i64, i64, i64, rows, rows,
                bytes_ro, vec, i64, i64, i64, vec, given_t, outs_t, stats_t, codes_t), nogil=True, cache=_CACHE)
def store_pages(rank_fd: int, names: Any, tmp_at: int, final_at: int, key_at: int, dir_flags: int, file_flags: int,
                mode: int, slab: Any, file_offs: Any, length: int, exact_len: int, do_fsync: int, piece: int, spans: Any,
                gaps: Any, blank: Any, sum_offsets: Any, key_off: int, token_off: int, sum_off: int,
                token_counts: Any, given: Any, sums: Any, scratch: Any, codes: Any) -> int:
    # One store_page per row of ``names``, each from the slab at its own offset (``given``:
    # n x 0 when the kernel hashes); store_page's return value of each goes to codes[i].
    for i in range(names.shape[0]):
        codes[i] = store_page(rank_fd, names[i], tmp_at, final_at, key_at, dir_flags, file_flags, mode, slab,
                              file_offs[i], length, exact_len, do_fsync, piece, spans, gaps, blank, sum_offsets, key_off,
                              token_off, sum_off, token_counts[i], given[i], sums[i], scratch[i])
    return names.shape[0]


# ----------------------------------------------------------------- the native I/O loop (rootstore/lane.py)
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


clock_gettime = _c_function("clock_gettime", "i32", ("i32", "i64"))
nanosleep = _c_function("nanosleep", "i32", ("i64", "i64"))

SYS_FUTEX, FUTEX_WAIT_PRIVATE, FUTEX_WAKE_PRIVATE = 202, 128, 129

ctl_t = t.Array(i64, 1, "C")
words_t = t.Array(t.int32, 1, "C")
desc_t = t.Array(i64, 2, "C")
names_t = t.Array(u8, 2, "C")
u64_2d = t.Array(t.uint64, 2, "C")
u64_1d = t.Array(t.uint64, 1, "C")
timespec_t = t.Array(i64, 1, "C", readonly=True)
_LANE_CACHE = _CACHE and LANE_FAULTS == 0  # a fault build never meets the production cache


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
