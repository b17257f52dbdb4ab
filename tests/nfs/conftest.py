"""Fixtures for the nfs backend's unit tests: a node whose commands are recorded, not run.

The mount table is a fake mountinfo file that the recording runner keeps up to date: a
recorded ``mount -t nfs ... SOURCE TARGET`` adds a line, a recorded ``umount ... TARGET``
removes the topmost one (unless a test scripts it to fail).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from flexhub_nfs import NfsBackend

from flexhub.config import NodeConfig
from flexhub.node import Node
from flexhub.node.mounts import MountTable
from flexhub.node.runner import RecordingRunner, Result
from flexhub.volume import Volume

ROOT_LINE = "22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n"


@dataclass
class FakeKernel:
    """A mountinfo file plus the rules the recording runner applies to it."""

    path: Path
    next_id: int = 100
    #: sources whose mount "fails" with this Result (or raises this exception)
    mount_answers: dict[str, object] = field(default_factory=dict)
    #: umount flags (``()`` or ``("-f", "-l")``) that fail and leave the mount in place
    failing_umounts: set[tuple[str, ...]] = field(default_factory=set)
    #: bind mounts made: target -> the stat of the directory bound there
    binds: dict[str, os.stat_result] = field(default_factory=dict)

    def lines(self) -> list[str]:
        return self.path.read_text().splitlines(keepends=True)

    def add(self, source: str, target: str, options: str, fs_type: str = "nfs4") -> None:
        self.next_id += 1
        vers = next((o for o in options.split(",") if o.startswith("vers=")), "vers=4.2")
        flags = "ro" if "ro" in options.split(",") else "rw"
        line = (
            f"{self.next_id} 22 0:{self.next_id} / {target} {flags},relatime shared:9 - "
            f"{fs_type} {source} {flags},{vers},hard,proto=tcp\n"
        )
        with self.path.open("a") as handle:
            handle.write(line)

    def remove(self, target: str) -> None:
        lines = self.lines()
        for index in range(len(lines) - 1, -1, -1):
            if lines[index].split()[4] == target:
                del lines[index]
                break
        self.path.write_text("".join(lines))

    def bind(self, source: str, target: str) -> None:
        """A bind of ``/proc/<pid>/fd/<n>``: the mount holding that directory, at its path."""
        real = os.readlink(source)
        self.binds[target] = os.stat(source)
        holder = max(
            (line.split() for line in self.lines() if real.startswith(line.split()[4] + "/")),
            key=lambda fields: len(fields[4]),
        )
        rest = real[len(holder[4]) :]
        self.next_id += 1
        tail = " ".join(holder[holder.index("-") :])
        line = f"{self.next_id} 22 {holder[2]} {rest} {target} rw,relatime shared:9 {tail}\n"
        with self.path.open("a") as handle:
            handle.write(line)

    def remount_ro(self, target: str) -> None:
        lines = self.lines()
        for index in range(len(lines) - 1, -1, -1):
            fields = lines[index].split(" ")
            if fields[4] == target:
                fields[5] = fields[5].replace("rw", "ro", 1)
                lines[index] = " ".join(fields)
                break
        self.path.write_text("".join(lines))

    def answer(self, argv: tuple[str, ...]) -> Result:
        if argv[0] == "mount" and "--bind" in argv:
            self.bind(argv[-2], argv[-1])
            return Result(argv, 0, "", "")
        if argv[0] == "mount" and "remount,bind,ro" in argv:
            self.remount_ro(argv[-1])
            return Result(argv, 0, "", "")
        if argv[0] == "mount":
            options = argv[argv.index("-o") + 1]
            source, target = argv[-2], argv[-1]
            scripted = self.mount_answers.get(source)
            if isinstance(scripted, BaseException):
                raise scripted
            if isinstance(scripted, Result):
                return scripted
            self.add(source, target, options, "nfs" if "vers=3" in options else "nfs4")
            return Result(argv, 0, "", "")
        if argv[0] == "umount":
            flags = tuple(a for a in argv[1 : argv.index("--")] if a not in ("-c", "-i"))
            if flags in self.failing_umounts:
                return Result(argv, 32, "", "umount: target is busy")
            self.remove(argv[-1])
            if "nfs-tmp" in argv[-1] and os.path.isdir(argv[-1]):
                # what the walk made lived on the (fake) NFS mount: gone with it
                for entry in os.scandir(argv[-1]):
                    if entry.is_dir(follow_symlinks=False):
                        shutil.rmtree(entry.path)
                    else:
                        os.unlink(entry.path)
            return Result(argv, 0, "", "")
        return Result(argv, 0, "", "")


@pytest.fixture
def kernel(tmp_path: Path) -> FakeKernel:
    path = tmp_path / "mountinfo"
    path.write_text(ROOT_LINE)
    return FakeKernel(path)


@pytest.fixture
def runner(kernel: FakeKernel) -> RecordingRunner:
    rec = RecordingRunner()
    for command in ("mount", "umount", "mkdir"):
        rec.script[(command,)] = kernel.answer
    return rec


@pytest.fixture
def config(tmp_path: Path) -> NodeConfig:
    return NodeConfig(
        state_dir=tmp_path / "state",
        log_dir=tmp_path / "log",
        lock_timeout=5,
        mount_timeout=20,
        unmount_timeout=7,
        backends={"nfs": {}},
    )


@pytest.fixture
def node(config: NodeConfig, runner: RecordingRunner, kernel: FakeKernel) -> Node:
    node = Node(config, backend="nfs", runner=runner)
    node.mounts = MountTable(kernel.path)
    return node


@pytest.fixture
def backend(node: Node, kernel: FakeKernel, monkeypatch: pytest.MonkeyPatch) -> NfsBackend:
    def holds(target: Path, fd: int) -> bool:
        bound, wanted = kernel.binds.get(str(target)), os.fstat(fd)
        return bound is not None and (bound.st_dev, bound.st_ino) == (wanted.st_dev, wanted.st_ino)

    monkeypatch.setattr(NfsBackend, "_holds_directory", staticmethod(holds))
    return NfsBackend(node)


@pytest.fixture
def target(tmp_path: Path) -> Path:
    path = tmp_path / "pods" / "uid" / "volumes" / "k8s~flexhub" / "pv"
    path.mkdir(parents=True, mode=0o750)
    return path


VolumeFactory = Callable[..., Volume]


@pytest.fixture
def make_volume() -> VolumeFactory:
    def make(read_only: bool = False, fs_type: str = "", **options: str) -> Volume:
        base = {"backend": "nfs", "server": "srv1", "share": "/export"}
        base.update(options)
        return Volume(options=base, fs_type=fs_type, read_only=read_only, name="pv")

    return make
