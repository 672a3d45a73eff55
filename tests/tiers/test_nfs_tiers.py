"""Shared tier on two "nodes": two sshfs mounts of one export (tests/nfs_standin.py).

Needs FUSE and the Debian packages sshfs + openssh-sftp-server (installed by CI's setup);
skipped with the reason otherwise. Each test prints the figures the design notes quote.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

import pytest
from nfs_standin import PROFILES, TwoNodeMount, unavailable_reason
from tiers_helpers import expected, key, load, store

from tierstore.config import TierStoreConfig
from tierstore.format.identity import page_file_size
from tierstore.fs.mapper import FileMapper
from tierstore.metrics import MetricsRegistry
from tierstore.rootstore.engine import IOEngine
from tierstore.testing.pages import page_bytes, simple_namespace, write_page
from tierstore.tiers import TierChain, gc
from tierstore.tiers.gc_scan import TRASH_DIR

HERE = Path(__file__).resolve().parents[1]  # tests/: the node scripts and stand-ins


def _two_nodes(profile_a: str, profile_b: str):
    @pytest.fixture
    def fx(tmp_path: Path):
        reason = unavailable_reason()
        if reason:
            pytest.skip(f"NFS stand-in unavailable: {reason}")
        with TwoNodeMount(tmp_path, profile_a, profile_b) as fs:
            yield fs
    return fx


two_nodes = _two_nodes("nfs", "nfs")
two_nodes_stale = _two_nodes("stale", "strict")


def _node_ns():
    return simple_namespace("float16", tokens_per_chunk=64, num_layers=2, num_kv_heads=4, head_size=64)


class _GcLoop:
    """``tierstore gc ROOT --loop 0.3 --json`` in a process of its own (one per node, as a
    fleet runs it), its pass reports collected as they arrive."""

    def __init__(self, root: Path, cap: int, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c",
             "import sys; from tierstore.admin import gc_command; import argparse;"
             "p = argparse.ArgumentParser(); gc_command.add_arguments(p);"
             "sys.exit(gc_command.run(p.parse_args(sys.argv[1:])))",
             str(root), "--max-bytes", str(cap), "--loop", "0.3", "--json", "--lease-ttl", "5"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def passes(self) -> list[dict]:
        return [json.loads(line) for line in list(self.lines) if line.startswith("{")]

    def stop(self) -> str:
        """End the loop (the process this test started); its stderr."""
        self.proc.terminate()
        _out, err = self.proc.communicate(timeout=30)
        self._reader.join(10)
        return err


def _name_cache_s(profile: str) -> float:
    """How long a mount of ``profile`` may answer a lookup from its cache: a name it found
    absent stays absent to it that long (an NFS client's negative lookup cache)."""
    opts = dict(o.split("=", 1) for o in PROFILES[profile].split(",") if "=" in o)
    return max(float(opts.get(k, 0)) for k in ("entry_timeout", "negative_timeout"))


def _page_bytes_on_server(export: Path) -> int:
    """File bytes of the pages at their place under ``export``, read on the server's side (a
    mount's listing may lag), as gc counts them toward its cap."""
    return sum(f.stat().st_size for f in export.rglob("*.kvp")
               if f.is_file() and TRASH_DIR not in f.relative_to(export).parts)


def test_two_nodes_store_and_load_concurrently_with_gc(two_nodes: TwoNodeMount, tmp_path: Path) -> None:
    fs = two_nodes
    n_keys, seconds = 48, 6.0
    page = page_file_size(_node_ns(), 0)
    cap = 24 * page  # half the key set: gc must evict while the nodes work
    low = int(cap * 0.9)  # gc's default --low-watermark: where a pass over the cap evicts down to
    env = dict(os.environ, PYTHONPATH=str(HERE.parent))
    nodes = [
        subprocess.Popen([sys.executable, str(HERE / "nfs_node_worker.py"), "--root", str(root),
                          "--local", str(tmp_path / f"local_{name}"), "--own", own, "--all", str(n_keys),
                          "--seconds", str(seconds), "--seed", str(seed)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for name, root, own, seed in (("a", fs.a, f"0:{n_keys // 2 + 4}", 1),
                                      ("b", fs.b, f"{n_keys // 2 - 4}:{n_keys}", 2))
    ]
    # one gc per node, both looping: the lease keeps them to one evictor at a time
    gcs = [_GcLoop(root, cap, env) for root in (fs.a, fs.b)]
    try:
        outs = [p.communicate(timeout=120) for p in nodes]
        # Every store has landed. A scan sees the root as its mount shows it: a name the mount
        # found absent (a page its gc evicted) stays absent to it for the mount's lookup cache
        # time, even once the other node has stored that page again. A pass that takes the
        # lease after that time has passed scans every page, so after it the root itself (not
        # only the pass's own count) must be within the cap.
        settled = time.time() + _name_cache_s("nfs")
        end = time.monotonic() + 60
        while time.monotonic() < end and not any(
                p.get("busy") is False and datetime.fromisoformat(p["started_at"]).timestamp() > settled
                for g in gcs for p in g.passes()):
            time.sleep(0.1)
    finally:
        gc_errs = [g.stop() for g in gcs]
    for p, (_out, err) in zip(nodes, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    a, b = (json.loads(out.strip().splitlines()[-1]) for out, _ in outs)
    passes = [p for g in gcs for p in g.passes()]
    assert all("busy" in p for p in passes), (passes, [err[-2000:] for err in gc_errs])  # no error document
    active = [p for p in passes if not p["busy"]]
    on_disk = _page_bytes_on_server(fs.export)
    summary = {
        "node_a": {k: a[k] for k in ("loads", "hits", "cross_node_hits", "misses", "wrong", "load_failures", "stores", "store_failures")},
        "node_b": {k: b[k] for k in ("loads", "hits", "cross_node_hits", "misses", "wrong", "load_failures", "stores", "store_failures")},
        "shared_a": a["tiers"]["shared"], "shared_b": b["tiers"]["shared"],
        "gc": {"passes": len(passes), "busy": len(passes) - len(active),
               "evicted": sum(p["evicted"] for p in active), "vanished": sum(p["vanished"] for p in active),
               "skipped_recent": sum(p["skipped_recent"] for p in active),
               "max_total_after": max((p["total_after"] for p in active), default=0), "cap": cap, "low": low,
               "page_bytes_at_end": on_disk},
    }
    print(json.dumps(summary, indent=1))
    for node in (a, b):
        assert node["wrong"] == 0  # no torn or wrong page was ever accepted
        assert node["load_failures"] == {}  # only clean misses
        assert node["store_failures"] == {}
        assert node["cross_node_hits"] > 0  # pages stored by the other node were served
        assert node["tiers"]["shared"]["hits"] > 0
    assert summary["gc"]["evicted"] > 0
    assert len(active) >= 1
    # one evictor at a time: no two passes that held the lease overlap in time
    spans = sorted((datetime.fromisoformat(p["started_at"]), datetime.fromisoformat(p["finished_at"])) for p in active)
    assert all(b[0] >= a[1] for a, b in zip(spans, spans[1:], strict=False)), spans
    # What one pass leaves, by its own count of what its scan found (pages stored after the
    # scan, or not shown by its mount yet, are a later pass's): under the cap, all of it; over
    # the cap, at most the low watermark. A victim hit since the scan (re-stamped), gone or
    # replaced is not evicted and the next page in LRU order is taken instead, so a pass stops
    # short of the low watermark only when it lost the lease or tried every page it found.
    for p in active:
        if p["total_before"] <= cap:
            assert p["evicted"] == 0 and p["total_after"] == p["total_before"], p
        else:
            tried_all = p["evicted"] + p["skipped_recent"] + p["vanished"] + len(p["unsafe"]) >= p["pages"]
            assert p["total_after"] <= low or p["lease_lost"] or tried_all, p
    # A pass that started once the stores had stopped and the mounts' caches had expired
    # scanned every page there is: the root is within the cap and holds no more than any such
    # pass left (nothing is added any more).
    final = [p for p in active if datetime.fromisoformat(p["started_at"]).timestamp() > settled]
    assert final, "no gc pass held the lease once the nodes had stopped storing"
    assert on_disk <= min(cap, *(p["total_after"] for p in final)), (on_disk, final)


def test_hostile_mount_checksums_catch_torn_and_stale_pages(two_nodes_stale: TwoNodeMount) -> None:
    """Mount A caches pages across opens (kernel_cache, 1 s SFTP mtimes): it serves stale and
    torn files when node B replaces a page under the same name. Every page tierstore accepts
    must be one complete version; a torn file must come back as a typed failure."""
    fs = two_nodes_stale
    ns = simple_namespace("float16", tokens_per_chunk=512, num_layers=4, num_kv_heads=4, head_size=64)  # 2 MiB pages
    k = key(7)
    layout = ns.groups[0].layout
    payloads = {page_bytes(layout, k, seed=seed): seed for seed in (0, 1)}
    rel = FileMapper(fs.a, ns.digest, 0, 0).path_for(k).relative_to(fs.a)
    files = {}
    for seed in (0, 1):  # the two complete files node B alternates between
        write_page(fs.b / f"v{seed}", ns, 0, k, seed=seed)
        files[(fs.b / f"v{seed}" / rel).read_bytes()] = seed

    def replace_on_b(seed: int, it: int) -> None:
        tmp = fs.b / "staging" / f"swap.{it}.tmp"
        tmp.write_bytes(next(f for f, s in files.items() if s == seed))
        os.replace(tmp, fs.b / rel)

    (fs.b / rel.parent).mkdir(parents=True, exist_ok=True)
    (fs.b / "staging").mkdir()
    replace_on_b(0, 0)
    assert (fs.a / rel).read_bytes() in files  # node A reads (and caches) version 0
    reader = IOEngine(fs.a, ns, 0, config=TierStoreConfig(root=str(fs.a), io_threads=1))
    counts = {"sequential": {"current": 0, "stale": 0, "rejected": {}, "raw_stale_or_torn": 0},
              "concurrent": {"accepted": 0, "rejected": {}, "raw_torn": 0, "raw_reads": 0},
              "mixed_accepted": 0, "raw_gone": 0}

    def read_raw() -> bytes | None:
        """What a plain reader gets; None if the file is gone: tierstore removes a page it
        rejected as damaged, until node B's next replace puts one back."""
        try:
            return (fs.a / rel).read_bytes()
        except FileNotFoundError:
            counts["raw_gone"] += 1
            return None

    def load_once() -> int | str:
        (r,) = reader.wait([reader.submit_load(k)], 30)
        if not r.ok:
            return r.error.kind
        got = payloads.get(bytes(r.slot.view), "mixed")
        reader.release_slot(r.slot)
        if got == "mixed":
            counts["mixed_accepted"] += 1
        return got

    try:
        load_once()  # node A caches version 0
        seq = counts["sequential"]
        for it in range(1, 21):  # B replaces, then A loads
            replace_on_b(it % 2, it)
            got = load_once()
            if isinstance(got, str):
                seq["rejected"][got] = seq["rejected"].get(got, 0) + 1
            else:
                seq["current" if got == it % 2 else "stale"] += 1
            raw = read_raw()
            if raw is not None:
                seq["raw_stale_or_torn"] += files.get(raw, "torn") != it % 2
        stop = threading.Event()

        def writer() -> None:
            it = 100
            while not stop.is_set():
                replace_on_b(it % 2, it)
                it += 1

        t = threading.Thread(target=writer)
        t.start()
        con = counts["concurrent"]
        try:
            for _ in range(40):  # B replaces continuously while A loads
                got = load_once()
                if isinstance(got, str):
                    con["rejected"][got] = con["rejected"].get(got, 0) + 1
                else:
                    con["accepted"] += 1
                raw = read_raw()
                if raw is not None:
                    con["raw_reads"] += 1
                    con["raw_torn"] += raw not in files
        finally:
            stop.set()
            t.join()
        # a torn file (first half of version 0, second half of version 1), as a bad mount or
        # a bad cache can serve it: it must be rejected, never accepted
        k2 = key(8)
        write_page(fs.b / "t0", ns, 0, k2, seed=0)
        write_page(fs.b / "t1", ns, 0, k2, seed=1)
        rel2 = FileMapper(fs.a, ns.digest, 0, 0).path_for(k2).relative_to(fs.a)
        v0, v1 = (fs.b / "t0" / rel2).read_bytes(), (fs.b / "t1" / rel2).read_bytes()
        half = len(v0) // 2
        (fs.b / rel2.parent).mkdir(parents=True, exist_ok=True)
        (fs.b / rel2).write_bytes(v0[:half] + v1[half:])
        (r,) = reader.wait([reader.submit_load(k2)], 30)
        counts["torn_file"] = "accepted" if r.ok else r.error.kind
        if r.ok:
            reader.release_slot(r.slot)
    finally:
        reader.close()
    print(json.dumps(counts))
    assert counts["torn_file"] == "checksum"
    assert counts["mixed_accepted"] == 0  # never a torn page accepted
    # the mount really was hostile: it served stale or torn files (to tierstore or a plain reader)
    assert counts["sequential"]["stale"] + counts["sequential"]["raw_stale_or_torn"] + counts["concurrent"]["raw_torn"] + sum(
        counts["concurrent"]["rejected"].values()) + sum(counts["sequential"]["rejected"].values()) > 0


def _chain(local: Path, shared: Path, deadline_ms: int) -> TierChain:
    cfg = TierStoreConfig.from_dict({"root": str(shared), "local_root": str(local), "local_max_bytes": 64 << 20,
                                     "shared_deadline_s": deadline_ms / 1000})
    return TierChain(cfg, simple_namespace(), 0, metrics=MetricsRegistry())


def test_hung_shared_tier_stays_within_deadline_and_comes_back(two_nodes: TwoNodeMount, tmp_path: Path) -> None:
    fs = two_nodes
    deadline = 0.5
    writer = _chain(tmp_path / "local_b", fs.b, 2000)  # node B fills the shared tier
    for i in range(8):
        assert store(writer, key(i)).ok
    assert writer.flush(10)
    writer.close()
    st = _chain(tmp_path / "local_a", fs.a, int(deadline * 1000))
    worst = 0.0
    figures: dict[str, object] = {}
    with fs.hung(fs.a):
        t0 = time.monotonic()
        ok, kind, _ = load(st, key(0))  # only in the shared tier: its server is stopped
        first = time.monotonic() - t0
        assert not ok and kind == "timeout"
        assert first < deadline + 0.5, first
        assert not st.shared.health.up
        for i in range(1, 8):  # while down: misses at once, no call blocks
            t = time.monotonic()
            assert load(st, key(i))[0] is False
            assert st.contains(key(i)) is False
            worst = max(worst, time.monotonic() - t)
        t = time.monotonic()
        r = store(st, key(100))  # stores still land on local disk
        assert r.ok
        worst = max(worst, time.monotonic() - t)
        t = time.monotonic()
        st.poll()
        worst = max(worst, time.monotonic() - t)
        # a chain opened while the mount hangs must not hang either
        t = time.monotonic()
        st2 = _chain(tmp_path / "local_c", fs.a, int(deadline * 1000))
        open_s = time.monotonic() - t
        assert open_s < deadline + 0.5 and not st2.shared.health.up
        figures.update(first_timeout_s=round(first, 3), worst_call_while_down_s=round(worst, 4),
                       open_while_hung_s=round(open_s, 3))
    assert worst < deadline
    t = time.monotonic()
    while not st.shared.health.up and time.monotonic() - t < 10:
        time.sleep(0.05)
    figures["recovered_after_s"] = round(time.monotonic() - t, 3)
    assert st.shared.health.up, "the shared tier did not come back after the server resumed"
    ok, _, data = load(st, key(3))
    assert ok and data == expected(st, key(3))
    t = time.monotonic()
    while not st2.shared.health.up and time.monotonic() - t < 10:
        time.sleep(0.05)
    assert st2.shared.health.up
    assert load(st2, key(4))[0]
    # the page stored while the mount hung reaches the shared tier once it answers again:
    # node B, which never had it locally, reads it through its own mount
    t = time.monotonic()
    while (len(st.backlog) or st.m_shared.get("backlog_uploads") < 1) and time.monotonic() - t < 10:
        time.sleep(0.05)
        st.poll()
    figures["backlog_uploaded_after_s"] = round(time.monotonic() - t, 3)
    assert len(st.backlog) == 0 and st.m_shared.get("backlog_uploads") == 1
    assert st.flush(10)
    reader_b = _chain(tmp_path / "local_d", fs.b, 2000)
    try:
        ok, _, data = load(reader_b, key(100))
        assert ok and data == expected(reader_b, key(100))
    finally:
        reader_b.close(5)
    figures["shared_failures"] = st.m_shared.failures()
    print(json.dumps(figures))
    st.close(5)
    st2.close(5)


def test_reader_on_one_node_while_gc_on_the_other_evicts(two_nodes: TwoNodeMount) -> None:
    """A page evicted by node B's gc: node A's reader that already opened it reads the whole
    file; node A's next load is a clean miss."""
    fs = two_nodes
    ns = simple_namespace("float16", tokens_per_chunk=256, num_layers=2, num_kv_heads=4, head_size=64)
    k = key(3)
    write_page(fs.b, ns, 0, k)
    eng = IOEngine(fs.a, ns, 0, config=TierStoreConfig(root=str(fs.a), io_threads=1))
    try:
        ok, _, data = load(eng, k)
        assert ok and data == expected(eng, k)
        path_a = eng.mapper.path_for(k)
        whole = path_a.read_bytes()
        with open(path_a, "rb") as f:
            head = f.read(4096)
            rep = gc.collect(fs.b, 1, low_watermark=0.0)  # node B evicts everything
            assert rep.evicted == 1 and not (fs.export / path_a.relative_to(fs.a)).exists()
            assert head + f.read() == whole  # the open reader keeps the whole file
        ok, kind, _ = load(eng, k)
        assert not ok and kind == "missing"  # a clean miss, not a torn page
    finally:
        eng.close()
