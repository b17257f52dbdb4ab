#!/bin/sh
# flexhub VM rig, stage 2: runs as PID 1 in the guest after switch_root.
# Prepares the usual runtime mounts, then execs the agent in PID-1 mode
# (it reaps orphans and powers the guest off when the host goes away).
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export HOME=/root LANG=C.UTF-8
mount -t tmpfs -o mode=0755 tmpfs /run
# /tmp stays the overlay's (writes land in its tmpfs upper layer): a tmpfs here would hide
# a checkout that lives under /tmp, as CI's clone may.
mkdir -p /dev/pts /dev/shm /run/lock
mount -t devpts -o gid=5,mode=0620,ptmxmode=0666 devpts /dev/pts
mount -t tmpfs -o mode=1777 tmpfs /dev/shm
modprobe configfs
mountpoint -q /sys/kernel/config || mount -t configfs configfs /sys/kernel/config
ln -sf /proc/self/fd /dev/fd
hostname rig
ip link set lo up
modprobe virtio_console
py= agent=
for arg in $(cat /proc/cmdline); do
    case "$arg" in
        rig.python=*) py="${arg#rig.python=}" ;;
        rig.agent=*) agent="${arg#rig.agent=}" ;;
    esac
done
exec "$py" "$agent" --pid1
