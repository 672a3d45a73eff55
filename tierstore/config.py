"""One validated configuration object for tierstore.

Built from vLLM's ``kv_connector_extra_config`` dict or from CLI options with
``TierStoreConfig.from_dict``. Unknown keys and bad values raise ``ConfigError`` naming the
setting and what to do; nothing is silently ignored. Defaults are documented here and in
README.md. Immutable once built; safe to share between threads.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from tierstore.errors import ConfigError

_CODECS = ("none", "zstd")

# The measured knee of one engine's I/O threads (docs/measurements/scaling.md, the thread sweeps):
# with the native lane, GB/s rises at every step up to 16 threads on the 16-core host, on the
# GPU and the CPU path, and falls at 32. Past twice max(knee, cores) threads only contend for
# the cores.
IO_THREADS_KNEE = 16
# The default's cap, below the knee: the vLLM adapter runs one engine per KV-cache group and
# tier, so a hybrid model's worker runs groups x tiers x io_threads I/O threads (4 groups and 2
# tiers: 64 at 8). A dense model on a host of 32+ cores gains from io_threads 16 (8 -> 16
# threads: +29-77% GB/s per case and direction in the final sweep, +2-50% in the first).
IO_THREADS_DEFAULT_CAP = 8


def _usable_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 4)


def default_io_threads(cpus: int | None = None) -> int:
    """The ``io_threads`` default: half the usable cores, at least 4, at most 8
    (``IO_THREADS_DEFAULT_CAP``)."""
    return max(4, min(IO_THREADS_DEFAULT_CAP, (cpus or _usable_cpus()) // 2))


def io_threads_advice(io_threads: int, cpus: int | None = None) -> str | None:
    """A warning when ``io_threads`` is far beyond the knee for this machine (None: fine)."""
    cpus = cpus or _usable_cpus()
    if io_threads > 2 * max(IO_THREADS_KNEE, cpus):
        return (f'setting "io_threads" is {io_threads}, more than twice max(the measured knee {IO_THREADS_KNEE}, '
                f"{cpus} cores): the extra threads only contend for the cores and throughput falls; "
                f"leave it unset for the default ({default_io_threads(cpus)})")
    return None
_ODIRECT = ("auto", "on", "off")
_IO_LOOPS = ("native", "python")


@dataclass(frozen=True)
class TierStoreConfig:
    # Where pages live. With only ``root`` set, tierstore is a single tier (local or shared).
    root: str
    # Optional faster tiers in front of ``root`` (see tierstore/tiers).
    local_root: str | None = None
    local_max_bytes: int | None = None  # cap of the local tier; None = no cap
    host_bytes: int = 0  # host-memory tier; 0 = off
    max_bytes: int | None = None  # cap of ``root`` kept by gc; None = no cap
    gc_interval_s: float = 0.0  # background gc of ``root`` every N s (needs max_bytes); 0 = off
    shared_touch_interval_s: float = 60.0  # min seconds between LRU touches (utime) of one shared page
    # Page encoding.
    codec: str = "none"  # "none" or "zstd"
    zstd_level: int = 1
    # I/O engine.
    io_threads: int = field(default_factory=default_io_threads)  # see default_io_threads
    queue_depth: int = 256  # bounded depth of each of the load and store queues
    # Most queued pages one I/O thread takes at once (a share of the queue: queued / io_threads),
    # loads read in one GIL-free call; 1 = one page per wake-up (docs/measurements/scaling.md).
    io_batch_pages: int = 8
    # "native": the common page loads and stores run on compiled threads that never return to
    # Python (native_lane.py); "python": every job on the Python I/O threads.
    io_loop: str = "native"
    fsync: bool = False  # fsync each page before publishing it
    odirect: str = "auto"  # "auto": probe, fall back to buffered I/O (logged); "on"/"off"
    deadline_ms: int = 10_000  # per operation on a lone root (local or NFS) and on the local tier
    shared_deadline_ms: int = 5_000  # per operation on root as the shared tier, and scheduler lookups
    index_refresh_s: float = 30.0  # re-list the tiers' directories for the scheduler's page index; 0 = never
    flush_timeout_s: float = 30.0  # how long shutdown waits for queued stores
    # Identity.
    model_id: str | None = None  # override the model name recorded in the namespace
    namespace_tag: str | None = None  # extra user-chosen identity (e.g. a deployment)
    # vLLM adapter.
    chunk_tokens: int | None = None  # tokens per stored page; None = the engine's block size
    # Page buffers per KV-cache group; None = sized from max_num_batched_tokens (two steps' worth).
    staging_slots: int | None = None
    # Device memory per KV-cache group for pages between the KV cache and the staging slots
    # (CUDA only; outside vLLM's KV budget, so keep it small). At least one page is always kept.
    # None: 64 MiB, raised to hold 2 x io_threads pages, at most 512 MiB (kernels.scratch.transfer_scratch_pages).
    transfer_scratch_mib: int | None = None
    # A root others can write to (issue 17; docs/DESIGN.md, threat model).
    shared_group_access: bool = False  # create files 0660 and directories 2770 (a fleet's service group)
    trust_shared_root: bool = False  # accept a root that other users can write to (trust.py)
    mac_key_file: str | None = None  # fleet key: every page carries a MAC; pages without a valid one are refused

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TierStoreConfig:
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(d) - set(known))
        if unknown:
            raise ConfigError(
                f"unknown tierstore setting(s) {unknown}; known settings: {sorted(known)}"
            )
        if not d.get("root"):
            raise ConfigError(
                'tierstore needs a cache directory: set "root" in kv_connector_extra_config '
                '(for example {"root": "/mnt/kvcache"})'
            )
        cfg = cls(**d)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.codec not in _CODECS:
            raise ConfigError(f'setting "codec" must be one of {_CODECS}, got {self.codec!r}')
        if self.io_loop not in _IO_LOOPS:
            raise ConfigError(f'setting "io_loop" must be one of {_IO_LOOPS}, got {self.io_loop!r}')
        if self.odirect not in _ODIRECT:
            raise ConfigError(f'setting "odirect" must be one of {_ODIRECT}, got {self.odirect!r}')
        for name in ("io_threads", "queue_depth", "io_batch_pages", "deadline_ms", "shared_deadline_ms"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ConfigError(f'setting "{name}" must be a positive integer, got {v!r}')
        for name in ("local_max_bytes", "max_bytes"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v <= 0):
                raise ConfigError(f'setting "{name}" must be a positive number of bytes, got {v!r}')
        if not isinstance(self.host_bytes, int) or self.host_bytes < 0:
            raise ConfigError(f'setting "host_bytes" must be >= 0, got {self.host_bytes!r}')
        if self.local_max_bytes is not None and self.local_root is None:
            raise ConfigError('setting "local_max_bytes" needs "local_root" (the local tier\'s directory)')
        if not 1 <= self.zstd_level <= 22:
            raise ConfigError(f'setting "zstd_level" must be 1..22, got {self.zstd_level}')
        if self.chunk_tokens is not None and self.chunk_tokens <= 0:
            raise ConfigError(f'setting "chunk_tokens" must be positive, got {self.chunk_tokens}')
        if self.staging_slots is not None and (
            not isinstance(self.staging_slots, int) or isinstance(self.staging_slots, bool) or self.staging_slots < 2
        ):
            raise ConfigError(
                f'setting "staging_slots" must be an integer >= 2 (page buffers per KV-cache group), '
                f"got {self.staging_slots!r}; leave it unset to size the pool from max_num_batched_tokens"
            )
        if self.transfer_scratch_mib is not None and (
                not isinstance(self.transfer_scratch_mib, int) or isinstance(self.transfer_scratch_mib, bool)
                or self.transfer_scratch_mib < 1):
            raise ConfigError(
                f'setting "transfer_scratch_mib" must be an integer >= 1 (MiB of GPU memory per KV-cache group '
                f"for pages in flight), got {self.transfer_scratch_mib!r}; leave it unset to size it from "
                f"io_threads")
        for name in ("gc_interval_s", "shared_touch_interval_s", "flush_timeout_s", "index_refresh_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or v < 0:
                raise ConfigError(f'setting "{name}" must be a number of seconds >= 0, got {v!r}')
        for name in ("shared_group_access", "trust_shared_root"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f'setting "{name}" must be true or false, got {getattr(self, name)!r}')
        if self.mac_key_file is not None and (not isinstance(self.mac_key_file, str) or not self.mac_key_file):
            raise ConfigError(f'setting "mac_key_file" must be the path of the fleet key file (at least 16 '
                              f"secret bytes, mode 0600), got {self.mac_key_file!r}; leave it unset for no MAC")
        if self.gc_interval_s and self.max_bytes is None:
            raise ConfigError('setting "gc_interval_s" needs "max_bytes" (the cap that gc keeps "root" under)')

    @property
    def root_path(self) -> Path:
        return Path(self.root)

    def replace(self, **changes: Any) -> TierStoreConfig:
        cfg = dataclasses.replace(self, **changes)
        cfg.validate()
        return cfg
