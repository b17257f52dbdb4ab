"""Fixtures of the deployment tests: a relocatable runtime built once per session, a mount
namespace in which no Python of this machine exists, and a fake host root."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.runtime_cache import cached_runtime

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


def in_namespace(script: str, pid: bool = False) -> subprocess.CompletedProcess[str]:
    """Run ``script`` with bash in a private mount namespace where no host Python exists;
    with ``pid``, also in a pid namespace of its own whose ``/proc`` it mounts: the script's
    bash is pid 1, the init a kubelet started by it shares its root and mount namespace with
    (as plugin-directory detection requires of the host's kubelet)."""
    body = "set -eu\n" + HIDE + "\n" + textwrap.dedent(script)
    unshare = ["unshare", "-m", "--propagation", "private"]
    if pid:
        unshare += ["--pid", "--fork", "--mount-proc"]
    return subprocess.run(
        [*unshare, "bash", "-c", body], capture_output=True, text=True, timeout=300, check=False
    )


@pytest.fixture(scope="session")
def runtime() -> Path:
    """A runtime built from this checkout by deploy/build_runtime.py (about a minute), or the
    one an earlier session built from the same inputs (:mod:`tests.runtime_cache`). Tests copy
    it before changing anything in it."""
    return cached_runtime()


@pytest.fixture(scope="session")
def node_runtime() -> Path:
    """The ``--profile node`` runtime of this checkout (no API client, no CSI packages), cached
    like :func:`runtime`."""
    return cached_runtime(profile="node")


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


def fake_kubelet(directory: Path, name: str = "kubelet") -> Path:
    """A root-owned 0755 executable called ``name`` in ``directory``: a copy of bash, so that
    ``<it> -c 'sleep 60; :' kubelet --volume-plugin-dir=...`` stays up with that command line
    and ``/proc/<pid>/exe`` names it."""
    directory.mkdir(mode=0o755, parents=True, exist_ok=True)
    path = directory / name
    shutil.copy2("/bin/bash", path)
    path.chmod(0o755)
    return path


@contextmanager
def running(
    argv: list[str], executable: str | Path | None = None, cwd: Path | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """A process with ``argv`` as its command line (``/proc/<pid>/cmdline``), killed at the
    end whatever happens. ``argv`` may start with ``setpriv ...``: the process that ends up
    with the command line is then the one ``setpriv`` becomes (same pid). It leads its own
    process group, and the whole group is killed, so that no child (bash's ``sleep``) is left
    behind."""
    proc = subprocess.Popen(argv, executable=executable, cwd=cwd, start_new_session=True)
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def wait_for_cmdline(pid: int, argv0: str) -> None:
    """Wait until ``pid``'s command line starts with ``argv0`` (after the execs)."""
    want = argv0.encode() + b"\0"
    for _ in range(100):
        if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(want):
            return
        time.sleep(0.05)
    raise AssertionError(f"pid {pid} never showed {argv0!r}")


class HostProc:
    """A ``proc_root`` for plugin-directory detection that shows the real ``/proc/<pid>`` of
    the processes a test names, and this test's own process as pid 1, the host's init.

    Detection believes only processes living where pid 1 does (its root and mount namespace);
    the real pid 1 of a test machine may be unreadable (a sandbox's init) and the real
    ``/proc`` holds the fake kubelets of other tests running at the same time. Every entry
    is a symlink to the real one: the kernel's own root, namespace, exe and status."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.mkdir()
        (path / "1").symlink_to(f"/proc/{os.getpid()}")

    def show(self, pid: int) -> None:
        link = self.path / str(pid)
        if not os.path.lexists(link):
            link.symlink_to(f"/proc/{pid}")


@pytest.fixture
def host_proc(tmp_path: Path) -> HostProc:
    return HostProc(tmp_path / "host-proc")
