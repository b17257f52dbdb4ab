#!/usr/bin/env bash
# Host tools the loopfile and node-service tests, the release test (skopeo) and the data-path benchmark (fio) use for
# real (idempotent).
set -euo pipefail
need=()
for tool in losetup:util-linux mkfs.ext4:e2fsprogs mkfs.xfs:xfsprogs blkid:util-linux cmp:diffutils \
        umoci:umoci skopeo:skopeo unshare:util-linux fio:fio; do
    command -v "${tool%%:*}" >/dev/null 2>&1 || need+=("${tool#*:}")
done
if [ "${#need[@]}" -gt 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
# The Go harness (tests/kubeharness), the control-plane tier and helm build against Kubernetes
# v1.37; their go.mod files need Go >= 1.26, which no Debian package of this release provides
# (golang-go is 1.19): the machine must have it (this kind has it in /usr/local/go).
# A release go1.N or go1.N.P with N >= 26, or a development toolchain (devel ...); not a
# release candidate of 1.26 (the go.mod files ask for 1.26.0).
version=$(go env GOVERSION 2>/dev/null || true)
minor=$(printf '%s\n' "$version" | sed -n 's/^go1\.\([0-9][0-9]*\)\(\.[0-9][0-9]*\)\{0,1\}$/\1/p')
case $version in devel*) minor=999 ;; esac
if [ -z "$minor" ] || [ "$minor" -lt 26 ]; then
    echo "Go >= 1.26 is needed (found: ${version:-no go on PATH}); install it and run again" >&2
    exit 1
fi
go version
