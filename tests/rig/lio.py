"""Guest-side driver of the kernel LIO iSCSI target (runs in the guest under
/usr/bin/python3, which has Debian's python3-rtslib-fb).

The rig agent imports this module and runs ``ACTIONS`` in-process (rtslib is
imported once per VM); it also works as a script:
``/usr/bin/python3 lio.py ACTION 'JSON-SPEC'`` prints a JSON result.

Actions:
  create  {"iqn", "luns": [{"path", "size", "pr"?}], "portals": ["ip:port"],
           "session_chap": {"userid", "password"} | null,
           "discovery_chap": {"userid", "password"} | null,
           "initiators": ["iqn..."] | null}
          ``initiators`` null means demo mode (any initiator; with session CHAP
          the credentials are set on the TPG). ``"pr": false`` turns off
          SCSI-3 persistent reservations on that LUN (emulate_pr=0).
  delete  {"iqn"}   (also clears discovery CHAP when no target is left)
  resize  {"iqn", "lun", "size"}   (backing file grown by the caller)
  portal_down {"iqn", "portal"}  /  portal_up {"iqn", "portal"}
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from rtslib_fb import (  # type: ignore[import-not-found]
    LUN,
    TPG,
    FabricModule,
    FileIOStorageObject,
    MappedLUN,
    NetworkPortal,
    NodeACL,
    RTSRoot,
    Target,
)


def _split(portal: str) -> tuple[str, int]:
    ip, _, port = portal.rpartition(":")
    return ip.strip("[]"), int(port or 3260)


def _so_name(iqn: str, index: int) -> str:
    return f"{iqn.rsplit(':', 1)[-1]}-lun{index}"[:60].replace(".", "_")


def _tpg(iqn: str) -> TPG:
    return TPG(Target(FabricModule("iscsi"), iqn, mode="lookup"), 1, mode="lookup")


def create(spec: dict[str, Any]) -> dict[str, Any]:
    RTSRoot()
    fabric = FabricModule("iscsi")
    target = Target(fabric, spec["iqn"], mode="create")
    tpg = TPG(target, 1, mode="create")
    luns = []
    for i, lun in enumerate(spec["luns"]):
        so = FileIOStorageObject(
            _so_name(spec["iqn"], i), dev=lun["path"], size=int(lun["size"]), write_back=True
        )
        if not lun.get("pr", True):
            so.set_attribute("emulate_pr", "0")  # only possible before the LUN is exported
        luns.append(LUN(tpg, i, storage_object=so))
    for portal in spec["portals"]:
        ip, port = _split(portal)
        NetworkPortal(tpg, ip, port, mode="create")
    chap = spec.get("session_chap")
    initiators = spec.get("initiators")
    if initiators:
        tpg.set_attribute("generate_node_acls", "0")
        for name in initiators:
            acl = NodeACL(tpg, name, mode="create")
            for lun in luns:
                MappedLUN(acl, lun.lun, tpg_lun=lun)
            if chap:
                acl.chap_userid = chap["userid"]
                acl.chap_password = chap["password"]
    else:
        tpg.set_attribute("generate_node_acls", "1")
        tpg.set_attribute("cache_dynamic_acls", "1")
        tpg.set_attribute("demo_mode_write_protect", "0")
        if chap:
            tpg.chap_userid = chap["userid"]
            tpg.chap_password = chap["password"]
    tpg.set_attribute("authentication", "1" if chap else "0")
    dchap = spec.get("discovery_chap")
    if dchap:
        fabric.discovery_userid = dchap["userid"]
        fabric.discovery_password = dchap["password"]
        fabric.discovery_enable_auth = True
    else:
        fabric.clear_discovery_auth_settings()
    tpg.enable = True
    return {"iqn": spec["iqn"], "luns": len(luns)}


def delete(spec: dict[str, Any]) -> dict[str, Any]:
    RTSRoot()
    fabric = FabricModule("iscsi")
    sos: list[Any] = []
    for target in list(fabric.targets):
        if spec.get("iqn") in (None, target.wwn):
            for tpg in target.tpgs:
                sos.extend(lun.storage_object for lun in tpg.luns)
            target.delete()
    for so in sos:
        so.delete()
    if not list(fabric.targets):
        fabric.clear_discovery_auth_settings()
    return {"deleted": len(sos)}


def resize(spec: dict[str, Any]) -> dict[str, Any]:
    tpg = _tpg(spec["iqn"])
    lun = next(lun for lun in tpg.luns if lun.lun == int(spec["lun"]))
    so = lun.storage_object
    # fd_dev_size is read on every READ CAPACITY for a regular backing file.
    with open(f"{so.path}/control", "w") as fh:
        fh.write(f"fd_dev_size={int(spec['size'])}")
    return {"size": int(spec["size"])}


def portal_down(spec: dict[str, Any]) -> dict[str, Any]:
    tpg = _tpg(spec["iqn"])
    ip, port = _split(spec["portal"])
    for np in tpg.network_portals:
        if np.ip_address == ip and np.port == port:
            np.delete()
    # Kill established connections to that portal too (CONFIG_INET_DIAG_DESTROY).
    subprocess.run(
        ["ss", "-K", "src", ip, "sport", "=", str(port)], check=False, capture_output=True
    )
    return {"down": spec["portal"]}


def portal_up(spec: dict[str, Any]) -> dict[str, Any]:
    tpg = _tpg(spec["iqn"])
    ip, port = _split(spec["portal"])
    NetworkPortal(tpg, ip, port, mode="any")
    return {"up": spec["portal"]}


ACTIONS = {
    "create": create,
    "delete": delete,
    "resize": resize,
    "portal_down": portal_down,
    "portal_up": portal_up,
}


def main() -> None:
    action, spec = sys.argv[1], json.loads(sys.argv[2] if len(sys.argv) > 2 else "{}")
    print(json.dumps(ACTIONS[action](spec)))


if __name__ == "__main__":
    main()
