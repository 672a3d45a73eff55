"""tierstore on a kernel NFS server with kernel NFS clients (issue 33), in a QEMU guest.

One guest boot for the module (tierstore/testing/nfs_guest.py; built by tools/nfs-guest.sh,
skipped with the reason where it is not): the guest runs tests/nfs_kernel/node.py, which drives
every scenario in one process (torch, the engine's staging memory, imports once: 60-100 s under
emulation) with node A on an NFSv3 mount and node B on an NFSv4.2 mount of one export (the
outage adds a hard v3 and a soft v4.2 node), and writes each scenario's counts to a JSON file;
each test here asserts on one of them and prints its figures. The whole module runs in about 7
minutes on the 2-core machine (software emulation; the 2-minute outage is a quarter of it).
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tierstore.errors import BAD_CONTENT_KINDS
from tierstore.testing.nfs_guest import GuestError, guest_available, run_in_guest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
# a normal run takes 6-7 minutes alone; beside a busy CI worker 9.5-11.7 minutes were measured
GUEST_TIMEOUT_S = 1200.0
OUTAGE_S = 120.0
SCENARIOS = ("a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "k")
# the guest's boot and scenarios run in the first test's setup: past pytest's 600 s default on a
# busy CI worker (one more worker runs the rest of the suite beside it)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(GUEST_TIMEOUT_S + 120)]


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Boot the guest once, run every scenario, return {letter: its JSON}."""
    reason = guest_available()
    if reason:
        pytest.skip(f"kernel-NFS guest unavailable: {reason}")
    results = tmp_path_factory.mktemp("nfs_kernel")
    # the host's checkout is read-only in the guest: numba's cache of the native kernels (compiled
    # there for the guest's CPU, ~80 s under emulation) goes to the results share
    command = (f"NUMBA_CACHE_DIR={shlex.quote(str(results / 'numba'))} PYTHONDONTWRITEBYTECODE=1 "
               f"PYTHONPATH={shlex.quote(str(REPO))} "
               f"{shlex.quote(sys.executable)} {shlex.quote(str(HERE / 'node.py'))} "
               f"--results {shlex.quote(str(results))} --only {','.join(SCENARIOS)} --outage {OUTAGE_S} "
               f"2> {shlex.quote(str(results / 'node.stderr'))}")
    started = time.monotonic()
    try:
        # three processes import torch (the nodes', scenario c's control, scenario k's skewed node)
        run = run_in_guest(command, results, timeout_s=GUEST_TIMEOUT_S, memory_mib=3072)
    except GuestError as exc:
        pytest.fail(f"the kernel-NFS guest failed: {exc}")
    stderr = (results / "node.stderr").read_text(errors="replace")
    assert run.rc == 0, f"node.py exited {run.rc}:\n{run.log[-3000:]}\n{stderr[-3000:]}"
    native = json.loads((results / "native.json").read_text()) if (results / "native.json").exists() else None
    assert native and native["ready"], f"the native kernels did not load in the guest: {native}\n{stderr[-3000:]}"
    out = {"native": native}
    for name in SCENARIOS:
        path = results / f"{name}.json"
        assert path.exists(), f"scenario {name} wrote no result:\n{run.log[-3000:]}\n{stderr[-3000:]}"
        out[name] = json.loads(path.read_text())
    print(json.dumps({"guest_wall_s": round(run.wall_s, 1), "boot_s": run.boot_s, "native": native,
                      "host_wall_s": round(time.monotonic() - started, 1),
                      "imports_done_at_uptime_s": (results / "imported_s").read_text().strip(),
                      "scenario_s": {k: v.get("seconds") for k, v in out.items() if k in SCENARIOS}}))
    return out


def _ok(result: dict[str, Any]) -> dict[str, Any]:
    if "crashed" in result:
        pytest.fail(f"the scenario crashed in the guest:\n{result['crashed']}")
    return result


def _figures(nodes: dict[str, Any]) -> dict[str, Any]:
    return {name: {k: n[k] for k in ("counts", "failures", "estale", "bad_content_rejected", "longest_s", "late_count")}
            for name, n in nodes.items()}


def test_concurrent_store_load_with_gc_serves_no_wrong_page(scenarios: dict[str, dict[str, Any]]) -> None:
    """Two nodes (v3, v4.2) store and load the same keys while `tierstore gc` evicts to a
    quarter of them: every load returns the right bytes or a typed miss/rejection; each
    node's store is seen by the other (first hit after the store, p50/p99, per caching)."""
    a = _ok(scenarios["a"])
    print(json.dumps({"visibility": a["visibility"], "gc": {k: v for k, v in a["gc"].items() if k != "stderr_tail"},
                      "nodes": _figures(a["nodes"])}, indent=1))
    # ``unsafe``: a page met inside another node's link(2) publish window (NFS has no
    # RENAME_NOREPLACE: the page has two links until the writer drops its temp name) past the
    # reader's second looks; a typed miss, the file kept (rootstore/publish.py, "The link window")
    allowed_load_failures = {"missing", "unsafe"} | BAD_CONTENT_KINDS
    for name, node in a["nodes"].items():
        assert node["counts"].get("wrong", 0) == 0, name  # never a wrong page
        kinds = {k.split(":", 1)[1] for k in node["failures"] if k.startswith("load:")}
        assert kinds <= allowed_load_failures, (name, node["failures"])
        assert not any(k.startswith("store:") for k in node["failures"]), (name, node["failures"])
        # deadline + 1 s at most, unless the guest could not run the thread that long (a call is
        # excused by as much as a sleeping thread overslept during it, as in scenario c)
        assert node["late_count"] <= len(node["late"]), (name, node)
        blamed = [call for call in node["late"] if call["seconds"] - (a["deadline_s"] + 1.0) > call["oversleep_s"]]
        assert not blamed, (name, blamed, a["oversleep"])
    for side in ("default_a", "default_b"):
        assert a["nodes"][side]["counts"].get("cross_node_hits", 0) > 0, side
    for variant, vis in a["visibility"].items():
        assert vis["wrong"] == 0, variant
        assert vis["stored"] == vis["pages"], (variant, vis)
        assert vis["seen"] == vis["stored"], (variant, vis)  # every page became visible to the other node
    assert a["gc"]["active"] >= 1, a["gc"]
    assert a["gc"]["evicted"] > 0, a["gc"]  # gc did evict while the nodes worked


# the scenarios whose nodes run page I/O, and so both I/O loops (node.py's ``io_loop``)
LOOP_SCENARIOS = ("a", "b", "c", "d", "f", "h", "i", "j")


def test_every_scenario_runs_both_io_loops(scenarios: dict[str, dict[str, Any]]) -> None:
    """The engine's two I/O loops on real NFS: in every scenario with page I/O, nodes alternate
    ``io_loop`` native (the default: the compiled lane, its held directory fd and its own error
    paths) and python, so each scenario's assertions hold for both. Here: a native node's NFS
    tier really ran jobs in the lane (it starts only once the kernels are compiled, and steps
    aside for jobs it cannot take), a python node's none."""
    ran: dict[str, dict[str, dict[str, int]]] = {}
    for letter in LOOP_SCENARIOS:
        result = _ok(scenarios[letter])
        if "skipped" in result:
            continue
        loops = set()
        for name, node in result["nodes"].items():
            if "jobs" not in node:
                continue
            tier = "shared" if "shared" in node["jobs"] else "root"
            jobs = node["jobs"][tier]
            ran[f"{letter}:{name}"] = {"io_loop": node["io_loop"], **jobs}
            loops.add(node["io_loop"])
            if node["io_loop"] == "native":
                assert jobs["native_loop"] > 0, (letter, name, node["jobs"])
            else:
                assert jobs["native_loop"] == 0 and jobs["run"] > 0, (letter, name, node["jobs"])
        assert loops == {"native", "python"}, (letter, loops)
    print(json.dumps(ran, indent=1))


def test_rm_rf_namespace_every_open_engine_hits_again(scenarios: dict[str, dict[str, Any]]) -> None:
    """Defect 3: after `rm -rf ROOT/*` by node B's client (dot files too), node A's open engine
    stores again within 2 s and puts the root's manifest and format marker back within 60 s
    (fsck exits 0), all with no engine restarting; then, with a new engine on B storing the
    pages again, node A's and node B's still-open engines hit every page again
    within 30 s, and a page A stores afterwards is seen by B's new engine."""
    b = _ok(scenarios["b"])
    print(json.dumps({k: v for k, v in b.items() if k != "nodes"} | {"nodes": _figures(b["nodes"])}, indent=1))
    assert b["b_before_ok"] and b["stored_by_a"] == b["pages"] == b["restored_by_b_new"], b
    for node, seconds in b["first_full_hit_s"].items():
        assert seconds is not None, f"engine {node} did not hit all {b['pages']} pages within {b['window_s']} s: {b}"
    assert b["a_store_then_b_new_hit_s"] is not None, b
    # `rm -rf ROOT/*` (dot files too) with no engine restarting: node A's open engine stores again
    # within 2 s, the root's metadata (manifest, format marker) is back within 60 s, fsck exits 0
    no_restart = b["no_restart"]
    assert no_restart["store_back_s"] is not None and no_restart["store_back_s"] <= 2.0, no_restart
    assert no_restart["metadata_back_s"] is not None, no_restart
    assert no_restart["fsck_rc"] == 0, no_restart
    for name, node in b["nodes"].items():
        assert node["counts"].get("wrong", 0) == 0, name


def test_server_stopped_no_call_past_its_deadline(scenarios: dict[str, dict[str, Any]]) -> None:
    """The server stopped for 2 minutes under load, four nodes on the four kinds of mount (A
    soft v3, B hard v4.2, C hard v3, D soft v4.2): no load or store returns later than
    deadline + 1 s (plus the guest's own delay at that moment: emulated vCPUs beside a busy CI
    worker fall behind, as measured by a control process beside the nodes': a fleet chain whose
    shared root is on the guest's tmpfs, making the nodes' calls with no NFS under them, and a
    thread that sleeps 50 ms at a time; not by the nodes' own process), failures are
    typed (EIO only on a soft mount), no thread stays blocked, the shared tier never comes up
    while the server is stopped, and every node hits and stores on the shared tier again once
    the server is back. Three engines started 10 s into the outage (fleet chains on the hard
    v4.2 and soft v4.2 mounts, one per I/O loop, a lone root on the hard v3 one) start within
    deadline + 2 s, answer every call within deadline + 1 s (the lone root: ``timeout``, "tier is
    down"; the chains: misses, stores to its local tier) and serve within 150 s of the restart
    (a hard mount retries its RPCs a minute apart); the pages the chains stored locally during
    the outage reach the export afterwards (the shared backlog).
    The scheduler side's lookups (node A's index, a step every 0.1 s) never wait on the mount:
    no step over 0.5 s that the control process does not excuse."""
    c = _ok(scenarios["c"])
    print(json.dumps({k: v for k, v in c.items() if k != "nodes"} | {"nodes": _figures(c["nodes"])}, indent=1))
    typed = {"missing", "timeout", "down", "queue_full"}
    # the control measured the whole run: its tmpfs roots served its loads and took its stores,
    # a load timing out (then missing while its shared tier is marked down) only when the guest
    # stalled the whole process (a CI run: a lone-root control's load took 3.3 s on tmpfs while a
    # sleeping thread overslept 2.6 s and a scheduler step took 2.3 s)
    control = c["control_calls"]
    outcomes = control["outcomes"]
    assert control["samples"] > 100 and not {"wrong", "no_result", "no_slot"} & set(outcomes), control
    assert outcomes["hit"] >= 0.9 * outcomes["loads"] and outcomes["stores_ok"] == outcomes["stores"], control
    for name, node in c["nodes"].items():
        # deadline + 1 s at most, unless the guest itself could not run the threads that long:
        # a call is excused only by as much as the control process was slow during it (a call of
        # its tmpfs node, or its sleeping thread's oversleep): a call that waited on its mount, or
        # on a stall of the nodes' own process, is still blamed
        assert node["late_count"] <= len(node["late"]), (name, node)
        blamed = [call for call in node["late"] if call["seconds"] - (c["deadline_s"] + 1.0) > call.get("control_s", 0.0)]
        assert not blamed, (name, blamed, c["oversleep"], c.get("control_calls"), node.get("late_stacks"))
        assert node["counts"].get("wrong", 0) == 0, name
        kinds = {k.split(":", 1)[1] for k in node["failures"]}
        # a soft mount may also answer EIO (``io``) when its retries run out before the deadline
        # (a CI run: node A, soft v3, one load of 846 failures); never a hard one
        mount = c["mounts"].get(name, "hard")  # the two late engines are on hard mounts
        assert kinds <= (typed | {"io"} if "soft" in mount.split(",") else typed), (name, mount, node["failures"])
        assert not node["counts"].get("no_result") and not node["counts"].get("no_slot"), (name, node["counts"])
    assert all(n == 0 for n in c["threads_stuck"].values()), c["threads_stuck"]
    for name, recovered in c["recovered_after_restart_s"].items():
        assert recovered["load"] is not None and recovered["store"] is not None, (name, c["recovered_after_restart_s"])
    # the shared tier stays down for the outage: its probe (a create the server must answer) did
    # not report it up while the server was stopped (a stat of a fresh name did: 32 flaps in
    # 30 s). Counted from one probe deadline after `rpc.nfsd 0` returned: a probe the server
    # answered just before it stopped marks the tier up within its deadline. After the restart
    # a tier may go down again: the v4 server's grace period, and the v3 mounts' retries a minute
    # apart, hold calls past the deadline (a CI run: node B on hard v4.2, 3 down/up episodes in
    # all). Each change is printed above with its time.
    stopped, restarted = c["timeline"]["server_stopped"] + c["deadline_s"], c["timeline"]["restarted"]
    up_in_outage = {name: [at for at, change in changes if change == "up" and stopped <= at <= restarted]
                    for name, changes in c["health_changes"].items()}
    assert not any(up_in_outage.values()), (up_in_outage, c["health_changes"], c["timeline"])
    shared_failures = {name: c["nodes"][name]["tiers"]["shared"]["failures"] for name in c["recovered_after_restart_s"]}
    assert all(f.get("timeout", 0) + f.get("down", 0) > 0 for f in shared_failures.values()), shared_failures
    new = c["new_engines"]
    assert set(new["open_s"]) == {"new_chain", "new_root", "new_chain_py"}, new
    # within deadline + 2 s, excused (as a late call is) by what the guest lost during the open: a
    # CI run beside two Ceph labs opened the chain in 4.88 s
    assert all(s < new["start_limit_s"] + new["open_excuse_s"][n] for n, s in new["open_s"].items()), new
    # a hybrid model's engine (3 groups, a tier each, opened one after another) on the hung export
    # starts within deadline + 2 s in all, excused as the opens are; all come up after the restart
    groups = new["groups_open"]
    assert groups["groups"] >= 3 and groups["up"] == 0, groups
    assert groups["seconds"] < new["start_limit_s"] + new["groups_open_excuse_s"], (groups, new["groups_open_excuse_s"])
    assert groups["up_after_restart_s"] is not None, groups
    assert new["outage_loads"]["new_root"] == {"timeout": 5}, new["outage_loads"]  # "root tier is down", at once
    assert new["outage_stores"]["new_root"] == {"timeout": 5}, new["outage_stores"]
    for chain in ("new_chain", "new_chain_py"):
        assert new["outage_loads"][chain] == {"miss": 5}, new["outage_loads"]
        assert new["outage_stores"][chain] == {"ok": 5}, new["outage_stores"]
        assert new["outage_stored_on"][chain] == {"stored_on:local": 5}, new["outage_stored_on"]
    assert all(s is not None for s in new["serve_after_restart_s"].values()), new["serve_after_restart_s"]
    # the pages the chains stored locally while the export was down reach it afterwards (their
    # backlogs), with nobody storing them again
    backlog = new["backlog"]
    assert backlog["on_export"] == {"new_chain": 5, "new_chain_py": 5}, backlog
    assert all(s is not None for s in backlog["on_export_after_restart_s"].values()), backlog
    # the scheduler thread's lookups never wait on the hung mount (a wait would last the
    # deadline, or the whole outage): a step longer than its bound (0.5 s; steps measure 50-90 ms
    # under emulation) is excused only by as much as the control process was slowed at the same
    # time (a CI run: a 3.98 s step while a tmpfs control call took 7.8 s), as the calls are
    steps = c["scheduler_steps"]
    assert steps["steps_during_outage"] > 100 and not steps["thread_stuck"], steps
    blamed = [s for s in steps["steps_over_bound"] if s["seconds"] - steps["bound_s"] > s["control_s"]]
    assert not blamed, (blamed, steps, c["control_calls"])
    assert steps["p99_step_ms"] < 1000 * steps["bound_s"], steps


def test_full_export_stores_fail_typed_loads_still_verify(scenarios: dict[str, dict[str, Any]]) -> None:
    """A full export (24 MiB tmpfs filled to its last block on the server): stores fail as
    `enospc`, loads of the pages already there verify on both nodes; `tierstore gc` on one
    node's mount, nobody deleting a file, exits 0 having evicted (its lease could not be written:
    it made room without it first) and both nodes store again within one trial-store interval
    (5 s) plus the guest's slack (the times, and the engine's log lines, are printed)."""
    d = _ok(scenarios["d"])
    print(json.dumps({k: v for k, v in d.items() if k != "nodes"} | {"nodes": _figures(d["nodes"])}, indent=1))
    assert d["stored_before"] == d["pages"], d
    gc_pass = d["gc"]
    assert gc_pass["rc"] == 0 and gc_pass["report"] and gc_pass["report"]["evicted"] >= 1, gc_pass
    assert gc_pass["report"]["total_after"] <= gc_pass["cap"], gc_pass
    for name in ("a", "b"):
        assert d["stores_while_full"][name] == {"enospc": 8}, d["stores_while_full"]
        assert d["loads_while_full"][name] == {"hit": d["pages"]}, d["loads_while_full"]
        # stores come back at the tier's next trial store after gc made room (every 5 s)
        again = d["stores_again_after_freeing_s"][name]
        assert again is not None and again <= 5.0 + 5.0, (again, d["stores_after_freeing"])
        assert set(d["stores_after_freeing"][name]) <= {"ok", "enospc"}, d["stores_after_freeing"]
        assert d["nodes"][name]["tiers"]["root"]["failures"].get("enospc", 0) >= 1, d["nodes"][name]["tiers"]


def test_gc_nodes_with_skewed_clocks_do_not_over_evict(scenarios: dict[str, dict[str, Any]]) -> None:
    """Defect 6: two `tierstore gc` loops (v3 and v4.2 mounts of one root, lease ttl 5 s), one
    with its clock 30 s ahead, while a node stores a new page every ~0.25 s for 30 s: no two
    passes that held the lease overlap in time and together they evict at most 1.5 times what
    the cap needs (the lease is judged by the server's clock, so the skewed node neither takes a
    live lease nor keeps a dead one), and no load returns a wrong page; the same holds for the
    run with both clocks right."""
    e = _ok(scenarios["e"])
    figures = {run: {k: v for k, v in r.items() if k not in ("node", "gc_stderr")} for run, r in e.items()
               if isinstance(r, dict) and "over_eviction_factor" in r}
    print(json.dumps(figures, indent=1))
    for run in ("skewed", "right"):
        r = e[run]
        # A pass holds the lease from taking it to releasing it at its end, renewing it every
        # ttl/3; another node takes it only once it is released, or once it has gone unrenewed
        # for ttl + skew by the server's clock. So one gc's passes may follow the other's closely
        # (passes_both_active_within_lease_ttl counts those: turns, not a fault), but none that
        # kept the lease to its end may overlap one of the other's in time, whichever node's clock
        # is wrong (a pass starved past ttl + skew finds its lease lost at its next renewal and
        # stops: a CI run's v3 pass, which had evicted nothing by then).
        assert r["overlapping_active_passes"] == 0, (run, figures[run])
        assert r["over_eviction_factor"] <= 1.5, (run, figures[run])
        assert r["node"]["counts"].get("wrong", 0) == 0, run
        assert r["loads"].get("wrong", 0) == 0, run
        assert all(n > 0 for n in r["active_passes"].values()), (run, r["active_passes"])  # both took turns
        assert not any(r["gc_errors"].values()), (run, r["gc_errors"])
        assert r["evicted"] > 0, run


def test_head_sliced_pages_stamped_on_hit_and_old_tools_refuse_a_newer_root(scenarios: dict[str, dict[str, Any]]) -> None:
    """Defect 7: head-sliced pages (``h1-1``) on a v4.2 mount, half of them loaded by another
    node through its shared tier: exactly those pages' server-side mtimes advance, and gc
    under half the bytes evicts exactly the other half. Defect 5: with a format marker naming
    an unknown layout, `tierstore fsck --repair` and `tierstore gc` on a v3 mount exit 8 and
    move, remove or add no file."""
    f = _ok(scenarios["f"])
    print(json.dumps(f, indent=1))
    half = f["pages"] // 2
    assert f["stored"] == f["on_server"] == f["pages"] and f["slice_dir"] == "h1-1", f
    assert f["load_outcomes"] == {"hit": half, "tier:shared": half}, f["load_outcomes"]
    assert f["mtime_advanced"] == {"loaded": half, "not_loaded": 0}, f["mtime_advanced"]
    assert f["gc"]["rc"] == 0 and f["gc"]["evicted"] == half, f["gc"]
    assert f["survived_gc"] == {"loaded": half, "not_loaded": 0}, f["survived_gc"]
    old = f["old_tool"]
    assert old["fsck_repair_rc"] == 8 and old["gc_rc"] == 8, old
    for change in ("moved_or_removed_by_fsck", "added_by_fsck", "moved_or_removed_by_gc", "added_by_gc"):
        assert old[change] == [], (change, old)


def test_page_index_refresh_server_operations(scenarios: dict[str, dict[str, Any]]) -> None:
    """Issue item 5: nfsd operations per refresh of an unchanged page index of 10^4 pages, per
    client (v3, v3 actimeo=0, v4.2), for the current rule (a directory re-listed only when its
    mtime changed, all of them every FULL_RELIST_EVERY-th refresh) against the old one (all 256
    every refresh). The current rule reads each directory's change through an open, which the
    server answers (close-to-open: at least one GETATTR per directory and refresh, on every
    client): another node's page is seen at the next refresh, not when the client's cached
    attributes expire (up to 60 s later; a stat-only check cost 0 server operations on v3 with
    caching, and missed it). The old rule still costs the server at least 1.5x as much
    (1.82-1.93x measured at 58d335d)."""
    g = _ok(scenarios["g"])
    print(json.dumps(g, indent=1))
    for name, client in g["clients"].items():
        unchanged = client["unchanged_stat_only"]
        assert unchanged["listings_per_refresh"] == 0, (name, client)
        assert unchanged["ops"].get("getattr", 0) >= 256 * unchanged["refreshes"], (name, client)  # the server asked
        assert client["full_relist"]["listings_per_refresh"] == 256, (name, client)
        assert client["old_over_current"] >= 1.5, (name, client)


def test_quota_stores_fail_typed_loads_still_verify(scenarios: dict[str, dict[str, Any]]) -> None:
    """A user quota on the export (ext4 with quota in the guest; every request squashed to one
    user): stores past it fail as `enospc` with errno EDQUOT on both nodes (v3, v4.2), and the
    pages stored before it still verify; `tierstore gc` over the quota, nobody deleting a file,
    exits 0 having evicted to its cap, and both nodes store again within one trial-store
    interval plus the guest's slack."""
    h = _ok(scenarios["h"])
    if "skipped" in h:
        pytest.skip(h["skipped"])
    print(json.dumps({k: v for k, v in h.items() if k != "nodes"} | {"nodes": _figures(h["nodes"])}
                     | {"errnos": {n: v["errnos"] for n, v in h["nodes"].items()}}, indent=1))
    for name in ("a", "b"):
        node = h["nodes"][name]
        assert h["stores_past_quota"][name] == {"enospc": 4}, h["stores_past_quota"]
        assert h["loads_past_quota"][name] == {"hit": h["pages"]}, h["loads_past_quota"]
        # the first store past the quota fails with the server's EDQUOT; the next ones are
        # skipped by the tier's "full" back-off, whose error names the same cause
        assert node["errnos"] == {"EDQUOT": 4}, node["errnos"]
        assert node["tiers"]["root"]["failures"].get("full", 0) == 3, node["tiers"]["root"]["failures"]
        # gc over the quota (as the quota's user) made room; the node stored again at its tier's
        # next trial store (every 5 s)
        again = h["stores_again_after_freeing_s"][name]
        assert again is not None and again <= 5.0 + 5.0, (again, h["stores_after_freeing"])
    gc_pass = h["gc"]
    assert gc_pass["rc"] == 0 and gc_pass["report"] and gc_pass["report"]["evicted"] >= 1, gc_pass
    assert gc_pass["report"]["total_after"] <= gc_pass["cap"], gc_pass
    # not one block was left: the lease could not be written, so gc made room without it first
    assert gc_pass["report"]["room_evicted"] >= 1, gc_pass


def test_reader_side_estale_is_a_typed_miss_and_counted(scenarios: dict[str, dict[str, Any]]) -> None:
    """Reader-side ESTALE from a third client: nodes load two 16 MiB pages over and over (v3:
    one node per I/O loop; v4.2: native) while another client replaces the page files (a rename
    over each, several times a second) and now and then removes one. Every load is the right
    page or a typed miss; the python loop's v3 node meets ESTALE (a read on a handle whose file
    the server no longer has) and counts it, in its tier's ``estale`` failures as in the errnos
    of its misses. The native lane hands a failed read to the Python path, which opens the name
    again: a replaced page is then served, and only a stale read of that second try is counted
    (the lane's own is not: printed). v4.2's open state keeps a replaced file readable."""
    i = _ok(scenarios["i"])
    print(json.dumps({k: v for k, v in i.items() if k != "nodes"} | {"nodes": _figures(i["nodes"])}
                     | {"errnos": {n: v["errnos"] for n, v in i["nodes"].items()}}, indent=1))
    assert i["stored"] == i["pages"] and i["churn"].get("replaced", 0) > 50, i["churn"]
    for name, node in i["nodes"].items():
        assert node["counts"].get("wrong", 0) == 0, name
        assert node["counts"].get("hit", 0) > 0, (name, node["counts"])
        kinds = {k.split(":", 1)[1] for k in node["failures"]}
        assert kinds <= {"missing", "unsafe"}, (name, node["failures"])  # "unsafe": scenario a's link window
        assert i["estale_metric"][name] == node["estale"], (name, node["errnos"], i["estale_metric"])
    assert i["nodes"]["a"]["estale"] > 0, i["nodes"]["a"]["errnos"]


def test_the_hot_set_survives_gc_on_a_long_lived_client(scenarios: dict[str, dict[str, Any]]) -> None:
    """A long-lived node (v3, default caching) hits a hot set of 10 of its 40 pages from its
    local tier, round after round, after every page was made an hour old on the server; gc to
    half the bytes, run by another long-lived client (v4.2, default caching) that had read every
    page's old attributes, keeps at least 95 % of the hot set, and a fresh node hits it. The hot
    set's hits came from the local tier, so the shared copies' stamps are the chain's touches."""
    j = _ok(scenarios["j"])
    print(json.dumps({k: v for k, v in j.items() if k != "nodes"} | {"nodes": _figures(j["nodes"])}, indent=1))
    assert j["stored"] == j["pages"] and j["cached_old_on_gc_client"] == j["pages"], j
    assert j["hot_loads"] == {"hit": 4 * j["hot"]} and j["local_hits"] >= 4 * j["hot"], j
    assert j["stamped"] == j["hot"], j
    assert j["gc"]["rc"] == 0 and j["gc"]["evicted"] >= j["pages"] // 2 - 1, j["gc"]
    assert j["hot_on_export_after_gc"] >= 0.95 * j["hot"], j
    assert j["fresh_node_loads"].get("hit", 0) >= 0.95 * j["hot"], j["fresh_node_loads"]


def test_a_writer_and_toucher_with_a_skewed_clock_do_not_skew_gc(scenarios: dict[str, dict[str, Any]]) -> None:
    """A node whose clock is a day behind (its own process under faketime) stores 20 pages and
    hits 5 of them from its local tier: every page file's time is the server's (within the
    run, not a day back), the hit pages' stamps are newer than every other page's, and gc on a
    node with the right clock, to half the bytes, keeps all 5 and evicts only cold pages."""
    k = _ok(scenarios["k"])
    print(json.dumps({key: v for key, v in k.items() if key != "nodes"}, indent=1))
    skewed = k["skewed"]
    assert skewed["rc"] == 0 and skewed["stored"] == k["pages"], skewed
    assert skewed["hot_loads"] == {"hit": 3 * k["hot"]} and skewed["local_hits"] >= 3 * k["hot"], skewed
    assert k["skewed_clock_behind_s"] > 0.9 * -k["skew_s"], k  # faketime did set the node's clock back
    assert k["mtimes_within_run"] == k["pages"], k  # file times are the server's
    assert k["hot_newer_than_every_cold"], k
    assert k["gc"]["rc"] == 0 and k["gc"]["evicted"] == k["pages"] // 2, k["gc"]
    assert k["survived_gc"] == {"hot": k["hot"], "cold": k["pages"] - k["hot"] - k["gc"]["evicted"]}, k
