"""The Ceph lab (tierstore.testing.ceph_lab): S3 on a real RADOS Gateway, its faults, CephFS,
and a stop that leaves nothing behind.

Also pins what the S3 object tier can rely on from RGW 16 (Debian 12's Ceph 16.2) through
obstore 0.12: a create-only put (``If-None-Match: *``) that fails raises ``AlreadyExistsError``;
a missing key raises ``FileNotFoundError``; ETags come back quoted, and RGW 16's ``If-Match`` on
a PUT matches only the unquoted ETag (the quoted one, as obstore returns and sends it, gets a
412 even when it is current); bulk delete (DeleteObjects) works, missing keys included.
"""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta
from pathlib import Path

import botocore.exceptions
import obstore
import pytest
from obstore.exceptions import AlreadyExistsError, PreconditionError
from obstore.store import S3Store

from tierstore.testing.ceph_lab import CephLab, CephLabError, ceph_available


def _store(lab: CephLab, bucket: str) -> S3Store:
    return S3Store(bucket, endpoint=lab.endpoint, access_key_id=lab.access_key,
                   secret_access_key=lab.secret_key, region=lab.region,
                   virtual_hosted_style_request=False,
                   client_options={"allow_http": True, "timeout": "10s", "connect_timeout": "2s"},
                   retry_config={"max_retries": 2, "retry_timeout": timedelta(seconds=10)})


def _processes_naming(path: Path) -> list[str]:
    """The command lines of the running processes that name ``path`` (the lab's leftovers)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if str(path) in cmdline:
            found.append(f"{pid}: {cmdline}")
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_put_and_get_with_boto3(ceph_lab: CephLab, s3_bucket: str) -> None:
    s3 = ceph_lab.s3_client()
    s3.put_object(Bucket=s3_bucket, Key="dir/page", Body=b"page bytes")
    assert s3.get_object(Bucket=s3_bucket, Key="dir/page")["Body"].read() == b"page bytes"
    listed = s3.list_objects_v2(Bucket=s3_bucket, Prefix="dir/")
    assert [o["Key"] for o in listed["Contents"]] == ["dir/page"]


def test_if_none_match_star_refuses_a_second_put_with_boto3(ceph_lab: CephLab, s3_bucket: str) -> None:
    s3 = ceph_lab.s3_client()
    s3.put_object(Bucket=s3_bucket, Key="k", Body=b"first", IfNoneMatch="*")
    with pytest.raises(botocore.exceptions.ClientError) as info:
        s3.put_object(Bucket=s3_bucket, Key="k", Body=b"second", IfNoneMatch="*")
    assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    assert info.value.response["Error"]["Code"] == "PreconditionFailed"
    assert s3.get_object(Bucket=s3_bucket, Key="k")["Body"].read() == b"first"


def test_obstore_create_mode_raises_already_exists(ceph_lab: CephLab, s3_bucket: str) -> None:
    store = _store(ceph_lab, s3_bucket)
    obstore.put(store, "k", b"first", mode="create")
    with pytest.raises(AlreadyExistsError, match="412 Precondition Failed"):
        obstore.put(store, "k", b"second", mode="create")
    assert obstore.get(store, "k").bytes() == b"first"


def test_obstore_missing_key_raises_file_not_found(ceph_lab: CephLab, s3_bucket: str) -> None:
    store = _store(ceph_lab, s3_bucket)
    with pytest.raises(FileNotFoundError, match="404 Not Found"):
        obstore.get(store, "missing").bytes()
    with pytest.raises(FileNotFoundError):
        obstore.head(store, "missing")


def test_rgw16_if_match_takes_the_etag_unquoted(ceph_lab: CephLab, s3_bucket: str) -> None:
    store = _store(ceph_lab, s3_bucket)
    etag = obstore.put(store, "k", b"v1")["e_tag"]
    assert etag is not None and etag.startswith('"') and etag.endswith('"')
    assert obstore.head(store, "k")["e_tag"] == etag
    # the current ETag as obstore gives it (quoted, as RFC 9110 has it): RGW 16 says 412
    with pytest.raises(PreconditionError):
        obstore.put(store, "k", b"v2", mode={"e_tag": etag})
    new_etag = obstore.put(store, "k", b"v2", mode={"e_tag": etag.strip('"')})["e_tag"]
    assert obstore.get(store, "k").bytes() == b"v2"
    # a stale ETag and a missing key: 412 as well
    with pytest.raises(PreconditionError):
        obstore.put(store, "k", b"v3", mode={"e_tag": etag.strip('"')})
    with pytest.raises(PreconditionError):
        obstore.put(store, "nothing-here", b"v3", mode={"e_tag": new_etag.strip('"')})
    assert obstore.get(store, "k").bytes() == b"v2"


def test_obstore_bulk_delete(ceph_lab: CephLab, s3_bucket: str) -> None:
    store = _store(ceph_lab, s3_bucket)
    keys = [f"d/{i}" for i in range(5)]
    for key in keys:
        obstore.put(store, key, b"x")
    obstore.put(store, "kept", b"x")
    obstore.delete(store, [*keys, "d/never-written"])
    assert [m["path"] for m in obstore.list(store).collect()] == ["kept"]


def test_obstore_reads_the_labs_environment(s3_env: dict[str, str], s3_bucket: str) -> None:
    store = S3Store(s3_bucket)  # endpoint, keys, region and allow_http from AWS_*
    obstore.put(store, "k", b"from the environment")
    assert obstore.get(store, "k").bytes() == b"from the environment"


def test_kill_and_restart_rgw(ceph_lab: CephLab, s3_bucket: str) -> None:
    s3 = ceph_lab.s3_client()
    s3.put_object(Bucket=s3_bucket, Key="k", Body=b"kept")
    old_pid = ceph_lab.pids["rgw"]
    ceph_lab.kill_rgw()
    assert "rgw" not in ceph_lab.pids and not _alive(old_pid)
    with pytest.raises(botocore.exceptions.EndpointConnectionError):
        s3.get_object(Bucket=s3_bucket, Key="k")
    ceph_lab.restart_rgw()
    assert ceph_lab.pids["rgw"] != old_pid
    assert s3.get_object(Bucket=s3_bucket, Key="k")["Body"].read() == b"kept"
    # the dead radosgw's watches are gone (blocklisted): a metadata change does not wait 30 s
    began = time.monotonic()
    ceph_lab.make_bucket(f"{s3_bucket}-after")
    assert time.monotonic() - began < 10


def test_a_stopped_osd_holds_requests_until_it_continues(ceph_lab: CephLab, s3_bucket: str) -> None:
    s3 = ceph_lab.s3_client()
    s3.put_object(Bucket=s3_bucket, Key="k", Body=b"held")
    got: list[bytes] = []
    ceph_lab.stop_osd()
    try:
        reader = threading.Thread(
            target=lambda: got.append(s3.get_object(Bucket=s3_bucket, Key="k")["Body"].read()))
        reader.start()
        reader.join(2.0)
        assert reader.is_alive() and not got  # RGW waits on the OSD
    finally:
        ceph_lab.cont_osd()
    reader.join(10.0)
    if reader.is_alive():  # a continued OSD may leave RGW's held op waiting ("waiting for readable",
        ceph_lab.restart_osd()  # measured); a restart serves it
        reader.join(20.0)
    assert got == [b"held"]


@pytest.mark.slow
def test_restart_osd(ceph_lab: CephLab, s3_bucket: str) -> None:
    s3 = ceph_lab.s3_client()
    s3.put_object(Bucket=s3_bucket, Key="k", Body=b"durable")
    old_pid = ceph_lab.pids["osd"]
    ceph_lab.restart_osd()
    assert ceph_lab.pids["osd"] != old_pid and not _alive(old_pid)
    assert s3.get_object(Bucket=s3_bucket, Key="k")["Body"].read() == b"durable"
    s3.put_object(Bucket=s3_bucket, Key="k2", Body=b"after")
    began = time.monotonic()
    ceph_lab.make_bucket(f"{s3_bucket}-after")
    assert time.monotonic() - began < 10


def test_two_cephfs_clients_see_each_others_files(ceph_lab: CephLab) -> None:
    if not ceph_lab.cephfs:
        pytest.skip(ceph_available(cephfs=True) or "the lab has no CephFS")
    top = ceph_lab.data_dir / "mnt"  # not under pytest's tmp_path: no one else's cleanup walks in
    one = ceph_lab.mount_cephfs(top / "one", "one")
    two = ceph_lab.mount_cephfs(top / "two", "two")
    try:
        with pytest.raises(ValueError, match="one client name per mount"):
            ceph_lab.mount_cephfs(top / "three", "one")
        (one / "from-one").write_bytes(b"written by client.one")
        assert (two / "from-one").read_bytes() == b"written by client.one"
        (two / "sub").mkdir()
        (two / "sub" / "from-two").write_bytes(b"2")
        os.rename(one / "sub" / "from-two", one / "sub" / "renamed")
        assert sorted(p.name for p in (two / "sub").iterdir()) == ["renamed"]
    finally:
        ceph_lab.unmount_cephfs(one)
        ceph_lab.unmount_cephfs(two)
    assert not os.path.ismount(one) and not os.path.ismount(two)


@pytest.mark.slow
def test_stop_ends_every_daemon_and_removes_the_directory(ceph_data_dir: Path) -> None:
    if (why := ceph_available()) is not None:
        pytest.skip(why)
    data_dir = ceph_data_dir
    lab = CephLab.start(data_dir)
    try:
        assert set(lab.pids) == {"mon", "mgr", "osd", "rgw"}
        lab.make_bucket("stop-test")
        lab.restart_rgw()  # a restarted daemon is one more pid to end
    finally:
        began = time.monotonic()
        lab.stop()
        stop_s = time.monotonic() - began
    assert len(lab.started_pids) == 5
    assert [pid for pid in lab.started_pids if _alive(pid)] == []
    assert _processes_naming(data_dir) == []
    assert not data_dir.exists()
    assert stop_s < 15
    lab.stop()  # idempotent


def test_a_start_that_fails_half_way_leaves_no_daemon(ceph_data_dir: Path) -> None:
    if (why := ceph_available()) is not None:
        pytest.skip(why)
    data_dir = ceph_data_dir
    with pytest.raises(CephLabError) as info:
        CephLab.start(data_dir, timeout=2.0)  # the manager and the OSD need longer
    assert info.value.phase in {"mon", "mgr", "osd", "io"}
    assert "within 2 s" in str(info.value) and "--- log tail ---" in str(info.value)
    assert _processes_naming(data_dir) == []
    assert not data_dir.exists()
