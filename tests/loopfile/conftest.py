"""Fixtures for the loopfile backend tests: a node with a temporary loopfile root."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from flexhub_loopfile import LoopfileBackend, _loop

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
