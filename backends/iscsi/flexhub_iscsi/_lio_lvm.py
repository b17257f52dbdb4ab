"""Part of the remote program (:mod:`flexhub_iscsi._lio_remote`): the logical volumes of
``backstore: block`` and their zeroing.

``lvm`` and ``blkdiscard`` run with an argument list (no shell), stdin from /dev/null, a
fixed environment and a timeout. An LV this program makes is tagged ``flexhub:<claim uid>``;
one of the claim's name without that tag is someone else's, and is never used, resized,
zeroed or removed. Zeroing and its bounds: see :mod:`flexhub_iscsi._lio_remote`.

Standard library only: this text runs on the target host (python3 3.7 or later).
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
from typing import Any

if __name__ != "__main__":  # imported on the host; sent, the parts' texts come before this
    from flexhub_iscsi._lio_errors import Refused

#: The LVM binaries' usual homes (root's: nothing from a directory others can write).
LVM = ("/usr/sbin/lvm", "/sbin/lvm")


LVM_TIMEOUT = 60


LVM_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C", "LVM_SUPPRESS_FD_WARNINGS": "1"}


#: util-linux's blkdiscard (2.36 or later: it opens the device exclusively unless --force).
BLKDISCARD = ("/usr/sbin/blkdiscard", "/sbin/blkdiscard")


#: Zeroing's bound: this many seconds, plus the bytes at ZERO_RATE (a slow disk's pace).
ZERO_BASE = 60


ZERO_RATE = 20 * 1024 * 1024


#: The tag an expanded LV carries while the range from <bytes> on is not zeroed yet.
ZERO_TAG = "flexhub-zero-from:"


def lvm(step: str, *args: str) -> str:
    """Run ``lvm <args>``; its stdout.

    :raises Refused: one line naming the step and lvm's last message.
    """
    binary = next((b for b in LVM if os.path.isfile(b)), "")
    if not binary:
        raise Refused("no lvm on the target host (install lvm2) for backstore block")
    try:
        done = subprocess.run(
            [binary, *args],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            env=LVM_ENV,
            timeout=LVM_TIMEOUT,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise Refused(f"{step}: lvm {args[0]} timed out after {LVM_TIMEOUT} s") from None
    if done.returncode != 0:
        lines = [x.strip() for x in done.stderr.decode("utf-8", "replace").splitlines()]
        lines = [x for x in lines if x and not x.startswith("WARNING")]
        why = "; ".join(lines)[:300] or f"exit status {done.returncode}"
        raise Refused(f"{step}: lvm {args[0]} failed: {why}")
    return done.stdout.decode("utf-8", "replace")


def zero_seconds(length: int) -> int:
    """How long zeroing ``length`` bytes may take (the provisioner's ssh bound adds this)."""
    return ZERO_BASE + length // ZERO_RATE


def zero(path: str, offset: int, length: int, shared: bool) -> None:
    """Write zeros over ``length`` bytes of the block device ``path`` from ``offset``
    (``blkdiscard --zeroout``: the device's WRITE ZEROES, else the kernel writes them).

    Opened exclusively (a mounted or otherwise held device is refused) unless ``shared``: an
    expansion's new range, on an LV that LIO's iblock holds.

    :raises Refused: blkdiscard failed, or did not finish within :func:`zero_seconds`.
    """
    binary = next((b for b in BLKDISCARD if os.path.isfile(b)), "")
    if not binary:
        raise Refused("no blkdiscard on the target host (install util-linux) for backstore block")
    argv = [binary, "--zeroout", "--offset", str(offset), "--length", str(length)]
    if shared:
        argv.append("--force")
    bound = zero_seconds(length)
    try:
        done = subprocess.run(
            [*argv, "--", path],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            env=LVM_ENV,
            timeout=bound,
            check=False,
        )
    except subprocess.TimeoutExpired:  # killed: the LV stays, the next call zeroes again
        raise Refused(f"zero {path}: blkdiscard timed out after {bound} s") from None
    if done.returncode != 0:
        lines = [x.strip() for x in done.stderr.decode("utf-8", "replace").splitlines()]
        lines = [x for x in lines if x and "contains existing" not in x]
        why = "; ".join(lines)[:300] or f"exit status {done.returncode}"
        raise Refused(f"zero {path}: blkdiscard failed: {why}")


def tag_of(spec: dict[str, Any]) -> str:
    """``flexhub:<uid>`` for a claim's LV (``pvc-<uid>``), ``flexhub-snapshot:<uid>`` for a
    snapshot's (``snap-<uid>``)."""
    name: str = spec["name"]
    if name.startswith("snap-"):
        return "flexhub-snapshot:" + name[len("snap-") :]
    return "flexhub:" + name[len("pvc-") :]


def volume_group(spec: dict[str, Any]) -> int:
    """The extent size of the class's volume group (bytes)."""
    out = lvm(
        "volumeGroup " + spec["vg"],
        "vgs", "--reportformat", "json", "--units", "b", "--nosuffix",
        "-o", "vg_name,vg_extent_size", "--", spec["vg"],
    )  # fmt: skip
    for vg in json.loads(out)["report"][0]["vg"]:
        if vg["vg_name"] == spec["vg"]:
            return int(vg["vg_extent_size"])
    raise Refused("volume group {} not found".format(spec["vg"]))


def logical_volume(spec: dict[str, Any]) -> Any:
    """The claim's LV in the volume group (a dict of lvs fields), or ``None``."""
    out = lvm(
        "logical volume " + spec["name"],
        "lvs", "--reportformat", "json", "--units", "b", "--nosuffix",
        "-o", "lv_name,lv_size,lv_tags,lv_attr,lv_kernel_major,lv_kernel_minor",
        "--", spec["vg"],
    )  # fmt: skip
    for lv in json.loads(out)["report"][0]["lv"]:
        if lv["lv_name"] == spec["name"]:
            return lv
    return None


def check_ours(spec: dict[str, Any], lv: Any) -> None:
    where = "{}/{}".format(spec["vg"], spec["name"])
    if tag_of(spec) not in lv["lv_tags"].split(","):
        raise Refused(
            f"logical volume {where} exists without the tag {tag_of(spec)}: "
            "not flexhub's, left as it is"
        )
    if lv["lv_attr"][:1] not in ("-", "V"):
        raise Refused(f"logical volume {where} is not a plain or thin volume")


def lv_path(spec: dict[str, Any]) -> str:
    """The LV's path, as its iblock backstore names it."""
    return "/dev/{}/{}".format(spec["vg"], spec["name"])


def device_of(spec: dict[str, Any]) -> str:
    """The LV's device node, which :func:`activate` stats and compares with the LV's
    major:minor before it is exported or zeroed (a seam: the host tests point it at a real
    loop device, since the path the backstore names is only an LV's on a target host)."""
    return lv_path(spec)


def activate(spec: dict[str, Any], lv: Any) -> Any:
    """The LV active and its device node that LV's (major:minor); the LV's fields."""
    if lv["lv_attr"][4:5] != "a":
        lvm("activate " + spec["name"], "lvchange", "--activate", "y", "--yes", "--",
            "{}/{}".format(spec["vg"], spec["name"]))  # fmt: skip
        lv = logical_volume(spec)
        if lv is None or lv["lv_attr"][4:5] != "a":
            raise Refused("activate {}: the logical volume is not active".format(spec["name"]))
    path = device_of(spec)
    try:
        st = os.stat(path)
    except OSError as exc:
        raise Refused(f"{path}: {exc.strerror}") from None
    want = os.makedev(int(lv["lv_kernel_major"]), int(lv["lv_kernel_minor"]))
    if not stat.S_ISBLK(st.st_mode) or st.st_rdev != want:
        raise Refused(f"{path} is not the device of that logical volume")
    return lv


def check_closed(spec: dict[str, Any], lv: Any) -> None:
    if lv["lv_attr"][5:6] == "o":
        raise Refused(
            "logical volume {}/{} is open (mounted or in use): not removed".format(
                spec["vg"], spec["name"]
            )
        )


def delete_lv(spec: dict[str, Any], wipe: bool = True) -> bool:
    """Zero the claim's LV whole, then remove it; ``False`` when it is gone already.

    ``wipe`` is ``False`` only for an LV the failing call itself just made: no PV names it
    yet, so no node ever wrote to it. A zeroing that fails, times out or is killed never gets
    to ``lvremove``: the LV stays, and the retry zeroes it again."""
    volume_group(spec)  # a missing group is an error, never "gone": its disks may be away
    lv = logical_volume(spec)
    if lv is None:
        return False
    check_ours(spec, lv)
    check_closed(spec, lv)
    where = "{}/{}".format(spec["vg"], spec["name"])
    if wipe:
        lv = activate(spec, lv)  # the device node, checked to be this LV's
        zero(device_of(spec), 0, int(lv["lv_size"]), shared=False)  # exclusive: no one has it
    lvm("remove " + where, "lvremove", "--yes", "--", where)
    return True


def zero_pending(lv: Any) -> Any:
    """Where the LV's unzeroed range begins (an expansion's tag), or ``None``."""
    starts = [
        int(tag[len(ZERO_TAG) :])
        for tag in lv["lv_tags"].split(",")
        if tag.startswith(ZERO_TAG) and tag[len(ZERO_TAG) :].isdigit()
    ]
    return min(starts) if starts else None
