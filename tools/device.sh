#!/usr/bin/env bash
# The GPU test set and the GPU benchmarks, on a lent H100/H200 (torch, triton and numba there;
# carry .whl with the cp312 wheels of zstandard and xxhash). Logs go under $OUT.
#   bash tools/device.sh tests    # the GPU test set, then the golden files' check
#   bash tools/device.sh bench    # the GPU path (`tierstore bench kernels`, transfers at 16 I/O
#                                 # threads) and the CPU path (`tierstore bench io`, 2 MiB pages)
#   bash tools/device.sh sealed   # the GPU path with encryption_key_file and without (16 I/O threads)
#   bash tools/device.sh all      # tests and bench, tests first
# The device runs behind docs/measurements/scaling.md and lane.md used experiment modes of this
# script's predecessor, tools/device_scaling.sh; each record names its commit, where that
# script is (`git show 463dc0b:tools/device_scaling.sh`).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python -m pip install -q --no-deps --root-user-action=ignore .whl/*.whl 2>&1 | tail -3
export PYTHONPATH=$PWD
python - <<'PY'
import os, platform, torch, triton
try:
    import numba
    nb = numba.__version__
except ImportError as e:
    nb = f"missing ({e})"
print("python", platform.python_version(), "cores", os.cpu_count(), "torch", torch.__version__, "triton", triton.__version__,
      "numba", nb, "gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, flush=True)
from tierstore.native import loader as native
print("native path:", native.start(wait=True), native.failure(), flush=True)
PY

gpu_tests() {
    timeout 450 python -m pytest -q -rsfE -p no:cacheprovider tests/native/test_native.py tests/kernels tests/vllm/test_worker_gpu.py \
        tests/vllm/test_worker_sparse_mla.py tests/vllm/test_worker_deepseek_v4.py tests/vllm/test_path_modules.py \
        tests/rootstore/test_engine.py tests/rootstore/test_engine_batches.py tests/format/test_golden.py tests/format/test_format.py \
        tests/tiers/test_tiers_chain.py tests/tiers/test_head_slices.py tests/rootstore/test_stress_threads.py \
        tests/bench/test_bench_kernels.py tests/native/test_native_lane.py tests/native/test_native_lane_races.py > "$OUT/gpu_tests.txt" 2>&1
    tail -4 "$OUT/gpu_tests.txt"
    python -m tierstore.testing.golden --check 2>&1 | tail -2
}

gpu_bench() {
    timeout 200 python -m tierstore bench kernels --skip-kernels --no-cold --repeats "${REPEATS:-2}" \
        --transfer-mib "${TRANSFER_MIB:-2048}" --io-threads 16 --root /dev/shm/tsk > "$OUT/bench_kernels.txt" 2>&1
    echo "bench kernels rc=$?"; grep -A6 "^| case" "$OUT/bench_kernels.txt"
    timeout 150 python -m tierstore bench io --no-vllm --page-mib 2 --total-mib 512 --repeat 2 --cold-rounds 1 \
        --warm-passes 2 --root /dev/shm/tsb --threads 4,8,16 --slots worker > "$OUT/bench_io.txt" 2>&1
    echo "bench io rc=$?"; grep -A5 "^| MiB" "$OUT/bench_io.txt"
}

# The GPU path with encryption_key_file against the same run without it (16 I/O threads).
sealed_bench() {
    head -c 32 /dev/urandom > /dev/shm/tsk.key && chmod 600 /dev/shm/tsk.key
    for mode in plain sealed; do
        key=(); [ "$mode" = sealed ] && key=(--encryption-key-file /dev/shm/tsk.key)
        timeout 250 python -m tierstore bench kernels --skip-kernels --no-cold --repeats "${REPEATS:-2}" \
            --transfer-mib "${TRANSFER_MIB:-2048}" --io-threads 16 --root /dev/shm/tsk "${key[@]}" \
            --json-out "$OUT/bench_kernels_$mode.json" > "$OUT/bench_kernels_$mode.txt" 2>&1
        echo "bench kernels $mode rc=$?"; grep -A6 "^| case" "$OUT/bench_kernels_$mode.txt"
    done
}

case "${1:-tests}" in
tests) gpu_tests ;;
bench) gpu_bench ;;
sealed) sealed_bench ;;
all) gpu_tests; gpu_bench ;;
*) echo "usage: bash tools/device.sh [tests|bench|sealed|all]" >&2; exit 2 ;;
esac
