"""The object tier (setting ``object_url``) against a real Ceph RGW on 127.0.0.1 (issue 44).

What these prove: the object body is the canonical page file under the key that mirrors the
file root's path; a second node loads every page of the first, verified; eight writers racing
on one page store it exactly once; damaged objects are never served and are removed; a killed
gateway ends every job with a typed error within its deadline, the tier goes down, and it comes
back by itself once the gateway answers.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
from tiers_helpers import expected, key, load_page, store

from tierstore.config import ObjectLocation, TierStoreConfig
from tierstore.errors import BAD_CONTENT_KINDS, ConfigError
from tierstore.metrics import MetricsRegistry
from tierstore.testing.pages import simple_namespace
from tierstore.tiers import close_shared_state, open_group_store
from tierstore.tiers.object import ObjectTier

NS = simple_namespace()


def cfg(root: Path, url: str, **kw: object) -> TierStoreConfig:
    return TierStoreConfig.from_dict({"root": str(root), "object_url": url, "io_threads": 4,
                                      "index_refresh_s": 0, **kw})


def _boto(lab):  # the raw client: what an attacker or an operator with the bucket's keys can do
    import boto3

    return boto3.client("s3", endpoint_url=lab.endpoint, aws_access_key_id=lab.access_key,
                        aws_secret_access_key=lab.secret_key, region_name=lab.region)


def _objects(s3, bucket: str) -> dict[str, bytes]:
    out = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for o in page.get("Contents", []):
            out[o["Key"]] = s3.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()
    return out


def test_object_url_is_checked_naming_the_setting() -> None:
    assert ObjectLocation.parse("s3://b/a/b/") == ObjectLocation("b", "a/b")
    assert ObjectLocation.parse("s3://b").key("x/y") == "x/y"
    for bad in ("b/prefix", "s3://", "s3:///p", "s3://b/../x", "http://b/p"):
        with pytest.raises(ConfigError, match='"object_url"'):
            TierStoreConfig.from_dict({"root": "/tmp/x", "object_url": bad})


def test_pages_are_the_canonical_files_and_a_second_node_loads_them_all(tmp_path, s3_env, s3_bucket, ceph_lab) -> None:
    url = f"s3://{s3_bucket}/fleet"
    a = open_group_store(cfg(tmp_path / "a", url), NS, 0, metrics=MetricsRegistry())
    keys = [key(i) for i in range(24)]
    try:
        for k in keys:
            assert store(a, k).ok
        assert a.flush(30)
    finally:
        a.close(30)
    objects = _objects(_boto(ceph_lab), s3_bucket)
    files = {str(p.relative_to(tmp_path / "a")): p.read_bytes() for p in (tmp_path / "a").rglob("*.kvp")}
    assert len(files) == len(keys)
    # the same bytes under the same relative names: copying a file root into a bucket migrates it
    assert {k: v for k, v in objects.items() if k.endswith(".kvp")} == {f"fleet/{k}": v for k, v in files.items()}

    close_shared_state()
    b = open_group_store(cfg(tmp_path / "b", url), NS, 0, metrics=MetricsRegistry())
    try:
        served = []
        for k in keys:
            r, data = load_page(b, k)
            assert r.ok, r.error
            assert data == expected(b, k)
            served.append(r.tier)
        assert served == ["object"] * len(keys)
        # promoted: the second load is the node's own root
        r, _ = load_page(b, keys[0])
        assert r.ok and r.tier == "root"
    finally:
        b.close(30)


def test_eight_writers_racing_on_one_page_store_it_once(tmp_path, s3_env, s3_bucket) -> None:
    url = f"s3://{s3_bucket}/race"
    tiers = [ObjectTier(cfg(tmp_path / f"n{i}", url), NS, 0, 0, MetricsRegistry().tier("object")) for i in range(8)]
    k = key(7)
    slots = []
    for t in tiers:
        slot = t.acquire_slot(5)
        slot.view[:] = expected(t, k)
        slots.append(slot)
    go = threading.Barrier(8)
    results = [None] * 8

    def one(i: int) -> None:
        go.wait()
        (results[i],) = tiers[i].wait([tiers[i].submit_store(k, slots[i], 16)], 30)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        assert all(r is not None and r.ok for r in results), [r.error for r in results if r is not None]
        assert sorted(r.stored for r in results) == [False] * 7 + [True]
        assert tiers[0].conditional_put == "ok"
    finally:
        for t in tiers:
            t.close(5)


def test_damaged_objects_are_never_served_and_are_removed(tmp_path, s3_env, s3_bucket, ceph_lab) -> None:
    url = f"s3://{s3_bucket}/bad"
    a = ObjectTier(cfg(tmp_path / "a", url), NS, 0, 0, MetricsRegistry().tier("object"))
    keys = [key(i, seed=3) for i in range(6)]
    try:
        for k in keys:
            assert store(a, k).ok
        okeys = [a.files.object_key(k) for k in keys]
    finally:
        a.close(5)
    s3 = _boto(ceph_lab)
    body = [s3.get_object(Bucket=s3_bucket, Key=o)["Body"].read() for o in okeys]
    flipped = bytearray(body[0])
    flipped[len(flipped) // 2] ^= 0x40
    s3.put_object(Bucket=s3_bucket, Key=okeys[0], Body=bytes(flipped))  # a bit flipped in the page
    s3.put_object(Bucket=s3_bucket, Key=okeys[1], Body=body[1][: len(body[1]) // 3])  # truncated
    s3.put_object(Bucket=s3_bucket, Key=okeys[2], Body=body[3])  # another page under this name
    flipped_header = bytearray(body[4])
    flipped_header[10] ^= 0x01
    s3.put_object(Bucket=s3_bucket, Key=okeys[4], Body=bytes(flipped_header))  # header damage

    b = ObjectTier(cfg(tmp_path / "b", url), NS, 0, 0, MetricsRegistry().tier("object"))
    try:
        kinds = []
        for i, k in enumerate(keys):
            r, data = load_page(b, k)
            if i in (0, 1, 2, 4):
                assert not r.ok and data is None
                kinds.append(r.error.kind)
            else:
                assert r.ok and data == expected(b, k)
        assert all(kind in BAD_CONTENT_KINDS for kind in kinds), kinds
        assert b.flush(10)
        left = {o for o in okeys if s3.list_objects_v2(Bucket=s3_bucket, Prefix=o).get("KeyCount")}
        assert left == {okeys[3], okeys[5]}  # the damaged ones removed, the good ones kept
    finally:
        b.close(5)


def test_a_killed_gateway_ends_every_job_typed_within_its_deadline_and_the_tier_comes_back(
        tmp_path, s3_env, s3_bucket, ceph_lab) -> None:
    """A chain (root, then the bucket): 200 jobs submitted to the object tier, then radosgw
    killed with them queued and in flight. Each ends typed within deadline + 1 s, the chain keeps
    serving from the root, and the object tier hits again within 5 s of a restart."""
    deadline = 2.0
    url = f"s3://{s3_bucket}/outage"
    chain = open_group_store(cfg(tmp_path / "a", url, object_deadline_s=deadline, staging_slots=256,
                                 queue_depth=512), NS, 0, metrics=MetricsRegistry())
    t = chain.object
    try:
        stored = [key(i, seed=5) for i in range(40)]
        for k in stored:
            assert store(chain, k).ok
        assert chain.flush(30) and all(t.client.head(t.files.object_key(k)) for k in stored)
        jobs: dict[int, float] = {}
        for i in range(200):
            k = stored[i % len(stored)] if i % 2 else key(1000 + i, seed=5)
            if i % 2:
                jobs[t.submit_load(k)] = time.monotonic()
            else:
                slot = t.acquire_slot(5)
                assert slot is not None
                slot.view[:] = expected(t, k)
                jobs[t.submit_store(k, slot, 16)] = time.monotonic()
        ceph_lab.kill_rgw()
        killed = time.monotonic()
        results = []
        end = time.monotonic() + deadline + 10
        while len(results) < len(jobs) and time.monotonic() < end:
            for r in t.wait(list(jobs), 0.2):
                results.append((r, time.monotonic()))
                if r.slot is not None:
                    t.release_slot(r.slot)
        assert len(results) == len(jobs)
        late = [(r.error, at - max(jobs[r.job_id], killed)) for r, at in results
                if at - max(jobs[r.job_id], killed) > deadline + 1]
        assert late == []
        failed = [r for r, _ in results if not r.ok]
        kinds = sorted({r.error.kind for r in failed if r.error is not None})
        assert failed and set(kinds) <= {"io", "timeout", "queue_full"}, kinds
        assert all(r.ok or r.error is not None for r, _ in results)
        for r, _ in results:  # what did finish before the kill is right
            assert not (r.ok and r.op == "load") or r.verified
        assert not t.available
        served = [load_page(chain, k) for k in stored[:8]]  # the engine goes on from the root
        assert [(r.ok, r.tier) for r, _ in served] == [(True, "root")] * 8
        ceph_lab.restart_rgw()
        back = time.monotonic()
        while not t.available and time.monotonic() < back + 5:
            time.sleep(0.05)
        assert t.available, f"the tier was still down 5 s after the gateway restarted ({time.monotonic() - killed:.1f} s)"
        up_after = time.monotonic() - back
        r, data = load_page(t, stored[0])
        assert r.ok and data == expected(t, stored[0])
        slowest = max(at - max(jobs[r.job_id], killed) for r, at in results)
        print(f"\nradosgw killed with {len(jobs)} jobs submitted ({len(failed)} of them failed, the rest had finished): "
              f"each ended at most {slowest:.2f} s after the kill (deadline {deadline:g} s); kinds {kinds}; the root "
              f"served 8 of 8 meanwhile; the object tier up and hitting {up_after:.2f} s after the restart")
    finally:
        chain.close(5)


@pytest.fixture(autouse=True)
def _fresh_state():
    yield
    close_shared_state()


def test_no_request_without_the_endpoint_variables_hangs(tmp_path, monkeypatch) -> None:
    """An endpoint that refuses connections: a store ends typed within its deadline."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # discard port: nothing listens
    monkeypatch.setenv("AWS_ALLOW_HTTP", "true")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    os.environ.pop("AWS_PROFILE", None)
    t = ObjectTier(cfg(tmp_path / "a", "s3://nowhere/p", object_deadline_s=1.0), NS, 0, 0,
                   MetricsRegistry().tier("object"))
    try:
        start = time.monotonic()
        r = store(t, key(1))
        assert not r.ok and r.error.kind in ("io", "timeout")
        assert time.monotonic() - start < 2.0
        assert not t.available
    finally:
        t.close(1)


STALL_S = float(os.environ.get("TIERSTORE_OSD_STALL_S", "10"))  # the measurement run: 60


@pytest.mark.slow
def test_a_stalled_osd_costs_no_request_past_its_deadline_and_no_partial_page(
        tmp_path, s3_env, s3_bucket, ceph_lab) -> None:
    """The storage daemon behind a live gateway stops (SIGSTOP) for ``STALL_S``: the gateway
    holds every request, so each one ends at its deadline; stores that timed out are absent or
    whole afterwards (verified), never partial; loads resume once the OSD is back."""
    deadline = 2.0
    url = f"s3://{s3_bucket}/stall"
    t = ObjectTier(cfg(tmp_path / "a", url, object_deadline_s=deadline, staging_slots=64), NS, 0, 0,
                   MetricsRegistry().tier("object"))
    try:
        before = [key(i, seed=9) for i in range(8)]
        for k in before:
            assert store(t, k).ok
        ceph_lab.stop_osd()
        stalled = time.monotonic()
        late, timed_out, during = [], [], []
        i = 0
        while time.monotonic() - stalled < STALL_S:  # jobs go on; while the tier is down they end at once
            k = key(100 + i, seed=9)
            during.append(k)
            slot = t.acquire_slot(1)
            assert slot is not None
            slot.view[:] = expected(t, k)
            jobs = [t.submit_store(k, slot, 16), t.submit_load(before[i % len(before)])]
            sent = time.monotonic()
            for r in t.wait(jobs, deadline + 5):
                took = time.monotonic() - sent
                if took > deadline + 1:
                    late.append((r.error, took))
                if r.ok and r.op == "load":
                    assert bytes(r.slot.view) == expected(t, r.key)  # never a wrong page
                if r.slot is not None:
                    t.release_slot(r.slot)
                if not r.ok and r.op == "store":
                    timed_out.append(r.key)
            i += 1
            time.sleep(0.2)
        ceph_lab.cont_osd()
        ceph_lab.restart_osd()  # a SIGCONT'ed OSD left RGW's requests blocked (measured): restart it
        back = time.monotonic()
        while not t.available and time.monotonic() < back + 10:
            time.sleep(0.05)
        assert t.available
        assert late == []
        assert timed_out, "no store met the stall"
        verified = absent = 0
        for k in timed_out:
            if t.client.head(t.files.object_key(k)) is None:
                absent += 1
                continue
            r, data = load_page(t, k)
            assert r.ok and data == expected(t, k), r.error  # whole and verified, never partial
            verified += 1
        print(f"\nOSD stalled {STALL_S:.0f} s: {len(during)} store+load pairs, {len(timed_out)} stores failed, "
              f"0 past deadline + 1 s; afterwards {absent} absent, {verified} whole and verified; "
              f"up again {time.monotonic() - back:.2f} s after the OSD restart")
    finally:
        t.close(5)


@pytest.mark.slow
def test_doctor_checks_an_object_tier_and_the_probe_names_a_versioned_bucket(tmp_path, s3_env, s3_bucket,
                                                                              ceph_lab) -> None:
    """``tierstore doctor s3://...`` passes on a plain bucket; on a bucket with versioning on, RGW
    16 stores a second create-only PUT and refuses If-Match even with the current ETag: the
    tier's start-up probe says the first, doctor both (exit 4: gc's lease cannot work there)."""
    import json
    import subprocess
    import sys

    from tierstore.tiers.object import probe_conditional_put

    run = subprocess.run([sys.executable, "-m", "tierstore", "doctor", f"s3://{s3_bucket}/doc", "--json",
                          "--pages", "2", "--page-bytes", "64K"], capture_output=True, text=True, timeout=120)
    doc = json.loads(run.stdout)
    assert run.returncode == 0, (run.stdout, run.stderr)
    assert {c["name"]: c["status"] for c in doc["checks"]} == {
        "endpoint": "ok", "create_only": "ok", "compare_and_swap": "ok", "throughput": "info"}
    assert not _boto(ceph_lab).list_objects_v2(Bucket=s3_bucket, Prefix="doc/").get("KeyCount")

    versioned = ceph_lab.make_bucket(f"{s3_bucket}-v")
    _boto(ceph_lab).put_bucket_versioning(Bucket=versioned, VersioningConfiguration={"Status": "Enabled"})
    t = ObjectTier(cfg(tmp_path / "a", f"s3://{versioned}/p"), NS, 0, 0, MetricsRegistry().tier("object"))
    try:
        assert probe_conditional_put(t.client) == "ignored"
    finally:
        t.close(5)
    run = subprocess.run([sys.executable, "-m", "tierstore", "doctor", f"s3://{versioned}/p", "--json",
                          "--pages", "1", "--page-bytes", "4K"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 4, (run.stdout, run.stderr)  # a check failed: gc's lease cannot work there
    doc = json.loads(run.stdout)
    status = {c["name"]: c["status"] for c in doc["checks"]}
    assert status["create_only"] == "warn" and status["compare_and_swap"] == "fail", status


def test_a_bucket_alone_is_a_chain_and_settings_that_need_a_root_are_refused(tmp_path, s3_env, s3_bucket) -> None:
    """``{"object_url": ...}`` without ``root``: the object tier is the chain's durable tier (with
    a local tier in front, pages it missed are uploaded later from the local tier)."""
    url = f"s3://{s3_bucket}/alone"
    with pytest.raises(ConfigError, match='"max_bytes" and "gc_interval_s"'):
        TierStoreConfig.from_dict({"object_url": url, "max_bytes": "1G"})
    with pytest.raises(ConfigError, match='"root".*"object_url"'):
        TierStoreConfig.from_dict({"io_threads": 2})
    keys = [key(i, seed=11) for i in range(12)]
    a = open_group_store(TierStoreConfig.from_dict({"object_url": url, "io_threads": 2, "index_refresh_s": 0,
                                                    "local_root": str(tmp_path / "local")}), NS, 0,
                         metrics=MetricsRegistry())
    try:
        assert [t.name for t in a.tiers] == ["local", "object"]
        for k in keys:
            assert store(a, k).ok
        assert a.flush(30)
    finally:
        a.close(30)
    close_shared_state()
    b = open_group_store(TierStoreConfig.from_dict({"object_url": url, "io_threads": 2, "index_refresh_s": 0}), NS, 0,
                         metrics=MetricsRegistry())
    try:
        assert [t.name for t in b.tiers] == ["object"]
        for k in keys:
            r, data = load_page(b, k)
            assert r.ok and r.tier == "object" and data == expected(b, k), r.error
    finally:
        b.close(30)
