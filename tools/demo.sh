#!/usr/bin/env bash
# Run the tierstore demo on a fresh CPU machine: installs what it needs, then `tierstore demo`.
# Usage: bash tools/demo.sh [demo options...]
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup-env.sh
export VLLM_ENABLE_V1_MULTIPROCESSING=0 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/tierstore demo "$@"
