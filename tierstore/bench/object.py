"""``tierstore bench object``: the object tier's stores and warm loads against the raw S3 client.

In one run, against the bucket of ``--url s3://BUCKET/PREFIX`` (endpoint and credentials from
``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``,
``AWS_ALLOW_HTTP=true``), for each page size (``--sizes``, MiB; default 0.5, 2 and 16), the
same ``--pages`` pages (default: 64 MiB of them, at least 8) are moved by three systems, each
with ``--threads`` threads:

- ``tier``: an ``ObjectTier`` (``io_threads`` = ``--threads``). Store: every page is put in
  its own staging slot before the clock starts (the tier's API takes a page in a slot: that is
  where the GPU copy lands it), then submitted, keeping up to ``--in-flight`` (default 2 x
  threads) jobs in flight (the oldest waited for: ``PageStore.wait`` waits for all of the ids it
  is given), until the last one is stored (each one create-only PUT of the canonical
  page file: header + page, section checksums computed). Warm load: every page just stored,
  submitted the same way, until the last one is in its slot (one GET, copied into the slot and
  its section checksums verified, as the tier always does). The bench keeps the slots until the
  clock stops, then checks every loaded page byte for byte against what was stored.
- ``obstore``: ``obstore.put`` (one PUT: ``use_multipart=False``, as the tier and boto3's
  ``put_object`` send) then ``obstore.get(...).bytes()`` of exactly the bodies the tier PUT
  (its canonical page files, fetched once after the warm-up round), to fresh keys under the
  same bucket, from a ``ThreadPoolExecutor`` of ``--threads`` threads; an ``S3Store`` with the
  tier client's connection options (plain http, path-style), obstore's own retry defaults.
- ``boto3``: ``put_object`` then ``get_object(...)["Body"].read()`` of the same bodies, the
  same way; one client shared by the threads (``max_pool_connections`` = 2 x threads,
  path-style, botocore's default checksum behaviour).

Loaded bodies of the raw systems are checked against the bodies after the clock stops, as the
tier's pages are. Every round moves every system's pages to keys of their own (random per run:
a store never finds its object there already); an untimed warm-up round comes first (the
connection pools filled; the tier's start-up probe and first listing finished). Then
``--repeats`` timed rounds, the system order reversed every other round (tier first, then
last). Reported per size: the median MB/s (10^6 bytes of object per second; every system moves
the same bodies) of each system's store and load, and the ratios tier/obstore and tier/boto3,
the median of the ratios paired within a round (``ratio_range`` their spread: the run's noise;
``ratio_of_medians`` too). Process CPU seconds per GB of each phase are in the JSON (the
endpoint shares the machine's cores when it is a local lab, so client CPU is endpoint time).

The project's targets (``TARGETS``): store and warm load at 2 MiB and 16 MiB at least 0.9x each
raw client, at 0.5 MiB at least 0.8x; the report says which are met. The exit status is 0 when
the bench ran, whatever the figures.
Every object the run wrote (all under ``PREFIX/bench-object-<run id>/``) is deleted at the end
(``DeleteObjects``), also after a failure.

Run: ``tierstore bench object --url s3://BUCKET/PREFIX [--sizes 0.5,2,16] [--json]``.
Threading: the tier's I/O threads, the baselines' thread pools, the main thread submitting and
waiting; nothing here is used by the library.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

from tierstore.admin.cli import positive_int
from tierstore.bench.io import bench_namespace
from tierstore.config import ObjectLocation, TierStoreConfig
from tierstore.errors import TierStoreError
from tierstore.metrics import MetricsRegistry
from tierstore.objstore.client import ObjectClient
from tierstore.testing.pages import page_bytes

MIB = 1 << 20
SYSTEMS = ("tier", "obstore", "boto3")
BASELINES = ("obstore", "boto3")
PHASES = ("store", "load")
DEFAULT_MIB_PER_SIZE = 64
MIN_PAGES = 8
WAIT_S = 120.0
# Done-when figures: tier / raw client (each baseline), store and warm load, by page size (MiB).
TARGETS = {0.5: 0.8, 2.0: 0.9, 16.0: 0.9}


def _sizes(text: str) -> list[float]:
    try:
        sizes = [float(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"sizes are MiB separated by commas, got {text!r}") from None
    if not sizes or any(s <= 0 for s in sizes):
        raise argparse.ArgumentTypeError(f"sizes must be positive MiB, got {text!r}")
    return sizes


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True, help="s3://BUCKET/PREFIX: where the run writes (all under "
                   "PREFIX/bench-object-<run id>/, deleted at the end)")
    p.add_argument("--sizes", type=_sizes, default=[0.5, 2.0, 16.0], help="page sizes in MiB (default 0.5,2,16)")
    p.add_argument("--pages", type=positive_int, default=None,
                   help=f"pages per size (default {DEFAULT_MIB_PER_SIZE} MiB of pages, at least {MIN_PAGES})")
    p.add_argument("--threads", type=positive_int, default=4, help="tier I/O threads = baseline threads")
    p.add_argument("--in-flight", type=positive_int, default=None,
                   help="tier jobs kept in flight, the oldest waited for (default 2 x threads)")
    p.add_argument("--repeats", type=positive_int, default=3, help="timed rounds (after one untimed warm-up)")
    p.add_argument("--json", action="store_true")


class _Progress:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.t0 = time.monotonic()

    def __call__(self, msg: str) -> None:
        if self.enabled:
            print(f"[{time.monotonic() - self.t0:7.1f}s] bench object: {msg}", file=sys.stderr, flush=True)


def _timed(fn: Callable[[], Any]) -> tuple[float, float, Any]:
    """(wall seconds, process CPU seconds, result) of ``fn``."""
    c0, t0 = time.process_time(), time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, time.process_time() - c0, out


# ----------------------------------------------------------------------------- the tier
class TierSystem:
    """One ``ObjectTier`` for one page size; each round stores and loads under new keys."""

    def __init__(self, url: str, page: int, pages: int, threads: int, in_flight: int, work: str) -> None:
        from tierstore.tiers.object import ObjectTier

        self.ns = bench_namespace(page)
        self.layout = self.ns.groups[0].layout
        self.tokens = self.ns.groups[0].tokens_per_chunk
        self.in_flight = in_flight
        cfg = TierStoreConfig.from_dict({"root": work, "object_url": url, "io_threads": threads,
                                         "index_refresh_s": 0})
        # A slot per page and per job in flight: the bench holds every loaded page until the
        # clock stops (its byte check is not the tier's time).
        self.tier = ObjectTier(cfg, self.ns, 0, 0, MetricsRegistry().tier("object"),
                               staging_slots=pages + in_flight)
        self.data = [page_bytes(self.layout, os.urandom(32)) for _ in range(pages)]

    def ready(self, timeout: float = 30.0) -> None:
        """The tier's first listing and start-up probe are over (neither runs beside a timed phase)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            index = self.tier.index
            if index is not None and index.listed.is_set() and self.tier.conditional_put != "unknown":
                return
            time.sleep(0.05)

    def store(self, keys: list[bytes]) -> tuple[float, float]:
        """Seconds (wall, CPU) to store every page under ``keys`` (slots filled beforehand)."""
        t = self.tier
        slots = []
        for d in self.data:
            slot = t.acquire_slot(30.0)
            if slot is None:
                raise TierStoreError("bench object: no free staging slot for a store")
            slot.view[:] = d
            slots.append(slot)
        limit = self.in_flight

        def go() -> None:
            inflight: deque[int] = deque()
            for k, slot in zip(keys, slots, strict=True):
                if len(inflight) >= limit:
                    _check_stores(t.wait([inflight.popleft()], WAIT_S))
                inflight.append(t.submit_store(k, slot, self.tokens))
            _check_stores(t.wait(list(inflight), WAIT_S), len(inflight))

        wall, cpu, _ = _timed(go)
        return wall, cpu

    def load(self, keys: list[bytes]) -> tuple[float, float]:
        """Seconds (wall, CPU) to load every page under ``keys`` into slots; then checked, released."""
        t = self.tier
        limit = self.in_flight
        results: dict[int, Any] = {}

        def go() -> None:
            inflight: deque[int] = deque()
            for k in keys:
                if len(inflight) >= limit:
                    for r in t.wait([inflight.popleft()], WAIT_S):
                        results[r.job_id] = r
                inflight.append(t.submit_load(k))
            for r in t.wait(list(inflight), WAIT_S):
                results[r.job_id] = r

        try:
            wall, cpu, _ = _timed(go)
            if len(results) != len(keys):
                raise TierStoreError(f"bench object: {len(keys) - len(results)} tier loads did not complete")
            by_key = {r.key: r for r in results.values()}
            for k, d in zip(keys, self.data, strict=True):
                r = by_key[k]
                if not r.ok or r.slot is None:
                    raise TierStoreError(f"bench object: a tier load failed: {r.error}")
                if bytes(r.slot.view) != d:
                    raise TierStoreError(f"bench object: tier page {k.hex()[:12]} came back different")
        finally:
            for r in results.values():
                if r.slot is not None:
                    t.release_slot(r.slot)
        return wall, cpu

    def object_keys(self, keys: list[bytes]) -> list[str]:
        return [self.tier.files.object_key(k) for k in keys]

    def close(self) -> None:
        self.tier.close(30.0)


def _check_stores(results: list[Any], expect: int = 1) -> None:
    if len(results) != expect:
        raise TierStoreError(f"bench object: {expect - len(results)} tier stores did not complete in {WAIT_S:g} s")
    for r in results:
        if not r.ok:
            raise TierStoreError(f"bench object: a tier store failed: {r.error}")
        if not r.stored:
            raise TierStoreError("bench object: a tier store found its object there already (keys are fresh)")


# ----------------------------------------------------------------------------- raw clients
def _allow_http() -> bool:
    return (os.environ.get("AWS_ALLOW_HTTP") or "").strip().lower() in ("1", "true", "yes", "on")


class ObstoreSystem:
    """obstore's ``put``/``get`` from a thread pool (module docstring)."""

    name = "obstore"

    def __init__(self, bucket: str, threads: int) -> None:
        import obstore
        from obstore.store import S3Store

        self._ob = obstore
        kwargs: dict[str, Any] = {}
        if not os.environ.get("AWS_VIRTUAL_HOSTED_STYLE_REQUEST"):
            kwargs["virtual_hosted_style_request"] = False
        self.store = S3Store(bucket, client_options={"allow_http": _allow_http(),
                                                     "timeout": timedelta(seconds=WAIT_S)}, **kwargs)
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="bench-obstore")

    def put(self, key: str, body: bytes) -> None:
        self._ob.put(self.store, key, body, use_multipart=False)

    def get(self, key: str) -> Any:
        return self._ob.get(self.store, key).bytes()

    def close(self) -> None:
        self.pool.shutdown()


class Boto3System:
    """boto3's ``put_object``/``get_object`` from a thread pool, one shared client (module docstring)."""

    name = "boto3"

    def __init__(self, bucket: str, threads: int) -> None:
        import boto3
        from botocore.config import Config

        self.bucket = bucket
        style = "virtual" if os.environ.get("AWS_VIRTUAL_HOSTED_STYLE_REQUEST") else "path"
        config = Config(max_pool_connections=2 * threads, s3={"addressing_style": style},
                        read_timeout=WAIT_S, retries={"max_attempts": 2, "mode": "standard"})
        self.s3 = boto3.session.Session().client("s3", config=config)
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="bench-boto3")

    def put(self, key: str, body: bytes) -> None:
        self.s3.put_object(Bucket=self.bucket, Key=key, Body=body)

    def get(self, key: str) -> Any:
        return self.s3.get_object(Bucket=self.bucket, Key=key)["Body"].read()

    def close(self) -> None:
        self.pool.shutdown()


def _raw_round(sys_: ObstoreSystem | Boto3System, keys: list[str], bodies: list[bytes],
               ) -> tuple[tuple[float, float], tuple[float, float]]:
    """((store wall, CPU), (load wall, CPU)) of PUT then GET of every body; loads checked after."""
    wall_s, cpu_s, _ = _timed(lambda: list(sys_.pool.map(sys_.put, keys, bodies)))
    wall_l, cpu_l, got = _timed(lambda: list(sys_.pool.map(sys_.get, keys)))
    for k, b, g in zip(keys, bodies, got, strict=True):
        if bytes(g) != b:
            raise TierStoreError(f"bench object: {sys_.name} object {k} came back different")
    return (wall_s, cpu_s), (wall_l, cpu_l)


# ----------------------------------------------------------------------------- one page size
def _pages_for(size_mib: float, pages: int | None) -> int:
    return pages if pages is not None else max(MIN_PAGES, round(DEFAULT_MIB_PER_SIZE / size_mib))


def _measure_size(size_mib: float, args: argparse.Namespace, run_loc: ObjectLocation, work: str,
                  raws: dict[str, Any], say: _Progress) -> dict[str, Any]:
    page = int(round(size_mib * MIB))
    n = _pages_for(size_mib, args.pages)
    tag = f"{size_mib:g}MiB"
    tier_url = f"s3://{run_loc.bucket}/{run_loc.key(f'tier-{tag}')}"
    say(f"{tag}: {n} pages, making the data")
    tier = TierSystem(tier_url, page, n, args.threads, args.in_flight or 2 * args.threads, work)
    rates: dict[str, dict[str, list[float]]] = {s: {p: [] for p in PHASES} for s in SYSTEMS}
    cpu: dict[str, dict[str, list[float]]] = {s: {p: [] for p in PHASES} for s in SYSTEMS}
    bodies: list[bytes] = []
    try:
        tier.ready()
        for rnd in range(args.repeats + 1):  # round 0: the untimed warm-up
            order = list(SYSTEMS) if rnd % 2 == 0 else list(reversed(SYSTEMS))
            for s in order:
                if s == "tier":
                    keys = [os.urandom(32) for _ in range(n)]
                    st = tier.store(keys)
                    ld = tier.load(keys)
                    if not bodies:  # what the tier PUT: the baselines' bodies
                        bodies = [bytes(raws["obstore"].get(k)) for k in tier.object_keys(keys)]
                else:
                    okeys = [run_loc.key(f"{s}-{tag}/r{rnd}/{i:05d}") for i in range(n)]
                    st, ld = _raw_round(raws[s], okeys, bodies)
                if rnd == 0:
                    continue
                total = sum(len(b) for b in bodies)
                for phase, (wall, c) in zip(PHASES, (st, ld), strict=True):
                    rates[s][phase].append(total / wall / 1e6)
                    cpu[s][phase].append(c / (total / 1e9))
            if rnd:
                say(f"{tag}: round {rnd}: " + ", ".join(
                    f"{s} {rates[s]['store'][-1]:.0f}/{rates[s]['load'][-1]:.0f}" for s in SYSTEMS) + " MB/s store/load")
            else:
                say(f"{tag}: warm-up done")
    finally:
        tier.close()
    out: dict[str, Any] = {"page_mib": size_mib, "page_bytes": page, "object_bytes": len(bodies[0]), "pages": n,
                           "mbps": {s: {p: statistics.median(rates[s][p]) for p in PHASES} for s in SYSTEMS},
                           "mbps_rounds": rates,
                           "cpu_s_per_gb": {s: {p: statistics.median(cpu[s][p]) for p in PHASES} for s in SYSTEMS},
                           "ratios": {}}
    target = TARGETS.get(size_mib)
    for b in BASELINES:
        for p in PHASES:
            paired = [t / r for t, r in zip(rates["tier"][p], rates[b][p], strict=True)]
            ratio = statistics.median(paired)
            out["ratios"][f"{p}_vs_{b}"] = {
                "ratio": ratio, "ratio_range": [min(paired), max(paired)],
                "ratio_of_medians": out["mbps"]["tier"][p] / out["mbps"][b][p],
                "target": target, "met": None if target is None else ratio >= target}
    return out


def _delete_run(client: ObjectClient, prefix: str) -> int:
    """Delete every object under ``prefix`` (listing, then ``DeleteObjects``); how many."""
    keys = [info.key for info in client.list_keys(prefix)]
    if keys:
        client.delete_many(keys)
    return len(keys)


def _table(results: Sequence[dict[str, Any]]) -> str:
    lines = ["| page MiB | pages | phase | tier MB/s | obstore MB/s | boto3 MB/s | tier/obstore | tier/boto3 | target |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---|"]
    for r in results:
        for p in PHASES:
            m = r["mbps"]
            cells = []
            verdicts = []
            for b in BASELINES:
                rt = r["ratios"][f"{p}_vs_{b}"]
                lo, hi = rt["ratio_range"]
                cells.append(f"{rt['ratio']:.2f} ({lo:.2f}-{hi:.2f})")
                if rt["met"] is not None:
                    verdicts.append(rt["met"])
            target = r["ratios"][f"{p}_vs_obstore"]["target"]
            verdict = "-" if target is None else (f">= {target:g}: " + ("met" if all(verdicts) else "NOT met"))
            lines.append(f"| {r['page_mib']:g} | {r['pages']} | {p} | {m['tier'][p]:.0f} | {m['obstore'][p]:.0f} | "
                         f"{m['boto3'][p]:.0f} | {cells[0]} | {cells[1]} | {verdict} |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    location = ObjectLocation.parse(args.url, "--url")
    say = _Progress(getattr(args, "progress", False))
    run_id = f"bench-object-{os.urandom(6).hex()}"
    run_loc = ObjectLocation(location.bucket, location.key(run_id))
    cleaner = ObjectClient(run_loc, WAIT_S)
    work = tempfile.mkdtemp(prefix="tierstore-bench-object-")  # the tier's (unused) root setting
    raws: dict[str, Any] = {}
    results: list[dict[str, Any]] = []
    deleted = 0
    try:
        raws = {"obstore": ObstoreSystem(location.bucket, args.threads), "boto3": Boto3System(location.bucket, args.threads)}
        for size in args.sizes:
            results.append(_measure_size(size, args, run_loc, work, raws, say))
            deleted += _delete_run(cleaner, run_loc.prefix + "/")
    finally:
        for r in raws.values():
            r.close()
        deleted += _delete_run(cleaner, run_loc.prefix + "/")
        shutil.rmtree(work, ignore_errors=True)
    left = sum(1 for _ in cleaner.list_keys(run_loc.prefix + "/"))
    say(f"deleted {deleted} objects, {left} left")
    met = [rt["met"] for r in results for rt in r["ratios"].values() if rt["met"] is not None]
    doc: dict[str, Any] = {
        "tierstore_bench_object": 1, "url": location.url, "run_prefix": run_loc.prefix,
        "endpoint": os.environ.get("AWS_ENDPOINT_URL"), "threads": args.threads, "repeats": args.repeats,
        "in_flight": args.in_flight or 2 * args.threads, "cpus": os.cpu_count(), "sizes": results,
        "targets": {f"{k:g}": v for k, v in TARGETS.items()}, "targets_met": all(met) if met else None,
        "objects_deleted": deleted, "objects_left": left,
    }
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    print(f"object tier vs raw S3 clients at {location.url} ({doc['endpoint']}), {args.threads} threads, "
          f"{doc['in_flight']} tier jobs in flight, median of {args.repeats} rounds (MB/s of object bytes; "
          "ratio: median of paired rounds, range in brackets)")
    print(_table(results))
    verdict = "n/a" if doc["targets_met"] is None else ("met" if doc["targets_met"] else "NOT met")
    print(f"targets (tier/raw >= 0.9 at 2 and 16 MiB, >= 0.8 at 0.5 MiB; each client, store and load): {verdict}")
    print(f"objects written and deleted: {deleted}; left under {run_loc.prefix}/: {left}")
    return 0
