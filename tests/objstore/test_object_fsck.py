"""``tierstore fsck|stats|ls s3://BUCKET/PREFIX`` against a real Ceph RGW (tierstore.admin.object_fsck,
object_walk).

What these prove: fsck finds exactly the page objects damaged behind the tier's back (bits
flipped, truncated, another page's body under a name), exit 4, in-process and as
``python -m tierstore``; ``--repair`` deletes exactly those and nothing else, exit 1, and a
re-run is clean, exit 0; a page not verifiable with the key given is kept (exit 64) unless
``--remove-unverifiable``; stats and ls count what the listing holds, byte for byte; and on
the same tree the directory fsck and the object fsck report the same counts and findings.

The object tier writes its namespace's ``manifest.json`` object at start, as a file root's
engine writes the file (``put_manifest`` checks it is there, byte for byte what a file root
holds); without it fsck reports the missing manifest
(``test_a_namespace_without_its_manifest_object_...``).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from tiers_helpers import key, store

from tierstore.admin.cli import main
from tierstore.config import TierStoreConfig
from tierstore.format.header import Codec
from tierstore.format.identity import MANIFEST_NAME, Namespace
from tierstore.fs.mapper import fanout
from tierstore.metrics import MetricsRegistry
from tierstore.testing import corrupt_flip_bit, fill_pages, hybrid_namespace, write_page
from tierstore.testing.pages import simple_namespace
from tierstore.tiers.object import ObjectTier

NS = simple_namespace()
REPO = Path(__file__).resolve().parents[2]


def _boto(lab):
    import boto3

    return boto3.client("s3", endpoint_url=lab.endpoint, aws_access_key_id=lab.access_key,
                        aws_secret_access_key=lab.secret_key, region_name=lab.region)


def _listing(s3, bucket: str, prefix: str = "") -> dict[str, int]:
    """Every object key under ``prefix`` -> its size."""
    out = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for o in page.get("Contents", []):
            out[o["Key"]] = o["Size"]
    return out


def put_manifest(s3, bucket: str, prefix: str, ns: Namespace) -> str:
    """The key of ``<prefix>/<ns>/manifest.json``, checked: the object tier wrote it, the bytes
    ``identity.write_manifest`` writes into a file root."""
    okey = f"{prefix}/{ns.digest}/{MANIFEST_NAME}"
    body = (json.dumps(ns.manifest(), indent=2, sort_keys=True) + "\n").encode()
    assert s3.get_object(Bucket=bucket, Key=okey)["Body"].read() == body
    return okey


def store_pages(tmp_path: Path, url: str, n: int, seed: int = 0, **settings: object) -> list[str]:
    """Store ``n`` pages of NS through the object tier; their object keys."""
    config = TierStoreConfig.from_dict({"root": str(tmp_path / "r"), "object_url": url, "io_threads": 2,
                                        "index_refresh_s": 0, **settings})
    tier = ObjectTier(config, NS, 0, 0, MetricsRegistry().tier("object"))
    try:
        keys = [key(i, seed=seed) for i in range(n)]
        for k in keys:
            r = store(tier, k)
            assert r.ok, r.error
        return [tier.files.object_key(k) for k in keys]
    finally:
        tier.close(10)


def cli(*argv: str) -> tuple[int, dict]:
    """``tierstore ARGV --json`` in-process: (exit status, document)."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main([*argv, "--json"])
    return rc, json.loads(buf.getvalue())


def cli_text(*argv: str) -> tuple[int, str]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(list(argv))
    return rc, buf.getvalue()


def damage(s3, bucket: str, okeys: list[str]) -> list[str]:
    """Damage four page objects behind the tier's back; their keys."""
    body = {k: s3.get_object(Bucket=bucket, Key=k)["Body"].read() for k in okeys[:5]}
    flipped = bytearray(body[okeys[0]])
    flipped[len(flipped) // 2] ^= 0x40
    s3.put_object(Bucket=bucket, Key=okeys[0], Body=bytes(flipped))  # a bit flipped in a section
    s3.put_object(Bucket=bucket, Key=okeys[1], Body=body[okeys[1]][: len(body[okeys[1]]) // 3])  # truncated
    s3.put_object(Bucket=bucket, Key=okeys[2], Body=body[okeys[4]])  # another page's body under this name
    header = bytearray(body[okeys[3]])
    header[10] ^= 0x01
    s3.put_object(Bucket=bucket, Key=okeys[3], Body=bytes(header))  # header damage
    return okeys[:4]


def test_fsck_reports_exactly_the_damaged_objects_and_repair_deletes_exactly_those(
        tmp_path, s3_env, s3_bucket, ceph_lab) -> None:
    url = f"s3://{s3_bucket}/fleet"
    n = 40
    okeys = store_pages(tmp_path, url, n)
    s3 = _boto(ceph_lab)
    manifest = put_manifest(s3, s3_bucket, "fleet", NS)
    rc, doc = cli("fsck", url)
    assert rc == 0 and doc["counts"]["pages_ok"] == n and doc["counts"]["problems"] == 0, doc

    bad = damage(s3, s3_bucket, okeys)
    k = len(bad)
    t0 = time.monotonic()
    rc, doc = cli("fsck", url)
    took = time.monotonic() - t0
    assert rc == 4, doc
    assert doc["tierstore_fsck"] == 1 and doc["root"] == url and doc["error"] is None
    assert doc["counts"]["bad_page"] == k and doc["counts"]["problems"] == k
    assert doc["counts"]["pages_ok"] == n - k and doc["counts"]["namespaces"] == 1
    assert sorted(p["path"] for p in doc["problems"]) == sorted(f"s3://{s3_bucket}/{b}" for b in bad)
    kinds = {p["path"].rsplit("/", 1)[1]: p["kind"] for p in doc["problems"]}
    assert kinds[bad[0].rsplit("/", 1)[1]] == "checksum" and kinds[bad[2].rsplit("/", 1)[1]] == "key_mismatch"
    assert doc["reads"]["threads"] >= 1 and doc["reads"]["max_in_flight"] >= 1

    # the same as a separate process: `python -m tierstore fsck s3://...`, text output
    proc = subprocess.run([sys.executable, "-m", "tierstore", "fsck", url], capture_output=True, text=True,
                          cwd=REPO, env=os.environ, timeout=120)
    assert proc.returncode == 4, proc.stderr
    assert f"{n - k} pages ok" in proc.stdout and f"{k} bad_page" in proc.stdout
    assert all(f"s3://{s3_bucket}/{b}" in proc.stdout for b in bad)
    assert "run `tierstore fsck --repair` to repair" in proc.stdout

    rc, doc = cli("fsck", url, "--repair", "--jobs", "4")
    assert rc == 1, doc
    assert doc["counts"]["repaired"] == k and doc["counts"]["left"] == 0
    assert {p["action"] for p in doc["problems"]} == {"deleted"}
    left = _listing(s3, s3_bucket, "fleet/")
    assert set(left) == (set(okeys) - set(bad)) | {manifest}  # exactly those k gone, the rest kept

    rc, text = cli_text("fsck", url)
    assert rc == 0, text
    assert f"{n - k} pages ok" in text and "no problems" in text
    print(f"\nobject fsck: {n} page objects, {k} damaged: found in {took:.2f} s (exit 4), repaired (exit 1), "
          "re-run clean (exit 0)")


def test_a_namespace_without_its_manifest_object_is_a_manifest_problem_left_for_a_human(
        tmp_path, s3_env, s3_bucket, ceph_lab) -> None:
    url = f"s3://{s3_bucket}/bare"
    okeys = store_pages(tmp_path, url, 6)
    s3 = _boto(ceph_lab)
    s3.delete_object(Bucket=s3_bucket, Key=put_manifest(s3, s3_bucket, "bare", NS))
    rc, doc = cli("fsck", url)
    assert rc == 4, doc
    assert [(p["category"], p["kind"]) for p in doc["problems"]] == [("manifest", "manifest")]
    assert "no manifest.json" in doc["problems"][0]["message"]
    assert doc["counts"]["pages_ok"] == 6  # still verified, against what each header and its place say
    rc, doc = cli("fsck", url, "--repair")
    assert rc == 4 and doc["problems"][0]["repair_error"] and not doc["problems"][0]["repaired"]
    assert set(_listing(s3, s3_bucket, "bare/")) == set(okeys)


def test_a_page_not_verifiable_with_the_key_is_kept_unless_remove_unverifiable(
        tmp_path, s3_env, s3_bucket, ceph_lab) -> None:
    keys = []
    for name in ("a", "b"):
        path = tmp_path / f"{name}.key"
        path.write_text(os.urandom(32).hex())
        path.chmod(0o600)
        keys.append(str(path))
    url = f"s3://{s3_bucket}/mac"
    okeys = store_pages(tmp_path, url, 5, mac_key_file=keys[0])
    s3 = _boto(ceph_lab)
    put_manifest(s3, s3_bucket, "mac", NS)
    assert cli("fsck", url, "--mac-key-file", keys[0])[0] == 0
    rc, doc = cli("fsck", url, "--mac-key-file", keys[1], "--repair")
    assert rc == 64, doc  # not damage: kept
    assert doc["counts"]["unverifiable"] == 5 and doc["counts"]["problems"] == 0
    assert {u["kind"] for u in doc["unverifiable"]} == {"mac"} and not any(u["repaired"] for u in doc["unverifiable"])
    assert set(okeys) <= set(_listing(s3, s3_bucket, "mac/"))
    rc, doc = cli("fsck", url, "--mac-key-file", keys[1], "--repair", "--remove-unverifiable")
    assert rc == 1, doc
    assert not set(okeys) & set(_listing(s3, s3_bucket, "mac/"))


def test_stats_and_ls_count_what_the_listing_holds(tmp_path, s3_env, s3_bucket, ceph_lab) -> None:
    url = f"s3://{s3_bucket}/st"
    okeys = store_pages(tmp_path, url, 12) + store_pages(tmp_path, url, 5, seed=1, codec="zstd")
    s3 = _boto(ceph_lab)
    put_manifest(s3, s3_bucket, "st", NS)
    listed = {k: v for k, v in _listing(s3, s3_bucket, "st/").items() if k.endswith(".kvp")}
    assert set(listed) == set(okeys)
    rc, stats = cli("stats", url)
    assert rc == 0 and stats["tierstore_stats"] == 1 and stats["root"] == url
    assert stats["totals"] == {"namespaces": 1, "files": len(listed), "bytes": sum(listed.values())}
    (g,) = stats["namespaces"][0]["groups"]
    assert g["files"] == len(listed) and g["bytes"] == sum(listed.values()) and g["bytes_source"] == "stat"
    assert g["ranks"] == [0] and g["tokens_source"] == "estimate" and g["newest"] is not None
    rc, ls = cli("ls", url, "--exact", "--jobs", "3")  # accepted; the listing is exact already
    assert rc == 0 and ls["tierstore_ls"] == 1
    assert [(r["namespace"], r["group"], r["files"], r["bytes"]) for r in ls["rows"]] == [
        (NS.digest, 0, len(listed), sum(listed.values()))]
    rc, text = cli_text("ls", url)
    assert rc == 0 and NS.digest in text and "attention" in text
    rc, text = cli_text("stats", url, "--namespace", NS.digest[:6], "--no-progress")
    assert rc == 0 and f"{len(listed)} pages" in text

    # a prefix holding objects but no namespace is refused, as a directory that is not a cache
    s3.put_object(Bucket=s3_bucket, Key="other/notes.txt", Body=b"hello")
    rc, doc = cli("stats", f"s3://{s3_bucket}/other")
    assert rc == 8 and "no namespace" in doc["error"]


def test_flags_that_make_no_sense_on_objects(tmp_path, s3_env, s3_bucket, ceph_lab) -> None:
    url = f"s3://{s3_bucket}/flags"
    store_pages(tmp_path, url, 3)
    put_manifest(_boto(ceph_lab), s3_bucket, "flags", NS)
    rc, doc = cli("fsck", url, "--repair", "--quarantine-bad")
    assert rc == 2 and "--quarantine-bad" in doc["error"]
    rc, doc = cli("fsck", url, "--tmp-age", "5", "--group-access", "--deep", "--progress")  # accepted
    assert rc == 0 and doc["counts"]["pages_ok"] == 3
    rc, doc = cli("fsck", f"s3://{s3_bucket}-missing/x")
    assert rc == 8 and doc["error"] and doc["exit_code"] == 8
    rc, doc = cli("fsck", "s3://")
    assert rc == 8 and "s3://BUCKET/PREFIX" in doc["error"]
    rc, doc = cli("fsck", url, "--namespace", "ffff")
    assert rc == 8 and "no namespace directory" in doc["error"]


def _damaged_tree(root: Path) -> None:
    """A file root with pages of two namespaces (one without its manifest) and one of each
    problem that a bucket can hold too."""
    ns = hybrid_namespace()
    pages = fill_pages(root, ns, 4) + fill_pages(root, ns, 2, seed=1, codec=Codec.ZSTD)
    corrupt_flip_bit(pages[0].path, -100)  # checksum
    data = pages[1].path.read_bytes()
    pages[1].path.write_bytes(data[: len(data) // 2])  # truncated
    shutil.copyfile(pages[3].path, pages[2].path)  # another page's body under this name
    other = simple_namespace(model="tierstore-test/no-manifest")
    write_page(root, other, 0, key(1, seed=7))  # a namespace whose manifest.json is missing
    write_page(root, ns, 0, key(2, seed=7), rank=5)  # orphan: rank outside the parallel layout
    g9 = root / ns.digest / "g9" / "r0" / pages[5].path.parent.name
    g9.mkdir(parents=True)
    shutil.copyfile(pages[5].path, g9 / pages[5].path.name)  # orphan: a group the manifest does not know
    moved = write_page(root, ns, 1, key(3, seed=7)).path
    wrong = moved.parent.parent / ("00" if fanout(key(3, seed=7)) != "00" else "01")
    wrong.mkdir(exist_ok=True)
    moved.rename(wrong / moved.name)  # misplaced
    (root / "notes.txt").write_text("not a page")  # foreign file
    (root / "junk" / "a").mkdir(parents=True)
    (root / "junk" / "a" / "b").write_bytes(b"x" * 10)  # foreign directory
    (root / ns.digest / "README").write_text("hi")  # foreign file in a namespace


def test_directory_and_object_fsck_agree_on_the_same_tree(tmp_path, s3_env, s3_bucket, ceph_lab) -> None:
    root = tmp_path / "root"
    _damaged_tree(root)
    s3 = _boto(ceph_lab)
    for path in root.rglob("*"):
        rel = path.relative_to(root)
        if path.is_file() and not rel.parts[0].startswith(".tierstore"):
            s3.put_object(Bucket=s3_bucket, Key=f"copy/{rel}", Body=path.read_bytes())
    url = f"s3://{s3_bucket}/copy"
    rc_dir, on_dir = cli("fsck", str(root))
    rc_obj, on_obj = cli("fsck", url)
    assert rc_dir == rc_obj == 4
    assert on_obj["counts"] == on_dir["counts"], (on_dir["counts"], on_obj["counts"])

    def found(doc: dict, base: str) -> list[tuple[str, str, str]]:
        return sorted((p["path"][len(base):].strip("/"), p["category"], p["kind"]) for p in doc["problems"])

    assert found(on_obj, url) == found(on_dir, str(root.resolve())), (found(on_obj, url), found(on_dir, str(root.resolve())))
    cats = {c for _, c, _ in found(on_obj, url)}
    assert cats == {"bad_page", "orphan", "foreign", "manifest"}, cats
    # ls: the same rows (files per namespace and group) from either listing
    rows = [[(r["namespace"], r["group"], r["files"]) for r in cli("ls", where)[1]["rows"]] for where in (str(root), url)]
    assert rows[0] == rows[1]
    # --repair on the bucket deletes the damaged, misplaced and orphaned pages and nothing else
    rc, doc = cli("fsck", url, "--repair")
    assert rc == 4  # foreign objects and the missing manifest are left for a human
    deleted = {p["path"] for p in doc["problems"] if p["action"] == "deleted"}
    assert deleted == {p["path"] for p in doc["problems"] if p["category"] in ("bad_page", "orphan")}
    rc, doc = cli("fsck", url)
    assert doc["counts"]["bad_page"] == doc["counts"]["orphan"] == 0 and doc["counts"]["problems"] == 4
