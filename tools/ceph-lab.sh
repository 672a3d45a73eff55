#!/usr/bin/env bash
# The Ceph test lab (tierstore/testing/ceph_lab.py: one monitor, manager, OSD, radosgw and, on
# request, CephFS, all on 127.0.0.1 under one directory). The object-store tests start their own;
# this installs what they need and starts one for a shell.
#
#   tools/ceph-lab.sh                      # install Debian's Ceph packages if missing (setup)
#   tools/ceph-lab.sh start DIR [--cephfs] # start a lab in DIR (created, removed at the end): one
#                                          # JSON line (endpoint, keys, pids), up until SIGTERM/SIGINT
#
# Quiet: one line of what it does, errors in full. Installing needs root and apt-get.
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGES=(ceph-mon ceph-osd ceph-mgr radosgw ceph-mds ceph-fuse)
# programs the lab runs (from the packages above and ceph-common; umount unmounts ceph-fuse as root)
PROGRAMS=(monmaptool ceph-mon ceph-mgr ceph-osd radosgw radosgw-admin ceph rados ceph-mds ceph-fuse umount)

log() { echo "ceph-lab: $*" >&2; }
die() { echo "ceph-lab: error: $*" >&2; exit 1; }

missing_programs() {
    local p out=()
    for p in "${PROGRAMS[@]}"; do
        command -v "$p" >/dev/null 2>&1 || [[ -x "/usr/sbin/$p" || -x "/sbin/$p" ]] || out+=("$p")
    done
    echo "${out[*]}"
}

if [[ -n "$(missing_programs)" ]]; then
    [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null \
        || die "missing programs: $(missing_programs); as root: apt-get install -y ${PACKAGES[*]}"
    log "installing ${PACKAGES[*]}"
    export DEBIAN_FRONTEND=noninteractive
    out=$(apt-get update -qq 2>&1) || die "apt-get update failed:
$out"
    out=$(apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" 2>&1) \
        || die "apt-get install ${PACKAGES[*]} failed:
$out"
    [[ -z "$(missing_programs)" ]] || die "still missing after install: $(missing_programs)"
fi

[[ $# -eq 0 ]] && exit 0
case "$1" in
    start)
        shift
        PY=.venv/bin/python
        [[ -x "$PY" ]] || PY=${PYTHON:-python3}
        exec "$PY" -m tierstore.testing.ceph_lab_cli start "$@"
        ;;
    *) die "usage: tools/ceph-lab.sh [start DIR [--cephfs]]" ;;
esac
