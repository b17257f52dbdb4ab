"""loopfile through the installed driver, called exactly as kubelet calls it (real loops)."""

from __future__ import annotations

import json
import os
import subprocess
import threading
from pathlib import Path

import pytest

from flexhub.admin.harness import DriverReply, Kubelet, go_json
from tests.conftest import needs_root
from tests.loopfile.conftest import loops_of, mounts_under

pytestmark = [needs_root, pytest.mark.root]

MiB = 1024 * 1024


def mount(k: Kubelet, uid: str, user: dict[str, str], **kw: object) -> DriverReply:
    reply = k.mount(uid, "pv-1", Kubelet.mount_options(user, pv="pv-1", pod_uid=uid, **kw))  # type: ignore[arg-type]
    assert reply is not None
    return reply


VOL = {"backend": "loopfile", "file": "vols/a.img", "size": "1Gi"}


def test_full_cycle_data_persists(kube: Kubelet, node_tree: dict[str, Path]) -> None:
    a, b = kube.new_pod_uid(), kube.new_pod_uid()
    assert mount(kube, a, VOL).ok
    image = node_tree["loopfiles"] / "namespaces" / "default" / "vols" / "a.img"
    # a 1 GiB sparse volume uses almost no disk: only ext4's metadata and 32 MiB journal
    used = image.stat().st_blocks * 512
    assert image.stat().st_size == 1024 * MiB
    assert used < 40 * MiB, used
    (kube.pod_dir(a, "pv-1") / "data").write_text("kept")
    assert kube.unmount(a, "pv-1").ok  # type: ignore[union-attr]
    assert loops_of(image) == []
    assert mounts_under(node_tree["kubelet"]) == []
    assert image.exists()
    assert mount(kube, b, VOL).ok
    assert (kube.pod_dir(b, "pv-1") / "data").read_text() == "kept"
    assert kube.unmount(b, "pv-1").ok  # type: ignore[union-attr]
    assert not list((node_tree["state"] / "pods").iterdir())
    assert not list((node_tree["state"] / "volumes").iterdir())


def test_two_pods_at_once_share_one_staging_mount(
    kube: Kubelet, node_tree: dict[str, Path]
) -> None:
    uids = [kube.new_pod_uid() for _ in range(2)]
    replies: list[DriverReply] = []
    threads = [
        threading.Thread(target=lambda u=u: replies.append(mount(kube, u, VOL))) for u in uids
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.ok for r in replies] == [True, True], [r.reply for r in replies]
    image = node_tree["loopfiles"] / "namespaces" / "default" / "vols" / "a.img"
    assert len(loops_of(image)) == 1
    staging = [m for m in mounts_under(node_tree["state"]) if "/staging/" in m]
    assert len(staging) == 1
    (kube.pod_dir(uids[0], "pv-1") / "x").write_text("from pod 0")
    assert (kube.pod_dir(uids[1], "pv-1") / "x").read_text() == "from pod 0"
    assert kube.unmount(uids[0], "pv-1").ok  # type: ignore[union-attr]
    assert (kube.pod_dir(uids[1], "pv-1") / "x").read_text() == "from pod 0"
    assert len(loops_of(image)) == 1
    assert kube.unmount(uids[1], "pv-1").ok  # type: ignore[union-attr]
    assert loops_of(image) == []
    assert mounts_under(node_tree["state"]) == []


def test_read_only(kube: Kubelet, node_tree: dict[str, Path]) -> None:
    ro_first = kube.new_pod_uid()
    reply = mount(kube, ro_first, VOL, read_only=True)
    # a blank device is never formatted for a read-only mount
    assert reply.status == "Failure" and "read-only" in reply.message, reply.reply
    assert loops_of(node_tree["loopfiles"]) == []
    writer, reader = kube.new_pod_uid(), kube.new_pod_uid()
    assert mount(kube, writer, VOL).ok
    (kube.pod_dir(writer, "pv-1") / "f").write_text("rw")
    assert mount(kube, reader, VOL, read_only=True).ok
    target = kube.pod_dir(reader, "pv-1")
    assert (target / "f").read_text() == "rw"
    with pytest.raises(OSError) as err:
        (target / "g").write_text("no")
    assert err.value.errno == 30  # EROFS
    entry = [
        line
        for line in Path("/proc/self/mountinfo").read_text().splitlines()
        if f" {target} " in line
    ]
    assert entry and " ro," in entry[0].split(" - ")[0] + ","
    (kube.pod_dir(writer, "pv-1") / "f2").write_text("still rw")
    assert kube.unmount(reader, "pv-1").ok  # type: ignore[union-attr]
    assert kube.unmount(writer, "pv-1").ok  # type: ignore[union-attr]


def test_mount_on_an_already_mounted_pod_dir_is_idempotent(kube: Kubelet) -> None:
    uid = kube.new_pod_uid()
    options = Kubelet.mount_options(VOL, pv="pv-1", pod_uid=uid)
    assert mount(kube, uid, VOL).ok
    target = kube.pod_dir(uid, "pv-1")
    again = kube.call(
        "mount", str(target), go_json(options)
    )  # kubelet would skip; we must not break
    assert again.ok, again.reply
    stacked = [
        line
        for line in Path("/proc/self/mountinfo").read_text().splitlines()
        if f" {target} " in line
    ]
    assert len(stacked) == 1
    assert kube.unmount(uid, "pv-1").ok  # type: ignore[union-attr]


def test_unmount_after_reboot_cleans_up(kube: Kubelet, node_tree: dict[str, Path]) -> None:
    uid = kube.new_pod_uid()
    assert mount(kube, uid, VOL).ok
    image = node_tree["loopfiles"] / "namespaces" / "default" / "vols" / "a.img"
    # a reboot: every mount and the loop device vanish behind flexhub's back
    for target in [kube.pod_dir(uid, "pv-1"), *[Path(m) for m in mounts_under(node_tree["state"])]]:
        subprocess.run(["umount", str(target)], check=True)
    for loop in loops_of(image):
        subprocess.run(["losetup", "-d", loop], check=True)
    reply = kube.unmount(uid, "pv-1")
    assert reply is not None and reply.ok, reply and reply.reply
    assert not kube.pod_dir(uid, "pv-1").exists()
    assert not list((node_tree["state"] / "pods").iterdir())
    assert not list((node_tree["state"] / "volumes").iterdir())
    assert loops_of(image) == []


@pytest.mark.parametrize(
    ("file", "expected"),
    [
        ("/etc/shadow", "$.file"),
        ("../outside.img", "$.file"),
        ("a/../../outside.img", "$.file"),
        ("escape/x.img", "escapes the loopfile root"),
        ("dev0", "escapes the loopfile root"),
        ("disk", "not a regular file"),
    ],
)
def test_file_escaping_the_root_or_naming_a_device_fails_and_creates_nothing(
    kube: Kubelet, node_tree: dict[str, Path], file: str, expected: str
) -> None:
    root = node_tree["loopfiles"] / "namespaces" / "default"  # the pod namespace's area
    root.mkdir(mode=0o700, parents=True)
    (root / "escape").symlink_to("/tmp")
    (root / "dev0").symlink_to("/dev/loop0")
    os.mknod(root / "disk", 0o600 | 0o060000, os.makedev(7, 0))
    before = sorted(p.name for p in root.iterdir())
    uid = kube.new_pod_uid()
    reply = mount(kube, uid, {"backend": "loopfile", "file": file, "size": "64Mi"})
    assert reply.status == "Failure" and reply.returncode == 1
    assert expected in reply.message, reply.message
    assert sorted(p.name for p in root.iterdir()) == before
    assert not Path("/tmp/x.img").exists()
    assert not (node_tree["state"] / "pods").exists() or not list(
        (node_tree["state"] / "pods").iterdir()
    )
    assert loops_of(Path("/etc")) == [] and loops_of(root) == []


def test_expand_is_visible_in_df_inside_the_pod(kube: Kubelet) -> None:
    uid = kube.new_pod_uid()
    user = {"backend": "loopfile", "file": "grow.img", "size": "400Mi"}
    assert mount(kube, uid, user, fs_type="xfs").ok
    target = kube.pod_dir(uid, "pv-1")
    before = int(
        subprocess.run(
            ["df", "-B1", "--output=size", str(target)], capture_output=True, text=True, check=True
        ).stdout.split()[1]
    )
    options = Kubelet.base_options(user, pv="pv-1", fs_type="xfs")
    reply = kube.expandfs(uid, "pv-1", options, 800 * MiB, 400 * MiB)
    assert reply.ok, reply.reply
    after = int(
        subprocess.run(
            ["df", "-B1", "--output=size", str(target)], capture_output=True, text=True, check=True
        ).stdout.split()[1]
    )
    assert after > before + 300 * MiB, (before, after)
    shrink = kube.expandfs(uid, "pv-1", options, 200 * MiB, 800 * MiB)
    assert shrink.status == "Failure" and "shrink" in shrink.message
    assert kube.unmount(uid, "pv-1").ok  # type: ignore[union-attr]


def test_ext4_online_growth_without_cap_sys_resource_fails_honestly(kube: Kubelet) -> None:
    uid = kube.new_pod_uid()
    user = {"backend": "loopfile", "file": "grow4.img", "size": "256Mi"}
    assert mount(kube, uid, user, fs_type="ext4").ok
    target = kube.pod_dir(uid, "pv-1")
    before = os.statvfs(target).f_blocks
    reply = kube.expandfs(
        uid, "pv-1", Kubelet.base_options(user, pv="pv-1", fs_type="ext4"), 512 * MiB, 256 * MiB
    )
    after = os.statvfs(target).f_blocks
    caps = Path("/proc/self/status").read_text()
    eff = int(next(line.split()[1] for line in caps.splitlines() if line.startswith("CapEff")), 16)
    if eff & (1 << 24):  # CAP_SYS_RESOURCE present: it must really grow
        assert reply.ok and after > before, reply.reply
    else:
        assert reply.status == "Failure", "reported success without growing"
        assert "resize" in reply.message.lower()
        assert after == before
    assert kube.unmount(uid, "pv-1").ok  # type: ignore[union-attr]


def test_replies_are_single_json_objects(kube: Kubelet) -> None:
    uid = kube.new_pod_uid()
    reply = mount(kube, uid, VOL)
    assert json.loads(reply.output) == reply.reply
    assert reply.output.count(b"\n") == 1
    assert kube.unmount(uid, "pv-1").ok  # type: ignore[union-attr]


def test_state_command_shows_the_journal(kube: Kubelet, node_tree: dict[str, Path]) -> None:
    from tests.conftest import PYTHON

    a, b = kube.new_pod_uid(), kube.new_pod_uid()
    assert mount(kube, a, VOL).ok
    assert mount(kube, b, VOL, read_only=True).ok

    def state(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [PYTHON, "-m", "flexhub", "state", "--config", str(node_tree["config"]), *extra],
            capture_output=True,
            text=True,
            check=True,
        )

    data = json.loads(state("--json").stdout)
    assert [v["pods"] for v in data["volumes"]] == [2]
    assert data["volumes"][0]["backend"] == "loopfile" and data["volumes"][0]["mounted"]
    assert data["volumes"][0]["device"].startswith("/dev/loop")
    assert sorted(p["read_only"] for p in data["pods"]) == [False, True]
    assert all(p["mounted"] for p in data["pods"])
    text = state().stdout
    assert "volumes (1):" in text and "pod directories (2):" in text and "pods=2 staged" in text
    assert kube.unmount(a, "pv-1").ok  # type: ignore[union-attr]
    assert kube.unmount(b, "pv-1").ok  # type: ignore[union-attr]
    assert json.loads(state("--json").stdout) == {"pods": [], "volumes": []}
