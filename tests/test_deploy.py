"""deploy/: the deployment examples parse, and what they run is what tierstore accepts.

No image is built, no cluster and no systemd are involved (the examples have not run; deploy/README.md).
Checked by parsing the files:
- every YAML document (PyYAML; those tests skip without it): kinds, the NFS volume and its claim,
  the mounts, probes, Prometheus annotations, the CronJob's policy;
- every connector JSON (Dockerfile CMD/ENTRYPOINT, Deployment args and env): the connector and
  module names, and ``kv_connector_extra_config`` through ``TierStoreConfig.from_dict``;
- every ``tierstore ...`` command line (CronJob, the Deployment's doctor init container, systemd
  unit, Dockerfile RUN) through tierstore's own parsers (``admin.gc_command.add_arguments`` for gc,
  ``cli.build_parser`` for the rest);
- the stop settings wherever ``vllm serve`` runs (README, "Stopping without losing stores");
- the systemd unit as an INI file (configparser, strict=False).
"""

from __future__ import annotations

import argparse
import configparser
import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest

from tierstore.admin import cli, gc_command
from tierstore.config import TierStoreConfig

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "kubernetes"
DOCKERFILE = DEPLOY / "Dockerfile"
UNIT = DEPLOY / "systemd" / "tierstore-gc.service"

CONNECTOR = "TierStoreConnector"
MODULE = "tierstore.vllm"
WORKER_TIMEOUT = "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS"
# vLLM 0.32's stop (README): the engine kills its workers VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS + 4 s
# after closing them, so --shutdown-timeout must cover that for the workers' flush to finish.
ENGINE_KILL_MARGIN_S = 4
SHELL_OPERATORS = {"&&", "||", ";", "|", "&", ">", ">>", "<", "(", ")"}


# ----------------------------------------------------------------------------- helpers
@pytest.fixture(scope="module")
def yaml() -> Any:
    return pytest.importorskip("yaml", reason="PyYAML is not importable: the Kubernetes manifests are not checked")


def _docs(yaml: Any, name: str) -> list[dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all((K8S / name).read_text()) if d is not None]
    assert docs, f"{name}: no YAML document"
    for d in docs:
        assert isinstance(d, dict) and d.get("apiVersion") and d.get("kind"), f"{name}: {d!r:.200}"
    return docs


def _one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def _quantity(text: str | int) -> int:
    """A Kubernetes storage quantity in bytes (binary and decimal suffixes)."""
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?", str(text))
    assert m, f"not a quantity: {text!r}"
    units = {None: 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50,
             "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15}
    return int(m.group(1)) * units[m.group(2)]


def _flag(argv: list[str], flag: str) -> str:
    """The value of ``flag`` (``--flag V`` or ``--flag=V``), given exactly once."""
    values = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == flag]
    values += [a.split("=", 1)[1] for a in argv if a.startswith(flag + "=")]
    assert len(values) == 1, f"{flag} given {len(values)} times in {argv}"
    return values[0]


def _connector(text: str) -> TierStoreConfig:
    """A --kv-transfer-config JSON: tierstore's connector, its extra config valid for tierstore."""
    kvt = json.loads(text)
    assert kvt["kv_connector"] == CONNECTOR
    assert kvt["kv_connector_module_path"] == MODULE
    assert kvt["kv_role"] == "kv_both"
    return TierStoreConfig.from_dict(kvt["kv_connector_extra_config"])


def _connector_jsons(strings: list[str]) -> list[TierStoreConfig]:
    """Every string that mentions the connector must be a valid connector JSON."""
    return [_connector(s) for s in strings if "kv_connector" in s]


def _check_serve(argv: list[str], env: dict[str, str], cfg: TierStoreConfig) -> float:
    """``vllm serve`` with tierstore's stop settings; returns --shutdown-timeout."""
    assert argv[:2] == ["vllm", "serve"], argv
    cfgs = _connector_jsons([_flag(argv, "--kv-transfer-config")])
    assert cfgs == [cfg]
    shutdown = float(_flag(argv, "--shutdown-timeout"))
    assert WORKER_TIMEOUT in env, f"{WORKER_TIMEOUT} is not set where vllm serve runs"
    worker = float(env[WORKER_TIMEOUT])
    assert worker >= cfg.flush_timeout_s, (worker, cfg.flush_timeout_s)
    assert shutdown > cfg.flush_timeout_s, (shutdown, cfg.flush_timeout_s)
    assert shutdown >= worker + ENGINE_KILL_MARGIN_S, (shutdown, worker)
    return shutdown


def _parse(parser: argparse.ArgumentParser, args: list[str], where: str) -> argparse.Namespace | None:
    try:
        return parser.parse_args(args)
    except SystemExit as exc:
        if exc.code == 0:  # --version, --help: parsed, nothing to return
            return None
        pytest.fail(f"{where}: tierstore's parser refused {args} (its message is in the captured stderr)")


def _tierstore(argv: list[str], where: str) -> tuple[str, argparse.Namespace | None]:
    """Parse a ``tierstore ...`` command line with tierstore's own parsers: (command, namespace)."""
    assert Path(argv[0]).name == "tierstore", argv
    args = argv[1:]
    if args and args[0] == "gc":
        parser = argparse.ArgumentParser(prog="tierstore gc")
        gc_command.add_arguments(parser)
        return "gc", _parse(parser, args[1:], where)
    assert not (args and args[0] in cli.DELEGATED), f"{where}: add a parser for `tierstore {args[0]}` here"
    assert not (args[:1] == ["bench"] and args[1:2] and args[1] in cli.BENCH), f"{where}: {args}"
    ns = _parse(cli.build_parser(), args, where)
    return (ns.command if ns is not None else "--version"), ns


def _shell_commands(line: str) -> list[list[str]]:
    """The simple commands of a shell line, split at && || ; | and redirections."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    out: list[list[str]] = [[]]
    for tok in lexer:
        if tok in SHELL_OPERATORS:
            out.append([])
        else:
            out[-1].append(tok)
    return [c for c in out if c]


# ----------------------------------------------------------------------------- Dockerfile
def _dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined as Docker joins them."""
    out, buf = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        if line.lstrip().startswith("#") or (not buf and not line.strip()):
            continue  # comments (also inside a continuation) and blank lines
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1]
            continue
        instr, _, rest = (buf + line).strip().partition(" ")
        out.append((instr.upper(), rest.strip()))
        buf = ""
    assert not buf, "Dockerfile ends inside a continuation line"
    return out


def _exec_form(instrs: list[tuple[str, str]], name: str) -> list[str]:
    found = [rest for instr, rest in instrs if instr == name]
    assert len(found) == 1, f"Dockerfile: {len(found)} {name} instructions"
    # Docker runs an array that is not valid JSON as shell form (sh -c: SIGTERM would stop at sh).
    value = json.loads(found[0])
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), found[0]
    return value


def _docker_env(instrs: list[tuple[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for instr, rest in instrs:
        if instr == "ENV":
            for word in shlex.split(rest):
                key, sep, value = word.partition("=")
                assert sep, f"ENV {rest}: write KEY=value"
                env[key] = value
    return env


def _dockerfile_serve() -> tuple[list[str], dict[str, str], TierStoreConfig]:
    instrs = _dockerfile()
    argv = _exec_form(instrs, "ENTRYPOINT") + _exec_form(instrs, "CMD")
    cfgs = _connector_jsons(argv)
    assert len(cfgs) == 1, f"Dockerfile: {len(cfgs)} connector JSONs in ENTRYPOINT + CMD"
    return argv, _docker_env(instrs), cfgs[0]


def test_dockerfile_base_image_and_install_from_the_clone() -> None:
    instrs = _dockerfile()
    args = {k: v for k, _, v in (rest.partition("=") for instr, rest in instrs if instr == "ARG")}
    froms = [rest for instr, rest in instrs if instr == "FROM"]
    assert len(froms) == 1 and (m := re.fullmatch(r"\$\{?(\w+)\}?", froms[0])), froms
    assert args[m.group(1)].startswith("vllm/vllm-openai:v"), args
    copied = [shlex.split(rest) for instr, rest in instrs if instr == "COPY"]
    assert any(c[-1].rstrip("/").startswith("/src") for c in copied), copied
    runs = [cmd for instr, rest in instrs if instr == "RUN" for cmd in _shell_commands(rest)]
    pip = [c for c in runs if "pip" in c and "install" in c]
    assert any("/src[vllm,encrypt]" in c for c in pip), pip  # encryption_key_file needs cryptography


def test_dockerfile_serves_with_the_connector_and_the_stop_settings() -> None:
    argv, env, cfg = _dockerfile_serve()
    _check_serve(argv, env, cfg)
    instrs = _dockerfile()
    volumes = [v for instr, rest in instrs if instr == "VOLUME" for v in json.loads(rest)]
    assert cfg.root in volumes, (cfg.root, volumes)
    assert cfg.local_root is None  # one volume: the Deployment adds the local tier


def test_dockerfile_run_example_waits_longer_than_vllm() -> None:
    """Docker's stop timeout is 10 s by default: the `docker run` example raises it."""
    argv, env, cfg = _dockerfile_serve()
    shutdown = _check_serve(argv, env, cfg)
    runs = [shlex.split(line.lstrip("# ")) for line in DOCKERFILE.read_text().splitlines()
            if line.lstrip("# ").startswith("docker run") and "--stop-timeout" in line]
    assert runs, "Dockerfile: no `docker run ... --stop-timeout N` example"
    for run in runs:
        assert float(_flag(run, "--stop-timeout")) > shutdown, run


def test_dockerfile_tierstore_commands_parse() -> None:
    lines = [cmd for instr, rest in _dockerfile() if instr == "RUN" for cmd in _shell_commands(rest)
             if Path(cmd[0]).name == "tierstore"]
    assert lines, "Dockerfile: no tierstore command (the install is checked with `tierstore --version`)"
    for argv in lines:
        _tierstore(argv, "Dockerfile")


# ----------------------------------------------------------------------------- Kubernetes
def _pod_volumes(pod: dict[str, Any], container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """mountPath -> the volume mounted there."""
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    return {m["mountPath"]: volumes[m["name"]] for m in container.get("volumeMounts", [])}


def _mount_of(path: str, mounts: dict[str, dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """The mount that holds ``path`` (the longest mountPath above it)."""
    above = [m for m in mounts if Path(path).is_relative_to(m)]
    assert above, f"{path} is on no volume: {sorted(mounts)}"
    best = max(above, key=len)
    return best, mounts[best]


def _pv_and_claim(yaml: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    docs = _docs(yaml, "nfs-pv.yaml")
    return _one(docs, "PersistentVolume"), _one(docs, "PersistentVolumeClaim")


def _deployment(yaml: Any) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    dep = _one(_docs(yaml, "vllm-deployment.yaml"), "Deployment")
    pod = dep["spec"]["template"]["spec"]
    (container,) = [c for c in pod["containers"] if c["name"] == "vllm"]
    return dep, pod, container


def _cronjob(yaml: Any) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    cj = _one(_docs(yaml, "gc-cronjob.yaml"), "CronJob")
    pod = cj["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    return cj, pod, container


def _env(container: dict[str, Any]) -> dict[str, str]:
    env = {}
    for e in container.get("env", []):
        assert "value" in e, f"env {e['name']}: a literal value, so that the test sees it"
        assert isinstance(e["value"], str), f"env {e['name']}: Kubernetes wants a string, got {e['value']!r}"
        env[e["name"]] = e["value"]
    return env


def test_every_manifest_parses_with_the_expected_kinds(yaml: Any) -> None:
    kinds = {p.name: sorted(d["kind"] for d in _docs(yaml, p.name)) for p in sorted(K8S.glob("*.yaml"))}
    assert kinds == {
        "gc-cronjob.yaml": ["CronJob"],
        "nfs-pv.yaml": ["PersistentVolume", "PersistentVolumeClaim"],
        "vllm-deployment.yaml": ["Deployment", "Service"],
    }


def test_nfs_volume_is_hard_mounted_nfs4_and_claimed_read_write_many(yaml: Any) -> None:
    pv, pvc = _pv_and_claim(yaml)
    assert pv["apiVersion"] == "v1" and pv["spec"]["nfs"]["server"] and pv["spec"]["nfs"]["path"]
    opts = pv["spec"]["mountOptions"]
    assert "hard" in opts and "soft" not in opts, opts
    assert any(re.fullmatch(r"(nfs)?vers=4(\.\d)?", o) for o in opts), opts
    for obj in (pv, pvc):
        assert "ReadWriteMany" in obj["spec"]["accessModes"]
        assert obj["spec"]["storageClassName"] == ""  # static binding, no provisioner
    assert pvc["spec"]["volumeName"] == pv["metadata"]["name"]
    assert _quantity(pvc["spec"]["resources"]["requests"]["storage"]) <= _quantity(pv["spec"]["capacity"]["storage"])


def test_deployment_connector_tiers_on_the_right_volumes(yaml: Any) -> None:
    _, pvc = _pv_and_claim(yaml)
    dep, pod, container = _deployment(yaml)
    assert dep["apiVersion"] == "apps/v1"
    strings = [*container.get("command", []), *container.get("args", []), *_env(container).values()]
    cfgs = _connector_jsons(strings)
    assert len(cfgs) == 1, f"Deployment: {len(cfgs)} connector JSONs"
    cfg = cfgs[0]
    mounts = _pod_volumes(pod, container)
    # root: the shared NFS claim, at its mount point.
    assert mounts[cfg.root]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    # local_root: on a node-local volume (never NFS, never the claim), with a cap below its size.
    assert cfg.local_root and cfg.local_max_bytes
    _, local = _mount_of(cfg.local_root, mounts)
    assert "emptyDir" in local or "hostPath" in local, local
    assert local.get("emptyDir", {}).get("medium") != "Memory", "local_root belongs on a disk"
    if (limit := (local.get("emptyDir") or {}).get("sizeLimit")) is not None:
        assert cfg.local_max_bytes < _quantity(limit), "the kubelet evicts a pod whose emptyDir outgrows sizeLimit"


def test_deployment_stops_without_losing_stores(yaml: Any) -> None:
    _, pod, container = _deployment(yaml)
    assert container.get("command", ["vllm", "serve"]) == ["vllm", "serve"]  # the image's ENTRYPOINT
    image_entrypoint = _exec_form(_dockerfile(), "ENTRYPOINT")
    argv = image_entrypoint + container["args"]
    (cfg,) = _connector_jsons(container["args"])
    shutdown = _check_serve(argv, {**_docker_env(_dockerfile()), **_env(container)}, cfg)
    assert WORKER_TIMEOUT in _env(container), "set it in the manifest too: another image may not"
    pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    sleep = float(pre_stop[1]) if pre_stop[:1] == ["sleep"] else 0.0
    assert pod["terminationGracePeriodSeconds"] > sleep + shutdown, (pod["terminationGracePeriodSeconds"], sleep, shutdown)
    assert not pod.get("hostNetwork"), "pods need host names of their own (stale-temp detection)"


def test_deployment_probes_metrics_and_service(yaml: Any) -> None:
    dep, pod, container = _deployment(yaml)
    port = int(_flag(container["args"], "--port"))
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert port in named.values()

    def probe_port(probe: dict[str, Any]) -> int:
        p = probe["httpGet"]["port"]
        return named[p] if isinstance(p, str) else p

    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert probe_port(container["readinessProbe"]) == port
    ann = dep["spec"]["template"]["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true"
    assert ann["prometheus.io/path"] == "/metrics"
    assert ann["prometheus.io/port"] == str(port)
    assert "nvidia.com/gpu" in container["resources"]["limits"]
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
    svc = _one(_docs(yaml, "vllm-deployment.yaml"), "Service")
    assert svc["spec"]["selector"].items() <= labels.items()
    (sp,) = svc["spec"]["ports"]
    target = sp["targetPort"]
    assert (named[target] if isinstance(target, str) else target) == port


def test_cronjob_gc_parses_and_runs_on_the_engines_root(yaml: Any) -> None:
    pv, pvc = _pv_and_claim(yaml)
    cj, pod, container = _cronjob(yaml)
    assert cj["apiVersion"] == "batch/v1"
    assert cj["spec"]["concurrencyPolicy"] == "Forbid"
    assert pod["restartPolicy"] in ("Never", "OnFailure")
    argv = [*container.get("command", []), *container.get("args", [])]
    command, args = _tierstore(argv, "gc-cronjob.yaml")
    assert command == "gc" and args is not None
    assert args.loop == 0, "a CronJob pass must end: --loop would hold the Forbid slot for ever"
    assert not args.dry_run
    assert args.max_bytes <= _quantity(pv["spec"]["capacity"]["storage"])
    mounts = _pod_volumes(pod, container)
    assert mounts[args.root]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    # The same root as the engines, and the same uid (pages 0600, directories 0700).
    _, dpod, dcontainer = _deployment(yaml)
    (cfg,) = _connector_jsons(dcontainer["args"])
    assert args.root == cfg.root
    assert pod["securityContext"]["runAsUser"] == dpod["securityContext"]["runAsUser"]
    assert container["image"] == dcontainer["image"]


def test_deployment_runs_doctor_before_vllm_on_the_engines_root(yaml: Any) -> None:
    """The init container runs `tierstore doctor` (a command the CLI has) on the engines' root,
    against the gc CronJob's cap, and lets only exit 0 and 16 (warnings) through."""
    _, pod, container = _deployment(yaml)
    (init,) = [c for c in pod.get("initContainers", []) if c["name"] == "tierstore-doctor"]
    argv = [*init.get("command", []), *init.get("args", [])]
    assert argv[:2] == ["sh", "-c"], argv
    lines = [cmd for cmd in _shell_commands(argv[2]) if Path(cmd[0]).name == "tierstore"]
    assert len(lines) == 1, argv
    command, args = _tierstore(lines[0], "vllm-deployment.yaml initContainers")
    assert command == "doctor" and args is not None
    (cfg,) = _connector_jsons(container["args"])
    assert args.root == cfg.root
    mounts = _pod_volumes(pod, init)
    assert mounts[args.root] == _pod_volumes(pod, container)[cfg.root]  # the same volume as vLLM's root
    _, _, cj_container = _cronjob(yaml)
    parser = argparse.ArgumentParser()
    gc_command.add_arguments(parser)
    gc_args = parser.parse_args([*cj_container.get("command", []), *cj_container.get("args", [])][2:])
    assert args.max_bytes == gc_args.max_bytes, "doctor checks the space against gc's cap"
    assert init["image"] == container["image"]
    shell = argv[2]
    assert '[ "$rc" -eq 0 ] || [ "$rc" -eq 16 ]' in shell, "exit 4 (a check failed) must stop the pod"
    assert cli.EXIT_WARNINGS == 16 and "16   doctor: warnings only" in cli.EXIT_TABLE


# ----------------------------------------------------------------------------- systemd
def _unit() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",),
                                       comment_prefixes=("#", ";"), empty_lines_in_values=False)
    parser.optionxform = str  # systemd keys are case-sensitive
    parser.read_string(UNIT.read_text())
    return parser


def test_systemd_unit_parses_and_runs_gc_in_a_loop() -> None:
    unit = _unit()
    assert {"Unit", "Service", "Install"} <= set(unit.sections())
    svc = unit["Service"]
    exec_start = svc["ExecStart"].lstrip("-@:+!")
    argv = shlex.split(exec_start)
    assert argv[0].startswith("/"), "ExecStart takes an absolute path"
    command, args = _tierstore(argv, "tierstore-gc.service")
    assert command == "gc" and args is not None
    assert args.loop > 0 and not args.dry_run
    assert svc["Restart"] == "on-failure"
    assert svc["User"] not in ("", "root") and svc.get("DynamicUser", "no") == "no"
    assert svc["NoNewPrivileges"] == "yes"
    assert svc["ProtectSystem"] == "strict"
    assert svc["PrivateTmp"] == "yes"
    # ProtectSystem=strict leaves only ReadWritePaths writable: gc's root must be one of them.
    assert any(Path(args.root).is_relative_to(p) for p in svc["ReadWritePaths"].split()), svc["ReadWritePaths"]
    assert args.root in unit["Unit"]["RequiresMountsFor"].split()


# ----------------------------------------------------------------------------- README
def test_deploy_readme_names_every_file() -> None:
    text = (DEPLOY / "README.md").read_text()
    files = [p.relative_to(DEPLOY).as_posix() for p in DEPLOY.rglob("*") if p.is_file() and p.name != "README.md"]
    assert files
    missing = [f for f in files if f not in text]
    assert not missing, f"deploy/README.md does not mention {missing}"
