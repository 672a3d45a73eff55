#!/usr/bin/env bash
# Build (once) the QEMU guest the kernel-NFS tests boot: Debian's kernel and a busybox initramfs
# that mounts the host's / read-only over 9p and chroots into it (tierstore/testing/nfs_guest.py
# boots it; tests/nfs_kernel/ runs scenarios inside).
#
# Idempotent: a second run checks the cache and returns. Quiet: one line of what it does, errors
# in full. Needs root (apt-get) unless the packages are already installed.
#
#   tools/nfs-guest.sh                  # cache in ${TIERSTORE_NFS_GUEST_DIR:-~/.cache/tierstore/nfs-guest}
#   TIERSTORE_NFS_GUEST_DIR=/x tools/nfs-guest.sh
set -euo pipefail

CACHE="${TIERSTORE_NFS_GUEST_DIR:-${HOME}/.cache/tierstore/nfs-guest}"
# bump when the initramfs recipe below changes: the cache is rebuilt
RECIPE=4  # 4: host paths under the guest's tmpfs mounts stay visible (guest.paths)
PACKAGES=(qemu-system-x86 busybox-static nfs-kernel-server rpcbind kmod cpio e2fsprogs faketime util-linux)
# programs the guest runs (from the packages above), checked before anything is skipped
PROGRAMS=(qemu-system-x86_64 busybox rpcbind rpc.nfsd rpc.mountd exportfs modprobe depmod cpio mkfs.ext4 faketime losetup)

log() { echo "nfs-guest: $*"; }
die() { echo "nfs-guest: error: $*" >&2; exit 1; }

missing_programs() {
    local p out=()
    for p in "${PROGRAMS[@]}"; do
        command -v "$p" >/dev/null 2>&1 || [[ -x "/usr/sbin/$p" || -x "/sbin/$p" ]] || out+=("$p")
    done
    echo "${out[*]}"
}

# --- the kernel version linux-image-amd64 points at (answered from the local apt cache) ---
kernel_package() {
    apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/ {print $2; exit}'
}

# --- fast path: everything in place --------------------------------------------------------
if [[ -f "$CACHE/ready" && -z "$(missing_programs)" ]]; then
    read -r ready_recipe ready_version < "$CACHE/ready" || true
    if [[ "$ready_recipe" == "$RECIPE" && -f "$CACHE/kernel/boot/vmlinuz-$ready_version" \
          && -f "$CACHE/initramfs.cpio.gz" \
          && -f "$CACHE/kernel/lib/modules/$ready_version/modules.dep" ]]; then
        exit 0
    fi
fi

log "building the kernel-NFS test guest in $CACHE"

# --- packages ------------------------------------------------------------------------------
if [[ -n "$(missing_programs)" ]]; then
    [[ $(id -u) -eq 0 ]] || die "missing programs: $(missing_programs); run as root or: apt-get install -y ${PACKAGES[*]}"
    export DEBIAN_FRONTEND=noninteractive
    out=$(apt-get update -qq 2>&1) || die "apt-get update failed:
$out"
    out=$(apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" 2>&1) \
        || die "apt-get install ${PACKAGES[*]} failed:
$out"
    [[ -z "$(missing_programs)" ]] || die "still missing after install: $(missing_programs)"
fi

pkg=$(kernel_package)
[[ -n "$pkg" ]] || die "apt-cache cannot resolve linux-image-amd64 (run apt-get update)"
version=${pkg#linux-image-}

# --- kernel: downloaded and unpacked, modules.dep generated --------------------------------
mkdir -p "$CACHE"
if [[ ! -f "$CACHE/kernel/boot/vmlinuz-$version" || ! -f "$CACHE/kernel/lib/modules/$version/modules.dep" ]]; then
    work=$(mktemp -d "$CACHE/.download.XXXXXX")
    trap 'rm -rf "$work"' EXIT
    # apt's sandbox user cannot write into root-owned temp dirs: that warning is harmless
    out=$( (cd "$work" && apt-get download "$pkg") 2>&1 ) || die "apt-get download $pkg failed:
$out"
    deb=$(ls "$work"/*.deb 2>/dev/null | head -1)
    [[ -n "$deb" ]] || die "apt-get download $pkg produced no .deb:
$out"
    rm -rf "$CACHE/kernel.new"
    dpkg-deb -x "$deb" "$CACHE/kernel.new" || die "dpkg-deb -x $deb failed"
    out=$(depmod -b "$CACHE/kernel.new" "$version" 2>&1) || die "depmod -b failed:
$out"
    rm -rf "$CACHE/kernel"
    mv "$CACHE/kernel.new" "$CACHE/kernel"
    rm -rf "$work"
    trap - EXIT
fi
[[ -f "$CACHE/kernel/boot/vmlinuz-$version" ]] || die "no vmlinuz-$version in $CACHE/kernel/boot"

# --- initramfs: busybox, the 9p modules in load order, /init -------------------------------
root=$(mktemp -d "$CACHE/.initramfs.XXXXXX")
trap 'rm -rf "$root"' EXIT
mkdir -p "$root"/{bin,dev,proc,sys,newroot,lib/modules}
cp "$(command -v busybox)" "$root/bin/busybox"
if command -v ldd >/dev/null && ldd "$root/bin/busybox" >/dev/null 2>&1; then
    die "busybox is dynamically linked: apt-get install busybox-static"
fi
# modprobe prints "insmod PATH" lines in dependency order; built-in modules print "builtin"
order=""
for module in virtio_pci 9pnet_virtio 9p; do
    deps=$(modprobe -d "$CACHE/kernel" -S "$version" --show-depends "$module" 2>&1) \
        || die "modprobe --show-depends $module failed (kernel modules incomplete?):
$deps"
    order+="$deps"$'\n'
done
: > "$root/modules.order"
while read -r word path _; do
    [[ "$word" == insmod ]] || continue
    name=$(basename "$path")
    grep -qx "$name" "$root/modules.order" && continue
    cp "$path" "$root/lib/modules/$name"
    echo "$name" >> "$root/modules.order"
done <<< "$order"
grep -q '^9p.ko$' "$root/modules.order" || die "9p.ko not found among the kernel's modules:
$order"

cat > "$root/init" <<'INIT'
#!/bin/busybox sh
# PID 1 of the kernel-NFS test guest: mount the host's / (9p, read-only), give the guest its own
# tmpfs on /tmp, /run, /mnt, /var/tmp and /var/lib/nfs, keep the host paths the job needs visible
# under them, mount the writable results share at its host path, chroot and run the job script.
#
# The results share (tag "results") holds guest.paths, written by the host: line 1 is the share's
# host path, each further line a host directory under one of the tmpfs mount points that must stay
# visible (a checkout or venv under /tmp, for one). Paths are read line by line, so white space in
# them is fine. Each is bind-mounted aside before the tmpfs mounts hide it and bound back after.
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
for m in $(cat /modules.order); do insmod /lib/modules/$m 2>/dev/null; done
job=""
for arg in $(cat /proc/cmdline); do
    case "$arg" in
        tierstore.job=*) job="${arg#tierstore.job=}" ;;
    esac
done
fail() { echo "nfs-guest init: $*" > /dev/console; reboot -f; }
opts=trans=virtio,version=9p2000.L,msize=512000
mount -t 9p -o "$opts,ro,cache=loose" hostroot /newroot || fail "cannot mount the host's / over 9p"
mkdir -p /results /keep
mount -t 9p -o "$opts" results /results || fail "cannot mount the results share"
[ -f /results/guest.paths ] || fail "no guest.paths in the results share"
results=$(head -n 1 /results/guest.paths)
[ -n "$results" ] || fail "guest.paths names no results path"
kept=0
tail -n +2 /results/guest.paths > /kept.paths
while IFS= read -r path; do
    [ -n "$path" ] || continue
    mkdir -p "/keep/$kept"
    mount -o bind "/newroot$path" "/keep/$kept" || fail "cannot hold the host path $path"
    kept=$((kept + 1))
done < /kept.paths
mount -t proc proc /newroot/proc
mount -t sysfs sys /newroot/sys
mount -t devtmpfs dev /newroot/dev
mkdir -p /newroot/dev/shm /newroot/dev/pts
mount -t tmpfs -o mode=1777 shm /newroot/dev/shm
for d in /run /var/lib/nfs /mnt /var/tmp /tmp; do
    mount -t tmpfs -o mode=1777 tmpfs "/newroot$d" || fail "cannot mount tmpfs on $d"
done
kept=0
while IFS= read -r path; do
    [ -n "$path" ] || continue
    mkdir -p "/newroot$path" 2>/dev/null
    mount -o bind "/keep/$kept" "/newroot$path" || fail "cannot show the host path $path"
    kept=$((kept + 1))
done < /kept.paths
# last: the results dir may lie under a kept path, or under the guest's /tmp
mkdir -p "/newroot$results" 2>/dev/null
mount -o bind /results "/newroot$results" || fail "cannot mount the results share at $results"
echo "$(cut -d' ' -f1 /proc/uptime)" > /results/booted_s
chroot /newroot /bin/sh "$results/$job" > /results/guest.log 2>&1
echo $? > /results/rc
sync
reboot -f
INIT
chmod 755 "$root/init"
(cd "$root" && find . | cpio -o -H newc --quiet | gzip -1 > "$CACHE/initramfs.cpio.gz.new") \
    || die "cpio of the initramfs failed"
mv "$CACHE/initramfs.cpio.gz.new" "$CACHE/initramfs.cpio.gz"
rm -rf "$root"
trap - EXIT
echo "$RECIPE $version" > "$CACHE/ready"
log "ready: kernel $version, initramfs $(du -h "$CACHE/initramfs.cpio.gz" | cut -f1)"
