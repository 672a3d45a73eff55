"""``tierstore doctor s3://BUCKET/PREFIX``: can this endpoint and bucket hold an object tier?

The checks, in order, each under the request deadline (``--deadline-s``), every object they
write under ``PREFIX/.tierstore/doctor-<host>-<pid>/`` and deleted at the end:
- ``endpoint``: a HEAD answers (the keys, the endpoint and the bucket are right); its latency.
- ``create_only``: a second ``If-None-Match: *`` PUT of one key is refused (412). ``ignored``
  fails the check's safety, not its use: pages stay correct (content addresses, verified
  reads) but "stored" may be reported by several writers; RGW 16 ignores the header on a
  bucket with versioning on, so the advice names versioning.
- ``compare_and_swap``: an ``If-Match`` PUT with the current ETag succeeds and one with a stale
  ETag is refused: gc's lease (``objstore/lease.py``) needs both (RGW 16 refuses even the
  current ETag on a bucket with versioning on: measured).
- ``throughput``: ``--pages`` PUTs then GETs of ``--page-bytes`` each, on one thread: MB/s.
The report is ``doctor``'s (``DoctorReport``: the same text, ``--json`` schema and exit codes:
0 every check passed, 16 warnings only, 4 a check failed, 8 the endpoint did not answer).

Failure policy: a request that fails makes its check ``fail`` with the error; the endpoint
not answering at all is exit 8 with the reason. Threading: the caller's thread only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
import time

from tierstore.admin.doctor import EXIT_OPERATIONAL, SCHEMA_VERSION, Check, DoctorReport
from tierstore.config import ObjectLocation
from tierstore.errors import ConfigError, PageError
from tierstore.objstore.client import ObjectClient, ObjectPreconditionFailed
from tierstore.tiers.object import probe_conditional_put


def check_create_only(client: ObjectClient) -> Check:
    found = probe_conditional_put(client)
    if found == "ok":
        return Check("create_only", "ok", "a second If-None-Match: * PUT of one key is refused (412)")
    if found == "ignored":
        return Check("create_only", "warn", "the endpoint stored a second If-None-Match: * PUT of one key", [
            "pages stay correct (content addresses, verified reads), but several writers may each report a "
            "page stored; on Ceph RGW this happens when the bucket has versioning on: turn it off"])
    return Check("create_only", "fail", "the create-only probe's requests failed (see the endpoint check)")


def check_cas(client: ObjectClient, base: str) -> Check:
    key = f"{base}/cas"
    etag = client.put(key, b"first")
    try:
        new = client.put_if_match(key, b"second", etag)
    except ObjectPreconditionFailed:
        return Check("compare_and_swap", "fail", "a PUT with the current If-Match ETag was refused", [
            "gc's lease cannot be renewed here; on Ceph RGW this happens when the bucket has versioning on: "
            "turn it off"])
    try:
        client.put_if_match(key, b"third", etag)  # stale now
    except ObjectPreconditionFailed:
        return Check("compare_and_swap", "ok", "If-Match with the current ETag succeeds, a stale one is refused",
                     data={"etag_changed": new != etag})
    return Check("compare_and_swap", "fail", "a PUT with a stale If-Match ETag was accepted", [
        "gc's lease needs compare-and-swap: run gc from one node only on this endpoint"])


def check_throughput(client: ObjectClient, base: str, pages: int, page_bytes: int) -> Check:
    body = os.urandom(page_bytes)
    keys = [f"{base}/page-{i}" for i in range(pages)]
    t0 = time.perf_counter()
    for k in keys:
        client.put(k, body)
    t1 = time.perf_counter()
    for k in keys:
        got, _ = client.get(k)
        if bytes(got) != body:
            return Check("throughput", "fail", f"GET of {k} returned other bytes than its PUT")
    t2 = time.perf_counter()
    mb = pages * page_bytes / 1e6
    return Check("throughput", "info", f"one thread, {pages} x {page_bytes} B: PUT {mb / (t1 - t0):.0f} MB/s, "
                 f"GET {mb / (t2 - t1):.0f} MB/s", data={"put_mb_s": mb / (t1 - t0), "get_mb_s": mb / (t2 - t1)})


def diagnose_objects(location: ObjectLocation, deadline_s: float, pages: int, page_bytes: int) -> DoctorReport:
    """Every check on ``location`` (module docstring); raises ``PageError`` when the endpoint
    does not answer the first request."""
    start = time.monotonic()
    client = ObjectClient(location, deadline_s)
    rep = DoctorReport(root=location.url, host=socket.gethostname(), generated=time.time())
    base = location.key(f".tierstore/doctor-{socket.gethostname()}-{os.getpid()}")
    t = time.perf_counter()
    client.head(f"{base}/none")
    rep.checks.append(Check("endpoint", "ok", f"HEAD answered in {(time.perf_counter() - t) * 1e3:.1f} ms"))
    try:
        for make in (lambda: check_create_only(client), lambda: check_cas(client, base),
                     lambda: check_throughput(client, base, pages, page_bytes)):
            try:
                rep.checks.append(make())
            except PageError as exc:
                rep.checks.append(Check("request", "fail", str(exc)))
    finally:
        with contextlib.suppress(PageError):  # else left under .tierstore/doctor-*: metadata to gc and fsck
            client.delete_many([info.key for info in client.list_keys(base + "/")])
    rep.seconds = time.monotonic() - start
    return rep


def run_objects(args: argparse.Namespace) -> int:
    """``tierstore doctor s3://...`` (module docstring)."""
    try:
        location = ObjectLocation.parse(args.root, "ROOT")
    except ConfigError as exc:
        print(f"tierstore doctor: {exc}", file=sys.stderr)
        return 2
    try:
        rep = diagnose_objects(location, args.deadline_s, args.pages, args.page_bytes)
    except (PageError, ConfigError) as exc:
        message = f"{location.url} did not answer: {exc} (check AWS_ENDPOINT_URL, the keys and the bucket)"
        print(f"tierstore doctor: {message}", file=sys.stderr)
        if args.json:
            print(json.dumps({"tierstore_doctor": SCHEMA_VERSION, "error": message, "exit_code": EXIT_OPERATIONAL}))
        return EXIT_OPERATIONAL
    print(json.dumps(rep.to_json(), indent=2) if args.json else rep.format_text())
    return rep.exit_code
