"""The compiled page file kernels of ``native`` and ``native_page``: section hashing, page file
reads and writes, ``load_page``/``store_page`` and their batches, and the C functions they call,
cached on disk (numba ``cache=_CACHE``).

Imported only by ``loader._build`` and by ``lane_kernels`` (it imports numba; the package works
without it). Every
function is compiled for an explicit signature at import, or loaded from numba's cache: the
``__pycache__`` beside this file when it is writable, else numba's per-user cache directory
(``NUMBA_CACHE_DIR`` overrides; where none is writable ``loader._build`` imports this module
again with caching off). Why cached: compiling took ~6 s of CPU in every process that
loads a page (each vLLM worker), mostly holding the GIL while the worker's first steps ran; at
TP=2 on the 2-core machine an engine's first step waited ~9 s, and an engine start took 37.7 s
against 26.6 s with the native path off (docs/DESIGN.md §6, the page store on one root). Loading the cache
takes a fraction of a second.

What makes caching possible: C functions are called by symbol through ``c_function``'s
intrinsics (resolved by LLVM when the code is loaded), not through ctypes pointers, which numba
cannot cache. XXH3 is the loaded xxhash extension's own, ``XXH3_64bits_dispatch`` where it is
exported, else ``XXH3_64bits`` (``_xxh3_symbol``). ``loader._build`` makes its symbols visible with ``llvmlite.binding.load_library_permanently`` first, and checks the
compiled hash against ``xxhash.xxh3_64_intdigest`` before any use. The declarations match the
ctypes prototypes used before: ``openat`` always gets its mode argument (0 unless creating).
Stores publish create-only (``place``, the Python path's ``rootstore.publish.place``):
``renameat2`` with ``RENAME_NOREPLACE`` (glibc 2.28 or later: without that symbol the kernels
do not load and the Python path serves), or ``linkat`` + ``unlinkat`` once the file system
refuses the flag (the scratch row's ``PUBLISH_LINK``, in and out); errno is read through
``__errno_location`` (``peek_i32``).

numba's cache is keyed on this file (its path, size and time stamp) and the CPU. The constants
compiled in come from ``native/abi.py`` alone, and ``ABI_DIGEST`` below ties that module to this
file: a changed constant without a new digest here stops the import (the Python path serves).
The native lane's loop (``lane_kernels``) compiles this file's ``load_page`` and ``store_page``
into its own cached kernels, so it records a digest of this file
(``lane_kernels.PAGE_KERNELS_DIGEST``): an edit here comes with a new digest there.

Threading: the kernels hold no GIL (``nogil=True``) and touch only the buffers they are given.
"""

from __future__ import annotations

import errno
import os
from typing import Any

import numba
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from tierstore.native import abi as native_abi
from tierstore.native.abi import (
    BAD_SECTION,
    LOAD_BAD_GAP,
    LOAD_BAD_HEADER,
    LOAD_BAD_SUM,
    LOAD_COLD,
    LOAD_NOT_PLAIN,
    LOAD_OPEN_FAILED,
    LOAD_READ_FAILED,
    PUBLISH_LINK,
    READ_ODIRECT,
    STORE_EXISTS,
    STORE_FAILED,
    STORE_NO_DIR,
    VERIFY_TOKENS,
)

# native_abi.digest() of the constants compiled in below. numba keys its cache on this file
# alone, so a change to native_abi must change this line too (which renews the cache); until it
# does, the kernels refuse to load and the Python path serves.
ABI_DIGEST = "55e39b5816cc474e"
if native_abi.digest() != ABI_DIGEST:
    raise RuntimeError(f"tierstore/native/abi.py changed (digest {native_abi.digest()}) since the native kernels were "
                       f"last built against it ({ABI_DIGEST}): set ABI_DIGEST in tierstore/native/page_kernels.py to the "
                       "new digest, after checking every kernel that uses a changed constant")

_CACHE = native_abi.cache_kernels  # False: no writable cache directory (loader._build); compile only
_LL = {"i32": ir.IntType(32), "i64": ir.IntType(64)}


def _fit(builder: Any, value: Any, to: Any, signed: bool) -> Any:
    """``value`` (an LLVM integer) as the integer type ``to`` (truncated or extended)."""
    if value.type.width > to.width:
        return builder.trunc(value, to)
    if value.type.width < to.width:
        return builder.sext(value, to) if signed else builder.zext(value, to)
    return value


def c_function(name: str, ret: str, params: tuple[str, ...], unsigned: bool = False) -> Any:
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
xxh3 = c_function(XXH3_SYMBOL, "i64", ("i64", "i64"), unsigned=True)
openat = c_function("openat", "i32", ("i32", "i64", "i32", "i32"))  # with its mode, as creating
close = c_function("close", "i32", ("i32",))
fstat = c_function("fstat", "i32", ("i32", "i64"))
fstatat = c_function("fstatat", "i32", ("i32", "i64", "i64", "i32"))
pread = c_function("pread", "i64", ("i32", "i64", "i64", "i64"))
pwrite = c_function("pwrite", "i64", ("i32", "i64", "i64", "i64"))
fsync = c_function("fsync", "i32", ("i32",))
ftruncate = c_function("ftruncate", "i32", ("i32", "i64"))
renameat2 = c_function("renameat2", "i32", ("i32", "i64", "i32", "i64", "i32"))  # glibc 2.28+
linkat = c_function("linkat", "i32", ("i32", "i64", "i32", "i64", "i32"))
unlinkat = c_function("unlinkat", "i32", ("i32", "i64", "i32"))
errno_location = c_function("__errno_location", "i64", ())  # this thread's errno: its address
fcntl = c_function("fcntl", "i32", ("i32", "i32", "i64"))
syscall = c_function("syscall", "i64", ("i64", "i64", "i64", "i64", "i64"))


@intrinsic
def peek_i32(typingctx: Any, addr: Any) -> Any:
    """The C int at the address ``addr`` (an integer), as an int64: errno, at ``errno_location()``."""
    if not isinstance(addr, types.Integer):
        return None

    def codegen(context: Any, builder: Any, signature: Any, llargs: Any) -> Any:
        ptr = builder.inttoptr(_fit(builder, llargs[0], _LL["i64"], False), _LL["i32"].as_pointer())
        return builder.sext(builder.load(ptr), _LL["i64"])

    return types.int64(addr), codegen


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

row_t = numba.types.Array(numba.types.int64, 1, "C")
rename_noreplace, at_symlink_nofollow = 1, 0x100  # linux/fs.h, fcntl.h
e_exist, e_inval, e_nosys, e_opnotsupp = errno.EEXIST, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP

@numba.njit(i64(i64, i64, i64, row_t), nogil=True, cache=_CACHE)
def place(d: int, tmp: int, final: int, scratch: Any) -> int:
    # The closed temp gets the final name unless an entry has it (create-only, as
    # rootstore.publish.place): renameat2 RENAME_NOREPLACE, or link + unlink of the temp where
    # scratch[PUBLISH_LINK] says the file system refuses that flag (set here at the first
    # refusal: ENOSYS, EINVAL (NFS), EOPNOTSUPP). 0 placed (the temp name gone), STORE_EXISTS
    # an entry has the name, STORE_FAILED; the temp stays for the caller on either.
    if scratch[PUBLISH_LINK] == 0:
        if renameat2(d, tmp, d, final, rename_noreplace) == 0:
            return 0
        err = peek_i32(errno_location())
        if err == e_exist:
            return STORE_EXISTS
        if err != e_inval and err != e_nosys and err != e_opnotsupp:
            return STORE_FAILED
        scratch[PUBLISH_LINK] = 1
    if linkat(d, tmp, d, final, 0) != 0:
        if peek_i32(errno_location()) != e_exist:
            return STORE_FAILED
        # NFS: a LINK the server did but answered twice says EEXIST; the temp's second link
        # says the final name is ours.
        if fstatat(d, tmp, scratch.ctypes.data, at_symlink_nofollow) != 0 or scratch[2] < 2:
            return STORE_EXISTS
    unlinkat(d, tmp, 0)  # at once: until then the page has two links, and loads refuse it
    return 0

@numba.njit(i64(i64, i64, i64, i64, i64, i64, i64, numba.types.boolean, row_t), nogil=True, cache=_CACHE)
def publish_temp(d: int, f: int, tmp: int, final: int, length: int, exact_len: int, do_fsync: int,
                 ok: bool, scratch: Any) -> int:
    # The written temp ``f``: cut the O_DIRECT padding, fsync if asked, close, give it the
    # final name unless an entry has it (place); on anything but 0 (or ``ok`` False) the temp
    # is removed, the final name untouched.
    if ok and exact_len < length and ftruncate(f, exact_len) != 0:
        ok = False
    if ok and do_fsync != 0 and fsync(f) != 0:
        ok = False
    if close(f) != 0:
        ok = False
    code = place(d, tmp, final, scratch) if ok else STORE_FAILED
    if code != 0:
        unlinkat(d, tmp, 0)
    return code

@numba.njit(i64(i64, i64, i64, i64, i64, i64, i64, i64, i64, row_t), nogil=True, cache=_CACHE)
def write_file(d: int, tmp: int, final: int, file_flags: int, mode: int, buf: int, length: int, exact_len: int,
               do_fsync: int, scratch: Any) -> int:
    # In the directory fd ``d``: create the temp (O_EXCL), write, publish (publish_temp).
    # ``tmp``/``final``: addresses of NUL-terminated names.
    f = openat(d, tmp, file_flags, mode)
    if f < 0:
        return STORE_FAILED
    return publish_temp(d, f, tmp, final, length, exact_len, do_fsync, write_range(f, buf, 0, length), scratch)


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
        code = publish_temp(d, f, tmp, final, length, exact_len, do_fsync, ok, scratch)
        close(d)
        return code
    if given.shape[0]:
        sums[:] = given
    else:
        hash_spans(base + hl, spans, 0, spans.shape[0], sums)
    fill_header(frame, file_off, names, key_at, blank, key_off, token_off, sum_off, sum_offsets, token_count, sums)
    code = write_file(d, tmp, final, file_flags, mode, base, length, exact_len, do_fsync, scratch)
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
    # n x 0 when the kernel hashes); store_page's return value of each goes to codes[i]. A
    # refusal of renameat2's flag (scratch[i, PUBLISH_LINK]) holds for the rest of the batch.
    for i in range(names.shape[0]):
        codes[i] = store_page(rank_fd, names[i], tmp_at, final_at, key_at, dir_flags, file_flags, mode, slab,
                              file_offs[i], length, exact_len, do_fsync, piece, spans, gaps, blank, sum_offsets, key_off,
                              token_off, sum_off, token_counts[i], given[i], sums[i], scratch[i])
        if scratch[i, PUBLISH_LINK] != 0 and i + 1 < names.shape[0]:
            scratch[i + 1, PUBLISH_LINK] = 1
    return names.shape[0]
