"""Namespace identity: which pages may serve which engine.

A ``Namespace`` names everything that changes the meaning of KV bytes: model id and revision,
dtype, each KV-cache group (kind, block size, tokens per chunk, layer names, page layout),
the canonical layout id, the block-hash algorithm (and whether it is stable across
processes), the parallel layout and the page format version. Its digest (xxh3-128 over a
canonical JSON encoding) is the directory name under the root and is written into every
page header; a page from another namespace is never served.

``manifest.json`` in the namespace directory holds the same data for humans and for
``tierstore stats``/``ls``/``fsck`` (which need no vLLM). Manifests are published atomically
(temp + rename); an existing manifest with the same digest is left alone.

Threading: values are immutable; ``write_manifest`` is safe to call from several processes
and nodes at once (the content is the same, the publish is atomic).
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import xxhash

from tierstore.errors import ConfigError
from tierstore.format.header import (
    FORMAT_VERSION,
    Codec,
    GroupKind,
    PageMeta,
    SectionEntry,
    encode_header,
)
from tierstore.format.page_layout import PageLayout, SectionSpec
from tierstore.fs import safefs
from tierstore.fs.mapper import host_tag

MANIFEST_NAME = "manifest.json"
# Hash algorithms whose values vLLM derives identically in every process by default.
STABLE_HASH_ALGOS = frozenset({"sha256", "sha256_cbor", "sha256_cbor_64bit"})


@dataclass(frozen=True)
class GroupSpec:
    """One KV-cache group as stored: every page of the group has ``layout``."""

    kind: GroupKind
    block_size: int  # tokens per vLLM (scheduler) block of this group
    tokens_per_chunk: int  # tokens per stored page
    layer_names: tuple[str, ...]
    layout: PageLayout
    sliding_window: int | None = None  # tokens, for SLIDING_WINDOW groups

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", GroupKind(self.kind))
        object.__setattr__(self, "layer_names", tuple(self.layer_names))
        if self.block_size <= 0 or self.tokens_per_chunk <= 0:
            raise ConfigError("block_size and tokens_per_chunk must be positive")
        if self.tokens_per_chunk % self.block_size:
            raise ConfigError(
                f"tokens_per_chunk ({self.tokens_per_chunk}) must be a multiple of the group's "
                f"block size ({self.block_size})"
            )

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind.name.lower(),
            "block_size": self.block_size,
            "tokens_per_chunk": self.tokens_per_chunk,
            "sliding_window": self.sliding_window,
            "layer_names": list(self.layer_names),
            "sections": [[s.name, s.dtype, list(s.shape)] for s in self.layout.sections],
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> GroupSpec:
        layout = PageLayout(tuple(SectionSpec(n, t, tuple(sh)) for n, t, sh in d["sections"]))
        return cls(
            kind=GroupKind[d["kind"].upper()],
            block_size=int(d["block_size"]),
            tokens_per_chunk=int(d["tokens_per_chunk"]),
            layer_names=tuple(d["layer_names"]),
            layout=layout,
            sliding_window=d.get("sliding_window"),
        )


@dataclass(frozen=True)
class ParallelLayout:
    """Sizes of the parallel layout; each file records its own rank and head slice."""

    tp_size: int = 1
    pp_size: int = 1
    dcp_size: int = 1
    pcp_size: int = 1

    def to_json(self) -> dict[str, int]:
        return {"tp": self.tp_size, "pp": self.pp_size, "dcp": self.dcp_size, "pcp": self.pcp_size}

    @classmethod
    def from_json(cls, d: dict[str, int]) -> ParallelLayout:
        return cls(d["tp"], d["pp"], d["dcp"], d["pcp"])


@dataclass(frozen=True)
class Namespace:
    model: str
    dtype: str
    groups: tuple[GroupSpec, ...]
    hash_algo: str
    layout_id: str = "tierstore-canonical-v1"
    revision: str | None = None
    parallel: ParallelLayout = field(default_factory=ParallelLayout)
    hash_stable: bool | None = None  # None: derived from hash_algo
    format_version: int = FORMAT_VERSION
    extra: tuple[tuple[str, str], ...] = ()  # further identity, e.g. ("salt_domain", ...)

    def __post_init__(self) -> None:
        object.__setattr__(self, "groups", tuple(self.groups))
        object.__setattr__(self, "extra", tuple(sorted((str(k), str(v)) for k, v in self.extra)))
        if self.hash_stable is None:
            object.__setattr__(self, "hash_stable", self.hash_algo in STABLE_HASH_ALGOS)
        if not self.groups:
            raise ConfigError("a namespace needs at least one KV-cache group")

    def identity_json(self) -> dict[str, Any]:
        """Everything that enters the digest, as plain JSON values."""
        return {
            "format_version": self.format_version,
            "model": self.model,
            "revision": self.revision,
            "dtype": self.dtype,
            "layout_id": self.layout_id,
            "hash_algo": self.hash_algo,
            "hash_stable": self.hash_stable,
            "parallel": self.parallel.to_json(),
            "groups": [g.to_json() for g in self.groups],
            "extra": [list(kv) for kv in self.extra],
        }

    def canonical_bytes(self) -> bytes:
        return json.dumps(self.identity_json(), sort_keys=True, separators=(",", ":")).encode()

    @cached_property  # the value is immutable: hash the canonical JSON once
    def digest_bytes(self) -> bytes:
        """16-byte digest written into every page header."""
        return xxhash.xxh3_128_digest(self.canonical_bytes())

    @property
    def digest(self) -> str:
        """32 hex characters: the namespace's directory name under the root."""
        return self.digest_bytes.hex()

    def manifest(self) -> dict[str, Any]:
        m = {"tierstore_manifest": 1, "namespace": self.digest}
        m.update(self.identity_json())
        return m

    @classmethod
    def from_manifest(cls, m: dict[str, Any]) -> Namespace:
        ns = cls(
            model=m["model"],
            revision=m.get("revision"),
            dtype=m["dtype"],
            groups=tuple(GroupSpec.from_json(g) for g in m["groups"]),
            hash_algo=m["hash_algo"],
            layout_id=m["layout_id"],
            parallel=ParallelLayout.from_json(m["parallel"]),
            hash_stable=m.get("hash_stable"),
            format_version=m["format_version"],
            extra=tuple(tuple(kv) for kv in m.get("extra", [])),  # type: ignore[misc]
        )
        if m.get("namespace") not in (None, ns.digest):
            raise ConfigError(f"manifest digest {m.get('namespace')} does not match its content ({ns.digest})")
        return ns


def namespace_dir(root: str | os.PathLike[str], ns: Namespace | str) -> Path:
    return Path(root) / (ns if isinstance(ns, str) else ns.digest)


MANIFEST_MAX_BYTES = 4 << 20  # real manifests are a few KiB to a few hundred (many layers)


def manifest_bytes(ns: Namespace) -> bytes:
    """The bytes of ``ns``'s ``manifest.json`` (a file root's, and the object tier's object)."""
    return (json.dumps(ns.manifest(), indent=2, sort_keys=True) + "\n").encode()


def write_manifest(root: str | os.PathLike[str], ns: Namespace, *, perms: safefs.Perms = safefs.PRIVATE) -> Path:
    """Create ``ROOT/<digest>/manifest.json`` unless it exists; returns its path.

    Written through the namespace directory's checked fd (safefs: a symlinked namespace
    directory raises ``UnsafeEntry``, nothing is written through it): a temp created
    O_EXCL|O_NOFOLLOW with ``perms.file_mode`` (0600; group bits kept whatever the umask),
    then renamed over the final name. An existing entry of that name, of any type, is left
    alone (fsck reports one that is not a valid manifest)."""
    Path(root).mkdir(parents=True, exist_ok=True, mode=perms.dir_mode)
    path = namespace_dir(root, ns) / MANIFEST_NAME
    root_fd = safefs.open_root(root)
    try:
        ns_fd = safefs.open_dir_path(root_fd, (ns.digest,), create=True, perms=perms)
    finally:
        os.close(root_fd)
    try:
        try:
            safefs.lstat_at(MANIFEST_NAME, ns_fd)
            return path
        except FileNotFoundError:
            pass
        # Named like a page temp (same host tag), so fsck judges both by the same rule.
        tmp = f".{MANIFEST_NAME}.{host_tag()}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        data = manifest_bytes(ns)
        fd = safefs.create_file(tmp, ns_fd, perms)
        try:
            try:
                if perms.file_mode & 0o070:
                    os.fchmod(fd, perms.file_mode)  # a fleet sharing a group: not up to the umask
                safefs.write_all(fd, data)
            finally:
                os.close(fd)
            _publish_manifest(tmp, ns_fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=ns_fd)
            raise
    finally:
        os.close(ns_fd)
    return path


def _publish_manifest(tmp: str, ns_fd: int) -> None:
    """Rename the written temp over the manifest's name, both in the checked directory."""
    os.replace(tmp, MANIFEST_NAME, src_dir_fd=ns_fd, dst_dir_fd=ns_fd)


def read_manifest(path: str | os.PathLike[str]) -> Namespace:
    """Parse a manifest file (JSON only; nothing is executed). Read through its directory's fd
    without following a symlink, non-blocking, as a regular single-link file of at most
    ``MANIFEST_MAX_BYTES`` (safefs.read_small); any failure, whatever its type (a FIFO, a
    RecursionError of deeply nested JSON, a number out of range...), is a ``ConfigError``."""
    try:
        dir_fd = os.open(os.path.dirname(path) or ".", safefs.DIR_FLAGS)
        try:
            raw = safefs.read_small(os.path.basename(path), dir_fd, MANIFEST_MAX_BYTES)
        finally:
            os.close(dir_fd)
        return Namespace.from_manifest(json.loads(raw))
    except Exception as exc:  # noqa: BLE001 - one bad manifest is a finding, never a crash
        raise ConfigError(f"unreadable manifest {os.fsdecode(path)}: {type(exc).__name__}: {exc}") from exc


def page_file_size(namespace: Namespace, group_index: int, key_len: int = 32, rank: int = 0,
                   layout: PageLayout | None = None) -> int:
    """Bytes of an uncompressed page file of this group (header + payload; ``layout``: a head
    slice's instead of the group's): the one rule of the local tier's reservations and the
    of the walk's estimates (``admin.namespace_dirs``)."""
    lay = layout if layout is not None else namespace.groups[group_index].layout
    meta = PageMeta(namespace.digest_bytes, b"\0" * key_len, group_index, namespace.groups[group_index].kind, 0, rank)
    entries = [SectionEntry(s, o, s.nbytes, 0) for s, o in zip(lay.sections, lay.offsets, strict=True)]
    return len(encode_header(meta, Codec.NONE, entries, lay.nbytes)) + lay.nbytes
