"""The numbers the compiled kernels are built with: result codes, scratch slots, the native
lane's shared-array layout and its fault-injection points. A leaf: it imports nothing.

Contract: ``native/page_kernels.py`` and ``native/lane_kernels.py`` compile these values into
machine code that numba caches on disk, keyed on each file alone. So
``native.page_kernels.ABI_DIGEST`` records ``digest()`` of this module, and the kernels refuse
to load (the Python path serves, ``native.failure()`` says why) when the two differ: a change here must come with a new ``ABI_DIGEST`` there, and that
edit renews numba's cache (of lane_kernels.py too, through its ``PAGE_KERNELS_DIGEST``).
``tests/native/test_native_lane_races.py`` checks both.

Threading: constants, and one flag (``cache_kernels``) that ``loader`` sets before it imports
the kernels.
"""

from __future__ import annotations

import hashlib

# ----------------------------------------------------------------- page kernels' results
# load_page's outcomes other than "read this many bytes" (the caller then takes the Python
# path, which redoes the load and names what went wrong).
LOAD_OPEN_FAILED, LOAD_NOT_PLAIN, LOAD_COLD, LOAD_READ_FAILED = -2, -3, -4, -5
# ... and those where the file was read and identified (the caller names the damage).
LOAD_BAD_HEADER, LOAD_BAD_SUM, LOAD_BAD_GAP = -6, -7, -8
# store_page: 0 done; STORE_EXISTS the final name exists (stored), found before writing or by
# the create-only publish (renameat2 RENAME_NOREPLACE or link(2): EEXIST, the temp removed);
# the others hand the store to the Python path, which redoes it and names the error.
STORE_EXISTS, STORE_NO_DIR, STORE_FAILED = 1, -2, -3

# A kernel's per-page scratch row (int64): [0:18] struct stat (x86-64), [18:20] cachestat
# range, [20:25] cachestat out, then these.
SCRATCH_LEN = 32
BAD_SECTION = 25  # the first section whose checksum differs
READ_ODIRECT = 26  # 1 when this load read the file with O_DIRECT (reset by every load)
VERIFY_TOKENS = 27  # verify_pages: a good page's token count
# store_page, in and out: 1 publish with link(2) + unlink(2) (this root's file system refuses
# renameat2's RENAME_NOREPLACE: rootstore.publish.CreateOnly); a store that meets the refusal
# sets it. Loads leave it alone, so a lane entry's row keeps it.
PUBLISH_LINK = 28

# ----------------------------------------------------------------- the native lane's arrays
CTL_STOP, CTL_SLEEPERS, CTL_DONE_WAITER = 0, 1, 2
CTL_HEAD, CTL_TAIL = 4, 5  # + 2 * queue (0 loads, 1 stores)
CTL_LEN = 8
WORD_JOBS, WORD_DONE = 0, 1
ENTRY_FREE, ENTRY_READY, ENTRY_RUNNING, ENTRY_DONE = 0, 1, 2, 3
F_OP, F_OFF, F_ARG, F_FLAG, F_DIRECT_LEN, F_CODE, F_T0, F_T1, F_RANK_FD, F_DEADLINE, F_GEN = range(11)
FIELDS = 11
OP_LOAD, OP_STORE = 0, 1
LANE_EXPIRED = -100  # lane_serve: the job was past its deadline when a thread took it
MAX_BYPASS = 8  # loads taken past waiting stores before one is served (ioqueue.QueuePolicy's default)
# The latest deadline a lane entry records (ns on CLOCK_MONOTONIC, ~146 years): a larger or
# infinite deadline is this one.
DEADLINE_NS_MAX = 1 << 62

# ----------------------------------------------------------------- fault injection (tests)
# Points where a lane thread pauses in a kernel built with TIERSTORE_LANE_FAULTS set
# (native.lane_kernels.LANE_FAULTS); the faults array holds FAULT_FIELDS per point: pause every
# Nth pass (0: never), for this many ns, and a pass counter.
FAULT_CLAIM = 0  # inside claim: between reading the ring cell and taking it (the CAS of head)
FAULT_BEFORE_RUNNING = 1  # between the claim and the RUNNING mark
FAULT_BEFORE_IO = 2  # after the RUNNING mark, before the job's first system call
FAULT_BEFORE_DONE = 3  # after the job's I/O, before the DONE mark
FAULT_POINTS = 4
FAULT_EVERY, FAULT_PAUSE_NS, FAULT_COUNT = 0, 1, 2
FAULT_FIELDS = 3


# False when numba found no writable cache directory: ``loader`` then imports the kernels again
# with caching off (state, not a constant: lower case, outside the digest).
cache_kernels = True


def digest() -> str:
    """A digest of every upper-case constant here (``native.page_kernels.ABI_DIGEST`` keeps the one
    it was built against)."""
    items = sorted((k, v) for k, v in globals().items() if k.isupper() and isinstance(v, int))
    return hashlib.sha256(repr(items).encode()).hexdigest()[:16]
