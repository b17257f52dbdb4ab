#!/usr/bin/env bash
# Host tools the loopfile and node-service tests and the data-path benchmark (fio) use for
# real (idempotent).
set -euo pipefail
need=()
for tool in losetup:util-linux mkfs.ext4:e2fsprogs mkfs.xfs:xfsprogs blkid:util-linux cmp:diffutils \
        umoci:umoci unshare:util-linux fio:fio; do
    command -v "${tool%%:*}" >/dev/null 2>&1 || need+=("${tool#*:}")
done
if [ "${#need[@]}" -gt 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
# The Go harness (tests/kubeharness) and the control-plane tier build against Kubernetes v1.37;
# their go.mod files need Go >= 1.26.
if ! command -v go >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends golang-go >/dev/null
fi
go version
