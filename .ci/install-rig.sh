#!/usr/bin/env bash
# Debian packages the real-kernel VM rig (tests/rig) needs: qemu, a stock
# kernel with every module, busybox for the initramfs, and the NFS / iSCSI / SMB /
# filesystem tools the guest uses (it sees the host's root read-only), and OpenSSH
# (sshd in the guest plays the target host the iSCSI provisioner reaches with ssh).
# Idempotent: does nothing when everything is installed.  Services are not
# started on the host (policy-rc.d exits 101 while apt runs).
set -euo pipefail
pkgs=(qemu-system-x86 linux-image-amd64 busybox-static kmod udev iproute2 procps
      nfs-kernel-server nfs-common open-iscsi python3-rtslib-fb samba cifs-utils
      e2fsprogs xfsprogs btrfs-progs util-linux multipath-tools sg3-utils
      openssh-server openssh-client lvm2)
missing=()
for p in "${pkgs[@]}"; do
    dpkg-query -W -f='${Status}\n' "$p" 2>/dev/null | grep -q '^install ok installed$' \
        || missing+=("$p")
done
if [ "${#missing[@]}" -eq 0 ]; then
    echo "install-rig: all packages present"
    exit 0
fi
echo "install-rig: installing ${missing[*]}"
policy=/usr/sbin/policy-rc.d
created_policy=0
if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy"
    chmod 755 "$policy"
    created_policy=1
fi
cleanup() { if [ "$created_policy" = 1 ]; then rm -f "$policy"; fi; }
trap cleanup EXIT
export DEBIAN_FRONTEND=noninteractive
log=$(mktemp)
if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${missing[@]}"; } \
        >"$log" 2>&1; then
    cat "$log" >&2
    echo "install-rig: apt-get failed" >&2
    exit 1
fi
rm -f "$log"
ls /boot/vmlinuz-* >/dev/null 2>&1 || { echo "install-rig: no kernel in /boot" >&2; exit 1; }
echo "install-rig: done"
