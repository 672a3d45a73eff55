#!/usr/bin/env bash
# Run the tierstore demo on a fresh CPU machine: installs what it needs, then `tierstore demo`.
# Usage: bash tools/demo.sh [demo options...]
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup-env.sh
export VLLM_ENABLE_V1_MULTIPROCESSING=0 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# Default: a small random-weight Llama (hidden 1024 x 8 layers, built locally in ~10 s), whose
# 2000-token prefill is long enough for the restored-vs-cold timing to mean something.
if [ $# -eq 0 ]; then set -- --size small --prompt-tokens 2000 --prompts 2; fi
exec .venv/bin/tierstore demo "$@"
