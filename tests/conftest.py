"""Shared fixtures: a node config in a temporary tree, an installed driver, a kubelet."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

# gRPC core logs to stderr at ERROR by default, also from a child this process forks with a
# ``preexec_fn`` (a chroot into another host root, a umask). ``flexhub.csi`` turns gRPC's fork
# support off, as in the CSI plugin (tests/deploy/test_run_in_host.py proves the child's output
# is the driver's alone with the logging on); it is imported here, before any test module
# imports grpc, and the test process's gRPC stays quiet besides.
os.environ.setdefault("GRPC_VERBOSITY", "NONE")

import flexhub.csi  # noqa: F401  (gRPC's fork support off before any test imports grpc)
from flexhub.admin.harness import KUBELET_ENV, DriverReply, Kubelet, parse_reply
from flexhub.admin.install import install
from flexhub.errors import forget_secrets

pytest_plugins = ["tests.rig.fixtures", "tests.ciplugin", "pytester"]

REPO = Path(__file__).resolve().parent.parent
TEST_SITE = REPO / "tests" / "fixtures" / "site"
PYTHON = sys.executable


def is_root() -> bool:
    return os.geteuid() == 0


needs_root = pytest.mark.skipif(not is_root(), reason="needs root (real mounts and loop devices)")


@pytest.fixture(autouse=True)
def _forget_call_secrets() -> Iterator[None]:
    """Secrets parsed in-process are remembered for the call (the process); not across tests."""
    yield
    forget_secrets()


@pytest.fixture
def trusted_dir() -> Iterator[Path]:
    """A directory that only root may write, as may only root every directory above it.

    It lives in ``/run`` (root's, 0755), not in ``/tmp`` or ``/var/tmp``: those are 1777, and
    flexhub counts a sticky directory that others may write as writable by others.
    """
    base = Path("/run")
    for directory in (base, *base.parents):
        info = os.stat(directory)
        assert info.st_uid == 0 and not info.st_mode & 0o022, directory
    path = Path(tempfile.mkdtemp(prefix="flexhub-trusted-", dir=base))
    path.chmod(0o755)
    try:
        yield path
    finally:
        mounts = Path("/proc/self/mounts").read_text().split()
        left = [m for m in mounts if m.startswith(f"{path}/")]
        assert not left, f"still mounted, {path} is kept: {left}"  # rmtree would empty them
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def node_tree(tmp_path: Path) -> dict[str, Path]:
    """A node's directories under tmp_path, and a config file naming them."""
    tree = {
        "state": tmp_path / "state",
        "log": tmp_path / "log",
        "loopfiles": tmp_path / "loopfiles",
        "plugins": tmp_path / "plugins",
        "kubelet": tmp_path / "kubelet",
        "config": tmp_path / "flexhub.toml",
    }
    tree["config"].write_text(
        f'state_dir = "{tree["state"]}"\n'
        f'log_dir = "{tree["log"]}"\n'
        "lock_timeout = 20\n"
        f'[loopfile]\nroot = "{tree["loopfiles"]}"\n'
    )
    return tree


@pytest.fixture
def driver(node_tree: dict[str, Path]) -> Path:
    """flexhub installed into a kubelet-style plugin directory."""
    return install(node_tree["plugins"], config=node_tree["config"])


@pytest.fixture
def kubelet(driver: Path, node_tree: dict[str, Path]) -> Kubelet:
    return Kubelet(driver=driver, root=node_tree["kubelet"])


def run_flexhub(
    args: list[str], config: Path | None = None, env: Mapping[str, str] | None = None
) -> DriverReply:
    """Run ``python -m flexhub`` like kubelet, with the test backends on the path.

    Without ``config`` the call gets the session's throw-away node config (tests/ciplugin.py),
    never the node's real ``/etc/flexhub``, ``/var/lib/flexhub`` or ``/var/log/flexhub``.
    """
    full_env = dict(KUBELET_ENV)
    full_env["PYTHONPATH"] = str(TEST_SITE)
    full_env["FLEXHUB_CONFIG"] = str(config) if config is not None else os.environ["FLEXHUB_CONFIG"]
    full_env.update(env or {})
    argv = [PYTHON, "-m", "flexhub", *args]
    proc = subprocess.run(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=full_env,
        cwd="/",
        timeout=120,
        check=False,
    )
    return DriverReply(argv, proc.returncode, proc.stdout, parse_reply(proc.stdout))
