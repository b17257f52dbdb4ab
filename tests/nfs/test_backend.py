"""The nfs backend against a recording runner and a fake mount table, only for what no real
system here shows: the exact argv where its effect is not visible in the mount table (retry=0,
an IPv6 server's brackets, which umount variant ran), failures a real server or kernel cannot
be made to produce on demand (a kernel ignoring ro, a mount finishing as its timeout fires,
umount failing or timing out), settings, age-based clean-up and refusals that run no command.
What a real mount does (versions, ro, idempotency, stale handles, subPath, symlinks, dead
servers, fsGroup never chowning) is in tests/vm/test_nfs.py and the kit's test_kit_nfs.py."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from flexhub_nfs import NfsBackend

from flexhub.admin.harness import Kubelet, go_json
from flexhub.config import NodeConfig
from flexhub.driver import kubelet
from flexhub.errors import (
    CommandError,
    CommandTimeout,
    FlexhubError,
    InvalidOptions,
    VolumeError,
)
from flexhub.node import Node
from flexhub.node.mounts import MountTable, is_corrupted
from flexhub.node.runner import RecordingRunner, Result
from flexhub.node.volumes import expand_volume, mount_volume, unmount_volume
from tests.nfs.conftest import FakeKernel, VolumeFactory


def mount_argv(options: str, source: str, target: Path) -> list[str]:
    return ["mount", "-t", "nfs", "-o", options, "--", source, str(target)]


# -- mount -------------------------------------------------------------------------------------


def test_mount_runs_one_exact_command(
    backend: NfsBackend, runner: RecordingRunner, target: Path, make_volume: VolumeFactory
) -> None:
    details = backend.mount(target, make_volume(nfsVersion="4.1", mountOptions="noatime"))
    assert runner.calls == [mount_argv("vers=4.1,noatime,hard,retry=0", "srv1:/export", target)]
    assert details == {"source": "srv1:/export", "server": "srv1", "vers": "4.1"}


def test_mount_that_stays_writable_is_undone(
    backend: NfsBackend,
    runner: RecordingRunner,
    kernel: FakeKernel,
    target: Path,
    make_volume: VolumeFactory,
) -> None:
    def writable(argv: tuple[str, ...]) -> Result:
        kernel.add(argv[-2], argv[-1], "vers=4.2")  # the kernel ignored "ro"
        return Result(argv, 0, "", "")

    runner.script[("mount",)] = writable
    with pytest.raises(VolumeError, match="did not become read-only"):
        backend.mount(target, make_volume(read_only=True))
    assert not backend.node.mounts.is_mount_point(target)
    assert runner.calls[-1][:3] == ["umount", "-c", "-i"]


def test_ipv6_server_is_bracketed(
    backend: NfsBackend, runner: RecordingRunner, target: Path, make_volume: VolumeFactory
) -> None:
    backend.mount(target, make_volume(server="fd00::7", share="/export/team/a"))
    assert runner.calls == [mount_argv("hard,retry=0", "[fd00::7]:/export/team/a", target)]


def test_other_mount_on_target_is_refused(
    backend: NfsBackend,
    runner: RecordingRunner,
    kernel: FakeKernel,
    target: Path,
    make_volume: VolumeFactory,
) -> None:
    kernel.add("srv2:/other", str(target), "vers=4.2")
    with pytest.raises(VolumeError, match="already a mount point of srv2:/other"):
        backend.mount(target, make_volume())
    assert runner.calls == []


def test_timeout_kills_cleans_and_names_the_server(
    backend: NfsBackend,
    runner: RecordingRunner,
    kernel: FakeKernel,
    target: Path,
    make_volume: VolumeFactory,
) -> None:
    def late(argv: tuple[str, ...]) -> Result:
        kernel.add(argv[-2], argv[-1], "vers=4.2")  # the kernel finished as we gave up
        raise CommandTimeout("mount ... timed out after 20s and was killed")

    runner.script[("mount",)] = late
    with pytest.raises(CommandTimeout) as caught:
        backend.mount(target, make_volume())
    assert caught.value.message == (
        "NFS server srv1 did not answer within 20s: mount of srv1:/export abandoned and its "
        "processes killed"
    )
    assert not backend.node.mounts.is_mount_point(target)
    assert ["umount", "-c", "-i", "--", str(target)] in runner.calls


def test_mount_timeout_comes_from_the_nfs_table(
    tmp_path: Path, kernel: FakeKernel, runner: RecordingRunner, make_volume: VolumeFactory
) -> None:
    seen: list[float | None] = []

    class Spy(RecordingRunner):
        def __call__(self, argv, *, timeout=None, check=True, secrets=(), env=None):  # type: ignore[no-untyped-def]
            seen.append(timeout)
            return runner(argv, timeout=timeout, check=check, secrets=secrets, env=env)

    config = NodeConfig(
        state_dir=tmp_path / "s",
        mount_timeout=60,
        backends={"nfs": {"mount_timeout": 7.5, "unmount_timeout": 3, "force_unmount_timeout": 2}},
    )
    node = Node(config, backend="nfs", runner=Spy())
    node.mounts = MountTable(kernel.path)
    target = tmp_path / "t"
    target.mkdir()
    backend = NfsBackend(node)
    backend.mount(target, make_volume())
    backend.unmount(target, {})
    backend.mount(target, make_volume())
    kernel.failing_umounts.add(())
    backend.unmount(target, {})
    assert seen == [7.5, 3.0, 7.5, 3.0, 2.0]


@pytest.mark.parametrize("value", [0, -1, "30", True])
@pytest.mark.parametrize(
    "key", ["mount_timeout", "unmount_timeout", "force_unmount_timeout", "stat_timeout"]
)
def test_bad_timeout_setting_is_a_failure(tmp_path: Path, key: str, value: object) -> None:
    config = NodeConfig(state_dir=tmp_path, backends={"nfs": {key: value}})
    backend = NfsBackend(Node(config, backend="nfs"))
    attribute = {"force_unmount_timeout": "force_timeout"}.get(key, key)
    with pytest.raises(FlexhubError, match=rf"\[nfs\] {key} must be a positive number"):
        getattr(backend, attribute)


def test_mount_error_is_one_clear_line(
    backend: NfsBackend, runner: RecordingRunner, target: Path, make_volume: VolumeFactory
) -> None:
    runner.script[("mount",)] = Result((), 32, "", "mount.nfs: access denied by server\n")
    with pytest.raises(CommandError) as caught:
        backend.mount(target, make_volume())
    assert caught.value.message == (
        "mount of NFS export srv1:/export failed (exit 32): mount.nfs: access denied by server"
    )


def test_create_sub_path_mounts_root_makes_dir_and_unmounts(
    backend: NfsBackend,
    runner: RecordingRunner,
    kernel: FakeKernel,
    target: Path,
    make_volume: VolumeFactory,
    config: NodeConfig,
) -> None:
    volume = make_volume(
        read_only=True, subPath="a/b", createSubPath="true", subPathMode="2770", nfsVersion="3"
    )
    backend.mount(target, volume)
    temp_root = Path(os.path.realpath(config.state_dir)) / "nfs-tmp"
    mount_root, bind, read_only, umount = runner.calls
    temp = Path(mount_root[-1])
    made, pid, _random = temp.name.split("-")  # when and by whom (claimdir.temp_mount_point)
    assert temp.parent == temp_root and made.isdigit() and int(pid) == os.getpid()
    assert mount_root == mount_argv("vers=3,hard,retry=0", "srv1:/export", temp)
    assert bind[:4] == ["mount", "--no-canonicalize", "--bind", "--"]
    assert bind[4].startswith(f"/proc/{os.getpid()}/fd/") and bind[5] == str(target)
    made = kernel.binds[str(target)]
    assert stat.S_ISDIR(made.st_mode) and stat.S_IMODE(made.st_mode) == 0o2770
    assert read_only == ["mount", "--no-canonicalize", "-o", "remount,bind,ro", "--", str(target)]
    assert umount == ["umount", "-c", "-i", "--", str(temp)]
    entry = backend.node.mounts.at(target)
    assert entry is not None and entry.source == "srv1:/export" and entry.root == "/a/b"
    assert entry.read_only
    assert list(temp_root.iterdir()) == []  # the private directory is gone
    backend.mount(target, volume)  # idempotent: the bind of the sub-directory is recognised
    assert len(runner.calls) == 4


def test_old_temp_leftovers_are_collected(
    backend: NfsBackend,
    runner: RecordingRunner,
    kernel: FakeKernel,
    target: Path,
    make_volume: VolumeFactory,
    config: NodeConfig,
) -> None:
    temp_root = Path(os.path.realpath(config.state_dir)) / "nfs-tmp"
    old, young = temp_root / "0123456789abcdef", temp_root / "fedcba9876543210"
    old.mkdir(parents=True)
    young.mkdir()
    kernel.add("srv1:/export", str(old), "vers=4.2")
    os.utime(old, (0, 0))
    backend.mount(target, make_volume(subPath="a", createSubPath="true"))
    assert runner.calls[0] == ["umount", "-c", "-i", "--", str(old)]
    assert sorted(p.name for p in temp_root.iterdir()) == [young.name]


# -- unmount -----------------------------------------------------------------------------------


def test_unmount_healthy_is_one_plain_umount(
    backend: NfsBackend, runner: RecordingRunner, target: Path, make_volume: VolumeFactory
) -> None:
    backend.mount(target, make_volume())
    runner.calls.clear()
    backend.unmount(target, {"source": "srv1:/export"})
    assert runner.calls == [["umount", "-c", "-i", "--", str(target)]]
    assert not backend.node.mounts.is_mount_point(target)


def test_unmount_escalates_when_plain_umount_fails(
    backend: NfsBackend,
    runner: RecordingRunner,
    kernel: FakeKernel,
    target: Path,
    make_volume: VolumeFactory,
) -> None:
    backend.mount(target, make_volume())
    runner.calls.clear()
    kernel.failing_umounts.add(())
    backend.unmount(target, {})
    assert [c[3] for c in runner.calls] == ["--", "-f"]


def test_unmount_timeout_escalates(
    backend: NfsBackend,
    runner: RecordingRunner,
    kernel: FakeKernel,
    target: Path,
    make_volume: VolumeFactory,
) -> None:
    backend.mount(target, make_volume())
    runner.calls.clear()
    runner.script[("umount", "-c", "-i", "--")] = CommandTimeout("umount timed out after 7s")
    backend.unmount(target, {})
    assert [c[3] for c in runner.calls] == ["--", "-f"]
    assert not backend.node.mounts.is_mount_point(target)


def test_unmount_that_cannot_succeed_fails(
    backend: NfsBackend,
    runner: RecordingRunner,
    kernel: FakeKernel,
    target: Path,
    make_volume: VolumeFactory,
) -> None:
    backend.mount(target, make_volume())
    kernel.failing_umounts.update({(), ("-f",), ("-l",), ("-f", "-l")})
    with pytest.raises(CommandError, match="cannot unmount"):
        backend.unmount(target, {})


def test_unmount_of_nothing_runs_nothing(
    backend: NfsBackend, runner: RecordingRunner, target: Path
) -> None:
    backend.unmount(target, {})
    backend.unmount(target / "gone", {})
    assert runner.calls == []


def test_stacked_mounts_are_all_removed(
    backend: NfsBackend, runner: RecordingRunner, kernel: FakeKernel, target: Path
) -> None:
    kernel.add("srv1:/export", str(target), "vers=4.2")
    kernel.add("srv1:/export", str(target), "vers=4.2")
    backend.unmount(target, {})
    assert len(runner.calls) == 2
    assert not backend.node.mounts.is_mount_point(target)


# -- through the core ---------------------------------------------------------------------------


def test_core_mount_unmount_and_expand(
    node: Node,
    backend: NfsBackend,
    runner: RecordingRunner,
    target: Path,
    make_volume: VolumeFactory,
) -> None:
    volume = make_volume(nfsVersion="4.2")
    mount_volume(node, backend, target, volume)
    mount_volume(node, backend, target, volume)  # idempotent: the journal knows it
    assert len(runner.calls) == 1
    record = node.journal.get_pod(target)
    assert record is not None and record.volume_id == "nfs:srv1:/export"
    assert record.details["vers"] == "4.2"
    expand_volume(node, backend, target, volume, 10 * 2**30)
    assert len(runner.calls) == 1  # expand changes nothing
    unmount_volume(node, target, lambda name: backend)
    assert runner.calls[-1] == ["umount", "-c", "-i", "--", str(target)]
    assert node.journal.get_pod(target) is None
    unmount_volume(node, target, lambda name: backend)  # idempotent


@pytest.mark.parametrize(
    ("user", "needle"),
    [
        ({"server": "srv1", "share": "/x", "mountOptions": "hard,soft"}, ""),
        ({"server": "srv1", "share": "/x", "mountOptions": "bind"}, ""),
        ({"server": "srv1", "share": "/x", "nfsVersion": "3", "mountOptions": "vers=4.2"}, ""),
        ({"server": "srv1;id", "share": "/x"}, ""),
        ({"server": "srv1", "share": "/x/../etc"}, ""),
        ({"server": "srv1", "share": "/x", "subPath": "../y", "createSubPath": "true"}, ""),
        ({"server": "srv1", "share": "/x", "mountOptions": "nconnect=99"}, ""),
        # moved from the VM (tests/vm/test_nfs.py): refused before any command is run
        (
            {"server": "srv1", "share": "/x", "mountOptions": "vers=3", "nfsVersion": "4.2"},
            "contradicts nfsVersion",
        ),
        ({"server": "srv1", "share": "/x", "mountOptions": "hard,bind"}, "mountOptions"),
        (
            {"server": "srv1", "share": "/x", "subPath": "../../etc", "createSubPath": "true"},
            "subPath",
        ),
    ],
)
def test_bad_options_fail_before_any_command(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    runner: RecordingRunner,
    target: Path,
    user: dict[str, str],
    needle: str,
) -> None:
    """The kubelet path: a Failure reply naming the problem, not one command run (no runner
    call), nothing made in the pod directory and no command in the call's log."""
    log_dir = tmp_path / "log"
    config = tmp_path / "flexhub.toml"
    config.write_text(
        f'state_dir = "{tmp_path / "state"}"\nlog_dir = "{log_dir}"\nlog_level = "debug"\n'
    )
    monkeypatch.setenv("FLEXHUB_CONFIG", str(config))
    monkeypatch.setattr(kubelet, "_CONFIG", [])
    import flexhub.node.services

    monkeypatch.setattr(flexhub.node.services, "SubprocessRunner", lambda timeout: runner)
    target.mkdir(parents=True, exist_ok=True)
    options = Kubelet.mount_options({"backend": "nfs", **user}, pv="pv", pod_uid="uid")
    call = kubelet.Call(operation="mount")
    reply = kubelet.handle([str(target), go_json(options)], call)
    assert reply.status == "Failure"
    assert reply.message.startswith(("invalid option", "mount option", "mount options"))
    assert needle in reply.message, reply.message
    assert runner.calls == []
    assert list(target.iterdir()) == []
    logged = "".join(p.read_text() for p in log_dir.glob("*.log")) if log_dir.exists() else ""
    assert "mount -t nfs" not in logged and " exited " not in logged
    assert json.loads(reply.to_json())["status"] == "Failure"


def test_invalid_options_class(make_volume: VolumeFactory, backend: NfsBackend) -> None:
    with pytest.raises(InvalidOptions):
        backend.volume_id(make_volume(server="bad..host"))


# -- the health probe -------------------------------------------------------------------------


def test_probe_healthy_stale_and_hung(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno
    import threading
    import time

    assert not is_corrupted(tmp_path, 1.0)
    assert not is_corrupted(tmp_path / "missing", 1.0)  # ENOENT is not a stale mount

    def stale(path: object) -> None:
        raise OSError(errno.ESTALE, "Stale file handle")

    monkeypatch.setattr(os, "statvfs", stale)  # stat answered from the cache
    assert is_corrupted(tmp_path, 1.0)

    release = threading.Event()

    def hang(path: object) -> None:
        release.wait(10)

    monkeypatch.setattr(os, "statvfs", hang)
    started = time.monotonic()
    assert is_corrupted(tmp_path, 0.2)
    assert time.monotonic() - started < 2
    release.set()
