"""The deployment examples follow docs/SECURITY.md: the NFS export reaches only the engines' nodes
(never a whole private range), Kerberos (sec=krb5p) is named, and the vLLM pods run with a fleet
key (encryption_key_file) that tierstore will accept: a file of the pods' uid, mode 0600, copied from a
Secret (whose files belong to root) by an init container. Text and YAML only; nothing runs."""

from __future__ import annotations

import ipaddress
import json
import re
from pathlib import Path
from typing import Any

import yaml

from tierstore.config import TierStoreConfig

REPO = Path(__file__).resolve().parent.parent
K8S = REPO / "deploy" / "kubernetes"


def _deployment() -> tuple[dict[str, Any], dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all((K8S / "vllm-deployment.yaml").read_text()) if d]
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    pod = dep["spec"]["template"]["spec"]
    (vllm,) = [c for c in pod["containers"] if c["name"] == "vllm"]
    return pod, vllm


def test_the_export_example_names_its_nodes_and_kerberos() -> None:
    """Every network in the /etc/exports examples is a /24 or narrower (a node list, a small
    subnet): 10.0.0.0/8 handed every client root on the range every page."""
    text = (K8S / "nfs-pv.yaml").read_text()
    exports = [line for line in text.splitlines() if "/srv/nfs/kvcache " in line and "(" in line]
    assert exports, "nfs-pv.yaml shows no /etc/exports line"
    for line in exports:
        for host in re.findall(r"\s([0-9./]+)\(", line):
            net = ipaddress.ip_network(host, strict=False)
            assert net.prefixlen >= 24, f"exported to {net}: export to the engines' nodes only ({line.strip()})"
    assert "sec=krb5p" in text and "sec=sys" in text
    assert any("sec=krb5p" in line for line in exports)


def test_the_pods_run_with_a_fleet_key_tierstore_accepts() -> None:
    pod, vllm = _deployment()
    args = vllm["args"]
    cfg = TierStoreConfig.from_dict(json.loads(args[args.index("--kv-transfer-config") + 1])["kv_connector_extra_config"])
    key_file = cfg.encryption_key_file
    assert key_file, "the connector sets no encryption_key_file: any reader of the export reads the prompts"
    key_dir = str(Path(key_file).parent)
    volumes = {v["name"]: v for v in pod["volumes"]}
    (mount,) = [m for m in vllm["volumeMounts"] if m["mountPath"] == key_dir]
    assert volumes[mount["name"]].get("emptyDir", {}).get("medium") == "Memory"  # never on a disk
    # an init container copies the Secret's key there, as the pods' uid, mode 0600
    (init,) = [c for c in pod["initContainers"] if any(m["name"] == mount["name"] for m in c.get("volumeMounts", []))]
    assert init["command"][:3] == ["install", "-m", "0600"] and init["command"][-1] == key_file
    src_mount = [m for m in init["volumeMounts"] if init["command"][-2].startswith(m["mountPath"] + "/")]
    assert len(src_mount) == 1 and "secret" in volumes[src_mount[0]["name"]]
    assert pod["securityContext"]["runAsUser"] == 1000 and pod["securityContext"]["fsGroup"] == 1000
    assert volumes[src_mount[0]["name"]]["secret"]["defaultMode"] & 0o004 == 0  # not world-readable


def test_security_doc_has_the_deployment_advice() -> None:
    text = (REPO / "docs" / "SECURITY.md").read_text()
    for needle in ("krb5p", "mac_key_file", "deploy/kubernetes/nfs-pv.yaml"):
        assert needle in text, needle
