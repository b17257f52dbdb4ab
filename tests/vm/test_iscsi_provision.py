"""iSCSI dynamic provisioning against the real thing: a kernel LIO target driven over SSH.

The guest is the target host (sshd on 127.0.0.1:2222, LIO, rtslib) and the node. The
provisioner's side runs in the guest as the provisioner runs it: ``IscsiBackend`` with the
production runner, calling the real ``ssh`` (:data:`PROVISIONER`). The PV it returns is
mounted through the installed driver exactly as kubelet calls it, with the node Secret's CHAP
keys; a sampler reads every process's command line during all of it.
"""

from __future__ import annotations

import base64
import json
import time
import uuid
from typing import Any

from tests.rig import services
from tests.rig.vm import VM
from tests.vm import test_iscsi
from tests.vm.test_iscsi import USED_SECRETS, Kubelet, go_json, read, sessions, write

kubelet = test_iscsi.kubelet
clean = test_iscsi.clean

pytest_plugins = ["tests.rig.fixtures"]

MiB = 1024 * 1024
LUNS = f"{services.LUN_DIR}/prov"
PREFIX = "iqn.2026-01.io.flexhub.rig:prov"
CHAP_USER = "prov-chap-user"
CHAP_PASSWORD = "Prov-Chap-Pw-9xQ2m7Lk"
CONFIGFS = "/sys/kernel/config/target"
SAVED = "/etc/rtslib-fb-target/saveconfig.json"
#: Seconds of each provisioner call, by kind (printed at the end).
SECONDS: dict[str, list[float]] = {}

#: Runs in the guest: one provisioner call, the request on stdin, the answer on stdout.
PROVISIONER = r"""
import json, os, sys, time
from pathlib import Path
from flexhub.config import NodeConfig
from flexhub.errors import FlexhubError
from flexhub.node.services import Node
from flexhub.provisioning import Claim
from flexhub.volume import Secret, Secrets
from flexhub_iscsi import IscsiBackend

keys = "/var/lib/flexhub-prov-test/capacity"  # [iscsi] capacity_secret_dir, as the controller's
node = Node(NodeConfig(state_dir=Path("/var/lib/flexhub-prov-test"),
                       backends={"iscsi": {"capacity_secret_dir": keys}}), "iscsi")
backend = IscsiBackend(node)
answers = []
for req in json.load(sys.stdin):  # several calls, one import (4 s under emulation)
    secrets = Secrets({k: Secret(v) for k, v in req["secrets"].items()})
    started = time.monotonic()
    try:
        if req["op"] == "provision":
            p = backend.provision(Claim(**req["claim"]), req["parameters"], secrets)
            out = {"options": dict(p.options), "size": p.size, "reclaim": dict(p.reclaim),
                   "fs_type": p.fs_type, "secret": p.secret}
        elif req["op"] == "capacity":  # CSI GetCapacity of the class
            out = {"capacity": backend.capacity(req["parameters"])}
        elif req["op"] == "statvfs":  # what the guest's kernel says of the directory, after it
            vfs = os.statvfs(req["path"])
            out = {"available": vfs.f_bavail * vfs.f_frsize}
        elif req["op"] == "expand":
            out = {"size": backend.expand_storage(req["options"], req["reclaim"], req["size"], secrets)}
        else:
            backend.reclaim(req["options"], req["reclaim"], secrets)
            out = {}
    except FlexhubError as exc:
        out = {"error": exc.message}
    out["seconds"] = round(time.monotonic() - started, 2)
    answers.append(out)
print(json.dumps(answers))
"""

SAMPLER = r"""
import os, sys, time
with open(sys.argv[2], "rb") as f:  # not on this argv: the sampler would find itself
    needles = [n for n in f.read().split(b"\n") if n]
out = open(sys.argv[3], "a", buffering=1)
scans = ssh = 0
while not os.path.exists(sys.argv[1]):
    scans += 1
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read()
        except OSError:
            continue
        if argv.split(b"\0")[0] == b"ssh":
            ssh += 1
        if any(n in argv for n in needles):
            out.write("HIT " + argv.replace(b"\0", b" ").decode("utf-8", "replace")[:200] + "\n")
    time.sleep(0.2)  # the guest has one CPU: leave it to the calls sampled (an ssh lives seconds)
out.write(f"DONE {scans} {ssh}\n")
"""


def provisioner(vm: VM, *requests: dict[str, Any]) -> list[dict[str, Any]]:
    """Run provisioner calls in one guest process; their answers, each with its seconds."""
    vm.write_file("/tmp/prov-call.py", PROVISIONER)
    res = vm.run([vm.flexhub_python, "/tmp/prov-call.py"], input=json.dumps(requests), timeout=300)
    answers: list[dict[str, Any]] = json.loads(res.stdout.strip().splitlines()[-1])
    for request, answer in zip(requests, answers, strict=True):
        SECONDS.setdefault(request["op"], []).append(answer.pop("seconds"))
    return answers


def setup(vm: VM) -> tuple[services.SshServer, dict[str, str]]:
    ssh = services.start_sshd(vm)
    services._ensure_lio(vm)
    vm.run(["mkdir", "-p", "-m", "0755", LUNS])
    secrets = {
        "ssh-privatekey": ssh.private_key,
        "ssh-knownhosts": ssh.known_hosts,
        "node.session.auth.username": CHAP_USER,
        "node.session.auth.password": CHAP_PASSWORD,
    }
    return ssh, secrets


def capacity_keys(vm: VM, ssh: services.SshServer) -> None:
    """The class's SSH key where the controller's ``[iscsi] capacity_secret_dir`` names it
    (the provisioner script's node config): CSI sends ``GetCapacity`` no secrets."""
    vm.run(["install", "-d", "-m", "0700", "/var/lib/flexhub-prov-test/capacity"])
    vm.write_file("/var/lib/flexhub-prov-test/capacity/ssh-privatekey", ssh.private_key, 0o600)
    vm.write_file("/var/lib/flexhub-prov-test/capacity/ssh-knownhosts", ssh.known_hosts, 0o600)


def parameters(ssh: services.SshServer, **extra: str) -> dict[str, str]:
    return {
        "targetHost": ssh.host,
        "sshPort": str(ssh.port),
        "portals": "127.0.0.1:3260",
        "iqnPrefix": PREFIX,
        "fileioDirectory": LUNS,
        "initiators": services.GUEST_INITIATOR,
        "nodeSecretName": "iscsi-chap",
        "nodeSecretNamespace": "flexhub",
        **extra,
    }


def claim(size: int) -> dict[str, Any]:
    return {"uid": str(uuid.uuid4()), "namespace": "default", "name": "data", "size": size}


def mount_pv(
    kubelet: Kubelet, pv: dict[str, Any], secrets: dict[str, str], name: str
) -> tuple[str, dict[str, object]]:
    """``mount`` of the provisioned PV as kubelet calls it: the PV's options, its fsType, the
    pod keys and the node Secret's keys base64-encoded."""
    directory = kubelet.pod_dir(name)
    options = {
        **pv["options"],
        "backend": "iscsi",
        "kubernetes.io/fsType": pv["fs_type"],
        "kubernetes.io/readwrite": "rw",
        "kubernetes.io/pvOrVolumeName": name,
        "kubernetes.io/pod.name": "web-0",
        "kubernetes.io/pod.namespace": "default",
        "kubernetes.io/pod.uid": directory.split("/")[-4],
        "kubernetes.io/serviceAccount.name": "default",
    }
    for key, value in secrets.items():
        USED_SECRETS.add(value)
        options[f"kubernetes.io/secret/{key}"] = base64.b64encode(value.encode()).decode()
    return directory, kubelet.call("mount", ["mount", directory, go_json(options)])


def exists(vm: VM, path: str) -> bool:
    return vm.run(["test", "-e", path], check=False).rc == 0


def backstores(vm: VM, name: str) -> list[str]:
    out = vm.sh(f"ls -d {CONFIGFS}/core/fileio_*/{name} 2>/dev/null; true").stdout
    return out.split()


def fs_size(vm: VM, directory: str) -> int:
    return int(vm.run(["df", "-B1", "--output=size", directory]).stdout.split()[-1])


def test_provision_mount_expand_reclaim(vm: VM, kubelet: Kubelet, clean: None) -> None:
    """A claim's LUN made over ssh; provisioned twice, one LUN; CHAP enforced; mounted with
    the node Secret's CHAP through the driver, written, grown on the target and by expandfs;
    deleted, and deleted again once gone; no CHAP value or key line on any command line
    meanwhile."""
    ssh, secrets = setup(vm)
    node_secret = {k: v for k, v in secrets.items() if k.startswith("node.session.")}
    key_line = ssh.private_key.splitlines()[1]
    vm.write_file("/tmp/prov-sampler.py", SAMPLER)
    vm.write_file("/tmp/prov-sampler.needles", f"{CHAP_PASSWORD}\n{key_line}\n", mode=0o600)
    vm.run(["rm", "-f", "/tmp/prov-sampler.stop", "/tmp/prov-sampler.out"])
    sampler = f"{vm.python} /tmp/prov-sampler.py /tmp/prov-sampler.stop /tmp/prov-sampler.needles"
    vm.run(
        ["/bin/sh", "-c", f"setsid {sampler} /tmp/prov-sampler.out >/dev/null 2>&1 </dev/null &"]
    )
    started = time.monotonic()

    wanted = claim(64 * MiB - 5)  # rounded up to MiB
    request = {
        "op": "provision",
        "claim": wanted,
        "parameters": parameters(ssh),
        "secrets": secrets,
    }
    # the second call is the provisioner's retry after a crash before it saved the PV
    pv, again = provisioner(vm, request, request)
    name = f"pvc-{wanted['uid']}"
    iqn = f"{PREFIX}:{name}"
    assert pv == {
        "options": {
            "targetPortal": "127.0.0.1:3260",
            "iqn": iqn,
            "lun": "0",
            "chapAuthSession": "true",
        },
        "size": 64 * MiB,
        "reclaim": {
            "targetHost": "127.0.0.1",
            "sshUser": "root",
            "sshPort": "2222",
            "backstore": "fileio",
            "fileioDirectory": LUNS,
            "sparse": "true",
            "overcommit": "1",
            "claimUid": wanted["uid"],
        },
        "fs_type": "ext4",
        "secret": ["flexhub", "iscsi-chap"],
    }, pv
    assert again == pv
    image = f"{LUNS}/{name}.img"
    assert vm.run(["stat", "-c", "%s %a %U", image]).stdout.split() == [
        str(64 * MiB),
        "600",
        "root",
    ]
    assert len(backstores(vm, name)) == 1
    assert vm.sh(f"ls {CONFIGFS}/iscsi/{iqn}/tpgt_1/lun").stdout.split() == ["lun_0"]
    acl = f"{CONFIGFS}/iscsi/{iqn}/tpgt_1/acls/{services.GUEST_INITIATOR}"
    assert exists(vm, f"{acl}/lun_0")
    assert read(vm, acl, "auth/userid").strip() == CHAP_USER
    assert iqn in vm.read_file(SAVED).decode(), "saveconfig did not keep the target"

    # CHAP is enforced: the same initiator without it, or with another password, is refused
    for chap in (None, services.Chap(CHAP_USER, "Not-The-Chap-Pw-3k")):
        refused = services.login(vm, iqn, "127.0.0.1:3260", chap=chap, check=False)
        assert refused.rc != 0, refused.output
    vm.run(["iscsiadm", "-m", "node", "-T", iqn, "-o", "delete"], check=False)
    assert sessions(vm, iqn) == []

    directory, reply = mount_pv(kubelet, pv, node_secret, name)
    assert reply == {"status": "Success"}, reply
    write(vm, directory, "data", "provisioned")
    before = fs_size(vm, directory)

    grow = {"op": "expand", "options": pv["options"], "reclaim": pv["reclaim"], "size": 160 * MiB}
    assert provisioner(vm, {**grow, "secrets": secrets}) == [{"size": 160 * MiB}]
    assert vm.run(["stat", "-c", "%s", image]).stdout.strip() == str(160 * MiB)
    options = {
        **pv["options"],
        "backend": "iscsi",
        "kubernetes.io/fsType": "ext4",
        "kubernetes.io/readwrite": "rw",
        "kubernetes.io/pvOrVolumeName": name,
    }
    reply = kubelet.call(
        "expandfs", ["expandfs", go_json(options), "", directory, str(160 * MiB), str(64 * MiB)]
    )
    assert reply == {"status": "Success"}, reply
    assert fs_size(vm, directory) > before + 64 * MiB
    assert read(vm, directory, "data") == "provisioned"
    assert kubelet.unmount(directory) == {"status": "Success"}
    assert sessions(vm, iqn) == []

    gone = {
        "op": "reclaim",
        "options": pv["options"],
        "reclaim": {**pv["reclaim"], "onDelete": "delete"},
        "secrets": secrets,
    }
    assert provisioner(vm, gone, gone) == [{}, {}]  # the second finds it gone: success
    assert not exists(vm, f"{CONFIGFS}/iscsi/{iqn}")
    assert backstores(vm, name) == []
    assert not exists(vm, image)
    assert iqn not in vm.read_file(SAVED).decode()

    vm.run(["touch", "/tmp/prov-sampler.stop"])
    for _ in range(100):
        text = vm.run(["cat", "/tmp/prov-sampler.out"], check=False).stdout
        if "DONE" in text:
            break
        time.sleep(0.2)
    hits = [line for line in text.splitlines() if line.startswith("HIT ")]
    assert hits == [], hits
    scans, ssh_seen = (int(x) for x in text.split("DONE")[1].split()[:2])
    assert scans > 0 and ssh_seen > 0, text  # it did see ssh running
    print(
        f"iscsi provisioning: {time.monotonic() - started:.1f} s in all; "
        f"provisioner calls (s): {json.dumps(SECONDS)}"
    )


#: Runs in the guest with the system python3 and rtslib: what the saved configuration, the
#: running target and, after each claim's objects are dropped and restored from the saved
#: file (rtslib's restore_from_file, as targetctl restores at boot), the target again say of
#: each claim (its storage object and target entries).
RESTORE = r"""
import json, sys
import rtslib_fb as rts
claims = json.loads(sys.argv[1])
root = rts.RTSRoot()
def pick(config, name, iqn):
    return ([s for s in config.get("storage_objects", []) if s["name"] == name],
            [t for t in config.get("targets", []) if t["wwn"] == iqn])
with open(sys.argv[2]) as f:
    saved = json.load(f)
live = root.dump()
out = {"saved": {}, "live": {}, "restored": {}}
for name, iqn in claims:
    out["saved"][name] = pick(saved, name, iqn)
    out["live"][name] = pick(live, name, iqn)
    if out["saved"][name][0]:
        root.restore_from_file(sys.argv[2], clear_existing=True, target=iqn,
                               storage_object=name, abort_on_error=True)
restored = root.dump()
for name, iqn in claims:
    out["restored"][name] = pick(restored, name, iqn)
print(json.dumps(out))
"""


def test_each_call_saves_its_claim_and_the_saved_file_restores_it(vm: VM, clean: None) -> None:
    """Three claims made and the middle one reclaimed, each call saving only its own claim:
    the saved file holds the two left exactly as a whole dump of the running target says
    them and not the third, and each claim dropped from the running target and restored
    from that file (as at a reboot) comes back the same, its LUN, ACL and CHAP with it."""
    ssh, secrets = setup(vm)
    claims = [claim(4 * MiB) for _ in range(3)]
    made = provisioner(
        vm,
        *[{"op": "provision", "claim": c, "parameters": parameters(ssh), "secrets": secrets}
          for c in claims],
    )  # fmt: skip
    assert all("error" not in pv for pv in made), made
    gone = {"op": "reclaim", "options": made[1]["options"], "reclaim": made[1]["reclaim"]}
    assert provisioner(vm, {**gone, "secrets": secrets}) == [{}]
    names = [(f"pvc-{c['uid']}", f"{PREFIX}:pvc-{c['uid']}") for c in claims]
    vm.write_file("/tmp/prov-restore.py", RESTORE)
    res = vm.run(["/usr/bin/python3", "/tmp/prov-restore.py", json.dumps(names), SAVED])
    found = json.loads(res.stdout)
    for i, (name, iqn) in enumerate(names):
        sos, targets = found["saved"][name]
        if i == 1:
            assert sos == [] and targets == [], "the reclaimed claim is still saved"
            assert found["live"][name] == [[], []]
            continue
        assert len(sos) == 1 and len(targets) == 1, (name, sos, targets)
        assert found["live"][name] == [sos, targets], "saved differs from the running target"
        assert found["restored"][name] == [sos, targets], "the restore differs"
        assert targets[0]["tpgs"][0]["luns"][0]["storage_object"].endswith(f"/{name}")
        acl = f"{CONFIGFS}/iscsi/{iqn}/tpgt_1/acls/{services.GUEST_INITIATOR}"
        assert exists(vm, f"{acl}/lun_0")
        assert read(vm, acl, "auth/userid").strip() == CHAP_USER
    for pv in (made[0], made[2]):
        assert provisioner(vm, {"op": "reclaim", **pv, "secrets": secrets}) == [{}]


def test_a_claim_past_the_directorys_room_is_refused_unless_overcommitted(
    vm: VM, clean: None
) -> None:
    """The LUN directory's tmpfs holds far less than 4 GiB: a sparse 4 GiB claim is refused
    with the figures and nothing is made; with overcommit 64 it is provisioned.

    CSI ``GetCapacity`` of the class against the real target host (the remote ``room``, with
    the key of ``[iscsi] capacity_secret_dir``) follows the same rule, checked against the
    guest kernel's statvfs of the directory read right after it: the empty directory's free
    bytes; with overcommit 64 and the 4 GiB claim made, 64 x free - 4 GiB (the sparse file
    holds no block); a preallocating class of the same overcommit, no more than the free
    bytes. The slack allows for the guest's other writes to the rig's filesystem between the
    two reads (1 MiB, 64 times over with overcommit 64)."""
    ssh, secrets = setup(vm)
    capacity_keys(vm, ssh)
    big = claim(4096 * MiB)
    name = f"pvc-{big['uid']}"
    request = {"op": "provision", "claim": big, "parameters": parameters(ssh), "secrets": secrets}
    statvfs = {"op": "statvfs", "path": LUNS, "secrets": {}}
    room, vfs, refused = provisioner(
        vm, {"op": "capacity", "parameters": parameters(ssh), "secrets": {}}, statvfs, request
    )
    assert "error" not in room, room
    assert abs(room["capacity"] - vfs["available"]) <= MiB, (room, vfs)
    assert room["capacity"] < 4096 * MiB  # as the refusal below says
    assert "not enough room for" in refused.get("error", ""), refused
    assert "x overcommit 1 = " in refused["error"] and "\n" not in refused["error"]
    assert not exists(vm, f"{LUNS}/{name}.img") and backstores(vm, name) == []
    assert not exists(vm, f"{CONFIGFS}/iscsi/{PREFIX}:{name}")
    request["parameters"] = parameters(ssh, overcommit="64")
    ask = {"op": "capacity", "parameters": parameters(ssh, overcommit="64"), "secrets": {}}
    held = {**ask, "parameters": parameters(ssh, overcommit="64", sparse="false")}
    pv, room, preallocated, vfs = provisioner(vm, request, ask, held, statvfs)
    assert pv.get("size") == 4096 * MiB and pv["reclaim"]["overcommit"] == "64", pv
    assert abs(room["capacity"] - (64 * vfs["available"] - 4096 * MiB)) <= 64 * MiB, (room, vfs)
    assert abs(preallocated["capacity"] - vfs["available"]) <= MiB, (preallocated, vfs)
    assert provisioner(vm, {"op": "reclaim", **pv, "secrets": secrets}) == [{}]
    assert not exists(vm, f"{LUNS}/{name}.img")


#: Runs in the guest with the system python3 and rtslib: drops or makes storage objects as a
#: crash or another administrator would leave them.
RTS = r"""
import sys
import rtslib_fb as rts
rts.RTSRoot()
op, name = sys.argv[1], sys.argv[2]
if op == "crash":  # the provisioner died after the LV, before the backstore and the target
    for t in list(rts.FabricModule("iscsi").targets):
        if t.wwn == sys.argv[3]:
            t.delete()
    rts.BlockStorageObject(name).delete()
elif op == "make":
    rts.BlockStorageObject(name, dev=sys.argv[3])
elif op == "target":  # a target of a claim's name whose LUN 0 is another backstore
    tpg = rts.TPG(rts.Target(rts.FabricModule("iscsi"), sys.argv[3]), 1)
    rts.LUN(tpg, 0, storage_object=rts.BlockStorageObject(name))
else:
    for so in rts.RTSRoot().storage_objects:
        if so.name == name:
            so.delete()
"""


def lv(vm: VM, vg: str, name: str, field: str) -> str:
    out = vm.run(
        ["lvs", "--noheadings", "--units", "b", "--nosuffix", "-o", field, f"{vg}/{name}"],
        check=False,
    )
    return out.stdout.strip() if out.rc == 0 else ""


def lv_free(vm: VM, vg: str) -> str:
    out = vm.run(["vgs", "--noheadings", "--units", "b", "--nosuffix", "-o", "vg_free", vg])
    return out.stdout.strip()


PHASES: dict[str, float] = {}


def block_backstores(vm: VM, name: str) -> list[str]:
    return vm.sh(f"ls -d {CONFIGFS}/core/iblock_*/{name} 2>/dev/null; true").stdout.split()


def test_block_backstore_provision_mount_expand_reclaim(
    vm: VM, kubelet: Kubelet, clean: None
) -> None:
    """backstore block: the claim's LV (extent-rounded, tagged, no filesystem) under an iblock
    backstore; a crash after the LV, then provision again: the same LV, one backstore; mounted
    through the driver, written, grown by lvextend and expandfs; reclaimed twice (LV gone).
    An untagged LV of a claim's name, and a tagged one another backstore uses, are refused
    and kept, by provision and by a reclaim of an edited PV; an LV whose provision fails
    later (a target of its name with another LUN 0) is removed again, that target kept."""
    ssh, secrets = setup(vm)
    node_secret = {k: v for k, v in secrets.items() if k.startswith("node.session.")}
    SECONDS.clear()
    started = time.monotonic()
    vg = f"rigvg{uuid.uuid4().hex[:6]}"
    disk = f"{services.LUN_DIR}/{vg}.disk"
    vm.run(["modprobe", "-a", "dm_mod", "target_core_iblock"])
    vm.run(["truncate", "-s", str(256 * MiB), disk])
    loop = vm.run(["losetup", "--find", "--show", disk]).stdout.strip()
    vm.write_file("/tmp/prov-rts.py", RTS)
    rts = ["/usr/bin/python3", "/tmp/prov-rts.py"]
    try:
        vm.run(["vgcreate", "--yes", "--physicalextentsize", "4m", vg, loop])
        wanted, foreign, busy, failing = (claim(n * MiB) for n in (20, 8, 8, 8))
        wanted["size"] += 1
        name, iqn = f"pvc-{wanted['uid']}", f"{PREFIX}:pvc-{wanted['uid']}"
        # someone else's LV of a claim's name, with data; and a flexhub-tagged one in use by
        # another backstore
        other, squat = f"pvc-{foreign['uid']}", f"pvc-{busy['uid']}"
        vm.run(["lvcreate", "--yes", "-n", other, "-L", "8m", vg])
        vm.sh(f"printf FOREIGN-DATA | dd of=/dev/{vg}/{other} conv=fsync status=none")
        tag = f"flexhub:{busy['uid']}"
        vm.run(["lvcreate", "--yes", "-n", squat, "-L", "8m", "--addtag", tag, vg])
        vm.run([*rts, "make", "squatter", f"/dev/{vg}/{squat}"])
        PHASES["group"] = round(time.monotonic() - started, 1)

        params = {
            **{k: v for k, v in parameters(ssh).items() if k != "fileioDirectory"},
            "backstore": "block",
            "volumeGroup": vg,
        }
        request = {"op": "provision", "claim": wanted, "parameters": params, "secrets": secrets}
        capacity_keys(vm, ssh)
        free = int(lv_free(vm, vg))
        # CSI GetCapacity of a block class: the volume group's free bytes, as vgs says them
        room, pv = provisioner(vm, {"op": "capacity", "parameters": params, "secrets": {}}, request)
        assert room == {"capacity": free} and free > 0, (room, free)
        PHASES["provision"] = round(time.monotonic() - started, 1)
        assert "error" not in pv, pv
        assert pv["size"] == 24 * MiB  # 20 MiB + 1 byte: 21 MiB, six 4 MiB extents
        assert pv["reclaim"] == {
            "targetHost": "127.0.0.1",
            "sshUser": "root",
            "sshPort": "2222",
            "backstore": "block",
            "volumeGroup": vg,
            "claimUid": wanted["uid"],
        }
        assert pv["options"]["iqn"] == iqn
        assert lv(vm, vg, name, "lv_size,lv_tags").split() == [
            str(24 * MiB),
            f"flexhub:{wanted['uid']}",
        ]
        (store,) = block_backstores(vm, name)
        assert read(vm, store, "udev_path").strip() == f"/dev/{vg}/{name}"
        assert vm.run(["blkid", "-p", f"/dev/{vg}/{name}"], check=False).rc == 2  # no fs made
        uid = lv(vm, vg, name, "lv_uuid")

        vm.run([*rts, "crash", name, iqn])
        assert block_backstores(vm, name) == [] and not exists(vm, f"{CONFIGFS}/iscsi/{iqn}")
        refused = [{**request, "claim": c} for c in (foreign, busy)]
        # a target of the claim's name is there with another LUN 0: refused after the LV
        # was made, which goes again; that target is not this call's, and stays
        squatted = f"{PREFIX}:pvc-{failing['uid']}"
        vm.run([*rts, "target", "squatter", squatted])
        again, not_ours, in_use, late = provisioner(
            vm, request, *refused, {**request, "claim": failing}
        )
        PHASES["again"] = round(time.monotonic() - started, 1)
        assert again == pv
        assert lv(vm, vg, name, "lv_uuid") == uid  # the same LV, found again
        assert len(block_backstores(vm, name)) == 1
        assert "without the tag" in not_ours.get("error", ""), not_ours
        assert "in use by block squatter" in in_use.get("error", ""), in_use
        assert "has another LUN 0" in late.get("error", ""), late
        assert lv(vm, vg, f"pvc-{failing['uid']}", "lv_name") == ""
        assert block_backstores(vm, f"pvc-{failing['uid']}") == []
        assert exists(vm, f"{CONFIGFS}/iscsi/{squatted}/tpgt_1/lun/lun_0")
        for c in (foreign, busy):
            assert not exists(vm, f"{CONFIGFS}/iscsi/{PREFIX}:pvc-{c['uid']}")
            assert block_backstores(vm, f"pvc-{c['uid']}") == []

        directory, reply = mount_pv(kubelet, pv, node_secret, name)
        assert reply == {"status": "Success"}, reply
        write(vm, directory, "data", "on-a-logical-volume")
        PHASES["mount"] = round(time.monotonic() - started, 1)
        before = fs_size(vm, directory)
        grow = {"op": "expand", "options": pv["options"], "reclaim": pv["reclaim"]}
        assert provisioner(vm, {**grow, "size": 50 * MiB, "secrets": secrets}) == [
            {"size": 52 * MiB}  # thirteen extents
        ]
        assert lv(vm, vg, name, "lv_size") == str(52 * MiB)
        PHASES["expand"] = round(time.monotonic() - started, 1)
        options = {
            **pv["options"],
            "backend": "iscsi",
            "kubernetes.io/fsType": "ext4",
            "kubernetes.io/readwrite": "rw",
            "kubernetes.io/pvOrVolumeName": name,
        }
        reply = kubelet.call(
            "expandfs",
            ["expandfs", go_json(options), "", directory, str(52 * MiB), str(24 * MiB)],
        )
        assert reply == {"status": "Success"}, reply
        assert fs_size(vm, directory) > before + 24 * MiB
        PHASES["expandfs"] = round(time.monotonic() - started, 1)
        assert read(vm, directory, "data") == "on-a-logical-volume"
        assert kubelet.unmount(directory) == {"status": "Success"}
        assert sessions(vm, iqn) == []
        PHASES["unmount"] = round(time.monotonic() - started, 1)

        gone = {
            "op": "reclaim",
            "options": pv["options"],
            "reclaim": {**pv["reclaim"], "onDelete": "delete"},
            "secrets": secrets,
        }
        # an iqn edited to name another claim is refused before ssh (the record's claimUid);
        # one whose record was edited to match reaches the target host, which refuses it
        edited = {**gone, "options": {**pv["options"], "iqn": f"{PREFIX}:{other}"}}
        forged = {**edited, "reclaim": {**gone["reclaim"], "claimUid": foreign["uid"]}}
        first, then, mismatched, tampered = provisioner(vm, gone, gone, edited, forged)
        PHASES["reclaim"] = round(time.monotonic() - started, 1)
        assert first == {} and then == {}  # the second finds it gone: success
        assert lv(vm, vg, name, "lv_name") == ""
        assert block_backstores(vm, name) == []
        assert not exists(vm, f"{CONFIGFS}/iscsi/{iqn}")
        assert iqn not in vm.read_file(SAVED).decode()
        assert "claimUid" in mismatched.get("error", ""), mismatched
        assert "without the tag" in tampered.get("error", ""), tampered
        # the refused LVs are untouched: data, tag, the other backstore
        assert vm.sh(f"head -c 12 /dev/{vg}/{other}").stdout == "FOREIGN-DATA"
        assert lv(vm, vg, squat, "lv_tags") == tag
        assert len(block_backstores(vm, "squatter")) == 1
        print(
            f"iscsi block provisioning: {time.monotonic() - started:.1f} s in all; "
            f"provisioner calls (s): {json.dumps(SECONDS)}; phases (s): {json.dumps(PHASES)}"
        )
    finally:
        vm.run([*rts, "drop", "squatter"], check=False)
        vm.run(["vgremove", "--yes", "--force", vg], check=False)
        vm.run(["losetup", "-d", loop], check=False)
        vm.run(["rm", "-f", disk], check=False)


def pe_ranges(vm: VM, vg: str, name: str) -> list[str]:
    """The physical extents an LV's segments use (``/dev/loop3:0-1``), in order."""
    return lv(vm, vg, name, "seg_pe_ranges").split()


def plant(vm: VM, device: str, offset: int, text: str) -> None:
    vm.sh(f"printf {text} | dd of={device} bs=1M seek={offset // MiB} conv=fsync status=none")


def seen(vm: VM, device: str, offset: int, length: int) -> str:
    """``length`` bytes of ``device`` from ``offset`` (a MiB multiple), as text (NULs kept)."""
    out = vm.sh(
        f"dd if={device} bs=1M skip={offset // MiB} count=1 status=none | head -c {length}"
        " | od -An -tx1 -v | tr -d ' \\n'"
    ).stdout
    return bytes.fromhex(out).decode("latin-1")


def test_block_claims_never_read_an_earlier_claims_data(vm: VM, clean: None) -> None:
    """A claim's LV over the extents a reclaimed claim's LV used reads zeros, not that
    claim's data (reclaim zeroes an LV before lvremove; lvcreate alone zeroes 4 KiB); the
    range an expansion adds over extents freed outside flexhub reads zeros; an expansion cut
    short after lvextend (its tag left) zeroes that range when it is asked again."""
    ssh, secrets = setup(vm)
    started = time.monotonic()
    vg = f"rigvg{uuid.uuid4().hex[:6]}"
    disk = f"{services.LUN_DIR}/{vg}.disk"
    vm.run(["modprobe", "-a", "dm_mod", "target_core_iblock"])
    vm.run(["truncate", "-s", str(64 * MiB), disk])
    loop = vm.run(["losetup", "--find", "--show", disk]).stdout.strip()
    secret = "TENANT-A-SECRET"
    try:
        vm.run(["vgcreate", "--yes", "--physicalextentsize", "4m", vg, loop])
        params = {
            **{k: v for k, v in parameters(ssh).items() if k != "fileioDirectory"},
            "backstore": "block",
            "volumeGroup": vg,
        }
        a, b = claim(8 * MiB), claim(8 * MiB)
        made = {"op": "provision", "parameters": params, "secrets": secrets}
        (pv_a,) = provisioner(vm, {**made, "claim": a})
        assert "error" not in pv_a, pv_a
        lv_a = f"/dev/{vg}/pvc-{a['uid']}"
        plant(vm, lv_a, MiB, secret)  # what claim a's node wrote
        where = pe_ranges(vm, vg, f"pvc-{a['uid']}")
        gone = {"op": "reclaim", "options": pv_a["options"], "secrets": secrets,
                "reclaim": {**pv_a["reclaim"], "onDelete": "delete", "size": str(8 * MiB)}}  # fmt: skip
        reclaimed, pv_b = provisioner(vm, gone, {**made, "claim": b})
        assert reclaimed == {} and "error" not in pv_b, pv_b
        name_b = f"pvc-{b['uid']}"
        lv_b = f"/dev/{vg}/{name_b}"
        assert [r.split(":")[1] for r in pe_ranges(vm, vg, name_b)] == [
            r.split(":")[1] for r in where
        ]  # the very extents claim a had
        assert seen(vm, lv_b, MiB, len(secret)) == "\0" * len(secret)

        # extents freed outside flexhub (another LV of the group, written, removed)
        vm.run(["lvcreate", "--yes", "-n", "scratch", "-L", "8m", vg])
        plant(vm, f"/dev/{vg}/scratch", MiB, secret)
        vm.run(["lvremove", "--yes", f"{vg}/scratch"])
        grow = {"op": "expand", "options": pv_b["options"], "reclaim": pv_b["reclaim"],
                "secrets": secrets}  # fmt: skip
        assert provisioner(vm, {**grow, "size": 16 * MiB}) == [{"size": 16 * MiB}]
        assert seen(vm, lv_b, 9 * MiB, len(secret)) == "\0" * len(secret)

        # an expansion cut short after lvextend: the LV is at its size, the tag is left
        vm.run(["lvcreate", "--yes", "-n", "scratch", "-L", "8m", vg])
        plant(vm, f"/dev/{vg}/scratch", MiB, secret)
        vm.run(["lvremove", "--yes", f"{vg}/scratch"])
        vm.run(["lvchange", "--addtag", f"flexhub-zero-from:{16 * MiB}", f"{vg}/{name_b}"])
        vm.run(["lvextend", "--yes", "-L", "24m", f"{vg}/{name_b}"])
        assert seen(vm, lv_b, 17 * MiB, len(secret)) == secret  # what the crash left
        assert provisioner(vm, {**grow, "size": 24 * MiB}) == [{"size": 24 * MiB}]
        assert seen(vm, lv_b, 17 * MiB, len(secret)) == "\0" * len(secret)
        assert lv(vm, vg, name_b, "lv_tags") == f"flexhub:{b['uid']}"
        last = {**gone, "options": pv_b["options"],
                "reclaim": {**pv_b["reclaim"], "onDelete": "delete", "size": str(24 * MiB)}}  # fmt: skip
        assert provisioner(vm, last) == [{}]
        assert lv(vm, vg, name_b, "lv_name") == ""
        print(
            f"iscsi block zeroing: {time.monotonic() - started:.1f} s in all; "
            f"provisioner calls (s): {json.dumps(SECONDS)}"
        )
    finally:
        vm.run(["vgremove", "--yes", "--force", vg], check=False)
        vm.run(["losetup", "-d", loop], check=False)
        vm.run(["rm", "-f", disk], check=False)
