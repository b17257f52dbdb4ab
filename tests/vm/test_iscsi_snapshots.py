"""iSCSI snapshots, restores and clones against the real thing: the guest's kernel LIO target,
driven over SSH by the provisioner's code, and its LUNs mounted through the installed driver
(a real iSCSI login with CHAP, as kubelet calls it).

A LUN is written through its mount, snapshotted, written again; the snapshot restored into a
new LUN and the LUN cloned into another are logged into and mounted, and each holds exactly
the data of its moment (compared byte for byte on the target: backing files with ``cmp``, LVs
read with ``O_DIRECT``); the snapshot is deleted (twice: gone is success); LIO's saved
configuration holds the new claims exactly as the running target does and no snapshot.
fileio on the rig's tmpfs (a full copy keeping holes) and the LVM-backed block backstore (a
full copy into an LV). The reflink of a fileio LUN on xfs is the same remote code on a real
xfs and loop device on the host (tests/iscsi/test_lio_snapshots.py); it ran here too, on
2026-12-05.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from tests.rig import services
from tests.rig.vm import VM
from tests.vm import test_iscsi
from tests.vm.test_iscsi import Kubelet, read, sessions, write
from tests.vm.test_iscsi_provision import (
    CHAP_USER,
    CONFIGFS,
    LUNS,
    RESTORE,
    SAVED,
    claim,
    exists,
    lv,
    mount_pv,
    parameters,
    setup,
)

kubelet = test_iscsi.kubelet
clean = test_iscsi.clean

pytest_plugins = ["tests.rig.fixtures"]

MiB = 1024 * 1024
SECONDS: dict[str, list[float]] = {}

#: Runs in the guest: provisioner calls of the iscsi backend (the production runner and ssh),
#: the requests on stdin, the answers on stdout.
CALLS = r"""
import json, sys, time
from pathlib import Path
from flexhub.config import NodeConfig
from flexhub.errors import FlexhubError
from flexhub.node.services import Node
from flexhub.provisioning import Claim
from flexhub.volume import Secret, Secrets
from flexhub_iscsi import IscsiBackend

backend = IscsiBackend(Node(NodeConfig(state_dir=Path("/var/lib/flexhub-prov-test")), "iscsi"))

def pv(p):
    return {"options": dict(p.options), "size": p.size, "reclaim": dict(p.reclaim),
            "fs_type": p.fs_type, "secret": p.secret}

answers = []
for req in json.load(sys.stdin):
    secrets = Secrets({k: Secret(v) for k, v in req["secrets"].items()})
    started = time.monotonic()
    try:
        op = req["op"]
        if op == "provision":
            out = pv(backend.provision(Claim(**req["claim"]), req["parameters"], secrets))
        elif op == "snapshot":
            out = backend.snapshot(req["options"], req["reclaim"], req["name"], "default", secrets)
        elif op == "delete_snapshot":
            backend.delete_snapshot(req["snapshot"], secrets)
            out = {}
        elif op == "restore":
            out = pv(backend.restore(Claim(**req["claim"]), req["parameters"], req["snapshot"],
                                     secrets))
        elif op == "clone":
            out = pv(backend.clone(Claim(**req["claim"]), req["parameters"], req["options"],
                                   "default", secrets))
        else:
            backend.reclaim(req["options"], {**req["reclaim"], "onDelete": "delete"}, secrets)
            out = {}
    except FlexhubError as exc:
        out = {"error": exc.message}
    out["seconds"] = round(time.monotonic() - started, 2)
    answers.append(out)
print(json.dumps(answers))
"""


def calls(vm: VM, secrets: dict[str, str], *requests: dict[str, Any]) -> list[dict[str, Any]]:
    vm.write_file("/tmp/snap-calls.py", CALLS)
    res = vm.run(
        [vm.flexhub_python, "/tmp/snap-calls.py"],
        input=json.dumps([{**r, "secrets": secrets} for r in requests]),
        timeout=600,
    )
    answers: list[dict[str, Any]] = json.loads(res.stdout.strip().splitlines()[-1])
    for request, answer in zip(requests, answers, strict=True):
        SECONDS.setdefault(request["op"], []).append(answer.pop("seconds"))
    return answers


def snap_name() -> str:
    return f"snap-{uuid.uuid4()}"


def blob(vm: VM, directory: str, name: str) -> str:
    """Write 1 MiB of random bytes through the mount; their sha256."""
    vm.sh(f"head -c {MiB} /dev/urandom > {directory}/{name} && sync")
    return digest(vm, f"{directory}/{name}")


def digest(vm: VM, path: str) -> str:
    return vm.run(["sha256sum", path]).stdout.split()[0]


def direct(vm: VM, device: str, length: int) -> str:
    """The sha256 of the first ``length`` bytes of a block device, read with O_DIRECT."""
    out = vm.sh(
        f"dd if={device} iflag=direct bs=1M count={length // MiB} status=none | sha256sum"
    ).stdout
    return out.split()[0]


def mounted(vm: VM, kubelet: Kubelet, pv: dict[str, Any], secrets: dict[str, str]) -> str:
    node_secret = {k: v for k, v in secrets.items() if k.startswith("node.session.")}
    name = pv["options"]["iqn"].rsplit(":", 1)[1]
    directory, reply = mount_pv(kubelet, pv, node_secret, name)
    assert reply == {"status": "Success"}, reply
    return directory


def unmount(vm: VM, kubelet: Kubelet, directory: str, iqn: str) -> None:
    assert kubelet.unmount(directory) == {"status": "Success"}
    assert sessions(vm, iqn) == []


def check_saved(vm: VM, pvs: list[dict[str, Any]], gone: list[str]) -> None:
    """The saved configuration holds each claim as the running target does, and restores it
    (rtslib's restore_from_file, as at a reboot); nothing named ``gone`` is in it."""
    names = [(p["options"]["iqn"].rsplit(":", 1)[1], p["options"]["iqn"]) for p in pvs]
    vm.write_file("/tmp/prov-restore.py", RESTORE)
    res = vm.run(["/usr/bin/python3", "/tmp/prov-restore.py", json.dumps(names), SAVED])
    found = json.loads(res.stdout)
    for name, iqn in names:
        sos, targets = found["saved"][name]
        assert len(sos) == 1 and len(targets) == 1, (name, sos, targets)
        assert found["live"][name] == [sos, targets], "saved differs from the running target"
        assert found["restored"][name] == [sos, targets], "the restore differs"
        acl = f"{CONFIGFS}/iscsi/{iqn}/tpgt_1/acls/{services.GUEST_INITIATOR}"
        assert exists(vm, f"{acl}/lun_0")
        assert read(vm, acl, "auth/userid").strip() == CHAP_USER
    text = vm.read_file(SAVED).decode()
    for name in gone:
        assert name not in text, name


def test_fileio_snapshot_restore_clone_and_delete(vm: VM, kubelet: Kubelet, clean: None) -> None:
    ssh, secrets = setup(vm)
    started = time.monotonic()
    params = parameters(ssh)
    source = claim(32 * MiB)
    (pv,) = calls(vm, secrets, {"op": "provision", "claim": source, "parameters": params})
    assert "error" not in pv, pv
    iqn = pv["options"]["iqn"]
    name = iqn.rsplit(":", 1)[1]
    directory = mounted(vm, kubelet, pv, secrets)
    write(vm, directory, "data", "before-the-snapshot")
    before = blob(vm, directory, "blob")
    unmount(vm, kubelet, directory, iqn)

    snap = snap_name()
    request = {"op": "snapshot", "options": pv["options"], "reclaim": pv["reclaim"], "name": snap}
    record, again = calls(vm, secrets, request, request)
    assert record.get("how") == "copy", record  # tmpfs: no reflink
    assert record["size"] == str(32 * MiB) and record["fileioDirectory"] == LUNS
    assert again == {**record, "how": "exists"}
    snap_file = f"{LUNS}/{snap}.img"
    assert vm.run(["stat", "-c", "%a %U %s", snap_file]).stdout.split() == [
        "600", "root", str(32 * MiB)]  # fmt: skip
    vm.run(["cmp", f"{LUNS}/{name}.img", snap_file])
    assert snap not in vm.sh(f"ls {CONFIGFS}/core/fileio_*/").stdout  # no LUN serves it

    directory = mounted(vm, kubelet, pv, secrets)
    write(vm, directory, "data", "after-the-snapshot")
    unmount(vm, kubelet, directory, iqn)

    restored_claim, cloned_claim = claim(48 * MiB), claim(32 * MiB)
    restored, cloned = calls(
        vm,
        secrets,
        {"op": "restore", "claim": restored_claim, "parameters": params, "snapshot": record},
        {"op": "clone", "claim": cloned_claim, "parameters": params, "options": pv["options"]},
    )
    assert restored.get("size") == 48 * MiB and cloned.get("size") == 32 * MiB, (restored, cloned)
    r_name, c_name = (p["options"]["iqn"].rsplit(":", 1)[1] for p in (restored, cloned))
    # byte for byte on the target: the snapshot's bytes, then zeros; the source's bytes
    vm.run(["cmp", "-n", str(32 * MiB), snap_file, f"{LUNS}/{r_name}.img"])
    tail = vm.sh(f"tail -c {16 * MiB} {LUNS}/{r_name}.img | tr -d '\\0' | wc -c").stdout
    assert tail.strip() == "0", tail
    vm.run(["cmp", f"{LUNS}/{name}.img", f"{LUNS}/{c_name}.img"])
    assert vm.run(["cmp", "-s", snap_file, f"{LUNS}/{name}.img"], check=False).rc != 0

    for made, text in ((restored, "before-the-snapshot"), (cloned, "after-the-snapshot")):
        assert made["reclaim"]["claimUid"] in made["options"]["iqn"]
        directory = mounted(vm, kubelet, made, secrets)  # a real login with the node's CHAP
        assert read(vm, directory, "data") == text
        assert digest(vm, f"{directory}/blob") == before
        unmount(vm, kubelet, directory, made["options"]["iqn"])
    check_saved(vm, [pv, restored, cloned], [snap])

    gone = {"op": "delete_snapshot", "snapshot": record}
    assert calls(vm, secrets, gone, gone) == [{}, {}]
    assert not exists(vm, snap_file)
    for made in (pv, restored, cloned):
        assert calls(vm, secrets, {"op": "reclaim", **made}) == [{}]
    assert vm.sh(f"ls -A {LUNS}").stdout.split() == []
    check_saved(vm, [], [name, r_name, c_name, snap])
    print(f"iscsi fileio snapshots: {time.monotonic() - started:.1f} s; calls (s): "
          f"{json.dumps(SECONDS)}")  # fmt: skip


def test_block_snapshot_restore_clone_and_delete(vm: VM, kubelet: Kubelet, clean: None) -> None:
    """backstore block: the snapshot is the LV snap-<uid> (tagged flexhub-snapshot:<uid>), a
    whole copy; the restore and the clone are new claims' LVs with the data of their moment;
    deleting the snapshot zeroes its LV and removes it, and again is success."""
    ssh, secrets = setup(vm)
    started = time.monotonic()
    vg = f"rigvg{uuid.uuid4().hex[:6]}"
    disk = f"{services.LUN_DIR}/{vg}.disk"
    vm.run(["modprobe", "-a", "dm_mod", "target_core_iblock"])
    vm.run(["truncate", "-s", str(160 * MiB), disk])
    loop = vm.run(["losetup", "--find", "--show", disk]).stdout.strip()
    try:
        vm.run(["vgcreate", "--yes", "--physicalextentsize", "4m", vg, loop])
        params = {
            **{k: v for k, v in parameters(ssh).items() if k != "fileioDirectory"},
            "backstore": "block",
            "volumeGroup": vg,
        }
        (pv,) = calls(vm, secrets, {"op": "provision", "claim": claim(20 * MiB + 1),
                                    "parameters": params})  # fmt: skip
        assert pv.get("size") == 24 * MiB, pv
        iqn = pv["options"]["iqn"]
        name = iqn.rsplit(":", 1)[1]
        directory = mounted(vm, kubelet, pv, secrets)
        write(vm, directory, "data", "before-the-snapshot")
        before = blob(vm, directory, "blob")
        unmount(vm, kubelet, directory, iqn)

        snap = snap_name()
        request = {"op": "snapshot", "options": pv["options"], "reclaim": pv["reclaim"],
                   "name": snap}  # fmt: skip
        record, again = calls(vm, secrets, request, request)
        assert record.get("how") == "copy" and again.get("how") == "exists", (record, again)
        assert record["size"] == str(24 * MiB) and record["volumeGroup"] == vg
        assert lv(vm, vg, snap, "lv_size,lv_tags").split() == [
            str(24 * MiB), f"flexhub-snapshot:{snap[5:]}"]  # fmt: skip
        source_bytes = direct(vm, f"/dev/{vg}/{name}", 24 * MiB)
        assert direct(vm, f"/dev/{vg}/{snap}", 24 * MiB) == source_bytes

        directory = mounted(vm, kubelet, pv, secrets)
        write(vm, directory, "data", "after-the-snapshot")
        unmount(vm, kubelet, directory, iqn)

        restored, cloned = calls(
            vm,
            secrets,
            {"op": "restore", "claim": claim(40 * MiB), "parameters": params, "snapshot": record},
            {"op": "clone", "claim": claim(24 * MiB), "parameters": params,
             "options": pv["options"]},
        )  # fmt: skip
        assert restored.get("size") == 40 * MiB and cloned.get("size") == 24 * MiB, (
            restored, cloned)  # fmt: skip
        r_name, c_name = (p["options"]["iqn"].rsplit(":", 1)[1] for p in (restored, cloned))
        assert direct(vm, f"/dev/{vg}/{r_name}", 24 * MiB) == source_bytes
        assert direct(vm, f"/dev/{vg}/{c_name}", 24 * MiB) == direct(
            vm, f"/dev/{vg}/{name}", 24 * MiB)  # fmt: skip
        assert lv(vm, vg, r_name, "lv_tags") == f"flexhub:{r_name[4:]}"
        for made, text in ((restored, "before-the-snapshot"), (cloned, "after-the-snapshot")):
            directory = mounted(vm, kubelet, made, secrets)
            assert read(vm, directory, "data") == text
            assert digest(vm, f"{directory}/blob") == before
            unmount(vm, kubelet, directory, made["options"]["iqn"])
        check_saved(vm, [pv, restored, cloned], [snap])

        snap_lv = f"/dev/{vg}/{snap}"
        extents = lv(vm, vg, snap, "seg_pe_ranges")
        gone = {"op": "delete_snapshot", "snapshot": record}
        assert calls(vm, secrets, gone, gone) == [{}, {}]
        assert lv(vm, vg, snap, "lv_name") == "" and not exists(vm, snap_lv)
        # its extents were zeroed before lvremove: a new LV over them reads zeros
        vm.run(["lvcreate", "--yes", "-n", "probe", "-l", "6", vg, extents])  # exactly those
        assert lv(vm, vg, "probe", "seg_pe_ranges") == extents
        probe = vm.sh(f"dd if=/dev/{vg}/probe iflag=direct bs=1M count=24 status=none"
                      " | tr -d '\\0' | wc -c").stdout.strip()  # fmt: skip
        assert probe == "0", probe
        vm.run(["lvremove", "--yes", f"{vg}/probe"])
        for made in (pv, restored, cloned):
            made_size = str(made["size"])
            reclaim = {**made["reclaim"], "size": made_size}
            assert calls(vm, secrets, {"op": "reclaim", "options": made["options"],
                                       "reclaim": reclaim}) == [{}]  # fmt: skip
        assert vm.run(["lvs", "--noheadings", "-o", "lv_name", vg]).stdout.split() == []
        check_saved(vm, [], [name, r_name, c_name, snap])
        print(f"iscsi block snapshots: {time.monotonic() - started:.1f} s; calls (s): "
              f"{json.dumps(SECONDS)}")  # fmt: skip
    finally:
        services.reset_iscsi(vm)
        vm.run(["vgremove", "--yes", "--force", vg], check=False)
        vm.run(["losetup", "-d", loop], check=False)
        vm.run(["rm", "-f", disk], check=False)
