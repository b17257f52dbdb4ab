"""cifs provisioning for real: the backend's provision/reclaim in the guest (as the provisioner
calls them, tests/vm/provhelper.py, the Secret's credentials on stdin) against the rig's
Samba, and the PV options they return mounted by the installed driver exactly as kubelet
calls it. Two tests, each covering several behaviours, to keep the VM's cost small
(durations are logged)."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator

import pytest

from tests.rig import services
from tests.rig.vm import VM
from tests.vm.provhelper import Op, claim, run_ops
from tests.vm.test_cifs import CONFIG, NODE_CONFIG, PASSWORD, PLUGINS, Rig

LOG = logging.getLogger(__name__)

STATE = "/run/flexhub-cifs-prov/state"


@pytest.fixture(scope="module")
def rig(vm: VM) -> Iterator[Rig]:
    server = services.start_smb_server(vm, PASSWORD)
    vm.write_file(CONFIG, NODE_CONFIG)
    yield Rig(vm, vm.install_flexhub(PLUGINS, config=CONFIG), server)


def parameters(rig: Rig, **extra: str) -> dict[str, str]:
    return {
        "server": rig.server.host,
        "share": rig.server.share,
        "secretName": "smb-k8s",
        "secretNamespace": "flexhub",
        **extra,
    }


def secrets(rig: Rig) -> dict[str, str]:
    return {"username": rig.server.username, "password": PASSWORD}


def share_tree(rig: Rig) -> str:
    return rig.sh(f"cd {rig.server.local_dir} && find . | sort")


def nothing_left(rig: Rig) -> None:
    """No private mount of the share, and no credentials file, is left behind."""
    assert rig.sh(f"grep -c ' {STATE}/cifs-tmp' /proc/mounts", check=False) == "0\n"
    assert rig.sh(f"ls -A {STATE}/cifs-tmp {STATE}/cifs-creds") == (
        f"{STATE}/cifs-creds:\n\n{STATE}/cifs-tmp:\n"
    )


def test_provision_mount_and_delete(rig: Rig) -> None:
    """provision makes the claim's directory on the share with the Secret's credentials (a
    second call for the same claim returns the same and makes nothing else) and returns the
    class's Secret for the PV's secretRef; the options, mounted by the driver as kubelet
    calls it, show that directory with the owner and mode asked, and the pod's data lands
    there on the server; reclaim (delete) removes it and nothing else, and again (already
    gone) is success; the password is in no reply."""
    started = time.monotonic()
    asked = parameters(rig, uid="1234", gid="2345", mode="0750", fileMode="0640", vers="3.1.1")
    the_claim = claim("team-a", "files")
    before = share_tree(rig)
    results, _ = run_ops(
        rig.vm, "cifs", STATE, [Op("provision", the_claim, asked)] * 2, secrets(rig)
    )
    first, second = results
    assert "error" not in first, first
    assert first == second
    path = f"team-a-files-pvc-{the_claim['uid']}"
    assert first["options"] == {
        "server": rig.server.host,
        "share": rig.server.share,
        "vers": "3.1.1",
        "uid": "1234",
        "gid": "2345",
        "dir_mode": "0750",
        "file_mode": "0640",
        "subPath": path,
    }
    assert first["secret"] == ["flexhub", "smb-k8s"]
    assert first["reclaim"] == {"path": path, "claimUid": the_claim["uid"]}
    assert PASSWORD not in str(results)
    assert sorted(set(share_tree(rig).splitlines()) - set(before.splitlines())) == [f"./{path}"]
    nothing_left(rig)

    target = rig.pod_dir(f"pvc-{the_claim['uid']}")
    # The driver mounts what the PV says, as kubelet passes it (its flexVolume options).
    assert first["pv"]["options"] == {"backend": "cifs", **first["options"]}
    assert first["pv"]["secretRef"] == {"namespace": "flexhub", "name": "smb-k8s"}
    reply, _ = rig.mount(target, first["pv"]["options"])
    assert reply == {"status": "Success"}, reply
    rig.vm.write_file(f"{target}/written-by-pod", "hello\n")
    assert rig.sh(f"stat -c '%u %g %a' {target} {target}/written-by-pod") == (
        "1234 2345 750\n1234 2345 640\n"
    )
    assert rig.sh(f"cat {rig.server_path(path, 'written-by-pod')}") == "hello\n"
    assert rig.unmount(target)[0] == {"status": "Success"}

    reclaim = {**first["reclaim"], "onDelete": "delete"}
    results, _ = run_ops(
        rig.vm,
        "cifs",
        STATE,
        [Op("reclaim", options=first["options"], reclaim=reclaim)] * 2,
        secrets(rig),
    )
    assert results == [{"reclaimed": True}] * 2, results
    assert share_tree(rig) == before
    nothing_left(rig)
    LOG.warning("cifs provision/mount/delete test: %.1fs", time.monotonic() - started)


def test_retain_archive_and_symlinks_refused(rig: Rig) -> None:
    """retain keeps the directory and its data; archive renames it to archived-<name>
    beside it (again: success); a symlink on the pattern's way is refused and nothing is
    made where it points: one a client planted (mfsymlinks, which the provisioner's mount
    then shows as a symlink) and one planted on the server side (Samba does not follow it
    out of the share)."""
    started = time.monotonic()
    tag = uuid.uuid4().hex[:6]
    outside = f"/run/outside-{tag}"
    rig.sh(f"mkdir -m 0777 {outside} && ln -s {outside} {rig.server_path(f'srv-{tag}')}")
    plant = rig.pod_dir()
    assert rig.mount(plant, {"mountOptions": "mfsymlinks"})[0] == {"status": "Success"}
    rig.sh(f"ln -s {outside} {plant}/mf-{tag}")
    assert rig.unmount(plant)[0] == {"status": "Success"}
    kept = claim("team-b", "kept")
    ops = [
        Op("provision", kept, parameters(rig, pathPattern=f"k-{tag}/${{pvName}}")),
        Op(
            "provision",
            claim("team-b", "mf"),
            parameters(rig, pathPattern=f"mf-{tag}/${{pvName}}", mountOptions="mfsymlinks"),
        ),
        Op(
            "provision",
            claim("team-b", "srv"),
            parameters(rig, pathPattern=f"srv-{tag}/${{pvName}}"),
        ),
    ]
    results, _ = run_ops(rig.vm, "cifs", STATE, ops, secrets(rig))
    made, client_link, server_link = results
    assert "error" not in made, made
    assert client_link["error"] == "VolumeError", client_link
    assert "symbolic link" in client_link["message"], client_link
    assert "error" in server_link, server_link
    LOG.warning("server-side symlink: %s", server_link["message"])
    assert rig.sh(f"ls -A {outside}") == ""
    path = made["options"]["subPath"]
    rig.sh(f"echo data > {rig.server_path(path, 'f')}")

    options, record = made["options"], made["reclaim"]
    results, _ = run_ops(
        rig.vm,
        "cifs",
        STATE,
        [
            Op("reclaim", options=options, reclaim={**record, "onDelete": "retain"}),
            Op("reclaim", options=options, reclaim={**record, "onDelete": "archive"}),
            Op("reclaim", options=options, reclaim={**record, "onDelete": "archive"}),
        ],
        secrets(rig),
    )
    assert results == [{"reclaimed": True}] * 3, results
    archived = f"archived-pvc-{kept['uid']}"
    assert rig.sh(f"ls -A {rig.server_path(f'k-{tag}')}") == f"{archived}\n"
    assert rig.sh(f"cat {rig.server_path(f'k-{tag}', archived, 'f')}") == "data\n"
    nothing_left(rig)
    LOG.warning("cifs retain/archive/symlink test: %.1fs", time.monotonic() - started)
