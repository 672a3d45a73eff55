"""A namespace directory under a tierstore root and what its manifest says about its groups:
``NamespaceDir``, reading its manifest (``load_manifest``), the group spec of a head slice
(``sliced_group_spec``) and the size of a group's page file (``estimated_page_bytes``).

Contract:

- Untrusted input: a manifest is read through ``safefs`` (no symlink followed, FIFOs refused,
  at most ``MANIFEST_MAX_BYTES``); every exception while reading or checking it becomes
  ``NamespaceDir.error``, never the end of a walk. A manifest of another page format marks the
  directory as not to be walked (``walk=False``): its contents are neither read nor repaired.
- ``sliced_group_spec`` is the group as a head slice ``h<start>-<count>`` holds it (None when the
  group has no such slice); ``estimated_page_bytes`` is 0 when the manifest gives no usable
  size (a listing then counts no bytes rather than failing).

Threading: ``load_manifest`` runs on the walk's calling thread; a ``NamespaceDir`` is read-only
once loaded and shared with the walk's pool threads; ``estimated_page_bytes`` is cached
(``lru_cache`` is thread-safe).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from tierstore.format.header import FORMAT_VERSION
from tierstore.format.identity import MANIFEST_NAME, GroupSpec, Namespace, page_file_size
from tierstore.format.page_layout import PageLayout
from tierstore.fs import safefs
from tierstore.fs.mapper import NAMESPACE_DIR_RE

# Manifests are a few KiB (tens for models with hundreds of layers); a bigger one is refused
# before it is read, so a planted 500 MB file costs nothing.
MANIFEST_MAX_BYTES = 4 << 20


@dataclass
class NamespaceDir:
    """A namespace directory under ROOT and what its manifest says (if readable)."""

    name: str
    path: Path
    namespace: Namespace | None
    error: str | None = None
    walk: bool = True  # False: another format's tree; its contents are neither read nor repaired

    @property
    def digest_bytes(self) -> bytes | None:
        """The digest page headers must carry: the directory's name, when it is one."""
        return bytes.fromhex(self.name) if NAMESPACE_DIR_RE.match(self.name) else None

    def group(self, index: int) -> GroupSpec | None:
        if self.namespace is None or index >= len(self.namespace.groups):
            return None
        return self.namespace.groups[index]

    @property
    def world_size(self) -> int | None:
        """Upper bound on rank numbers (product of all parallel sizes)."""
        if self.namespace is None:
            return None
        p = self.namespace.parallel
        return p.tp_size * p.pp_size * p.dcp_size * p.pcp_size


def load_manifest(nsd: NamespaceDir, root_fd: int) -> None:
    """Read and check ``nsd``'s manifest through safefs; any problem becomes ``nsd.error``.

    Every exception counts (a planted manifest can raise anything from json or the dataclasses:
    RecursionError for deep nesting, OverflowError for 1e400, ValueError, KeyError...): it is a
    finding about this namespace, never the end of the walk.
    """
    try:
        ns_fd = safefs.open_dir(nsd.name, root_fd)
        try:
            raw = safefs.read_small(MANIFEST_NAME, ns_fd, MANIFEST_MAX_BYTES)
        finally:
            os.close(ns_fd)
        ns = Namespace.from_manifest(json.loads(raw))
        _check_namespace_values(ns)
    except safefs.UnsafeEntry as exc:
        nsd.error = f"unreadable manifest: {exc}"
        return
    except OSError as exc:
        nsd.error = f"unreadable manifest: {exc.strerror or exc}"
        return
    except Exception as exc:  # noqa: BLE001 - untrusted input: every failure is a finding
        nsd.error = f"unreadable manifest: {type(exc).__name__}: {str(exc)[:200]}"
        return
    if ns.digest != nsd.name:
        nsd.error = f"manifest describes namespace {ns.digest}, not {nsd.name}"
    elif ns.format_version != FORMAT_VERSION:
        # Another tierstore's tree (another page format and directory layout): its pages are
        # never served here, and nodes that still run that version may be using them, so
        # nothing in it is read or repaired.
        nsd.namespace = ns
        nsd.error = (f"written by tierstore page format {ns.format_version}; this tierstore uses "
                     f"format {FORMAT_VERSION} and never serves these pages "
                     "(left as is: delete the directory once no node uses that version)")
        nsd.walk = False
    else:
        nsd.namespace = ns


def _check_namespace_values(ns: Namespace) -> None:
    """Compute what the walk and the stats use, so a value that parses but cannot be used
    (a negative shape, a float where a count belongs) fails here, inside the manifest's try."""
    p = ns.parallel
    world = p.tp_size * p.pp_size * p.dcp_size * p.pcp_size
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"parallel layout has {world!r} ranks")
    if not isinstance(ns.format_version, int):
        raise ValueError(f"format_version {ns.format_version!r} is not an integer")
    for g in ns.groups:
        nbytes = g.layout.nbytes
        if not isinstance(nbytes, int) or nbytes < 0 or not isinstance(g.tokens_per_chunk, int):
            raise ValueError(f"group layout of {nbytes!r} bytes")
        g.kind.name.lower()
        len(g.layer_names)
    ns.parallel.to_json()
    dict(ns.extra)


def sliced_group_spec(group: GroupSpec, heads: tuple[int, int]) -> GroupSpec | None:
    """The group as its slice ``h<start>-<count>`` holds it (``head_slices.slice_layout``:
    attention sections cut to ``count`` KV heads, Gated DeltaNet states to ``count`` linear key
    heads; docs/DESIGN.md §9); None when the group has no such slice (another Mamba group, or
    units beyond the group's)."""
    from tierstore.format.head_slices import HeadRange, slice_layout

    try:
        layout = slice_layout(group.layout, HeadRange(*heads))
    except ValueError:
        return None
    return dataclasses.replace(group, layout=layout)


@lru_cache(maxsize=256)
def estimated_page_bytes(ns: Namespace, group_index: int, rank: int, key_len: int,
                         layout: PageLayout | None = None) -> int:
    """Bytes of an uncompressed page file of this group (header + payload; ``layout``: a head
    slice's); 0 if unknown."""
    try:
        return page_file_size(ns, group_index, key_len, rank, layout)
    except Exception:  # noqa: BLE001 - an odd manifest: no estimate rather than no stats
        return 0
