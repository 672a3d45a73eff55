#!/usr/bin/env bash
# Issue 16's device runs (the lent H100/H200: torch, triton, numba there; carry .whl with the
# cp312 wheels of zstandard, xxhash and py-spy). Writes its logs under $OUT.
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
#   bash tools/device_scaling.sh sources   # the CPU path, baseline stores from as many buffers as slots or from 4,
#                                       # alternated (16 MiB at 16 threads), then 2 MiB at 4-16 threads
#   bash tools/device_scaling.sh batchmib ["16 64x1 256"]  # the GPU path at 16 threads per transfer batch
#                                       # size in MiB [x device scratch in batches, default 2]
#   bash tools/device_scaling.sh iobatch16 # the CPU path, 16 MiB at 16 threads, io_batch_pages 8 and 1 alternated
#   bash tools/device_scaling.sh window ["4096 12288"]  # the GPU path at 16 threads with the bench's defaults,
#                                       # 3 repeats per transfer size in MiB, after touching 48 GiB of the VM
#   bash tools/device_scaling.sh gil ["16 128"]  # tools/gil_contention.py: the engine and raw files at 16
#                                       # threads, alone and beside a busy Python thread or a DMA copy (GIL_BESIDE,
#                                       # GIL_BATCHES); then the GPU path per I/O batch cap in MiB, alternated
#   bash tools/device_scaling.sh storebatch  # the stores of an I/O batch in one native call (1) or one call each
#                                       # (0, the code before ac3e83e), alternated: CPU path 2 MiB, then the GPU path
#   bash tools/device_scaling.sh lane      # the native I/O lane (io_loop native/python alternated): the GPU path at
#                                       # 16 threads (LANE_RUNS, default "native python native python"), then the
#                                       # engine beside a busy Python thread (LANE_GIL=0: not)
#   bash tools/device_scaling.sh lanecpu   # the same for the CPU path at 16 threads, 2 and 16 MiB pages
#   bash tools/device_scaling.sh lanerisk  # issue 36's table: tools/gil_contention.py at 16 threads, io_loop native
#                                       # and python, alone and beside a busy Python thread (87% and 100%),
#                                       # 8 then 2 MiB pages; then the GPU path, io_loop alternated
#   bash tools/device_scaling.sh srcmem    # store steps (tools/store_ceiling.py store) from pageable, THP-advised and
#                                       # pinned source pages, 16 MiB at SOURCE_THREADS (default 1,16)
#   bash tools/device_scaling.sh sweep     # the thread sweep (SWEEP_THREADS, default 1,4,8,16,32): the GPU path,
#                                       # then the CPU path with 2 and 16 MiB pages
#   bash tools/device_scaling.sh chunks    # tools/store_ceiling.py store with --chunks 256,1024: 16 MiB stores
#                                       # hashed piece by piece right before each write, at 1, 4 and 16 threads
#   bash tools/device_scaling.sh storepiece  # the CPU path, stores hashed piece by piece (STORE_PIECE_KIB 1024)
#                                       # or whole (0), alternated: 16 then 2 MiB pages at PIECE_THREADS (16)
#   bash tools/device_scaling.sh ceiling   # tools/store_ceiling.py: memory bandwidth, a store's steps one by
#                                       # one, raw file I/O and PCIe apart and together; then the benches
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
# Touch N GiB (default 24) of this fresh VM's memory once (a tmpfs file, then removed): memory
# the guest has never touched is slow to fault in, and whichever system ran first paid for it.
prewarm() {
    dd if=/dev/zero of=/dev/shm/prewarm bs=16M count=$(( ${1:-24} * 64 )) status=none; rm -f /dev/shm/prewarm
}
# `python -c "$PATCHED_CLI" bench ...`: the tierstore CLI with a setting no flag reaches, for paired
# runs: IO_BATCH_MIB=N caps an I/O batch at N MiB (rootstore.engine.IO_BATCH_BYTES); STORE_BATCH_CALL=0
# writes a batch's stores one native call per page (the code before ac3e83e); STORE_PIECE_KIB=K
# hashes and writes a store in K KiB pieces (native.page.STORE_PIECE_BYTES; 0: whole, the code
# before d3dda48).
PATCHED_CLI="import os, sys
import tierstore.rootstore.engine as e
import tierstore.rootstore.rankdir as pf
import tierstore.native.page as native_page
if os.environ.get('STORE_PIECE_KIB'):
    native_page.STORE_PIECE_BYTES = int(os.environ['STORE_PIECE_KIB']) << 10
if os.environ.get('IO_BATCH_MIB'):
    e.IO_BATCH_BYTES = int(os.environ['IO_BATCH_MIB']) << 20
if os.environ.get('STORE_BATCH_CALL') == '0':
    pf.PageFiles._store_native_many = lambda self, items, out: None
from tierstore.admin.cli import main; sys.argv = ['tierstore'] + sys.argv[1:]; main()"
case "${1:-tests}" in
tests|gputests|gputests+*)
    timeout 450 python -m pytest -q -p no:cacheprovider tests/test_native.py tests/kernels tests/vllm/test_worker_gpu.py tests/vllm/test_worker_sparse_mla.py \
        tests/vllm/test_worker_deepseek_v4.py tests/vllm/test_path_modules.py \
        tests/test_engine.py tests/test_engine_batches.py tests/test_golden.py tests/test_format.py \
        tests/tiers/test_tiers_chain.py tests/tiers/test_head_slices.py tests/test_stress_threads.py \
        tests/bench/test_bench_kernels.py tests/test_native_lane.py tests/test_native_lane_races.py > "$OUT/gpu_tests.txt" 2>&1
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
        timeout 200 python -c "import os, sys, runpy; from tierstore.rootstore import ioqueue as q; run = q.JobQueue._thread
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
sources)
    prewarm
    i=0
    for src in 4 slots 4 slots; do
        i=$((i + 1))
        timeout 100 python -m tierstore bench io --no-vllm --page-mib 16 --total-mib 4096 --repeat 2 --cold-rounds 1 \
            --warm-passes 2 --root /dev/shm/tsb --threads 16 --slots worker --store-sources "$src" > "$OUT/sources_${src}_$i.txt" 2>&1
        echo "16 MiB, baseline stores from $src buffers, run $i rc=$?"; grep -A3 "^| MiB" "$OUT/sources_${src}_$i.txt" | grep -v "^|---"
    done
    timeout 100 python -m tierstore bench io --no-vllm --page-mib 2 --total-mib 1024 --repeat 2 --cold-rounds 1 \
        --warm-passes 2 --root /dev/shm/tsb --threads 4,8,16 --slots worker > "$OUT/sources_2mib.txt" 2>&1
    echo "2 MiB rc=$?"; grep -A5 "^| MiB" "$OUT/sources_2mib.txt" | grep -v "^|---"
    ;;
iobatch16)
    # the CPU path, 16 MiB pages at 16 threads, io_batch_pages 8 and 1 alternated (I/O threads' busy share)
    prewarm
    i=0
    for b in 8 1 8 1; do
        i=$((i + 1))
        timeout 100 python -m tierstore bench io --no-vllm --page-mib 16 --total-mib 4096 --repeat 2 --cold-rounds 1 \
            --warm-passes 2 --root /dev/shm/tsb --threads 16 --slots worker --io-batch-pages "$b" > "$OUT/iobatch16_${b}_$i.txt" 2>&1
        echo "16 MiB, io_batch_pages $b, run $i rc=$?"; grep "run [01]:\|ratios" "$OUT/iobatch16_${b}_$i.txt"
    done
    ;;
batchmib)
    # each item: transfer batch MiB[xSCRATCH_BATCHES] (default 2 batches of device scratch)
    i=0
    for spec in ${2:-16 64 256 64}; do
        i=$((i + 1))
        mib=${spec%x*}; sb=2; [ "$spec" != "$mib" ] && sb=${spec#*x}
        # "auto": the worker's automatic scratch (kernels.scratch.transfer_scratch_pages); SLOTS=N: staging slots
        timeout 130 python -m tierstore bench kernels --skip-kernels --no-cold --repeats 2 --transfer-mib 4096 \
            --io-threads 16 --root /dev/shm/tsk $([ "$mib" != auto ] && echo --batch-mib "$mib") \
            --scratch-batches "$sb" --slots "${SLOTS:-0}" > "$OUT/batchmib_${spec}_$i.txt" 2>&1
        echo "batch $mib MiB, scratch $sb batches, run $i rc=$?"; grep -A6 "^| case" "$OUT/batchmib_${spec}_$i.txt" | grep -v "^|---"
        grep "slot census" "$OUT/batchmib_${spec}_$i.txt"
    done
    ;;
window)
    prewarm 48
    for mib in ${2:-4096 12288}; do
        timeout 420 python -m tierstore bench kernels --skip-kernels --no-cold --repeats 3 --transfer-mib "$mib" \
            --io-threads 16 --root /dev/shm/tsk > "$OUT/window_$mib.txt" 2>&1
        echo "transfer $mib MiB rc=$?"; grep -A6 "^| case" "$OUT/window_$mib.txt" | grep -v "^|---"
        grep "per-repeat\|slot census" "$OUT/window_$mib.txt"
    done
    ;;
gil)
    prewarm 48
    timeout 300 python tools/gil_contention.py --root /dev/shm/tsg --threads 16 --page-mib 8 --total-mib 4096 \
        --rounds 3 --beside "${GIL_BESIDE:-alone,spin87,spin100,dma}" --batches "${GIL_BATCHES:-8:16}" --direct "${GIL_DIRECT:-}" 2>&1 \
        | tee "$OUT/gil.txt" | grep -A20 "medians of"
    # then the GPU path with I/O batches capped at each CAP MiB (rootstore.engine.IO_BATCH_BYTES), alternated
    i=0
    for cap in ${2:-}; do
        i=$((i + 1))
        IO_BATCH_MIB=$cap timeout 130 python -c "$PATCHED_CLI" bench kernels --skip-kernels --no-cold \
            --repeats 2 --transfer-mib 4096 --io-threads 16 --root /dev/shm/tsk > "$OUT/gil_kernels_${cap}_$i.txt" 2>&1
        echo "I/O batches capped at $cap MiB, run $i rc=$?"; grep -A6 "^| case" "$OUT/gil_kernels_${cap}_$i.txt" | grep -v "^|---"
    done
    ;;
lane)
    # the native I/O lane (setting io_loop): native and python alternated in one call; the GPU
    # path at 16 threads, then the engine beside a busy Python thread (tools/gil_contention.py)
    prewarm 24
    i=0
    for loop in ${LANE_RUNS:-native python native python}; do
        i=$((i + 1))
        timeout 130 python -m tierstore bench kernels --skip-kernels --no-cold --repeats 2 --transfer-mib 4096 \
            --io-threads 16 --io-loop $loop --root /dev/shm/tsk > "$OUT/lane_k_${loop}_$i.txt" 2>&1
        echo "GPU path, io_loop=$loop, run $i rc=$?"; grep -A6 "^| case" "$OUT/lane_k_${loop}_$i.txt" | grep -v "^|---" | cut -d'|' -f2-6,8-11,16,18
    done
    [ "${LANE_GIL:-1}" = 1 ] && timeout 200 python tools/gil_contention.py --root /dev/shm/tsg --threads 16 --page-mib 8 \
        --total-mib 4096 --rounds 2 --beside alone,spin87 --io-loops native,python 2>&1 | tee "$OUT/lane_gil.txt" \
        | grep -A8 "medians of"
    ;;
lanerisk)
    prewarm 24
    for spec in "8 4096" "2 2048"; do
        set -- $spec
        timeout 200 python tools/gil_contention.py --root /dev/shm/tsg --threads 16 --page-mib $1 --total-mib $2 \
            --rounds 3 --beside alone,spin87,spin100 --io-loops native,python > "$OUT/lanerisk_gil_$1.txt" 2>&1
        echo "engine alone and beside a busy thread, $1 MiB, rc=$?"; grep -A9 "medians of" "$OUT/lanerisk_gil_$1.txt"
    done
    i=0
    for loop in native python native python; do
        i=$((i + 1))
        timeout 100 python -m tierstore bench kernels --skip-kernels --no-cold --repeats 2 --transfer-mib 4096 \
            --io-threads 16 --io-loop $loop --root /dev/shm/tsk > "$OUT/lanerisk_k_${loop}_$i.txt" 2>&1
        echo "GPU path, io_loop=$loop, run $i rc=$?"; grep -A6 "^| case" "$OUT/lanerisk_k_${loop}_$i.txt" | grep -v "^|---" | cut -d'|' -f2-6,8-11,16,18
    done
    ;;
lanecpu)
    # the CPU path at 16 threads, io_loop native and python alternated: 2 MiB, then 16 MiB pages
    prewarm 24
    i=0
    for spec in "2 1024" "16 4096"; do
        set -- $spec
        mib=$1
        for loop in native python native python; do
            i=$((i + 1))
            timeout 100 python -m tierstore bench io --no-vllm --page-mib $mib --total-mib $2 --repeat 2 --cold-rounds 1 \
                --warm-passes 2 --root /dev/shm/tsb --threads 16 --slots worker --io-loop $loop > "$OUT/lane_io_${mib}_${loop}_$i.txt" 2>&1
            echo "CPU path, $mib MiB, io_loop=$loop, run $i rc=$?"; grep "ratios\|I/O threads busy" "$OUT/lane_io_${mib}_${loop}_$i.txt"
        done
    done
    ;;
storebatch)
    prewarm 24
    i=0
    for one in 1 0 1 0; do
        i=$((i + 1))
        STORE_BATCH_CALL=$one timeout 100 python -c "$PATCHED_CLI" bench io --no-vllm --page-mib 2 --total-mib 1024 --repeat 2 --cold-rounds 1 \
            --warm-passes 2 --root /dev/shm/tsb --threads 16 --slots worker > "$OUT/storebatch_io_${one}_$i.txt" 2>&1
        echo "CPU path, batch stores in one call=$one, run $i rc=$?"; grep "ratios\|I/O threads busy" "$OUT/storebatch_io_${one}_$i.txt"
    done
    for one in 1 0 1 0; do
        i=$((i + 1))
        STORE_BATCH_CALL=$one timeout 130 python -c "$PATCHED_CLI" bench kernels --skip-kernels --no-cold --repeats 2 --transfer-mib 4096 \
            --io-threads 16 --root /dev/shm/tsk > "$OUT/storebatch_k_${one}_$i.txt" 2>&1
        echo "GPU path, batch stores in one call=$one, run $i rc=$?"; grep -A6 "^| case" "$OUT/storebatch_k_${one}_$i.txt" | grep -v "^|---" | cut -d'|' -f2-6,12-13,17
    done
    ;;
sweep)
    # issue 16's thread sweep with the default settings (io_loop native): every table in full
    prewarm 24
    threads=${SWEEP_THREADS:-1,4,8,16,32}
    timeout 330 python -m tierstore bench kernels --skip-kernels --no-cold --repeats 2 --transfer-mib 2048 \
        --io-threads "$threads" --root /dev/shm/tsk > "$OUT/sweep_kernels.txt" 2>&1
    echo "GPU path sweep rc=$?"; grep "^|" "$OUT/sweep_kernels.txt" | grep -v "^|---"
    for spec in "2 1024" "16 4096"; do
        set -- $spec
        timeout 150 python -m tierstore bench io --no-vllm --page-mib $1 --total-mib $2 --repeat 2 --cold-rounds 1 \
            --warm-passes 2 --root /dev/shm/tsb --threads "$threads" --slots worker > "$OUT/sweep_io_$1.txt" 2>&1
        echo "CPU path sweep, $1 MiB rc=$?"; grep "^|\|ratios" "$OUT/sweep_io_$1.txt" | grep -v "^|---"
    done
    ;;
chunks)
    prewarm 24
    timeout 300 python tools/store_ceiling.py store --root /dev/shm/tsc --threads ${CHUNK_THREADS:-1,4,16} --page-mib 16 \
        --total-mib 2048 --rounds 3 --chunks 256,1024 2>&1 | tee "$OUT/chunks.txt"
    ;;
srcmem)
    # the memory a store writes from: pageable (numpy), THP-advised, pinned (the engine's slots on a GPU host)
    prewarm 24
    timeout 400 python tools/store_ceiling.py store --root /dev/shm/tsc --threads ${SOURCE_THREADS:-1,16} --page-mib 16 \
        --total-mib 2048 --rounds 3 --source numpy,thp,pinned 2>&1 | tee "$OUT/sources.txt"
    ;;
storepiece)
    prewarm 24
    i=0
    for spec in ${PIECE_SPECS:-"16:4096" "2:1024"}; do
        set -- ${spec/:/ }
        for kib in ${PIECE_KIBS:-1024 0 1024 0}; do
            i=$((i + 1))
            STORE_PIECE_KIB=$kib timeout 100 python -c "$PATCHED_CLI" bench io --no-vllm --page-mib $1 --total-mib $2 \
                --repeat 2 --cold-rounds 1 --warm-passes 2 --root /dev/shm/tsb --threads ${PIECE_THREADS:-16} --slots worker \
                > "$OUT/piece_$1_${kib}_$i.txt" 2>&1
            echo "CPU path, $1 MiB, store piece $kib KiB, run $i rc=$?"; grep "^| $1 " "$OUT/piece_$1_${kib}_$i.txt"
        done
    done
    ;;
ceiling)
    python tools/store_ceiling.py membw --threads 1,4,16 2>&1 | tee "$OUT/ceiling_membw.txt"
    timeout 150 python tools/store_ceiling.py store --root /dev/shm/tsc --threads 16 --page-mib 16,2 --total-mib 4096 \
        --rounds 5 2>&1 | tee "$OUT/ceiling_store.txt"
    timeout 150 python tools/store_ceiling.py composed --root /dev/shm/tsc --threads 4,8,16 --page-mib 2,16 \
        --total-mib 2048 --rounds 3 2>&1 | tee "$OUT/ceiling_composed.txt"
    timeout 100 python -m tierstore bench io --no-vllm --page-mib 16 --total-mib 4096 --repeat 2 --cold-rounds 1 \
        --warm-passes 2 --root /dev/shm/tsb --threads 16 --slots worker > "$OUT/ceiling_io16.txt" 2>&1
    echo "bench io 16 MiB rc=$?"; grep -A3 "^| MiB" "$OUT/ceiling_io16.txt"
    timeout 130 python -m tierstore bench kernels --skip-kernels --no-cold --repeats 2 --transfer-mib 2048 \
        --io-threads 16 --root /dev/shm/tsk > "$OUT/ceiling_kernels.txt" 2>&1
    echo "bench kernels rc=$?"; grep -A6 "^| case" "$OUT/ceiling_kernels.txt"
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
