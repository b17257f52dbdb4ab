#!/bin/bash
# Baseline for the benchmark: the commands of a first loopfile mount in a plain shell script:
# create a sparse file, attach it, probe it, make ext4, mount it on a staging directory and
# bind-mount that into the pod directory.
#   loopfile-mount.sh <file> <size-bytes> <staging-dir> <pod-dir>
set -eu
file=$1 size=$2 staging=$3 target=$4
truncate -s "$size" "$file"
dev=$(losetup -f --show "$file")
blkid -p "$dev" >/dev/null 2>&1 || true
mkfs.ext4 -q -F -m0 "$dev"
mkdir -p "$staging"
mount -t ext4 "$dev" "$staging"
mount --bind "$staging" "$target"
echo '{"status":"Success"}'
