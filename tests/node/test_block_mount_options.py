"""Block-volume mount options: an allow-list, checked with real loop devices and mounts.

Nothing a volume asks for may crash or hang the node (``errors=panic``), corrupt the
filesystem (``nobarrier``, ``norecovery``), name a device or file of the node
(``journal_path=``, ``usrjquota=``), set SELinux labels, or change what is mounted.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from conftest import Rig

from flexhub.errors import InvalidOptions
from flexhub.node.mounts import MountTable, block_schema_pattern
from flexhub.node.volumes import mount_volume, unmount_volume
from tests.conftest import REPO, run_flexhub

pytestmark = pytest.mark.root

FORBIDDEN = [
    "errors=panic",
    "nobarrier",
    "barrier=0",
    "norecovery",
    "noload",
    "abort",
    "debug",
    "dax",
    "journal_path=/dev/sda",
    "journal_dev=2049",
    "logdev=/dev/sda",
    "usrjquota=/etc/passwd",
    "grpjquota=aquota.group",
    "jqfmt=vfsv0",
    "usrquota",
    "context=system_u:object_r:etc_t:s0",
    "fscontext=system_u:object_r:etc_t:s0",
    "commit=100000",
    "commit=0",
    "offset=4096",
    "loop=/dev/loop0",
    "upperdir=/tmp",
    "lowerdir=/",
    "sb=8193",
    "resuid=0",
    "ro",
    "rw",
    "remount",
    "bind",
]


def _unmount(rig: Rig, target: Path) -> None:
    unmount_volume(rig.node, target, lambda name: rig.backend)


@pytest.mark.parametrize("option", FORBIDDEN)
def test_a_forbidden_option_is_a_one_line_failure_with_nothing_mounted(
    rig: Rig, option: str
) -> None:
    file = rig.file()
    target = rig.pod("a")
    volume = rig.volume(file, mount_options=f"noatime,{option}")
    with pytest.raises(InvalidOptions) as info:
        mount_volume(rig.node, rig.backend, target, volume)
    message = info.value.message
    assert message.startswith(f"mount option {option!r} is not allowed")
    assert "\n" not in message and len(message) < 200
    rig.assert_clean()
    assert subprocess.run(["blkid", "-p", str(file)], capture_output=True).returncode == 2


def test_known_dangers_are_named() -> None:
    from flexhub.node.mounts import check_block_mount_options

    with pytest.raises(InvalidOptions, match="panics the whole node"):
        check_block_mount_options(["errors=panic"])
    with pytest.raises(InvalidOptions, match="names a device of the node"):
        check_block_mount_options(["journal_path=/dev/sda"])


@pytest.mark.parametrize(
    ("fs_type", "options", "shown"),
    [
        (
            "ext4",
            "noatime,nodev,nosuid,noexec,data=ordered,errors=continue,commit=30,discard,"
            "acl,user_xattr,barrier=1,lazytime,dirsync",
            {"noatime", "nodev", "nosuid", "noexec"},
        ),
        ("ext4", "sync,nodiratime,stripe=16,barrier,nodiscard", {"sync", "nodiratime"}),
        (
            "xfs",
            "noatime,inode64,logbsize=64k,allocsize=1m,nouuid,discard,relatime",
            {"noatime", "discard"},
        ),
    ],
)
def test_allowed_options_mount_for_real(
    rig: Rig, fs_type: str, options: str, shown: set[str]
) -> None:
    file = rig.file(size=320 << 20)
    target = rig.pod("a")
    mount_volume(rig.node, rig.backend, target, rig.volume(file, fs_type, mount_options=options))
    entry = MountTable().at(target)
    assert entry is not None and entry.fs_type == fs_type
    assert shown <= set(entry.options) | set(entry.super_options)
    (target / "f").write_text("data")
    _unmount(rig, target)
    rig.assert_clean()


def test_ext_mounts_remount_read_only_on_errors_whatever_the_superblock_says(rig: Rig) -> None:
    file = rig.file()
    subprocess.run(["mkfs.ext4", "-F", "-q", str(file)], check=True)
    subprocess.run(["tune2fs", "-e", "panic", str(file)], check=True, capture_output=True)
    target = rig.pod("a")
    mount_volume(rig.node, rig.backend, target, rig.volume(file, "ext4"))
    try:
        entry = MountTable().at(target)
        assert entry is not None
        device = os.path.basename(rig.loops()[0])
        options = Path(f"/proc/fs/ext4/{device}/options").read_text().split()
        assert "errors=remount-ro" in options
        assert "errors=panic" not in options
    finally:
        _unmount(rig, target)
    rig.assert_clean()


def test_the_schema_pattern_is_the_python_allow_list() -> None:
    schema = json.loads((REPO / "schemas/common.json").read_text())
    assert schema["$defs"]["blockMountOptions"]["pattern"] == block_schema_pattern()


def test_the_driver_refuses_errors_panic_for_a_loopfile_volume(
    tmp_path: Path, node_tree: dict[str, Path]
) -> None:
    from flexhub.admin.harness import Kubelet, go_json

    target = tmp_path / "pod"
    target.mkdir()
    user = {"backend": "loopfile", "file": "v.img", "size": "64Mi", "mountOptions": "errors=panic"}
    raw = go_json(Kubelet.mount_options(user, pv="pv-1", pod_uid="uid-1"))
    reply = run_flexhub(["mount", str(target), raw], node_tree["config"])
    assert reply.status == "Failure"
    assert reply.message.startswith("invalid option $.mountOptions: 'errors=panic' is not valid")
    assert not os.path.ismount(target)
    assert not [p for p in node_tree["loopfiles"].rglob("*") if p.is_file()]  # nothing created
