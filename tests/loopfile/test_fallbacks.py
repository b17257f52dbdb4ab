"""Rare paths, against a fake sysfs and /dev and a scripted ``losetup``."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from flexhub_loopfile import LoopfileBackend, _loop

from flexhub.backend import Attachment, Volume, VolumeError
from flexhub.config import NodeConfig
from flexhub.node import Node
from flexhub.node.runner import RecordingRunner, Result


def vol(**options: str) -> Volume:
    return Volume(options={"backend": "loopfile", **options})


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Fake /sys/block and /dev with free loop devices loop0 and loop5, loop0's node only."""
    sys_block = tmp_path / "sys" / "block"
    dev = tmp_path / "dev"
    dev.mkdir()
    for index in (0, 5):
        entry = sys_block / f"loop{index}"
        entry.mkdir(parents=True)
        (entry / "dev").write_text(f"7:{index}\n")
        (entry / "size").write_text("0\n")
        (entry / "diskseq").write_text(f"{40 + index}\n")
    os.mknod(dev / "loop0", 0o600 | stat.S_IFBLK, os.makedev(7, 0))
    monkeypatch.setattr(_loop, "SYS_BLOCK", sys_block)
    monkeypatch.setattr(_loop, "SYS_CLASS_BLOCK", sys_block)
    monkeypatch.setattr(_loop, "DEV", dev)
    return tmp_path


def backend_with(tmp_path: Path, runner: RecordingRunner) -> LoopfileBackend:
    config = NodeConfig(
        state_dir=tmp_path / "state",
        backends={"loopfile": {"root": str(tmp_path / "root"), "isolation": "none"}},
    )
    return LoopfileBackend(Node(config, backend="loopfile", runner=runner))


@pytest.mark.root
def test_find_fallback_creates_missing_nodes(fake: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No /dev/loop-control: ``losetup --find`` says no free device until nodes exist."""
    monkeypatch.setattr(_loop, "free_index", lambda: None)
    (fake / "sys/block/loop0/loop").mkdir()
    (fake / "sys/block/loop0/loop/backing_file").write_text("/elsewhere.img\n")  # busy

    def find(argv: tuple[str, ...]) -> Result:
        if not (fake / "dev" / "loop5").exists():
            return Result(argv, 1, "", "losetup: cannot find an unused loop device")
        return Result(argv, 0, "/dev/loop5\n", "")

    runner = RecordingRunner({("losetup", "--find", "--show"): find})
    # util-linux's message for "no free device" differs by version; both are recognised.
    runner.script[("losetup", "--find", "--show", "--direct-io=on")] = lambda argv: (
        Result(argv, 1, "", "losetup: could not find any free loop device")
        if not (fake / "dev" / "loop5").exists()
        else Result(argv, 0, "/dev/loop5\n", "")
    )
    backend = backend_with(fake, runner)
    att = backend.attach(vol(file="a.img", size="1Mi"))
    assert att.device == "/dev/loop5"
    assert att.details["created"] == "true"
    st = os.lstat(fake / "dev" / "loop5")
    assert stat.S_ISBLK(st.st_mode) and st.st_rdev == os.makedev(7, 5)
    assert backend._markers().read(_loop.LoopDevice("loop5", 5))["diskseq"] == "45"  # type: ignore[index]
    assert [c[:4] for c in runner.calls] == [
        ["losetup", "--find", "--show", "--direct-io=on"],
        ["losetup", "--find", "--show", "--direct-io=on"],
    ]


def test_direct_io_refused_retries_without(fake: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_loop, "free_index", lambda: 0)
    runner = RecordingRunner()
    runner.answer(
        "losetup",
        "--show",
        "--direct-io=on",
        rc=1,
        stderr="losetup: /dev/loop0: failed to set up loop device: Invalid argument",
    )
    runner.answer("losetup", "--show", "/dev/loop0", stdout="/dev/loop0\n")
    backend = backend_with(fake, runner)
    att = backend.attach(vol(file="a.img", size="1Mi"))
    assert att.device == "/dev/loop0"
    assert runner.calls[-1] == ["losetup", "--show", "/dev/loop0", str(fake / "root/a.img")]


def test_busy_device_tries_another(fake: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    indexes = iter([0, 0, 5])
    monkeypatch.setattr(_loop, "free_index", lambda: next(indexes))
    monkeypatch.setattr(_loop, "ensure_node", lambda dev: Path(dev.path))
    runner = RecordingRunner()
    busy = "losetup: a.img: failed to set up loop device: Device or resource busy"
    runner.answer("losetup", "--show", "--direct-io=on", "/dev/loop0", rc=1, stderr=busy)
    runner.answer("losetup", "--show", "--direct-io=on", "/dev/loop5", stdout="/dev/loop5\n")
    backend = backend_with(fake, runner)
    att = backend.attach(vol(file="a.img", size="1Mi"))
    assert att.device == "/dev/loop5"
    assert len(runner.calls) == 3
    assert not (backend._markers().directory / "loop0").exists()  # pending marker withdrawn


def test_losetup_failure_is_a_volume_error(fake: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_loop, "free_index", lambda: 0)
    runner = RecordingRunner()
    runner.answer("losetup", rc=1, stderr="losetup: a.img: Permission denied")
    backend = backend_with(fake, runner)
    with pytest.raises(VolumeError, match=r"cannot attach .* Permission denied"):
        backend.attach(vol(file="a.img", size="1Mi"))
    assert not list(backend._markers().directory.glob("loop*"))


def test_detach_without_marker_runs_nothing(fake: Path) -> None:
    (fake / "sys/block/loop5/loop").mkdir()
    (fake / "sys/block/loop5/loop/backing_file").write_text(f"{fake}/root/a.img\n")
    runner = RecordingRunner()
    backend = backend_with(fake, runner)
    backend.detach(Attachment("/dev/loop5", {"loop": "/dev/loop5", "file": f"{fake}/root/a.img"}))
    assert runner.calls == []


@pytest.mark.parametrize(
    "device", ["/dev/sda", "/dev/loop", "/tmp/loop1", "loopX", "/dev/../loop1"]
)
def test_loop_name_rejects(device: str) -> None:
    with pytest.raises(VolumeError):
        _loop.loop_name(device)


def test_loop_name() -> None:
    assert _loop.loop_name("/dev/loop12") == ("loop12", 12)
    assert _loop.loop_name("loop3") == ("loop3", 3)
