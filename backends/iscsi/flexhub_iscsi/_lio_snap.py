"""Part of the remote program (:mod:`flexhub_iscsi._lio_remote`): snapshots of LUNs, and the
data of a LUN restored from a snapshot or cloned from another LUN.

A snapshot is a copy kept on the target host where no volume's options can name it: no
storage object or target serves it, and its name (``snap-<uid>``) is never a claim's
(``pvc-<uid>``), the only names a PV's ``iqn`` can lead to.

* fileio: the file ``<fileioDirectory>/snap-<uid>.img`` (0600), a reflink or a full copy of
  the LUN's file (:mod:`flexhub_iscsi._lio_files`; always a full copy of a preallocated LUN's,
  ``"sparse": false``, whose own blocks a reflink would share); it counts in the directory's room
  (:mod:`flexhub_iscsi._lio_room`) at the blocks it holds (it is never written).
* block: the logical volume ``snap-<uid>`` in the LUN's volume group, of the LUN's size, tagged
  ``flexhub-snapshot:<uid>``, a full copy of the LV (not an LVM snapshot: a classic one is
  tied to its origin, which could then be neither reclaimed nor zeroed without it, slows
  every write of the origin and must be as large as it to stay valid; a thin one needs a thin
  pool, which these LVs are not in). While the copy runs the LV also carries the tag
  ``flexhub-copying``: a copy cut short is made again by the retry, never used.

A restore or a clone makes the claim's file or LV the same way (a copy of the snapshot's or of
the source LUN's, grown to the claim's size), then provisions the claim on it as
``provision`` does. Deleting a snapshot removes its file, or zeroes its LV whole before
``lvremove`` (no claim ever reads another's data); gone is success.

Standard library only: this text runs on the target host (python3 3.7 or later).
"""

from __future__ import annotations

import os
import sys
from typing import Any

if __name__ != "__main__":  # imported on the host; sent, the parts' texts come before this
    from flexhub_iscsi._lio_errors import Refused
    from flexhub_iscsi._lio_files import (
        check_directory,
        copy_device,
        copy_into,
        file_size,
        open_source,
        ratio,
        remove_file,
    )
    from flexhub_iscsi._lio_lvm import (
        activate,
        check_ours,
        delete_lv,
        device_of,
        logical_volume,
        lvm,
        tag_of,
        volume_group,
        zero,
        zero_pending,
    )
    from flexhub_iscsi._lio_room import check_room

#: The tag of an LV whose copy is not complete yet.
COPYING_TAG = "flexhub-copying"


def snapshot(spec: dict[str, Any]) -> dict[str, Any]:
    """Copy the claim's file or LV to its snapshot (``spec["snapshot"]``); one made already
    is answered as it is (``how``: ``exists``)."""
    if spec.get("backstore") == "block":
        source = {"vg": spec["vg"], "name": spec["name"]}
        dest = {"vg": spec["vg"], "name": spec["snapshot"]}
        lv = source_lv(source, "logical volume")
        size, how = copy_lv(source, lv, dest, int(lv["lv_size"]))
        return {"size": size, "how": how}
    directory, name = spec["directory"], spec["snapshot"] + ".img"
    check_directory(directory)
    found = file_size(directory, name)
    if found is not None:
        return {"size": found, "how": "exists"}
    src = open_source(directory, spec["file"], "the LUN's file")
    try:
        size = os.fstat(src).st_size
        if ratio(spec) > 0:  # 0: a PV from before room accounting, not counted
            check_room(directory, name, size, ratio(spec), True)
        # a preallocated LUN's (sparse false) is a full copy: a reflink would share its blocks
        how = copy_into(src, directory, name, size, True, reflink=spec.get("sparse", True))
    finally:
        os.close(src)
    return {"size": size, "how": how}


def delete_snapshot(spec: dict[str, Any]) -> dict[str, Any]:
    """Remove the snapshot's file, or zero and remove its LV; gone is success."""
    if spec.get("backstore") == "block":
        gone = delete_lv({"vg": spec["vg"], "name": spec["snapshot"]})
    else:
        gone = remove_file(spec["directory"], spec["snapshot"] + ".img")
    return {"deleted": [spec["snapshot"]] if gone else []}


def source_lv(spec: dict[str, Any], what: str) -> Any:
    """The LV a copy is made of: there, tagged as flexhub's, whole (not being copied)."""
    lv = logical_volume(spec)
    if lv is None:
        raise Refused("{} {}/{} does not exist".format(what, spec["vg"], spec["name"]))
    check_ours(spec, lv)
    if COPYING_TAG in lv["lv_tags"].split(","):
        raise Refused("{} {}/{} is not a whole copy yet".format(what, spec["vg"], spec["name"]))
    return lv


def copy_lv(source: dict[str, Any], lv: Any, dest: dict[str, Any], size: int) -> tuple[int, str]:
    """Make the LV ``dest`` (at least ``size`` bytes, in whole extents, tagged as flexhub's)
    a copy of ``source``'s data: its size and ``"copy"``, or ``"exists"`` when a whole copy
    is there already. A copy that fails is zeroed and removed again.

    One still tagged as being copied is what a killed call left: copied again from scratch
    over it, first grown to what is needed now (the source, or the claim, may have grown
    since), and zeroed and removed as this call's own if this copy fails too. A range of the
    source an expansion has not zeroed yet (:func:`zero_pending`) was never the source's
    data: the copy holds zeros there."""
    extent = volume_group(dest)
    where = "{}/{}".format(dest["vg"], dest["name"])
    extents = max(1, -(-max(size, int(lv["lv_size"])) // extent))
    found = logical_volume(dest)
    if found is not None:
        check_ours(dest, found)
        if COPYING_TAG not in found["lv_tags"].split(","):
            return int(found["lv_size"]), "exists"
        if int(found["lv_size"]) < extents * extent:
            lvm("extend " + where, "lvextend", "--extents", str(extents), "--", where)
    else:
        lvm(
            "create " + where,
            "lvcreate", "--yes", "--extents", str(extents), "--name", dest["name"],
            "--addtag", tag_of(dest), "--addtag", COPYING_TAG, "--activate", "y",
            "--setactivationskip", "n", "--zero", "y", "--wipesignatures", "y",
            "--", dest["vg"],
        )  # fmt: skip
    found = logical_volume(dest)
    if found is None:
        raise Refused(f"create {where}: lvcreate left no logical volume")
    try:
        activate(source, lv)
        found = activate(dest, found)
        length = int(lv["lv_size"])
        pending = zero_pending(lv)
        data = length if pending is None else min(pending, length)
        copy_device(device_of(source), device_of(dest), data)
        if data < length:  # exclusive: the copy is not served yet
            zero(device_of(dest), data, length - data, shared=False)
        lvm("mark " + where + " whole", "lvchange", "--deltag", COPYING_TAG, "--", where)
    except BaseException:
        # it holds part of the source's data: zeroed before its extents are freed
        try:
            delete_lv(dest)
        except Exception as exc:
            sys.stderr.write(f"clean-up failed: {type(exc).__name__}: {exc}\n")
        raise
    return int(found["lv_size"]), "copy"


def prepare_copy(spec: dict[str, Any]) -> tuple[bool, str]:
    """The claim's file or LV made as a copy of ``spec["source"]`` (a snapshot's or another
    claim's), grown to the claim's size: whether this call made it, and how. One there
    already (a retry) is left to ``provision``, which checks it."""
    source = spec["source"]
    if source["name"] == spec["name"]:
        raise Refused("a volume cannot be made from itself")
    what = "snapshot" if source["name"].startswith("snap-") else "source volume"
    if spec.get("backstore") == "block":
        dest = {"vg": spec["vg"], "name": spec["name"]}
        found = logical_volume(dest)
        if found is not None and COPYING_TAG not in found["lv_tags"].split(","):
            return False, "exists"
        lv = source_lv(source, what)
        if int(lv["lv_size"]) > spec["size"]:
            raise Refused(
                "{} {}/{} holds {} bytes, more than the claim's {}".format(
                    what, source["vg"], source["name"], lv["lv_size"], spec["size"]
                )
            )
        _, how = copy_lv(source, lv, dest, spec["size"])
        return how != "exists", how
    directory, name = spec["directory"], spec["file"]
    check_directory(directory)
    if file_size(directory, name) is not None:
        return False, "exists"
    src = open_source(source["directory"], source["name"] + ".img", what)
    try:
        size = os.fstat(src).st_size
        if size > spec["size"]:
            raise Refused(
                "{} {}/{}.img holds {} bytes, more than the claim's {}".format(
                    what, source["directory"], source["name"], size, spec["size"]
                )
            )
        check_room(directory, name, spec["size"], ratio(spec), spec["sparse"])
        how = copy_into(src, directory, name, spec["size"], spec["sparse"])
    finally:
        os.close(src)
    return True, how
