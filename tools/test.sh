#!/usr/bin/env bash
# Run tierstore's whole test suite on a fresh CPU machine: installs what it needs, then pytest.
# Usage: bash tools/test.sh [--quick] [pytest args...]
#   --quick: the check before every push (~2 minutes): every package's tests except engines,
#   servers, the QEMU guest and long storms (the `quick` marker, tests/conftest.py); set-up
#   skips the optional Prometheus, sshfs and guest steps, which only the full run needs.
# Under CI=true a skip whose reason is not on tests/conftest.py's ALLOWED_CI_SKIPS fails the run.
set -euo pipefail
cd "$(dirname "$0")/.."
QUICK=()
if [ "${1:-}" = "--quick" ]; then
  shift
  QUICK=(-m quick)
  export TIERSTORE_SETUP_MINIMAL=1
fi
bash tools/setup-env.sh
export TRITON_INTERPRET=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
.venv/bin/ruff check tierstore tests tools
# Compile the native kernels into numba's on-disk cache once, before any test process needs them:
# on a clean clone the cache is empty, and every engine process (the engine core and each TP
# worker, spawned together) compiled them at once: ~14 s of CPU each (five at once at TP=4 took
# 36 s of the 2-core machine, against 4 s loading a warm cache). Loading a warm cache: ~1.5 s.
.venv/bin/python -c "from tierstore.native import loader as native; native.start(wait=True) or print('tools/test.sh: native kernels not compiled:', native.failure())"
# Two pytest workers, one test file each at a time (module fixtures start their engines once):
# most of the suite's time is engine processes starting, one interpreter importing vLLM on one
# core, so a second worker fills the other core (docs/TESTING.md, "Two workers").
# TIERSTORE_TEST_WORKERS=0 runs in one process. -rsEf lists the failures last, after the skips
# and the set-up errors: CI keeps only the tail of what it prints (27 errors once pushed two
# failures' lines out of it).
WORKERS=${TIERSTORE_TEST_WORKERS:-2}
exec .venv/bin/python -m pytest -q -rsEf --durations=25 -n "$WORKERS" --dist loadfile "${QUICK[@]}" "$@"
