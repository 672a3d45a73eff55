#!/usr/bin/env bash
# Installs Debian's prometheus package (the server and promtool) for the metrics tests
# (tests/test_metrics_rules.py, tests/vllm/test_prometheus_serve.py). Idempotent and quiet:
# prints one line; on failure prints apt's output in full and exits non-zero.
# The package's own service is not started (the tests start their own server on 127.0.0.1).
set -euo pipefail
if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
    echo "prometheus-setup: $(prometheus --version 2>&1 | head -n1)"
    exit 0
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
log=$(mktemp)
trap 'rm -f "$log"' EXIT
echo "prometheus-setup: installing Debian's prometheus package (server and promtool)"
# policy-rc.d 101: the package's post-install must not start a system-wide server
policy=/usr/sbin/policy-rc.d
made_policy=0
if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$policy" >/dev/null
    $SUDO chmod +x "$policy"
    made_policy=1
fi
status=0
{ $SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends prometheus; } >"$log" 2>&1 || status=$?
if [ "$made_policy" = 1 ]; then $SUDO rm -f "$policy"; fi
if [ "$status" != 0 ]; then
    cat "$log" >&2
    echo "prometheus-setup: apt-get failed (exit $status); the Prometheus tests will skip" >&2
    exit "$status"
fi
echo "prometheus-setup: $(prometheus --version 2>&1 | head -n1)"
