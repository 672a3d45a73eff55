"""``tierstore doctor``, fs/mounts.py, and the local tier's refusal of a network ``local_root``.

Doctor runs for real on the test's directory (every check, its JSON, its exit codes); planted
conditions: a root others can write to, a max_bytes above the free space or the file system,
a mount table that says NFS with ``soft`` (fed as a fake mountinfo), a bad --config.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tierstore.admin import cli, doctor
from tierstore.config import TierStoreConfig
from tierstore.errors import ConfigError
from tierstore.fs import mounts
from tierstore.metrics import MetricsRegistry
from tierstore.testing import fill_pages, simple_namespace

REPO = Path(__file__).resolve().parents[2]
FAST = ["--ops", "20", "--pages", "2", "--page-bytes", "256K"]
ALL_CHECKS = {"filesystem", "contents", "ownership", "space", "odirect", "rename", "clock", "metadata", "throughput"}


def _doctor(capsys: pytest.CaptureFixture[str], root: Path, *extra: str) -> tuple[int, dict]:
    rc = cli.main(["doctor", str(root), "--json", *FAST, *extra])
    out = capsys.readouterr()
    doc = json.loads(out.out)
    assert doc["exit_code"] == rc
    return rc, doc


def _checks(doc: dict) -> dict[str, dict]:
    return {c["name"]: c for c in doc["checks"]}


def _mountinfo(tmp_path: Path, point: Path, fstype: str, source: str, options: str) -> Path:
    """A mount table with the real root plus ``point`` mounted as ``fstype`` with ``options``."""
    text = ("21 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n"
            f"99 21 0:77 / {point} rw,relatime shared:9 - {fstype} {source} rw,{options}\n")
    path = tmp_path / "mountinfo"
    path.write_text(text)
    return path


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "root"
    r.mkdir(mode=0o700)
    return r


def test_every_check_runs_and_reports_on_this_disk(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fill_pages(root, simple_namespace(), 2)
    before = sorted(p.relative_to(root) for p in root.rglob("*"))
    rc, doc = _doctor(capsys, root)
    assert doc["tierstore_doctor"] == 1 and next(iter(doc)) == "tierstore_doctor"
    checks = _checks(doc)
    assert set(checks) == ALL_CHECKS
    assert all(c["status"] in doctor.STATUSES and c["summary"] for c in checks.values())
    assert checks["rename"]["status"] == "ok" and checks["rename"]["data"]["atomic"] is True
    assert checks["clock"]["status"] == "ok" and abs(checks["clock"]["data"]["skew_s"]) < 1
    assert checks["contents"]["data"]["namespaces"] == 1
    for op in ("create", "rename", "stat", "readdir", "unlink"):
        lat = checks["metadata"]["data"][op]
        assert 0 <= lat["p50_ms"] <= lat["p99_ms"] and lat["n"] > 0
    io = checks["throughput"]["data"]
    assert io["write_gbps"] > 0 and io["read_gbps"] > 0 and io["files"] == 2
    assert checks["filesystem"]["data"]["fstype"] == mounts.mount_of(root).fstype  # type: ignore[union-attr]
    assert rc == (16 if doc["status"] == "warn" else 0) and doc["status"] != "fail"
    # Doctor wrote only under its own directory and removed it.
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == before


def test_text_report_and_missing_root(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main(["doctor", str(root), *FAST])
    out = capsys.readouterr()
    assert rc in (0, 16) and out.err == ""
    assert "[ok  ] rename:" in out.out and "failure(s)" in out.out
    assert cli.main(["doctor", str(root / "nope"), "--json"]) == 8
    out = capsys.readouterr()
    assert json.loads(out.out)["exit_code"] == 8 and "not accessible" in out.err and "root" in out.err


def test_a_root_others_can_write_to_fails_unless_trusted(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    os.chmod(root, 0o777)  # world-writable, no sticky bit: fs/trust.py's rule refuses it
    rc, doc = _doctor(capsys, root)
    own = _checks(doc)["ownership"]
    assert rc == 4 and own["status"] == "fail" and "trust_shared_root" in own["advice"][0]
    rc, doc = _doctor(capsys, root, "--trust-shared-root")
    own = _checks(doc)["ownership"]
    assert own["status"] == "warn" and any("mac_key_file" in a for a in own["advice"])
    assert rc in (4, 16) and (rc == 16) == (doc["status"] == "warn")


def test_shared_group_access_wants_a_group_writable_setgid_root(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, doc = _doctor(capsys, root, "--shared-group-access")
    own = _checks(doc)["ownership"]
    assert own["status"] == "warn" and "2770" in own["advice"][-1]


def test_max_bytes_against_free_space_and_size(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sv = os.statvfs(root)
    avail, total = sv.f_bavail * sv.f_frsize, sv.f_blocks * sv.f_frsize
    rc, doc = _doctor(capsys, root, "--max-bytes", str(max(1, avail // 2)))
    assert _checks(doc)["space"]["status"] == "ok"
    if avail + (1 << 20) < total:
        rc, doc = _doctor(capsys, root, "--max-bytes", str(avail + (1 << 20)))
        space = _checks(doc)["space"]
        assert space["status"] == "warn" and space["data"]["max_bytes"] == avail + (1 << 20) and rc in (4, 16)
    rc, doc = _doctor(capsys, root, "--max-bytes", str(total * 2))
    assert _checks(doc)["space"]["status"] == "fail" and rc == 4


def test_nfs_soft_mount_is_flagged_with_advice(root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    info = _mountinfo(tmp_path, root, "nfs4", "server:/export", "vers=4.2,soft,timeo=600,proto=tcp")
    rc, doc = _doctor(capsys, root, "--mountinfo", str(info))
    fs = _checks(doc)["filesystem"]
    assert fs["status"] == "warn" and fs["data"]["network"] and fs["data"]["options"]["vers"] == "4.2"
    assert any("`soft`" in a and "hard" in a for a in fs["advice"])
    assert any("lookupcache=positive" in a for a in fs["advice"]) and any("nconnect" in a for a in fs["advice"])
    assert rc in (4, 16)
    info = _mountinfo(tmp_path, root, "nfs4", "server:/export", "vers=4.2,hard,lookupcache=pos,nconnect=8")
    rc, doc = _doctor(capsys, root, "--mountinfo", str(info))
    fs = _checks(doc)["filesystem"]
    assert fs["status"] == "ok" and not any("nconnect" in a or "lookupcache" in a for a in fs["advice"])
    info = _mountinfo(tmp_path, root, "nfs", "server:/export", "vers=3,actimeo=0,hard")
    _, doc = _doctor(capsys, root, "--mountinfo", str(info))
    fs = _checks(doc)["filesystem"]
    assert fs["status"] == "warn" and any("actimeo=0" in a for a in fs["advice"])


def test_config_file_gives_the_settings_and_bad_values_are_refused(root: Path, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    total = os.statvfs(root).f_blocks * os.statvfs(root).f_frsize
    cfg = tmp_path / "kv.json"
    cfg.write_text(json.dumps({"kv_connector": "TierStoreConnector", "kv_connector_extra_config": {
        "root": str(root), "max_bytes": total * 4, "trust_shared_root": True}}))
    rc = cli.main(["doctor", "--config", str(cfg), "--json", *FAST])
    doc = json.loads(capsys.readouterr().out)
    assert doc["root"] == str(root) and _checks(doc)["space"]["status"] == "fail" and rc == 4
    assert _checks(doc)["ownership"]["data"]["trust_shared_root"] is True
    rc = cli.main(["doctor", "--config", str(cfg), "--json", "--max-bytes", "1M", *FAST])  # a flag wins
    assert _checks(json.loads(capsys.readouterr().out))["space"]["status"] == "ok"
    cfg.write_text(json.dumps({"root": str(root), "fsync": "false"}))
    assert cli.main(["doctor", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "fsync" in err and "tierstore doctor" in err


def test_parse_mountinfo_escapes_optional_fields_and_longest_prefix(tmp_path: Path) -> None:
    text = ("1 0 8:1 / / rw - ext4 /dev/sda1 rw,errors=remount-ro\n"
            "2 1 0:5 / /mnt/my\\040cache rw,noatime shared:2 master:1 - nfs4 srv:/x\\040y rw,vers=4.1,hard\n"
            "3 2 0:6 / /mnt/my\\040cache/deeper ro - tmpfs tmpfs rw,size=1g\n"
            "garbage line\n")
    ms = mounts.parse_mountinfo(text)
    assert [m.mount_point for m in ms] == ["/", "/mnt/my cache", "/mnt/my cache/deeper"]
    nfs = ms[1]
    assert nfs.fstype == "nfs4" and nfs.source == "srv:/x y" and nfs.option("vers") == "4.1"
    assert nfs.option("hard") == "" and nfs.option("soft") is None and nfs.option("noatime") == ""
    assert ms[2].option("ro") == "" and mounts.is_network(nfs) and not mounts.is_network(ms[2])
    assert mounts.mount_of("/mnt/my cache/a/b", text) == nfs
    assert mounts.mount_of("/mnt/my cache/deeper/x", text) == ms[2]
    assert mounts.mount_of("/mnt/my cachet", text) == ms[0]  # a prefix of the name is not a parent
    assert mounts.is_network(mounts.Mount("/m", "fuse.sshfs", "h:/", {}))
    assert not mounts.is_network(mounts.Mount("/m", "fuse-overlayfs", "o", {}))


def test_local_tier_refuses_local_root_on_nfs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tierstore.tiers.local import LocalTier, refuse_network_local_root

    local = tmp_path / "local"
    refuse_network_local_root(local)  # this machine's disk: accepted
    info = _mountinfo(tmp_path, tmp_path, "nfs4", "filer:/vol/kv", "vers=4.2,hard")
    monkeypatch.setattr(mounts, "MOUNTINFO_PATH", str(info))
    cfg = TierStoreConfig.from_dict({"root": str(tmp_path / "shared"), "local_root": str(local)})
    ns = simple_namespace()
    with pytest.raises(ConfigError) as caught:
        LocalTier(cfg, ns, 0, 0, MetricsRegistry().tier("local"))
    msg = str(caught.value)
    assert '"local_root"' in msg and "nfs4" in msg and "filer:/vol/kv" in msg and "local disk" in msg
    assert not local.exists()  # refused before the engine created anything


def test_doctor_in_a_fresh_process_with_progress(root: Path) -> None:
    """As an operator runs it: `python -m tierstore doctor ROOT --progress` draws a bar (rate)
    on stderr even when it is not a terminal, and the report on stdout."""
    out = subprocess.run([sys.executable, "-m", "tierstore", "doctor", str(root), "--progress", *FAST],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode in (0, 16), out.stderr
    assert "doctor" in out.stderr and "check/s" in out.stderr and "9/9" in out.stderr
    assert "rename:" in out.stdout


def test_a_hung_root_is_said_within_the_deadline(root: Path, capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A root whose file server stopped answering (its stat still answered from a cache):
    doctor says so within --deadline-s and exits 8 (before: it hung with the mount)."""
    import threading
    import time

    server = threading.Event()
    real_probe = doctor.probe_root

    def hung(path: Path) -> None:
        server.wait(60)
        real_probe(path)

    monkeypatch.setattr(doctor, "probe_root", hung)
    t0 = time.monotonic()
    try:
        rc = cli.main(["doctor", str(root), "--json", "--deadline-s", "0.5", *FAST])
    finally:
        server.set()
    out = capsys.readouterr()
    assert rc == 8 and time.monotonic() - t0 < 5
    assert "did not answer a create within 0.5 s (--deadline-s)" in out.err
    assert json.loads(out.out)["exit_code"] == 8
