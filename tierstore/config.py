"""One validated configuration object for tierstore.

Built from vLLM's ``kv_connector_extra_config`` dict or from CLI options with
``TierStoreConfig.from_dict``. Unknown keys and bad values raise ``ConfigError`` naming the
setting and what to do; nothing is silently ignored or coerced: booleans are JSON true/false,
integers never true/false, floats or strings, byte sizes an integer or a size string as
``tierstore gc --max-bytes`` reads it ("500G"; a float is refused), durations are seconds
(``*_s``, a finite number), and ``local_root`` is a directory apart from ``root``. The
millisecond settings of 0.3 (``deadline_ms``, ``shared_deadline_ms``) are refused with an error
naming their seconds setting (``deadline_s``, ``shared_deadline_s``) and the value to write. Defaults are
documented here, in README.md (one line each) and docs/SETTINGS.md (forms, units, rationale).
Immutable once built; safe to share between threads.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from tierstore.errors import ConfigError
from tierstore.fs.display import parse_size

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

# The kinds of setting, each with one rule (``validate``). tests/test_config.py checks that every
# field is in exactly one of them.
_BOOLS = ("fsync", "shared_group_access", "trust_shared_root", "require_cache_salt")  # JSON true/false only
# Integers (never true/false, a float or a string): name -> (least, most or None, what the number
# counts, what unset (None) means; "" where it must be set).
_INTEGERS: dict[str, tuple[int, int | None, str, str]] = {
    "io_threads": (1, None, "I/O threads per KV-cache group and tier", ""),
    "queue_depth": (1, None, "jobs in each of the load and store queues", ""),
    "io_batch_pages": (1, None, "pages one I/O thread takes at once", ""),
    "zstd_level": (1, 22, "the zstd compression level", ""),
    "chunk_tokens": (1, None, "tokens per stored page", "leave it unset for the engine's block size"),
    "staging_slots": (2, None, "page buffers per KV-cache group",
                      "leave it unset to size the pool from max_num_batched_tokens"),
    "transfer_scratch_mib": (1, None, "MiB of GPU memory per KV-cache group for pages in flight",
                             "leave it unset to size it from io_threads"),
}
# Byte sizes: name -> (least, what 0 or None means). An integer or a size string, read by
# ``fs.display.parse_size``, which ``tierstore gc --max-bytes`` uses too: one rule for both.
_BYTE_SIZES: dict[str, tuple[int, str]] = {
    "local_max_bytes": (1, "leave it unset for no cap"),
    "max_bytes": (1, "leave it unset for no cap"),
    "host_bytes": (0, "the number 0 turns the host-memory tier off"),
}
_SIZE_FORMS = ('an integer number of bytes (e.g. 536870912000) or a string as "tierstore gc --max-bytes" '
               'takes it: a number with an optional binary unit K, M, G or T (2^10 .. 2^40) and an optional '
               '"B" or "iB", e.g. "512M", "500G", "500GiB", "1.5T"')
_SECONDS = ("gc_interval_s", "shared_touch_interval_s", "index_refresh_s", "flush_timeout_s", "deadline_s",
            "shared_deadline_s", "object_deadline_s")
# Seconds that must be above 0: a deadline of 0 would fail every operation.
_POSITIVE_SECONDS = ("deadline_s", "shared_deadline_s", "object_deadline_s")
# Settings of 0.3 that were removed: old name -> (the setting to write, old units per second).
# Durations were milliseconds in these two and seconds everywhere else: one convention now.
_REMOVED: dict[str, tuple[str, int]] = {
    "deadline_ms": ("deadline_s", 1000),
    "shared_deadline_ms": ("shared_deadline_s", 1000),
}
_PATHS = ("root", "local_root", "mac_key_file", "encryption_key_file")
_CHOICES = {"codec": _CODECS, "odirect": _ODIRECT, "io_loop": _IO_LOOPS}
_NAMES = ("model_id", "namespace_tag")  # free-form strings
_URLS = ("object_url",)  # s3://BUCKET[/PREFIX]
_PATH_MAPS = ("tenant_key_files",)  # a name (cache_salt) -> a path, each


def _why_not(v: object) -> str:
    """Why a JSON value is not the number asked for, for a message."""
    if isinstance(v, bool):
        return " (true/false is not a number)"
    if isinstance(v, float):
        return " (a number with a fraction or an exponent is a float: write the whole number)"
    if isinstance(v, str):
        return " (a string: write the number without quotes)"
    return f" (of type {type(v).__name__})"


def _byte_size(name: str, v: object) -> int | None:
    """The value of a byte-size setting: None where allowed, an integer as is, a size string
    parsed as ``tierstore gc --max-bytes`` parses it; anything else refused naming the setting."""
    least, unset = _BYTE_SIZES[name]
    if v is None and least > 0:
        return None
    if isinstance(v, str):
        try:
            return parse_size(v)
        except ValueError:
            raise ConfigError(f'setting "{name}" must be {_SIZE_FORMS}; got {v!r}, not a byte count >= 1 '
                              f"in those forms ({unset})") from None
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError(f'setting "{name}" must be {_SIZE_FORMS}; got {v!r}{_why_not(v)}')
    if v < least:
        raise ConfigError(f'setting "{name}" must be at least {least} byte{"s" if least != 1 else ""} '
                          f"({unset}), got {v}")
    return v


def _refuse_removed(values: dict[str, Any]) -> None:
    """Raise ``ConfigError`` for a removed millisecond setting (``_REMOVED``), naming the
    seconds setting to write instead and, for a usable old value, the value in seconds."""
    for old, (new, per_second) in _REMOVED.items():
        if old in values:
            v = values[old]
            usable = not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) and v > 0
            example = f'"{new}": {v / per_second:g}' if usable else f'"{new}": 5'
            raise ConfigError(f'setting "{old}" (milliseconds) was removed in 0.4: write "{new}" in seconds '
                              f"instead, e.g. {example}")


def _read_sizes(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` with each byte-size setting given as a string replaced by its byte count."""
    return {k: _byte_size(k, v) if k in _BYTE_SIZES and isinstance(v, str) else v for k, v in values.items()}


def _resolved(path: str | os.PathLike[str]) -> Path:
    """The absolute, normalised path, computed without touching the file system: ``root`` may be
    a hung NFS mount, and validating a config must not block on it (a symlink that makes two
    written paths one directory is not seen here)."""
    return Path(os.path.abspath(path))


def _tiers_overlap(root: str | os.PathLike[str], local_root: str | os.PathLike[str]) -> str | None:
    """Why ``local_root`` cannot be where it is relative to ``root``; None: the trees are apart."""
    r, loc = _resolved(root), _resolved(local_root)
    given = (os.fspath(local_root), os.fspath(root))
    where = (f'"local_root" {given[0]!r} and "root" {given[1]!r}' if given == (str(loc), str(r)) else
             f'"local_root" {given[0]!r} ({loc}) and "root" {given[1]!r} ({r})')
    nested = ("each tier's upkeep (the local tier's index scan, LRU eviction and temp sweep; gc, fsck and stats "
              'of "root") takes its whole tree as its own, so pages of one tier could be counted or deleted as '
              "the other's")
    if loc == r:
        why = ("are the same directory: the two tiers would share page files, so the local tier's LRU eviction "
               'would delete the shared root\'s pages and gc of "root" would count and evict the local tier\'s')
    elif loc.is_relative_to(r):
        why = (f'overlap, "local_root" inside "root": {nested}; and on a shared root the local tier and its '
               "sqlite index (local disk only) would be on the shared filesystem")
    elif r.is_relative_to(loc):
        why = f'overlap, "root" inside "local_root": {nested}'
    else:
        return None
    return (f'setting "local_root" must be a directory apart from "root" (neither inside the other): {where} '
            f'{why}. Point "local_root" at a directory of its own on a local disk, or unset it for one tier')


@dataclass(frozen=True)
class ObjectLocation:
    """Where an object tier's pages are: a bucket and a key prefix (setting ``object_url``,
    ``s3://BUCKET/PREFIX``). A page's key is ``PREFIX/`` + its path under a file root, so a file
    root copied into the bucket is a valid object tier and one decoder verifies both."""

    bucket: str
    prefix: str  # "" or a path without leading or trailing "/"

    @classmethod
    def parse(cls, url: object, setting: str = "object_url") -> ObjectLocation:
        """``s3://BUCKET[/PREFIX]``; anything else is a ConfigError naming ``setting``."""
        form = (f'setting "{setting}" must be "s3://BUCKET/PREFIX" (endpoint and credentials come from '
                "AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION, AWS_ALLOW_HTTP)")
        if not isinstance(url, str) or not url.startswith("s3://"):
            raise ConfigError(f"{form}, got {url!r}")
        bucket, _, prefix = url[len("s3://"):].partition("/")
        prefix = prefix.strip("/")
        if not bucket or "//" in prefix or any(p in (".", "..") for p in prefix.split("/")):
            raise ConfigError(f"{form}, got {url!r} (a bucket name, then path segments without . or ..)")
        return cls(bucket, prefix)

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    def key(self, relpath: str) -> str:
        """The object key of a path relative to a file root (``a/b`` -> ``PREFIX/a/b``)."""
        return f"{self.prefix}/{relpath}" if self.prefix else relpath


def is_object_url(target: object) -> bool:
    """Whether a CLI target or a setting names an object tier rather than a directory."""
    return isinstance(target, str) and target.startswith("s3://")


@dataclass(frozen=True)
class TierStoreConfig:
    # Where pages live. With only ``root`` set, tierstore is a single tier (local or shared);
    # None only with ``object_url`` (the bucket is then the durable tier behind the faster ones).
    root: str | None = None
    # Optional faster tiers in front of ``root`` (see tierstore/tiers).
    local_root: str | None = None
    local_max_bytes: int | None = None  # cap of the local tier; None = no cap
    host_bytes: int = 0  # host-memory tier; 0 = off
    max_bytes: int | None = None  # cap of ``root`` kept by gc; None = no cap
    gc_interval_s: float = 0.0  # background gc of ``root`` every N s (needs max_bytes); 0 = off
    shared_touch_interval_s: float = 60.0  # min seconds between LRU touches (utime) of one shared page
    # An S3 object tier behind the root: "s3://BUCKET/PREFIX"; endpoint and credentials from the
    # standard AWS_* environment variables (tierstore/objstore).
    object_url: str | None = None
    object_deadline_s: float = 10.0  # per request to the object tier (connect and read included)
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
    # Python (rootstore/lane.py); "python": every job on the Python I/O threads.
    io_loop: str = "native"
    fsync: bool = False  # fsync each page before publishing it
    odirect: str = "auto"  # "auto": probe, fall back to buffered I/O (logged); "on"/"off"
    deadline_s: float = 10.0  # per operation on a lone root (local or NFS) and on the local tier
    shared_deadline_s: float = 5.0  # per operation on root as the shared tier, and scheduler lookups
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
    # Encryption at rest (format/sealing.py): 32 random bytes, mode 0600. Page bodies are
    # AES-256-GCM, names are keyed hashes of the block hashes, the namespace is the key's own.
    encryption_key_file: str | None = None
    # Keys per tenant: vLLM cache_salt -> its own key file (same rules); a request's pages are
    # named and sealed with its salt's key. With any, a salt without a key is not cached.
    tenant_key_files: dict[str, str] | None = None
    require_cache_salt: bool = False  # requests without a cache_salt (or without its key) are not cached

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TierStoreConfig:
        known = {f.name: f for f in fields(cls)}
        _refuse_removed(d)
        unknown = sorted(set(d) - set(known))
        if unknown:
            raise ConfigError(
                f"unknown tierstore setting(s) {unknown}; known settings: {sorted(known)}"
            )
        if not d.get("root") and not d.get("object_url"):
            raise ConfigError(
                'tierstore needs a cache directory or a bucket: set "root" in kv_connector_extra_config '
                '(for example {"root": "/mnt/kvcache"}), or "object_url" (for example "s3://bucket/kv")'
            )
        cfg = cls(**_read_sizes(d))
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.root is None and self.object_url is None:
            raise ConfigError('tierstore needs a cache directory or a bucket: set "root" (for example '
                              '"/mnt/kvcache") or "object_url" (for example "s3://bucket/kv")')
        for name in ("root", "local_root"):
            v = getattr(self, name)
            unset_ok = name == "local_root" or self.object_url is not None
            if not (v is None and unset_ok) and not isinstance(v, (str, os.PathLike)):
                raise ConfigError(f'setting "{name}" must be a directory path (a string), got {v!r}')
        for name, choices in _CHOICES.items():
            if getattr(self, name) not in choices:
                raise ConfigError(f'setting "{name}" must be one of {choices}, got {getattr(self, name)!r}')
        for name in _BOOLS:
            v = getattr(self, name)
            if not isinstance(v, bool):
                raise ConfigError(f'setting "{name}" must be true or false (a JSON boolean, not a string or a '
                                  f"number), got {v!r}")
        for name, (least, most, what, unset) in _INTEGERS.items():
            v = getattr(self, name)
            if v is None and unset:
                continue
            why = _why_not(v) if isinstance(v, bool) or not isinstance(v, int) else ""
            if why or v < least or (most is not None and v > most):
                accepted = f"{least}..{most}" if most is not None else f">= {least}"
                raise ConfigError(f'setting "{name}" must be an integer {accepted} ({what}), got {v!r}{why}'
                                  f"{'; ' + unset if unset else ''}")
        for name in _BYTE_SIZES:
            v = getattr(self, name)
            if isinstance(v, str):  # from_dict and replace read size strings; the constructor does not
                raise ConfigError(f'setting "{name}" is the string {v!r}: build the config with '
                                  f"TierStoreConfig.from_dict or .replace, which read size strings, or pass "
                                  f"the byte count ({_SIZE_FORMS})")
            _byte_size(name, v)
        for name in _SECONDS:
            v = getattr(self, name)
            least = "> 0" if name in _POSITIVE_SECONDS else ">= 0"
            if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0
                    or (v == 0 and name in _POSITIVE_SECONDS)):
                raise ConfigError(f'setting "{name}" must be a finite number of seconds {least} (e.g. 5 or 0.5), '
                                  f"got {v!r}{_why_not(v) if isinstance(v, (bool, str)) else ''}")
        if self.local_max_bytes is not None and self.local_root is None:
            raise ConfigError('setting "local_max_bytes" needs "local_root" (the local tier\'s directory)')
        if self.local_root and self.root:
            overlap = _tiers_overlap(self.root, self.local_root)
            if overlap:
                raise ConfigError(overlap)
        if self.mac_key_file is not None and (not isinstance(self.mac_key_file, str) or not self.mac_key_file):
            raise ConfigError(f'setting "mac_key_file" must be the path of the fleet key file (at least 16 '
                              f"secret bytes, mode 0600), got {self.mac_key_file!r}; leave it unset for no MAC")
        if self.encryption_key_file is not None:
            if not isinstance(self.encryption_key_file, str) or not self.encryption_key_file:
                raise ConfigError('setting "encryption_key_file" must be the path of a file of 32 random bytes '
                                  f"(mode 0600), got {self.encryption_key_file!r}; leave it unset for plain pages")
            if self.codec != "none":
                raise ConfigError('setting "encryption_key_file" needs "codec": "none" (encrypted pages are not '
                                  f'compressed; KV bytes gain little from zstd), got "codec": {self.codec!r}')
        if self.tenant_key_files is not None:
            if not self.encryption_key_file:
                raise ConfigError('setting "tenant_key_files" needs "encryption_key_file" (the key of requests '
                                  "without a cache_salt)")
            if not isinstance(self.tenant_key_files, dict) or not all(
                    isinstance(k, str) and k and isinstance(v, str) and v for k, v in self.tenant_key_files.items()):
                raise ConfigError('setting "tenant_key_files" must map each cache_salt (a string) to the path of its '
                                  f"key file (32 random bytes, mode 0600), got {self.tenant_key_files!r}")
        if self.object_url is not None:
            ObjectLocation.parse(self.object_url)  # a ConfigError naming the setting
        if self.root is None and (self.gc_interval_s or self.max_bytes is not None):
            raise ConfigError('settings "max_bytes" and "gc_interval_s" cap "root", which is unset; cap the bucket '
                              'with "tierstore gc s3://..." instead, or set "root"')
        if self.gc_interval_s and self.max_bytes is None:
            raise ConfigError('setting "gc_interval_s" needs "max_bytes" (the cap that gc keeps "root" under)')

    @property
    def root_path(self) -> Path:
        if self.root is None:
            raise ConfigError('setting "root" is unset (only "object_url"): this needs a cache directory')
        return Path(self.root)

    def replace(self, **changes: Any) -> TierStoreConfig:
        """A validated copy with ``changes``; size strings are read and removed settings refused
        as ``from_dict`` does."""
        _refuse_removed(changes)
        cfg = dataclasses.replace(self, **_read_sizes(changes))
        cfg.validate()
        return cfg
