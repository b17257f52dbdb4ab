"""loopfile provisioning for real: ``provision`` names the claim's file, the installed driver's
mount (called as kubelet calls it) creates it on loop devices, ``reclaim`` (what the node's
DaemonSet pod runs) removes it, and refuses while anything on the node uses it."""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

import pytest
from flexhub_loopfile import LoopfileBackend

from flexhub.admin.harness import Kubelet
from flexhub.config import NodeConfig, load_config
from flexhub.driver.loader import load_backend
from flexhub.driver.validation import validate_options
from flexhub.errors import InvalidOptions, VolumeError
from flexhub.node import Node
from flexhub.provisioner.storageclass import read_class
from flexhub.provisioning import Claim, Provisioned
from flexhub.volume import Secrets
from tests.conftest import needs_root
from tests.loopfile.conftest import loops_of

pytestmark = [needs_root, pytest.mark.root]

MiB = 1024 * 1024
NS = "team-a"
CLASS = {
    "apiVersion": "storage.k8s.io/v1",
    "kind": "StorageClass",
    "metadata": {"name": "local"},
    "provisioner": "flexhub",
    "volumeBindingMode": "WaitForFirstConsumer",
    "parameters": {"backend": "loopfile", "directory": "claims", "fsType": "xfs"},
}


def claim(size: int = 300 * MiB, node: str = "node-1") -> Claim:
    return Claim(uid=str(uuid.uuid4()), namespace=NS, name="data", size=size, selected_node=node)


@pytest.fixture
def agent(node_tree: dict[str, Path]) -> LoopfileBackend:
    """The backend as the node agent in the DaemonSet pod has it: the node's own config."""
    return LoopfileBackend(Node(load_config(node_tree["config"]), backend="loopfile"))


def provisioned(c: Claim) -> Provisioned:
    spec = read_class(CLASS, load_backend)
    backend = load_backend(spec.backend)
    assert isinstance(backend, type) and issubclass(backend, LoopfileBackend)
    # the provisioner's side: its node services point nowhere, provision touches nothing
    nowhere = NodeConfig(state_dir=Path("/nonexistent/flexhub-provisioner"))
    return backend(Node(nowhere, backend="loopfile")).provision(c, spec.parameters, Secrets())


def pv_options(p: Provisioned, c: Claim, uid: str) -> dict[str, str]:
    """What kubelet sends for a pod of the claim's namespace mounting the PV."""
    return Kubelet.mount_options(
        {"backend": "loopfile", **p.options},
        pv=c.volume_name,
        pod_uid=uid,
        namespace=c.namespace,
        fs_type=p.fs_type,
    )


def image(node_tree: dict[str, Path], p: Provisioned) -> Path:
    return node_tree["loopfiles"] / "namespaces" / NS / p.options["file"]


def reclaim(agent: LoopfileBackend, p: Provisioned, on_delete: str = "delete") -> None:
    agent.reclaim(p.options, {**p.reclaim, "onDelete": on_delete}, Secrets())


def test_provision_names_the_claims_file_and_is_idempotent() -> None:
    c = claim(size=1000)
    first, again = provisioned(c), provisioned(c)
    assert first == again
    assert first.options == {"file": f"claims/pvc-{c.uid}.img", "size": "1000", "maxSize": "1Ti"}
    assert (first.size, first.fs_type, first.node) == (4096, "xfs", "node-1")
    assert first.reclaim == {"namespace": NS, "claimUid": c.uid}
    # exactly what the node driver accepts
    options = Kubelet.base_options({"backend": "loopfile", **first.options}, pv=c.volume_name)
    validate_options(load_backend("loopfile"), options)


def test_the_longest_directory_and_uid_still_make_a_valid_file_option() -> None:
    from flexhub_loopfile import _provision

    longest = "/".join(["d" * 59] * 3)  # 179 characters
    c = Claim(uid="u" * 63, namespace=NS, name="x", size=1, selected_node="n")
    p = _provision.provision(c, {"directory": longest + "x"})  # 180
    options = Kubelet.base_options({"backend": "loopfile", **p.options}, pv=c.volume_name)
    validate_options(load_backend("loopfile"), options)
    with pytest.raises(InvalidOptions, match="parameter 'directory'"):
        _provision.provision(c, {"directory": longest + "xx"})


def test_provision_needs_the_selected_node() -> None:
    with pytest.raises(InvalidOptions, match="must be WaitForFirstConsumer"):
        provisioned(claim(node=""))


def test_provision_mount_write_unmount_reclaim(
    kube: Kubelet, node_tree: dict[str, Path], agent: LoopfileBackend
) -> None:
    c = claim()
    p = provisioned(c)
    uid = kube.new_pod_uid()
    reply = kube.mount(uid, c.volume_name, pv_options(p, c, uid))
    assert reply is not None and reply.ok, reply.reply
    path = image(node_tree, p)
    assert path.stat().st_size == 300 * MiB  # the driver made it at the claim's size
    target = kube.pod_dir(uid, c.volume_name)
    (target / "data").write_bytes(b"kept")
    statvfs = os.statvfs(target)
    assert statvfs.f_blocks * statvfs.f_frsize <= 300 * MiB  # the size is a real limit
    assert kube.unmount(uid, c.volume_name).ok  # type: ignore[union-attr]
    assert path.is_file() and loops_of(path) == []
    reclaim(agent, p)
    assert not path.exists()
    assert path.parent.is_dir()  # the class's directory is shared by its claims
    reclaim(agent, p)  # twice: gone is success


def test_reclaim_is_refused_while_mounted_or_attached(
    kube: Kubelet, node_tree: dict[str, Path], agent: LoopfileBackend
) -> None:
    c = claim()
    p = provisioned(c)
    uid = kube.new_pod_uid()
    assert kube.mount(uid, c.volume_name, pv_options(p, c, uid)).ok  # type: ignore[union-attr]
    path = image(node_tree, p)
    (kube.pod_dir(uid, c.volume_name) / "data").write_bytes(b"kept")
    with pytest.raises(VolumeError, match="in use: the node's journal has its staged volume"):
        reclaim(agent, p)
    assert path.is_file()
    assert (kube.pod_dir(uid, c.volume_name) / "data").read_bytes() == b"kept"
    assert kube.unmount(uid, c.volume_name).ok  # type: ignore[union-attr]
    # a loop device set up behind flexhub's back
    loop = subprocess.run(
        ["losetup", "--find", "--show", str(path)], capture_output=True, text=True, check=True
    ).stdout.strip()
    try:
        with pytest.raises(VolumeError, match=f"in use: {loop} maps it"):
            reclaim(agent, p)
        assert path.is_file()
    finally:
        subprocess.run(["losetup", "--detach", loop], check=True)
    reclaim(agent, p)
    assert not path.exists()


def test_reclaim_never_follows_a_symlink(
    tmp_path: Path, node_tree: dict[str, Path], agent: LoopfileBackend
) -> None:
    p = provisioned(claim())
    path = image(node_tree, p)
    victim = tmp_path / "victim"
    victim.write_text("not a volume")
    path.parent.mkdir(parents=True)
    path.symlink_to(victim)
    with pytest.raises(VolumeError, match="not a regular file"):
        reclaim(agent, p)
    assert victim.read_text() == "not a volume" and path.is_symlink()
    # a symlinked directory on the way
    path.unlink()
    path.parent.rmdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / path.name).write_text("not a volume either")
    path.parent.symlink_to(elsewhere)
    with pytest.raises(VolumeError, match="a directory on the way is a symlink"):
        reclaim(agent, p)
    assert (elsewhere / path.name).read_text() == "not a volume either"


def test_retain_keeps_the_file_and_a_missing_one_is_success(
    node_tree: dict[str, Path], agent: LoopfileBackend
) -> None:
    p = provisioned(claim())
    reclaim(agent, p)  # never mounted: nothing made, nothing to remove
    path = image(node_tree, p)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"\0" * 4096)
    reclaim(agent, p, "retain")
    assert path.is_file()
    with pytest.raises(InvalidOptions, match="loopfile honours delete and retain"):
        reclaim(agent, p, "archive")
    assert path.is_file()
    reclaim(agent, p)
    assert not path.exists()


def test_expandfs_grows_a_provisioned_volume(
    kube: Kubelet, node_tree: dict[str, Path], agent: LoopfileBackend
) -> None:
    """A PVC resize: kubelet's expandfs carries the PV's provisioned options (size the old
    claim's); the file, the loop device and the xfs filesystem grow."""
    c = claim(size=300 * MiB)
    p = provisioned(c)
    uid = kube.new_pod_uid()
    assert kube.mount(uid, c.volume_name, pv_options(p, c, uid)).ok  # type: ignore[union-attr]
    target = kube.pod_dir(uid, c.volume_name)
    before = os.statvfs(target)
    options = Kubelet.base_options(
        {"backend": "loopfile", **p.options}, pv=c.volume_name, fs_type=p.fs_type
    )
    reply = kube.expandfs(uid, c.volume_name, options, 600 * MiB, 300 * MiB)
    assert reply.ok, reply.reply
    after = os.statvfs(target)
    assert image(node_tree, p).stat().st_size == 600 * MiB
    assert after.f_blocks * after.f_frsize > before.f_blocks * before.f_frsize + 250 * MiB
    assert kube.unmount(uid, c.volume_name).ok  # type: ignore[union-attr]
    # the next mount (options still say the old size) takes the grown file at its size
    again = kube.new_pod_uid()
    assert kube.mount(again, c.volume_name, pv_options(p, c, again)).ok  # type: ignore[union-attr]
    assert kube.unmount(again, c.volume_name).ok  # type: ignore[union-attr]
    reclaim(agent, p)
    assert not image(node_tree, p).exists()


def test_reclaim_never_follows_a_symlinked_namespace_area(
    tmp_path: Path, node_tree: dict[str, Path], agent: LoopfileBackend
) -> None:
    """``namespaces/`` is walked too: a symlinked one is not followed either."""
    p = provisioned(claim())
    elsewhere = tmp_path / "other-areas"
    (elsewhere / NS / "claims").mkdir(parents=True)
    victim = elsewhere / NS / p.options["file"]
    victim.write_bytes(b"\0" * 4096)
    node_tree["loopfiles"].mkdir()
    (node_tree["loopfiles"] / "namespaces").symlink_to(elsewhere)
    with pytest.raises(VolumeError, match="a directory on the way is a symlink"):
        reclaim(agent, p)
    assert victim.is_file()


def test_a_hand_edited_file_option_never_reclaims_another_namespaces_file(
    node_tree: dict[str, Path], agent: LoopfileBackend
) -> None:
    """A PV edited to ``file: namespaces/<other>/...`` (the node agent's service account may
    patch any PV) must not reach another namespace's area through the pre-isolation place."""
    victim_claim = Claim(uid=str(uuid.uuid4()), namespace="victim", name="db", size=MiB)
    victim = node_tree["loopfiles"] / "namespaces" / "victim" / f"claims/pvc-{victim_claim.uid}.img"
    victim.parent.mkdir(parents=True)
    victim.write_bytes(b"\0" * 4096)
    p = provisioned(claim())
    edited = {**p.options, "file": f"namespaces/victim/claims/pvc-{victim_claim.uid}.img"}
    with pytest.raises(InvalidOptions, match="option 'file'"):
        agent.reclaim(edited, {**p.reclaim, "onDelete": "delete"}, Secrets())
    assert victim.is_file()


def test_a_hand_edited_file_option_never_reclaims_a_file_provision_did_not_name(
    node_tree: dict[str, Path], agent: LoopfileBackend
) -> None:
    """Only ``<directory>/pvc-<uid>.img`` is ever removed: not a static PV's image."""
    static = node_tree["loopfiles"] / "namespaces" / NS / "static" / "important.img"
    static.parent.mkdir(parents=True)
    static.write_bytes(b"\0" * 4096)
    p = provisioned(claim())
    edited = {**p.options, "file": "static/important.img"}
    with pytest.raises(InvalidOptions, match="option 'file'"):
        agent.reclaim(edited, {**p.reclaim, "onDelete": "delete"}, Secrets())
    assert static.is_file()


def test_a_directory_in_the_namespace_areas_is_a_class_mistake() -> None:
    """What reclaim refuses, provision never names."""
    from flexhub_loopfile import _provision

    with pytest.raises(InvalidOptions, match="parameter 'directory'"):
        _provision.provision(claim(), {"directory": "namespaces/victim"})


def test_a_hand_edited_file_option_never_reclaims_another_claims_file(
    node_tree: dict[str, Path], agent: LoopfileBackend
) -> None:
    """The record's claimUid (the provisioner checks it is the PV's own) names the one file
    reclaim may remove: not another claim's of the same namespace."""
    other = provisioned(claim())
    victim = image(node_tree, other)
    victim.parent.mkdir(parents=True)
    victim.write_bytes(b"\0" * 4096)
    p = provisioned(claim())
    with pytest.raises(InvalidOptions, match="is not the file of claim"):
        agent.reclaim(other.options, {**p.reclaim, "onDelete": "delete"}, Secrets())
    assert victim.is_file()


def test_a_claim_for_several_nodes_is_refused() -> None:
    """A loop file is one node's: ReadWriteMany or ReadOnlyMany cannot be honoured, and is a
    one-line mistake naming accessModes, not a PV that lies about its modes."""
    from flexhub_loopfile._provision import provision

    from flexhub.errors import InvalidOptions
    from flexhub.provisioning import Claim

    claim = Claim(
        uid="u1",
        namespace="ns",
        name="c",
        size=1 << 20,
        selected_node="n",
        access_modes=("ReadWriteMany",),
    )
    with pytest.raises(InvalidOptions, match=r"accessModes: .*ReadWriteMany"):
        provision(claim, {})


def test_a_record_without_claim_uid_reclaims_nothing(
    node_tree: dict[str, Path], agent: LoopfileBackend
) -> None:
    """A record with no claimUid (edited, or written before loopfile recorded it) cannot
    choose which namespace's file goes: both reclaim paths fill it from the PV's name, and
    the backend refuses one that still has none."""
    victim_claim = Claim(
        uid=str(uuid.uuid4()), namespace="victim", name="db", size=MiB, selected_node="node-1"
    )
    p = provisioned(victim_claim)
    victim = node_tree["loopfiles"] / "namespaces" / "victim" / p.options["file"]
    victim.parent.mkdir(parents=True)
    victim.write_bytes(b"\0" * 4096)
    record = {k: v for k, v in p.reclaim.items() if k != "claimUid"}
    with pytest.raises(InvalidOptions, match="no claimUid"):
        agent.reclaim(p.options, {**record, "onDelete": "delete"}, Secrets())
    assert victim.is_file()
