#!/usr/bin/env bash
# Run tierstore's whole test suite on a fresh CPU machine: installs what it needs, then pytest.
# Usage: bash tools/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup-env.sh
export TRITON_INTERPRET=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
.venv/bin/ruff check tierstore tests tools
exec .venv/bin/python -m pytest -q -rs --durations=25 "$@"
