"""Fixtures of the deployment tests: a relocatable runtime built once per session, a mount
namespace in which no Python of this machine exists, and a fake host root."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import REPO

LOOP_OPTIONS = {
    "backend": "loopfile",
    "file": "rt.img",
    "size": "64Mi",
    "kubernetes.io/fsType": "",
    "kubernetes.io/readwrite": "rw",
    "kubernetes.io/pvOrVolumeName": "pv",
    "kubernetes.io/pod.uid": "u1",
    "kubernetes.io/pod.name": "p",
    "kubernetes.io/pod.namespace": "default",
    "kubernetes.io/serviceAccount.name": "sa",
}


def host_pythons() -> list[str]:
    """Every place a Python of this machine lives (directories and executables)."""
    places = {sys.base_prefix, sys.prefix, "/usr/lib/python3", "/usr/local/lib/python3.11"}
    if "/.pyenv/" in sys.base_prefix:  # pyenv: its shims are on PATH too
        places.add(sys.base_prefix.split("/.pyenv/")[0] + "/.pyenv")
    places.update(str(p) for p in Path("/usr/lib").glob("python3*"))
    for directory in ("/usr/bin", "/usr/local/bin", "/bin", *os.environ["PATH"].split(":")):
        if directory:
            places.update(str(p) for p in Path(directory).glob("python*"))
    return sorted(p for p in places if os.path.exists(p) and not p.startswith("/tmp/"))


HIDE = "\n".join(
    f"if [ -d {p} ]; then mount -t tmpfs hidden {p}; "
    f"elif [ -e {p} ]; then mount --bind /dev/null {p}; fi"
    for p in host_pythons()
)


def in_namespace(script: str) -> subprocess.CompletedProcess[str]:
    """Run ``script`` with bash in a private mount namespace where no host Python exists."""
    body = "set -eu\n" + HIDE + "\n" + textwrap.dedent(script)
    return subprocess.run(
        ["unshare", "-m", "--propagation", "private", "bash", "-c", body],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip


@pytest.fixture(scope="session")
def runtime(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A runtime built from this checkout by deploy/build_runtime.py (about a minute)."""
    out = tmp_path_factory.mktemp("runtime")
    proc = subprocess.run(
        [sys.executable, str(REPO / "deploy" / "build_runtime.py"), str(out)],
        capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    path = Path(proc.stdout.strip().splitlines()[-1])
    assert (path / "flexhub-runtime.json").is_file()
    return path


def fake_host(tmp_path: Path) -> tuple[Path, str]:
    """A host root for `flexhub daemonset`: the real /usr (bind-mounted in the script),
    merged-/usr links, its own /etc, /var and plugin directory."""
    host = tmp_path / "host"
    for directory in ("usr", "dev", "proc", "sys", "tmp", "etc/flexhub", "var/lib", "plugins"):
        (host / directory).mkdir(parents=True)
    for link in ("bin", "sbin", "lib", "lib64"):
        (host / link).symlink_to(f"usr/{link}")
    (host / "etc/os-release").write_text("ID=debian\n")
    (host / "etc/flexhub/flexhub.toml").write_text(
        'state_dir = "/var/lib/flexhub"\nlog_dir = "/var/log/flexhub"\n'
    )
    mounts = f"""
        mount --bind /usr {host}/usr
        mount --bind /dev {host}/dev
        mount --bind /proc {host}/proc
        mount --bind /sys {host}/sys
        {HIDE.replace(" /usr/", f" {host}/usr/")}
    """
    return host, mounts
