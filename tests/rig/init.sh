#!/bin/busybox sh
# flexhub VM rig, stage 1: /init of the busybox initramfs.
# Loads virtio-pci/9p/overlay, mounts the host root read-only over virtio-9p
# under a tmpfs-backed overlay and switch_roots into it, running stage 2
# (tests/rig/stage2.sh from the host checkout, path given on the cmdline).
/bin/busybox mkdir -p /bin /proc /sys /dev /lower /rw /newroot
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
while read -r mod; do
    insmod "/mods/$mod" || echo "rig-init: insmod $mod failed"
done < /mods/order
fail() { echo "rig-init: $*"; echo o > /proc/sysrq-trigger; while :; do sleep 60; done; }
mount -t 9p -o trans=virtio,version=9p2000.L,cache=loose,msize=512000,ro hostroot /lower \
    || fail "cannot mount host root over 9p"
mount -t tmpfs -o mode=0755 rw /rw
mkdir -p /rw/upper /rw/work
mount -t overlay -o lowerdir=/lower,upperdir=/rw/upper,workdir=/rw/work overlay /newroot \
    || fail "cannot mount overlay"
stage2=
for arg in $(cat /proc/cmdline); do
    case "$arg" in rig.stage2=*) stage2="${arg#rig.stage2=}" ;; esac
done
[ -n "$stage2" ] || fail "no rig.stage2= on the kernel command line"
mount --move /dev /newroot/dev
mount --move /sys /newroot/sys
mount --move /proc /newroot/proc
exec switch_root /newroot /bin/sh "$stage2"
