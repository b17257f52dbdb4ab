"""Fixtures for the loopfile backend tests: a node with a temporary loopfile root."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from flexhub_loopfile import LoopfileBackend, _loop

from flexhub.admin.harness import Kubelet
from flexhub.config import NodeConfig
from flexhub.node import Node

REPO = Path(__file__).resolve().parents[2]


def _loop_usable() -> str:
    if os.geteuid() != 0:
        return "needs root (loop devices, mknod, mounts)"
    if not Path("/dev/loop-control").exists():
        return "needs /dev/loop-control"
    if not _loop.SYS_BLOCK.exists():
        return "needs /sys/block"
    return ""


ROOT_SKIP = _loop_usable()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if not ROOT_SKIP:
        return
    for item in items:
        if "root" in item.keywords and "loopfile" in str(item.fspath):
            item.add_marker(pytest.mark.skip(reason=ROOT_SKIP))


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """The loopfile root (not created: the backend creates it)."""
    return tmp_path / "loopfiles"


@pytest.fixture
def node(tmp_path: Path, root: Path) -> Node:
    config = NodeConfig(
        state_dir=tmp_path / "state",
        log_dir=tmp_path / "log",
        lock_timeout=10,
        command_timeout=30,
        backends={"loopfile": {"root": str(root), "isolation": "none"}},
    )
    return Node(config, backend="loopfile")


@pytest.fixture
def backend(node: Node, tmp_path: Path) -> Iterator[LoopfileBackend]:
    """The backend; afterwards every loop device still mapping a file of this test is freed."""
    yield LoopfileBackend(node)
    detach_under(tmp_path)


def detach_under(directory: Path) -> None:
    """Detach every loop device whose backing file lives under ``directory``."""
    prefix = str(directory.resolve()) + "/"
    for dev in _loop.devices():
        backing = dev.backing_file() or ""
        if backing.startswith(prefix):
            with contextlib.suppress(subprocess.CalledProcessError):
                subprocess.run(["losetup", "--detach", dev.path], check=True, capture_output=True)


def loops_of(path: Path) -> list[str]:
    """The loop devices (as ``losetup --list`` names them) whose backing file names ``path``."""
    out = subprocess.run(
        ["losetup", "--list", "--noheadings", "--output", "NAME,BACK-FILE"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    return [line.split()[0] for line in out.splitlines() if str(path) in line]


def mounts_under(path: Path) -> list[str]:
    return [
        line.split()[4]
        for line in Path("/proc/self/mountinfo").read_text().splitlines()
        if line.split()[4].startswith(str(path))
    ]


@pytest.fixture
def kube(kubelet: Kubelet, node_tree: dict[str, Path]) -> Iterator[Kubelet]:
    """The kubelet harness; afterwards, whatever the test did, nothing is left mounted under
    the node's kubelet or state directory nor attached from its loopfile root."""
    yield kubelet
    for target in mounts_under(node_tree["kubelet"]):
        kubelet.call("unmount", target)
    for target in mounts_under(node_tree["state"]):
        subprocess.run(["umount", "-l", target], check=False)
    for loop in loops_of(node_tree["loopfiles"]):
        subprocess.run(["losetup", "-d", loop], check=False)
