"""Namespace identity: the digest covers every field, is stable across processes, and the
manifest round-trips."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tierstore.errors import ConfigError
from tierstore.format.header import GroupKind
from tierstore.format.identity import (
    MANIFEST_NAME,
    GroupSpec,
    Namespace,
    ParallelLayout,
    read_manifest,
    write_manifest,
)
from tierstore.format.layout import attention_layout
from tierstore.testing import hybrid_namespace


def _replace_group(ns: Namespace, index: int, **changes: object) -> Namespace:
    groups = list(ns.groups)
    groups[index] = dataclasses.replace(groups[index], **changes)
    return dataclasses.replace(ns, groups=tuple(groups))


def _variants(ns: Namespace) -> dict[str, Namespace]:
    g0 = ns.groups[0]
    return {
        "model": dataclasses.replace(ns, model="other/model"),
        "revision": dataclasses.replace(ns, revision="r1"),
        "revision-none": dataclasses.replace(ns, revision=None),
        "dtype": dataclasses.replace(ns, dtype="float16"),
        "layout_id": dataclasses.replace(ns, layout_id="tierstore-canonical-v2"),
        "hash_algo": dataclasses.replace(ns, hash_algo="sha256_cbor"),
        "hash_stable": dataclasses.replace(ns, hash_stable=False),
        "tp": dataclasses.replace(ns, parallel=ParallelLayout(tp_size=2)),
        "pp": dataclasses.replace(ns, parallel=ParallelLayout(pp_size=2)),
        "dcp": dataclasses.replace(ns, parallel=ParallelLayout(dcp_size=2)),
        "pcp": dataclasses.replace(ns, parallel=ParallelLayout(pcp_size=2)),
        "format_version": dataclasses.replace(ns, format_version=ns.format_version + 1),
        "extra": dataclasses.replace(ns, extra=(("deployment", "blue"),)),
        "group-order": dataclasses.replace(ns, groups=(ns.groups[1], ns.groups[0], ns.groups[2])),
        "group-dropped": dataclasses.replace(ns, groups=ns.groups[:2]),
        "group-kind": _replace_group(ns, 0, kind=GroupKind.MLA),
        "block_size": _replace_group(ns, 0, block_size=8),
        "tokens_per_chunk": _replace_group(
            ns, 0, tokens_per_chunk=64,
            layout=attention_layout(g0.layer_names, 2, 64, 16, "bfloat16")),
        "layer_names": _replace_group(ns, 0, layer_names=("model.layers.9.self_attn", g0.layer_names[1])),
        "sliding_window": _replace_group(ns, 1, sliding_window=128),
        "section-shape": hybrid_namespace(head_size=32),
        "section-heads": hybrid_namespace(num_kv_heads=4),
        "section-dtype": hybrid_namespace(ssm_dtype="float16"),
        "section-conv": hybrid_namespace(conv_width=3),
    }


def test_digest_changes_with_every_field(hybrid_ns: Namespace) -> None:
    variants = _variants(hybrid_ns)
    digests = {name: v.digest for name, v in variants.items()}
    assert hybrid_ns.digest not in digests.values(), [k for k, d in digests.items() if d == hybrid_ns.digest]
    assert len(set(digests.values())) == len(digests)
    assert len(hybrid_ns.digest) == 32 and len(hybrid_ns.digest_bytes) == 16


def test_every_identity_field_is_covered(hybrid_ns: Namespace) -> None:
    # A new Namespace field that is not in identity_json() would silently not count.
    fields = {f.name for f in dataclasses.fields(Namespace)}
    assert fields <= set(hybrid_ns.identity_json())
    group_fields = {f.name for f in dataclasses.fields(GroupSpec)} - {"layout"}
    assert group_fields <= set(hybrid_ns.groups[0].to_json())


_DIGEST_SCRIPT = "from tierstore.testing import hybrid_namespace; print(hybrid_namespace().digest)"


@pytest.mark.parametrize("hash_seed", ["0", "12345"])
def test_digest_is_stable_across_processes(hybrid_ns: Namespace, hash_seed: str) -> None:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    out = subprocess.run([sys.executable, "-c", _DIGEST_SCRIPT], env=env, capture_output=True,
                         text=True, check=True, timeout=120)
    assert out.stdout.strip() == hybrid_ns.digest


def test_manifest_round_trip(root: Path, hybrid_ns: Namespace) -> None:
    path = write_manifest(root, hybrid_ns)
    assert path == root / hybrid_ns.digest / MANIFEST_NAME
    data = json.loads(path.read_text())
    assert data["namespace"] == hybrid_ns.digest and data["model"] == hybrid_ns.model
    back = read_manifest(path)
    assert back == hybrid_ns and back.digest == hybrid_ns.digest
    # A second writer leaves the published manifest alone and leaves no temp behind.
    before = path.stat().st_mtime_ns
    write_manifest(root, hybrid_ns)
    assert path.stat().st_mtime_ns == before
    assert sorted(p.name for p in path.parent.iterdir()) == [MANIFEST_NAME]


def test_manifest_temp_names_its_writer_as_fsck_reads_it(root: Path, hybrid_ns: Namespace,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from tierstore.admin.findings import STALE_TEMP
    from tierstore.admin.walk import walk_root

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    # A writer killed between writing its temp and renaming it: the temp stays behind.
    import tierstore.format.identity as identity_mod

    monkeypatch.setattr(identity_mod, "_publish_manifest", lambda tmp, ns_fd: None)
    write_manifest(root, hybrid_ns)  # as this process (alive)
    monkeypatch.setattr(os, "getpid", lambda: dead.pid)
    write_manifest(root, hybrid_ns)  # as a process of this host that is gone
    monkeypatch.undo()
    temps = sorted((root / hybrid_ns.digest).iterdir())
    assert len(temps) == 2 and all(t.name.startswith(f".{MANIFEST_NAME}.") for t in temps)
    inv = walk_root(root)
    # fsck reads this host and the pid back from the name: the dead writer's temp is stale at
    # once (no waiting for --tmp-age), the live one's in flight.
    assert inv.temps_active == 1
    stale = [f.path for f in inv.findings if f.category == STALE_TEMP]
    assert len(stale) == 1 and f".{dead.pid}." in Path(stale[0]).name


def test_manifest_tampering_is_detected(root: Path, hybrid_ns: Namespace) -> None:
    path = write_manifest(root, hybrid_ns)
    data = json.loads(path.read_text())
    data["dtype"] = "float16"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="does not match"):
        read_manifest(path)
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="unreadable manifest"):
        read_manifest(path)


def test_group_spec_validates() -> None:
    layout = attention_layout(["l0"], 1, 16, 8, "float16")
    with pytest.raises(ConfigError, match="multiple"):
        GroupSpec(GroupKind.ATTENTION, 16, 24, ("l0",), layout)
    with pytest.raises(ConfigError, match="at least one"):
        Namespace(model="m", dtype="float16", groups=(), hash_algo="sha256")
