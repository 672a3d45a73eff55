"""gc of an object tier (``tierstore gc s3://BUCKET/PREFIX``) against a real Ceph RGW on 127.0.0.1.

What these prove: a pass leaves the prefix under its cap, evicting least recently used first
(hits recorded in access journals keep pages, and still do at the next pass) with at most 1.1x
the bytes that had to go; ``--dry-run`` sends no mutating request (counted by a loopback proxy
in front of the gateway, which counts a real pass's); two gc processes never hold the lease at
once and together evict no more than one would; a dead holder's lease is taken over after its
ttl by the server's clock, a live one never is (not even by a node whose clock is a day ahead),
and of eight takers racing for one lease exactly one wins.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from tiers_helpers import key, load_page, store

from tierstore.admin import cli
from tierstore.config import ObjectLocation, TierStoreConfig
from tierstore.metrics import MetricsRegistry
from tierstore.objstore.access_journal import journal_prefix
from tierstore.objstore.client import ObjectClient
from tierstore.objstore.lease import LEASE_KEY, ObjectLease
from tierstore.testing.pages import simple_namespace
from tierstore.tiers import close_shared_state
from tierstore.tiers.object import ObjectTier
from tierstore.tiers.object_gc import collect_object

NS = simple_namespace()
REPO = Path(__file__).resolve().parents[2]
MUTATING = ("PUT", "POST", "DELETE")


def cfg(root: Path, url: str) -> TierStoreConfig:
    return TierStoreConfig.from_dict({"root": str(root), "object_url": url, "io_threads": 4, "index_refresh_s": 0})


def tier(tmp_path: Path, name: str, url: str) -> ObjectTier:
    return ObjectTier(cfg(tmp_path / name, url), NS, 0, 0, MetricsRegistry().tier("object"))


def client_of(url: str) -> ObjectClient:
    return ObjectClient(ObjectLocation.parse(url), 10.0)


def pages_of(url: str) -> dict[str, int]:
    """The page objects under ``url``: key -> size."""
    loc = ObjectLocation.parse(url)
    return {o.key: o.size for o in client_of(url).list_keys(loc.prefix) if o.key.endswith(".kvp")}


def store_pages(tmp_path: Path, url: str, n: int, seed: int = 0) -> tuple[list[bytes], dict[bytes, str]]:
    """Store ``n`` pages one after the other (creation order = key order); keys and object keys."""
    t = tier(tmp_path, f"writer{seed}", url)
    try:
        keys = [key(i, seed=seed) for i in range(n)]
        for k in keys:
            assert store(t, k).ok
        return keys, {k: t.files.object_key(k) for k in keys}
    finally:
        t.close(10)


def gc_json(url: str, *args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict]:
    """``tierstore gc URL ARGS --json`` in this process: (exit status, the one JSON document)."""
    capsys.readouterr()
    rc = cli.main(["gc", url, *args, "--json"])
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1, out
    return rc, json.loads(out[0])


def say(capsys: pytest.CaptureFixture[str], text: str) -> None:
    """A figure on the terminal (with -s) even in a test that captures the command's output."""
    with capsys.disabled():
        print(text)


@pytest.fixture(autouse=True)
def _fresh_state():
    yield
    close_shared_state()


def test_gc_keeps_the_cap_evicts_lru_first_and_journaled_hits_keep_pages(tmp_path, s3_env, s3_bucket, capsys) -> None:
    url = f"s3://{s3_bucket}/lru"
    keys, okeys = store_pages(tmp_path, url, 40)
    sizes = pages_of(url)
    stored = sum(sizes.values())
    page = max(sizes.values())
    hot = keys[:8]  # the 8 oldest pages: creation order alone would evict them first
    readers = [tier(tmp_path, "reader1", url), tier(tmp_path, "reader2", url)]
    try:
        for i, k in enumerate(hot):
            r, _ = load_page(readers[i % 2], k)
            assert r.ok, r.error
        journals = [t.access.flush() for t in readers]
        assert all(journals), journals
    finally:
        for t in readers:
            t.close(10)
    cap = stored // 2 + page // 3  # not a whole number of pages
    rc, rep = gc_json(url, "--max-bytes", str(cap), "--low-watermark", "1", capsys=capsys)
    assert rc == 0 and not rep["busy"] and not rep["lease_lost"], rep
    after = pages_of(url)
    left = sum(after.values())
    must_go = stored - cap
    over = rep["evicted_bytes"] / must_go
    say(capsys, f"\nobject gc: stored {stored} B in {len(keys)} pages, cap {cap} B, after {left} B; evicted "
          f"{rep['evicted_bytes']} B of {must_go} B that had to go: over-eviction {over:.3f}x; "
          f"journals {rep['journals']}, hot pages {rep['hot_pages']}")
    assert left <= cap and rep["total_after"] == left and rep["total_before"] == stored
    assert over <= 1.1
    assert all(okeys[k] in after for k in hot), "a page hit before the pass was evicted"
    assert rep["journals"] == 2 and rep["hot_pages"] == len(hot)
    kept_cold = [k for k in keys[len(hot):] if okeys[k] in after]
    assert kept_cold == keys[len(keys) - len(kept_cold):], "the pages kept are not the most recently used"
    # the merged journals are gone, replaced by one summary that the next pass still ranks by
    jp = journal_prefix(ObjectLocation.parse(url))
    left_journals = [o.key for o in client_of(url).list_keys(jp.rstrip("/"))]
    assert len(left_journals) == 1 and "gc-summary-" in left_journals[0], left_journals
    cap2 = 12 * page
    rc, rep2 = gc_json(url, "--max-bytes", str(cap2), "--low-watermark", "1", capsys=capsys)
    after2 = pages_of(url)
    assert rc == 0 and sum(after2.values()) <= cap2 and rep2["hot_pages"] == len(hot)
    assert all(okeys[k] in after2 for k in hot), "a hit known only from the summary journal was forgotten"


class CountingProxy:
    """A loopback HTTP proxy in front of the gateway counting requests by method."""

    def __init__(self, endpoint: str) -> None:
        target = urlsplit(endpoint)
        self.counts: dict[str, int] = {}
        self.lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def forward(self) -> None:
                with proxy.lock:
                    proxy.counts[self.command] = proxy.counts.get(self.command, 0) + 1
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else None
                up = http.client.HTTPConnection(target.hostname, target.port, timeout=30)
                try:  # the Host header as signed (the proxy's): the gateway checks the signature with it
                    up.request(self.command, self.path, body=body, headers=dict(self.headers.items()))
                    resp = up.getresponse()
                    data = resp.read()
                finally:
                    up.close()
                self.send_response(resp.status, resp.reason)
                for name, value in resp.getheaders():
                    if name.lower() not in ("transfer-encoding", "content-length", "connection"):
                        self.send_header(name, value)
                # a HEAD's Content-Length is the object's size (the client reads it)
                length = resp.getheader("Content-Length", "0") if self.command == "HEAD" else str(len(data))
                self.send_header("Content-Length", length)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = forward

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def take(self) -> dict[str, int]:
        with self.lock:
            out, self.counts = self.counts, {}
        return out

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_dry_run_sends_no_mutating_request(tmp_path, s3_env, s3_bucket, ceph_lab, monkeypatch, capsys) -> None:
    url = f"s3://{s3_bucket}/dry"
    keys, _ = store_pages(tmp_path, url, 20)
    reader = tier(tmp_path, "reader", url)
    try:
        assert load_page(reader, keys[0])[0].ok
        assert reader.access.flush()
    finally:
        reader.close(10)
    cap = sum(pages_of(url).values()) // 2
    proxy = CountingProxy(ceph_lab.endpoint)
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        rc, dry = gc_json(url, "--max-bytes", str(cap), "--dry-run", capsys=capsys)
        dry_counts = proxy.take()
        rc2, real = gc_json(url, "--max-bytes", str(cap), capsys=capsys)
        real_counts = proxy.take()
    finally:
        proxy.close()
    dry_mut = sum(dry_counts.get(m, 0) for m in MUTATING)
    real_mut = sum(real_counts.get(m, 0) for m in MUTATING)
    say(capsys, f"\nrequests: dry run {dry_counts} ({dry_mut} mutating); real pass {real_counts} ({real_mut} mutating)")
    assert rc == rc2 == 0 and dry["dry_run"] and not real["dry_run"]
    assert sum(dry_counts.values()) > 0, "the dry run's requests did not go through the proxy"
    assert dry_mut == 0, dry_counts
    assert real_mut > 0, real_counts  # the counter sees mutating requests: lease, clock, deletes, journals
    assert (dry["evicted"], dry["evicted_bytes"]) == (real["evicted"], real["evicted_bytes"]) and real["evicted"] > 0
    assert dry["journals"] == real["journals"] == 1


def _gc_process(url: str, cap: int, env: dict[str, str], out: Path) -> subprocess.Popen[str]:
    """A ``gc --loop`` process whose stdout and stderr go to ``out``.stdout/.stderr: files, so
    a loop never blocks on a full pipe while the test is busy storing."""
    return subprocess.Popen([sys.executable, "-m", "tierstore", "gc", url, "--max-bytes", str(cap), "--low-watermark",
                             "1", "--loop", "0.1", "--json"], cwd=REPO, env={**os.environ, **env, "PYTHONFAULTHANDLER": "1"},
                            stdout=out.with_suffix(".stdout").open("w"), stderr=out.with_suffix(".stderr").open("w"),
                            text=True)


def _stopped(proc: subprocess.Popen[str], out: Path) -> tuple[str, str]:
    """A gc loop's (stdout, stderr) once it exited after its SIGINT (the pass in progress ends
    first: admin/loop_stop.py). One that has not within 60 s is aborted, and the failure shows
    its threads' stacks (faulthandler): a loop once did not exit, cause unknown."""
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        proc.wait(timeout=30)
        pytest.fail(f"a gc loop did not exit within 60 s of SIGINT; its stacks:\n"
                    f"{out.with_suffix('.stderr').read_text()[-8000:]}")
    return out.with_suffix(".stdout").read_text(), out.with_suffix(".stderr").read_text()


def _intervals_disjoint(spans: list[tuple[object, object, int]]) -> list[tuple]:
    """The pairs of consecutive spans (sorted) that overlap."""
    spans = sorted(spans)
    return [(a, b) for a, b in zip(spans, spans[1:], strict=False) if a[1] > b[0]]


@pytest.mark.slow
def test_two_gc_processes_never_hold_the_lease_at_once(tmp_path, s3_env, s3_bucket) -> None:
    url = f"s3://{s3_bucket}/two"
    keys, _ = store_pages(tmp_path, url, 40)
    sizes = pages_of(url)
    page = max(sizes.values())
    cap = sum(sizes.values()) // 2 + page // 3
    procs = [_gc_process(url, cap, s3_env, tmp_path / f"gc{n}") for n in range(2)]
    writer = tier(tmp_path, "writer-late", url)
    added = 0
    try:  # more pages while both loop: each pass that holds the lease has something to evict
        time.sleep(2.0)
        for i in range(30):
            assert store(writer, key(i, seed=9)).ok
            added += 1
            time.sleep(0.1)
        time.sleep(3.0)  # the last pages' pass
    finally:
        writer.close(10)
        for p in procs:
            p.send_signal(signal.SIGINT)
        outs = [_stopped(p, tmp_path / f"gc{n}") for n, p in enumerate(procs)]
    docs = [[json.loads(line) for line in out.splitlines() if line.startswith("{")] for out, _ in outs]
    held = [[d for d in ds if not d.get("busy") and "error" not in d] for ds in docs]
    assert all(held), f"a process never held the lease: {[len(h) for h in held]}; stderr {[e[-500:] for _, e in outs]}"
    local = [(d["started_at"], d["finished_at"], n) for n, hs in enumerate(held) for d in hs]
    server = [(d["lease_from"], d["lease_to"], n) for n, hs in enumerate(held) for d in hs
              if d["lease_from"] and d["lease_to"]]
    hand_overs = [(a, b) for a, b in zip(sorted(local), sorted(local)[1:], strict=False) if a[2] != b[2]]
    print(f"\nlease intervals (this host's clock): {len(local)}, {len(hand_overs)} hand-overs between the processes; "
          f"the first six: {sorted(local)[:6]}")
    print(f"lease intervals (the server's clock, whole seconds): the first six: {sorted(server)[:6]}")
    assert _intervals_disjoint(local) == [], "two processes held the lease at once"
    assert _intervals_disjoint(server) == [], "two processes held the lease at once (server clock)"
    assert all(not d["lease_lost"] for hs in held for d in hs)
    stored = sum(sizes.values()) + added * page
    left = sum(pages_of(url).values())
    evicted = sum(d["evicted_bytes"] for hs in held for d in hs)
    must_go = stored - cap
    print(f"two processes: {[len(d) for d in docs]} passes, {[len(h) for h in held]} holding the lease; stored "
          f"{stored} B, cap {cap} B, after {left} B; evicted {evicted} B of {must_go} B: {evicted / must_go:.3f}x")
    assert left <= cap
    assert evicted == stored - left  # no page counted twice: no pass deleted what another had deleted
    assert evicted / must_go <= 1.1


@pytest.mark.slow
def test_a_dead_holders_lease_is_taken_over_after_its_ttl_by_the_servers_clock(s3_env, s3_bucket, monkeypatch,
                                                                               capsys) -> None:
    url = f"s3://{s3_bucket}/dead"
    client = client_of(url)
    lease_key = client.location.key(LEASE_KEY)
    ttl = 3
    dead = {"tierstore_gc_lease": 1, "state": "held", "owner": "dead-node", "ttl": ttl, "host": "gone", "pid": 1}
    client.put(lease_key, json.dumps(dead).encode())
    planted = time.monotonic()
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + 86400)  # this node's clock a day ahead
    taker = ObjectLease(client, ttl_s=30, skew_s=1)
    assert not taker.acquire() and taker.holder == "dead-node"  # live by the server's clock
    while not taker.acquire():
        assert time.monotonic() - planted < 15, "the dead holder's lease was never taken over"
        time.sleep(0.25)
    waited = time.monotonic() - planted
    say(capsys, f"\ndead holder (ttl {ttl} s, skew 1 s) taken over after {waited:.1f} s")
    assert taker.taken_over == "dead-node" and waited >= ttl
    assert taker.release()
    # the command line: a dead holder is taken over and said in the report
    client.put(lease_key, json.dumps({**dead, "ttl": 1}).encode())
    time.sleep(1 + 5 + 1 + 1.5)  # ttl + the CLI's skew + HEAD's whole seconds, by the server's clock
    rc, rep = gc_json(url, "--max-bytes", "1G", capsys=capsys)
    assert rc == 0 and not rep["busy"] and rep["lease_taken_over"] == "dead-node", rep


@pytest.mark.slow
def test_a_live_lease_is_never_taken_and_one_of_eight_racing_takers_wins(s3_env, s3_bucket, monkeypatch, capsys) -> None:
    url = f"s3://{s3_bucket}/live"
    client = client_of(url)
    holder = ObjectLease(client, ttl_s=3, skew_s=1, renew_every_s=0.5, owner="holder")
    assert holder.acquire()
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + 86400)  # the challenger's clock a day ahead
    challenger = ObjectLease(client, ttl_s=3, skew_s=1)
    end = time.monotonic() + 3 + 1 + 1 + 3  # past ttl + skew + granularity, renewed all along
    tries = 0
    while time.monotonic() < end:
        assert holder.renew_if_due()
        assert not challenger.acquire() and challenger.holder == "holder"
        tries += 1
        time.sleep(0.3)
    rc, rep = gc_json(url, "--max-bytes", "1G", capsys=capsys)
    assert rc == 0 and rep["busy"] and rep["lease_holder"] == "holder"
    assert holder.release()
    assert challenger.acquire() and challenger.taken_over is None  # a released lease: taken at once
    assert challenger.release()

    # eight takers racing for a free lease, then for an expired one: exactly one wins each time
    for state in ("free", "expired"):
        if state == "expired":
            body = {"tierstore_gc_lease": 1, "state": "held", "owner": "dead", "ttl": 1, "host": "x", "pid": 1}
            client.put(client.location.key(LEASE_KEY), json.dumps(body).encode())
            time.sleep(1 + 1 + 1 + 1.5)
        takers = [ObjectLease(client_of(url), ttl_s=30, skew_s=1) for _ in range(8)]
        go = threading.Barrier(8)
        won: list[bool] = [False] * 8

        def take(i: int, takers: list[ObjectLease] = takers, won: list[bool] = won, go: threading.Barrier = go) -> None:
            go.wait()
            won[i] = takers[i].acquire()

        threads = [threading.Thread(target=take, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        say(capsys, f"\n{state} lease, 8 takers: {sum(won)} won")
        assert sum(won) == 1, won
        assert takers[won.index(True)].release()
    say(capsys, f"live lease: {tries} takeover attempts over {3 + 1 + 1 + 3} s, none won")


def test_a_pass_that_loses_the_lease_stops_evicting(tmp_path, s3_env, s3_bucket) -> None:
    url = f"s3://{s3_bucket}/lost"
    store_pages(tmp_path, url, 6)
    before = pages_of(url)
    client = client_of(url)
    lease = ObjectLease(client, ttl_s=30, renew_every_s=0)  # renewed before every step
    real_put_if_match = client.put_if_match
    calls = []

    def put_if_match(k: str, body: bytes, etag: str) -> str:
        calls.append(k)
        if len(calls) == 1:  # the first renewal: another node took the lease over just before it
            client.put(k, b'{"tierstore_gc_lease": 1, "state": "held", "owner": "thief", "ttl": 30}')
        return real_put_if_match(k, body, etag)

    client.put_if_match = put_if_match  # type: ignore[method-assign]
    rep = collect_object(url, 1, low_watermark=1, client=client, lease=lease)
    assert rep.lease_lost and rep.evicted == 0 and rep.pages == 6
    assert pages_of(url) == before
    body, _ = client.get(client.location.key(LEASE_KEY))
    assert json.loads(bytes(body))["owner"] == "thief"  # the release did not free the thief's lease


def test_the_grammar_of_gc_on_a_bucket_prefix(tmp_path, s3_env, s3_bucket, capsys) -> None:
    """Exit statuses and text of the directory command: 2 for a flag with no meaning here, 8 for a
    prefix that is not a cache, 0 and one line when another node holds the lease."""
    url = f"s3://{s3_bucket}/grammar"
    assert cli.main(["gc", url, "--max-bytes", "1M", "--trash-grace", "5"]) == 2
    assert "--trash-grace does not apply" in capsys.readouterr().err
    assert cli.main(["gc", "s3://", "--max-bytes", "1M"]) == 2
    client = client_of(url)
    client.put(client.location.key("holiday/photo.jpg"), b"not a page")
    assert cli.main(["gc", url, "--max-bytes", "1M"]) == 8
    assert "not a cache prefix" in capsys.readouterr().err
    client.delete_many([client.location.key("holiday/photo.jpg")])
    store_pages(tmp_path, url, 4)
    assert cli.main(["gc", url, "--max-bytes", "1", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "4 pages" in out and "a real pass would evict 4 pages" in out and "[dry run: nothing changed]" in out
    holder = ObjectLease(client, owner="node-a")
    assert holder.acquire()
    assert cli.main(["gc", url, "--max-bytes", "1"]) == 0
    assert "another node holds the gc lease" in capsys.readouterr().out and len(pages_of(url)) == 4
    assert holder.release()
    assert cli.main(["gc", url, "--max-bytes", "1"]) == 0
    assert "evicted 4 pages" in capsys.readouterr().out and pages_of(url) == {}
