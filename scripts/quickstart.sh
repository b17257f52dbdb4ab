#!/usr/bin/env bash
# flexhub's quick start: install what `flexhub demo` needs, then run it. No cluster, no Go.
#
#     bash scripts/quickstart.sh
#
# 1. the system tools the demo (the loopfile backend) runs: losetup, blkid, mount (util-linux,
#    mount), mkfs.xfs and xfs_growfs (xfsprogs), mkfs.ext4 and resize2fs (e2fsprogs), and
#    Python's venv module (python3-venv): apt-get installs those that are missing;
# 2. a virtual environment, $FLEXHUB_VENV (default ~/flexhub-venv), with flexhub and its
#    backends (this checkout, editable): a distribution's own Python refuses a pip install;
# 3. `flexhub demo`, as root (it attaches a loop device and mounts), in a directory only root
#    may write: $FLEXHUB_DEMO_DIR (default /run/flexhub-quickstart), removed afterwards.
#
# Run it as root, or as a user who may sudo (then only apt-get and the demo run with sudo).
# It needs Python 3.11 or newer. The tests are another command: `bash .ci/run` (CI's, which
# also installs the test-only tools, Go 1.26 among them).
set -euo pipefail
cd "$(dirname "$0")/.."
say() { printf 'quickstart: %s\n' "$*"; }
die() { printf 'quickstart: %s\n' "$*" >&2; exit 1; }

if [ "$(id -u)" -eq 0 ]; then
    as_root=()
elif command -v sudo >/dev/null 2>&1; then
    as_root=(sudo)
else
    die "the demo needs root and there is no sudo: run it as root (su -c 'bash scripts/quickstart.sh')"
fi

python=${PYTHON:-python3}
command -v "$python" >/dev/null 2>&1 || need_python=1
if [ -z "${need_python:-}" ] && ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    die "flexhub needs Python 3.11 or newer; $python is $("$python" -V 2>&1)"
fi

# tool:package, for each tool the demo runs
need=()
[ -n "${need_python:-}" ] && need+=(python3 python3-venv)
for tool in losetup:util-linux blkid:util-linux mount:mount umount:mount mkfs.xfs:xfsprogs \
        xfs_growfs:xfsprogs mkfs.ext4:e2fsprogs resize2fs:e2fsprogs; do
    command -v "${tool%%:*}" >/dev/null 2>&1 || need+=("${tool#*:}")
done
if [ -z "${need_python:-}" ] && ! "$python" -c 'import ensurepip, venv' 2>/dev/null; then
    need+=(python3-venv)  # Debian keeps venv's pip bootstrap in its own package
fi
if [ "${#need[@]}" -gt 0 ]; then
    command -v apt-get >/dev/null 2>&1 \
        || die "missing: ${need[*]} (no apt-get here: install them with your package manager)"
    # one of each, in order
    mapfile -t need < <(printf '%s\n' "${need[@]}" | awk '!seen[$0]++')
    say "installing ${need[*]}"
    "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

venv=${FLEXHUB_VENV:-$HOME/flexhub-venv}
if [ ! -x "$venv/bin/python" ]; then
    say "making the venv $venv"
    "$python" -m venv "$venv"
fi
backends=()
for dir in backends/*/; do backends+=(-e "$dir"); done
say "installing flexhub and its backends into $venv"
"$venv/bin/python" -m pip install -q -e . "${backends[@]}"

# The demo's tree: under a directory only root may write (not /tmp, which everyone may).
demo_dir=${FLEXHUB_DEMO_DIR:-/run/flexhub-quickstart}
"${as_root[@]}" mkdir -p -m 0755 "$demo_dir"
say "running flexhub demo (as root, in $demo_dir)"
status=0
"${as_root[@]}" env TMPDIR="$demo_dir" "$venv/bin/flexhub" demo || status=$?
"${as_root[@]}" rmdir "$demo_dir" 2>/dev/null || true  # empty unless the demo left something
if [ "$status" -ne 0 ]; then
    die "flexhub demo failed (exit $status): its summary above says why"
fi
say "done: $venv/bin/flexhub is installed (. $venv/bin/activate); the tests: bash .ci/run"
