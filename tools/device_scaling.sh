#!/usr/bin/env bash
# Issue 16's device runs (the lent H100/H200: torch, triton, numba there; carry .whl with the
# cp312 wheels of zstandard, xxhash, aiofiles and py-spy). Writes its logs under $OUT.
#   bash tools/device_scaling.sh tests   # the GPU test set, then the CPU path, batches 8/1 alternated
#   bash tools/device_scaling.sh gpu     # the GPU path at 16 threads, batches 8/1 alternated
#   bash tools/device_scaling.sh gputests  # the GPU test set and the golden files only
#   bash tools/device_scaling.sh gputests+MODE [ARG]  # the GPU test set, then MODE
#   bash tools/device_scaling.sh profile   # py-spy of the GPU path at 16 threads
#   bash tools/device_scaling.sh launch [1 0 ...]  # the GPU path at 16 threads, Triton kernels launched
#                                       # through libcuda (1) or Triton (0), alternated in that order
#   bash tools/device_scaling.sh xxh3      # the CPU path, the kernels' XXH3 through xxhash's dispatcher or
#                                       # its SSE2 XXH3_64bits, alternated (2 MiB at 4-16 threads, 16 MiB at 16)
#   bash tools/device_scaling.sh switch    # the GPU path at 16 threads under other GIL switch intervals
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
from tierstore import native
print("native path:", native.start(wait=True), native.failure(), flush=True)
PY
# alternate NAME TIMEOUT TABLE ROWS CMD...: CMD with io_batch_pages 8, 1, 8, 1 appended (paired
# runs in one call), each log under $OUT, its table printed
alternate() {
    local name=$1 limit=$2 table=$3 rows=$4 i=0 b
    shift 4
    for b in 8 1 8 1; do
        i=$((i + 1))
        timeout "$limit" "$@" "$b" > "$OUT/${name}_b${b}_$i.txt" 2>&1
        echo "$name io_batch_pages=$b run $i rc=$?"; grep -A"$rows" "$table" "$OUT/${name}_b${b}_$i.txt"
    done
}
case "${1:-tests}" in
tests|gputests|gputests+*)
    timeout 330 python -m pytest -q -p no:cacheprovider tests/test_native.py tests/kernels tests/vllm/test_worker_gpu.py \
        tests/test_engine.py tests/test_engine_batches.py tests/test_golden.py tests/test_format.py \
        tests/tiers/test_tiers_chain.py tests/tiers/test_head_slices.py tests/test_stress_threads.py \
        tests/bench/test_bench_kernels.py > "$OUT/gpu_tests.txt" 2>&1
    tail -4 "$OUT/gpu_tests.txt"
    python -m tierstore.testing.golden --check 2>&1 | tail -2
    [ "$1" = gputests ] && exit 0
    case "$1" in gputests+*) exec bash "$0" "${1#gputests+}" "${@:2}";; esac
    alternate cpu 45 "^| MiB" 5 python -m tierstore bench io --no-vllm --page-mib 2 --total-mib 512 --repeat 2 \
        --cold-rounds 1 --warm-passes 2 --root /dev/shm/tsb --threads 4,8,16 --slots worker --io-batch-pages
    ;;
xxh3)
    # the native kernels' XXH3: xxhash's dispatcher (AVX2/AVX-512) or its SSE2 XXH3_64bits,
    # alternated; each with its own numba cache (the cache keeps the symbol it compiled with)
    i=0
    for spec in "2 4,8,16 512" "16 16 4096"; do
        set -- $spec
        for sym in XXH3_64bits_dispatch XXH3_64bits XXH3_64bits_dispatch XXH3_64bits; do
            i=$((i + 1))
            TIERSTORE_XXH3_SYMBOL=$sym NUMBA_CACHE_DIR=/tmp/numba-$sym timeout 100 python -m tierstore bench io \
                --no-vllm --page-mib "$1" --total-mib "$3" --repeat 2 --cold-rounds 1 --warm-passes 2 \
                --root /dev/shm/tsb --threads "$2" --slots worker > "$OUT/xxh3_$1_${sym}_$i.txt" 2>&1
            echo "page MiB $1 $sym run $i rc=$?"; grep -A5 "^| MiB" "$OUT/xxh3_$1_${sym}_$i.txt" | grep -v "^|---"
        done
    done
    ;;
launch)
    # kernels.launch on (1: GIL kept) or off (0: Triton's launcher releases the GIL), paired
    i=0
    for v in ${2:-1 0 1 0}; do
        i=$((i + 1))
        TIERSTORE_TRITON_LAUNCH=$v timeout 200 python -m tierstore bench kernels --skip-kernels --no-cold \
            --repeats "${REPEATS:-2}" --transfer-mib "${TRANSFER_MIB:-2048}" --io-threads 16 --root /dev/shm/tsk > "$OUT/launch_${v}_$i.txt" 2>&1
        echo "TIERSTORE_TRITON_LAUNCH=$v run $i rc=$?"; grep -A6 "^| case" "$OUT/launch_${v}_$i.txt"
    done
    ;;
gpu)
    alternate gpu 130 "^| case" 6 python -m tierstore bench kernels --skip-kernels --no-cold --repeats 2 \
        --transfer-mib 2048 --io-threads 16 --root /dev/shm/tsk --io-batch-pages
    ;;
nice)
    # the I/O threads at a lower CPU priority (os.setpriority on each thread: nice N), alternated:
    # does the thread that drives the transfers wait for a core, not for the GIL?
    i=0
    for n in ${2:-5 0 5 0}; do
        i=$((i + 1))
        timeout 200 python -c "import os, sys, runpy; from tierstore import ioqueue as q; run = q.JobQueue._thread
def niced(self, run=run):
    import threading; os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), $n) if $n else None
    run(self)
q.JobQueue._thread = niced; sys.argv = ['tierstore', 'bench', 'kernels', '--skip-kernels', '--no-cold', '--repeats', '${REPEATS:-2}', '--transfer-mib', '${TRANSFER_MIB:-4096}', '--io-threads', '16', '--root', '/dev/shm/tsk']; runpy.run_module('tierstore', run_name='__main__')" > "$OUT/nice_${n}_$i.txt" 2>&1
        echo "I/O threads nice $n run $i rc=$?"; grep -A6 "^| case" "$OUT/nice_${n}_$i.txt" | grep -v "^|---"
    done
    ;;
switch)
    # the GPU path at 16 threads under other GIL switch intervals (sys.setswitchinterval; 5 ms is
    # CPython's default): how much of the driver's GIL waiting is forced switches
    i=0
    for si in 0.005 0.05 0.0005 0.005; do
        i=$((i + 1))
        timeout 130 python -c "import sys, runpy; sys.setswitchinterval($si); sys.argv = ['tierstore', 'bench', 'kernels', '--skip-kernels', '--no-cold', '--repeats', '2', '--transfer-mib', '2048', '--io-threads', '16', '--root', '/dev/shm/tsk']; runpy.run_module('tierstore', run_name='__main__')" > "$OUT/switch_${i}_$si.txt" 2>&1
        echo "switch interval $si s rc=$?"; grep -A6 "^| case" "$OUT/switch_${i}_$si.txt"
    done
    ;;
profile)
    # py-spy (carried wheel): every thread with idle samples, then only the thread holding the GIL
    for mode in ${2:-idle gil}; do
        timeout 200 "$(python -c "import sysconfig; print(sysconfig.get_path('scripts'))")/py-spy" record --threads --$mode --rate 200 --format raw -o "$OUT/prof_$mode.txt" -- \
            python -m tierstore bench kernels --skip-kernels --no-cold --repeats 1 --transfer-mib 2048 \
            --io-threads 16 --root /dev/shm/tsp > "$OUT/prof_${mode}_bench.txt" 2>&1
        echo "profile $mode rc=$?"; grep -A6 "^| case" "$OUT/prof_${mode}_bench.txt"
    done
    ;;
esac
