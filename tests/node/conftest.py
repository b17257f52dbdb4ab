"""Fixtures for the node services tests: real nodes on tmp dirs, loop files, stale mounts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))

from blockfile import BlockfileBackend  # noqa: E402

from flexhub.config import NodeConfig  # noqa: E402
from flexhub.node import Node  # noqa: E402
from flexhub.node.mounts import MountTable  # noqa: E402
from flexhub.volume import Volume  # noqa: E402

PYTHON = sys.executable


def _is_root() -> bool:
    return os.geteuid() == 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _is_root():
        return
    skip = pytest.mark.skip(reason="needs root for loop devices and real mounts")
    for item in items:
        if "root" in item.keywords:
            item.add_marker(skip)


def _mounts_under(base: str) -> list[str]:
    points = [e.mount_point for e in MountTable().entries()]
    return [p for p in points if p == base or p.startswith(base.rstrip("/") + "/")]


def _loops_of(path: str) -> list[str]:
    out = subprocess.run(
        ["losetup", "-j", path, "-O", "NAME", "-n"], capture_output=True, text=True, check=False
    ).stdout
    return [line.strip() for line in out.splitlines() if line.strip()]


class Rig:
    """One test's world: a state dir, pod dirs, backing files; cleaned up afterwards."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.state = base / "state"
        self.files: list[Path] = []
        self.config = NodeConfig(
            state_dir=self.state,
            lock_timeout=20,
            mount_timeout=20,
            unmount_timeout=10,
            command_timeout=60,
        )
        self.node = Node(self.config, "blockfile")
        self.backend = BlockfileBackend(self.node)

    def file(self, name: str = "vol.img", size: int = 64 << 20) -> Path:
        path = self.base / name
        with open(path, "wb") as handle:
            handle.truncate(size)
        self.files.append(path)
        return path

    def pod(self, name: str) -> Path:
        path = self.base / "pods" / name / "volumes" / "flexhub~blockfile" / "vol"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def volume(
        self,
        file: Path,
        fs_type: str = "",
        read_only: bool = False,
        fs_group: int | None = None,
        mount_options: str = "",
    ) -> Volume:
        options = {"backend": "blockfile", "file": str(file)}
        if mount_options:
            options["mountOptions"] = mount_options
        return Volume(options=options, fs_type=fs_type, read_only=read_only, fs_group=fs_group)

    def loops(self) -> list[str]:
        found: list[str] = []
        for path in self.files:
            found += _loops_of(str(path))
        return found

    def mounts(self) -> list[str]:
        return _mounts_under(str(self.base))

    def records(self) -> list[str]:
        found = []
        for sub in ("pods", "volumes"):
            directory = self.state / sub
            if directory.is_dir():
                found += [f"{sub}/{n}" for n in os.listdir(directory)]
        return found

    def staging_dirs(self) -> list[str]:
        directory = self.state / "staging"
        return sorted(os.listdir(directory)) if directory.is_dir() else []

    def assert_clean(self) -> None:
        assert self.mounts() == []
        assert self.loops() == []
        assert self.records() == []
        assert self.staging_dirs() == []

    def drive(
        self,
        op: str,
        target: Path,
        file: Path | None = None,
        env: dict[str, str] | None = None,
        **extra: object,
    ) -> subprocess.CompletedProcess[str]:
        args: dict[str, object] = {"op": op, "state": str(self.state), "target": str(target)}
        if file is not None:
            args["file"] = str(file)
        args.update(extra)
        full_env = dict(os.environ, PYTHONPATH=str(REPO))
        full_env.pop("FLEXHUB_TEST_CRASH_AT", None)
        full_env.update(env or {})
        return subprocess.run(
            [PYTHON, str(HERE / "driver.py"), json.dumps(args)],
            capture_output=True,
            text=True,
            env=full_env,
            timeout=120,
            check=False,
        )

    def cleanup(self) -> None:
        for _ in range(5):
            points = self.mounts()
            if not points:
                break
            for point in reversed(points):
                subprocess.run(["umount", "-l", point], capture_output=True, check=False)
        for device in self.loops():
            subprocess.run(["losetup", "-d", device], capture_output=True, check=False)


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    if not _is_root():
        pytest.skip("needs root for loop devices and real mounts")
    world = Rig(tmp_path)
    try:
        yield world
    finally:
        world.cleanup()


class Fuse:
    """A FUSE mount nobody serves: ``stat`` hangs while open, ENOTCONN once aborted."""

    def __init__(self, target: Path) -> None:
        self.target = target
        self.fd: int | None = os.open("/dev/fuse", os.O_RDWR)
        subprocess.run(
            [
                "mount",
                "-t",
                "fuse",
                "-o",
                f"fd={self.fd},rootmode=40000,user_id=0,group_id=0",
                "flexhub-stale",
                str(target),
            ],
            pass_fds=[self.fd],
            check=True,
            capture_output=True,
        )

    def abort(self) -> None:
        """Close the device: the connection aborts, the mount point turns ENOTCONN."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
            time.sleep(0.1)


@pytest.fixture
def stale_fuse() -> Iterator[Callable[[Path], Fuse]]:
    if not (_is_root() and Path("/dev/fuse").exists()):
        pytest.skip("needs root and /dev/fuse to make a stale mount")
    made: list[Fuse] = []

    def make(target: Path) -> Fuse:
        fuse = Fuse(target)
        made.append(fuse)
        return fuse

    yield make
    for fuse in made:
        fuse.abort()
        subprocess.run(["umount", "-l", str(fuse.target)], capture_output=True, check=False)
