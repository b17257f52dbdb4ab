"""nfs provisioning for real: the backend's provision/reclaim in the guest (as the provisioner
calls them, tests/vm/provhelper.py) against the rig's kernel NFS server, and the PV options
they return mounted by the installed driver exactly as kubelet calls it. Two tests, each
covering several behaviours, to keep the VM's cost small (durations are logged)."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator

import pytest

from tests.rig import services
from tests.rig.vm import VM
from tests.vm.provhelper import Op, claim, run_ops
from tests.vm.test_nfs import CONFIG, NODE_CONFIG, PLUGINS, Rig, short_nfs_grace

LOG = logging.getLogger(__name__)

EXPORT = services.NFS_EXPORT
STATE = "/run/flexhub-nfs-prov/state"


@pytest.fixture(scope="module")
def rig(vm: VM) -> Iterator[Rig]:
    short_nfs_grace(vm)
    server = services.start_nfs_server(vm)
    vm.write_file(CONFIG, NODE_CONFIG)
    yield Rig(vm, vm.install_flexhub(PLUGINS, config=CONFIG), server)


def export_tree(rig: Rig) -> str:
    return rig.sh(f"cd {EXPORT} && find . | sort")


def no_private_mount_left(rig: Rig) -> None:
    assert rig.sh(f"grep -c ' {STATE}/nfs-tmp' /proc/mounts", check=False) == "0\n"
    assert rig.sh(f"ls -A {STATE}/nfs-tmp") == ""


def test_provision_mount_and_delete(rig: Rig) -> None:
    """provision makes the claim's directory with the owner and mode asked (and a second
    call for the same claim returns the same and makes nothing else); the options, mounted
    by the driver as kubelet calls it, show exactly that directory and the pod's data lands
    there on the server; reclaim (delete) removes it and nothing else, and again (already
    gone) is success; no private mount of the export is left behind."""
    started = time.monotonic()
    parameters = {
        "server": rig.server.host,
        "share": rig.server.v4_path,
        "nfsVersion": "4.2",
        "uid": "1234",
        "gid": "2345",
    }
    the_claim = claim("team-a", "db")
    before = export_tree(rig)
    first, second = run_ops(rig.vm, "nfs", STATE, [Op("provision", the_claim, parameters)] * 2)[0]
    assert "error" not in first, first
    path = f"team-a-db-pvc-{the_claim['uid']}"
    assert first == second
    assert first["options"] == {
        "server": rig.server.host,
        "share": rig.server.v4_path,
        "nfsVersion": "4.2",
        "subPath": path,
    }
    assert first["reclaim"] == {"path": path, "claimUid": the_claim["uid"]}
    assert first["size"] == 1 << 30 and first["secret"] is None
    assert rig.sh(f"stat -c '%u %g %a' {EXPORT}/{path}") == "1234 2345 2770\n"
    assert sorted(set(export_tree(rig).splitlines()) - set(before.splitlines())) == [f"./{path}"]
    no_private_mount_left(rig)

    target = rig.pod_dir(f"pvc-{the_claim['uid']}")
    # The driver mounts what the PV says, as kubelet passes it (its flexVolume options).
    assert first["pv"]["options"] == {"backend": "nfs", **first["options"]}
    reply, _ = rig.mount(target, first["pv"]["options"])
    assert reply == {"status": "Success"}, reply
    rig.vm.write_file(f"{target}/written-by-pod", "hello\n")
    assert rig.sh(f"cat {EXPORT}/{path}/written-by-pod") == "hello\n"
    assert rig.sh(f"ls -A {target}") == "written-by-pod\n"
    assert rig.unmount(target)[0] == {"status": "Success"}

    reclaim = {**first["reclaim"], "onDelete": "delete"}
    results, _ = run_ops(
        rig.vm, "nfs", STATE, [Op("reclaim", options=first["options"], reclaim=reclaim)] * 2
    )
    assert results == [{"reclaimed": True}] * 2, results
    assert export_tree(rig) == before
    no_private_mount_left(rig)
    LOG.warning("nfs provision/mount/delete test: %.1fs", time.monotonic() - started)


def test_retain_archive_and_symlink_refused(rig: Rig) -> None:
    """retain keeps the directory and its data; archive renames it to archived-<name>
    beside it (again: success); a symlink planted server-side on the pattern's way is
    refused and nothing is made where it points."""
    started = time.monotonic()
    tag = uuid.uuid4().hex[:6]
    outside = f"/run/outside-{tag}"
    rig.sh(f"mkdir -m 0755 {outside} && ln -s {outside} {EXPORT}/link-{tag}")
    parameters = {"server": rig.server.host, "share": rig.server.v4_path}
    kept = claim("team-b", "kept")
    linked = claim("team-b", "linked")
    results, _ = run_ops(
        rig.vm,
        "nfs",
        STATE,
        [
            Op("provision", kept, {**parameters, "pathPattern": f"k-{tag}/${{pvName}}"}),
            Op("provision", linked, {**parameters, "pathPattern": f"link-{tag}/${{pvName}}"}),
        ],
    )
    made, refused = results
    assert "error" not in made, made
    assert refused["error"] == "VolumeError" and "symbolic link" in refused["message"], refused
    assert rig.sh(f"ls -A {outside}") == ""
    path = made["options"]["subPath"]
    assert path == f"k-{tag}/pvc-{kept['uid']}"
    assert rig.sh(f"stat -c '%u %g %a' {EXPORT}/{path}") == "0 0 2770\n"
    rig.sh(f"echo data > {EXPORT}/{path}/f")

    options, record = made["options"], made["reclaim"]
    results, _ = run_ops(
        rig.vm,
        "nfs",
        STATE,
        [
            Op("reclaim", options=options, reclaim={**record, "onDelete": "retain"}),
            Op("reclaim", options=options, reclaim={**record, "onDelete": "archive"}),
            Op("reclaim", options=options, reclaim={**record, "onDelete": "archive"}),
        ],
    )
    assert results == [{"reclaimed": True}] * 3, results
    assert rig.sh(f"ls -A {EXPORT}/k-{tag}") == f"archived-pvc-{kept['uid']}\n"
    assert rig.sh(f"cat {EXPORT}/k-{tag}/archived-pvc-{kept['uid']}/f") == "data\n"
    no_private_mount_left(rig)
    LOG.warning("nfs retain/archive/symlink test: %.1fs", time.monotonic() - started)
