"""Create-only publication under a race: eight processes store the same page at the same moment.

Names are content addresses, so the page must end up as one file, and exactly one of the eight
stores may say ``stored=True`` (the one whose publish created the name); the seven others say
``stored=False`` ("already there"), none fails, no temp is left and nothing is moved aside as
planted. With the old rename-over publish the file was right but 1 to 6 stores said True, and
a rename could replace a page published a moment before.

Each case runs in a script of its own (``SCRIPT``), which forks the eight writers after the
native kernels (if used) are loaded, as ``test_concurrency`` does: each child builds its own
``IOEngine``, stores a page of its own first (its I/O threads, or the native lane, running),
then waits at a pipe barrier (a start pipe per writer, so each takes one start per round); the
parent releases all eight at once, for ``ROUNDS`` keys. Cases:
the Python I/O path (``TIERSTORE_NATIVE=0``) and the native one (``io_loop`` "native": the
lane and the native store calls), each publishing with renameat2(RENAME_NOREPLACE) or with
the link(2) fallback (forced: ``publish.NOREPLACE_AVAILABLE`` False), and on the sshfs
stand-in (FUSE), whose renameat2 refuses the flag with EINVAL, so the fallback is found at run
time there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tierstore.fs.mapper import FileMapper
from tierstore.rootstore.page_read import inspect_page
from tierstore.testing.pages import hybrid_namespace, page_key

WRITERS = 8
ROUNDS = 8
GROUP = 0


def race_namespace():  # noqa: ANN201 - also built by the script
    return hybrid_namespace(tokens_per_chunk=256, num_kv_heads=8, head_size=64)  # 1 MiB pages: a wide race window


SCRIPT = textwrap.dedent(
    """
    import json, os, select, sys, time, traceback
    sys.path.insert(0, {tests!r})
    from test_publish_race import GROUP, race_namespace
    from tierstore.config import TierStoreConfig
    from tierstore.native import loader as native
    from tierstore.rootstore import publish
    from tierstore.rootstore.engine import IOEngine
    from tierstore.testing.pages import page_bytes, page_key

    root, out_dir, loop, force_link = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
    writers, rounds = int(sys.argv[5]), int(sys.argv[6])
    if force_link:
        publish.NOREPLACE_AVAILABLE = False  # every CreateOnly made below publishes with link(2)
    ns = race_namespace()

    def engine():
        cfg = TierStoreConfig.from_dict({{"root": root, "io_loop": loop, "io_threads": 1, "odirect": "off", "fsync": True}})
        return IOEngine(root, ns, GROUP, config=cfg, staging_slots=2)

    def store(eng, key):
        slot = eng.acquire_slot(timeout=30)
        slot.view[:] = page_bytes(eng.layout, key, GROUP)
        (res,) = eng.wait([eng.submit_store(key, slot, 128)], timeout=60)
        return res

    def child(i, ready, go):
        eng = engine()
        own = store(eng, page_key(1000 + i))  # the I/O threads or the lane started, on a page of its own
        assert own.ok and own.stored, own
        out = []
        for r in range(rounds):
            key = page_key(r)
            slot = eng.acquire_slot(timeout=30)
            slot.view[:] = page_bytes(eng.layout, key, GROUP)
            os.write(ready, b"r")
            if os.read(go, 1) != b"g":
                raise SystemExit("the parent closed the start pipe")
            (res,) = eng.wait([eng.submit_store(key, slot, 128)], timeout=60)
            out.append({{"ok": res.ok, "stored": bool(res.stored),
                        "error": None if res.error is None else f"{{res.error.kind}}: {{res.error}}"}})
        stats = eng.stats
        eng.close()
        return {{"rounds": out, "lane_jobs": int(stats.get("jobs_native_loop", 0)),
                "planted_replaced": int(stats["planted_replaced"])}}

    engine().close()  # the directories, once
    native_ready = native.start(wait=True) if loop == "native" else False
    if loop == "native" and (not native_ready or native.lane_kernels() is None):
        print("SKIP native path unavailable:", native.failure())
        sys.exit(0)
    ready_r, ready_w = os.pipe()
    gos = [os.pipe() for _ in range(writers)]  # a start pipe per writer: each takes exactly its own start
    pids = []
    for i in range(writers):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                with open(os.path.join(out_dir, f"writer{{i}}.json"), "w") as f:
                    json.dump(child(i, ready_w, gos[i][0]), f)
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        pids.append(pid)
    for r in range(rounds):
        got, deadline = b"", time.monotonic() + 120
        while len(got) < writers and time.monotonic() < deadline:
            if select.select([ready_r], [], [], 1.0)[0]:
                got += os.read(ready_r, writers - len(got))  # not a byte of the next round
        for _, go_w in gos:  # all eight at once
            os.write(go_w, b"g")
    status = [os.waitpid(pid, 0)[1] for pid in pids]
    print(json.dumps(status))
    sys.exit(0 if all(s == 0 for s in status) else 1)
    """
)


def _race(root: Path, out: Path, loop: str, force_link: bool) -> list[dict]:
    script = out / "race.py"
    script.write_text(SCRIPT.format(tests=str(Path(__file__).parent)))
    env = dict(os.environ)
    if loop == "python":
        env["TIERSTORE_NATIVE"] = "0"  # no native store call either: the Python publish alone
    proc = subprocess.run([sys.executable, str(script), str(root), str(out), loop, "1" if force_link else "0",
                           str(WRITERS), str(ROUNDS)], capture_output=True, text=True, timeout=400, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    if "SKIP" in proc.stdout:
        pytest.skip(proc.stdout.strip())
    return [json.loads((out / f"writer{i}.json").read_text()) for i in range(WRITERS)]


def _check(root: Path, results: list[dict], loop: str) -> None:
    ns = race_namespace()
    mapper = FileMapper(root, ns.digest, GROUP, 0)
    per_round = [[w["rounds"][r] for w in results] for r in range(ROUNDS)]
    counts = [(sum(x["stored"] for x in rnd), sum(x["ok"] and not x["stored"] for x in rnd),
               [x["error"] for x in rnd if not x["ok"]]) for rnd in per_round]
    # exactly one writer published each page, the seven others found it, none failed
    assert counts == [(1, WRITERS - 1, [])] * ROUNDS, counts
    assert [w["planted_replaced"] for w in results] == [0] * WRITERS  # no page taken for a planted entry
    for r in range(ROUNDS):
        key = page_key(r)
        final = mapper.path_for(key)
        entries = sorted(p.name for p in final.parent.iterdir() if key.hex() in p.name)
        assert entries == [final.name], entries  # one file: no temp left, nothing moved aside
        assert os.stat(final).st_nlink == 1
        inspect_page(final)
    if loop == "native":
        assert sum(w["lane_jobs"] for w in results) >= WRITERS  # the lane served (each writer's own page)


@pytest.mark.parametrize("publish", ["renameat2", "link"])
@pytest.mark.parametrize("loop", ["python", "native"])
def test_eight_writers_of_one_page_store_it_once(tmp_path: Path, loop: str, publish: str) -> None:
    root = tmp_path / "root"
    root.mkdir()
    results = _race(root, tmp_path, loop, force_link=publish == "link")
    _check(root, results, loop)


@pytest.mark.slow  # sshfs: a full-run set-up step (tools/test.sh --quick skips it)
@pytest.mark.parametrize("loop", ["python", "native"])
def test_eight_writers_on_a_file_system_refusing_noreplace(tmp_path: Path, loop: str) -> None:
    """sshfs (FUSE) answers renameat2's RENAME_NOREPLACE with EINVAL, as NFS does: each writer
    finds that out on its first store and publishes with link(2) from then on."""
    from nfs_standin import TwoNodeMount, unavailable_reason

    reason = unavailable_reason()
    if reason:
        pytest.skip(f"sshfs stand-in unavailable: {reason}")
    out = tmp_path / "out"
    out.mkdir()
    with TwoNodeMount(tmp_path / "mnt") as fs:
        results = _race(fs.a, out, loop, force_link=False)
        _check(fs.a, results, loop)
