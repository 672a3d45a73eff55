"""The shipped Prometheus rules pass ``promtool check rules`` and their unit tests, and each alert's
unit test fails when the alert's expression is broken (the tests can catch a bad rule).

Skips with the reason when promtool is missing (tools/prometheus-setup.sh installs Debian's
prometheus package, which ships it).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
RULES = REPO / "deploy" / "prometheus" / "tierstore-alerts.yml"
RULE_TESTS = REPO / "deploy" / "prometheus" / "tierstore-alerts.test.yml"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not found: run tools/prometheus-setup.sh "
                                    "(Debian's prometheus package)")


def _promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def _alerts() -> list[str]:
    doc = yaml.safe_load(RULES.read_text())
    return [r["alert"] for g in doc["groups"] for r in g["rules"] if "alert" in r]


@needs_promtool
def test_promtool_check_rules() -> None:
    out = _promtool("check", "rules", str(RULES), cwd=REPO)
    assert out.returncode == 0, out.stdout + out.stderr


@needs_promtool
def test_promtool_unit_tests_pass() -> None:
    out = _promtool("test", "rules", RULE_TESTS.name, cwd=RULES.parent)
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_alert_has_a_firing_and_a_silent_unit_test() -> None:
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    firing, silent = set(), set()
    for case in tests:
        for check in case.get("alert_rule_test", []):
            (firing if check.get("exp_alerts") else silent).add(check["alertname"])
    assert set(_alerts()) == firing == silent


@needs_promtool
@pytest.mark.parametrize("alert", _alerts())
def test_unit_tests_catch_a_broken_alert(alert: str, tmp_path: Path) -> None:
    """Plant a fault: the alert's expression never fires; its unit test must now fail."""
    doc = yaml.safe_load(RULES.read_text())
    for group in doc["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == alert:
                rule["expr"] = "vector(0) > 1"
    (tmp_path / RULES.name).write_text(yaml.safe_dump(doc, sort_keys=False))
    shutil.copy(RULE_TESTS, tmp_path / RULE_TESTS.name)
    out = _promtool("test", "rules", RULE_TESTS.name, cwd=tmp_path)
    assert out.returncode != 0 and alert in out.stdout + out.stderr, out.stdout + out.stderr
