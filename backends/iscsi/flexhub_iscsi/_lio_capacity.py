"""Part of the remote program (:mod:`flexhub_iscsi._lio_remote`): its read-only action
``room``, for CSI's ``GetCapacity`` (:mod:`flexhub_iscsi._capacity` asks it).

fileio: what a new LUN file of the class can promise now by the room rule that refuses
claims (:mod:`flexhub_iscsi._lio_room`): ``(available + occupied) x overcommit - promised``,
no more than ``available`` for a preallocating (``sparse: "false"``) class, never below 0. An
overcommitted class is answered the promises it can still make, which may exceed the free
bytes. block: the volume group's free bytes (``vg_free``: whole extents; an LV may span
physical volumes, so that is also the largest LUN).

Standard library only: this text runs on the target host (python3 3.7 or later).
"""

from __future__ import annotations

import json
from typing import Any

if __name__ != "__main__":  # imported on the host; sent, the parts' texts come before this
    from flexhub_iscsi._lio_errors import Refused
    from flexhub_iscsi._lio_files import check_directory
    from flexhub_iscsi._lio_lvm import lvm
    from flexhub_iscsi._lio_room import measure


def room(spec: dict[str, Any]) -> dict[str, Any]:
    """Read only: the bytes a new LUN of the class can have now (``available``)."""
    if spec.get("backstore") == "block":
        out = lvm(
            "volumeGroup " + spec["vg"],
            "vgs", "--reportformat", "json", "--units", "b", "--nosuffix",
            "-o", "vg_name,vg_free", "--", spec["vg"],
        )  # fmt: skip
        for vg in json.loads(out)["report"][0]["vg"]:
            if vg["vg_name"] == spec["vg"]:
                return {"available": int(vg["vg_free"])}
        raise Refused("volume group {} not found".format(spec["vg"]))
    directory = spec["directory"]
    check_directory(directory)
    promised, occupied, available = measure(directory, None)
    allowed = int((available + occupied) * float(spec["overcommit"])) - promised
    if not spec["sparse"]:
        allowed = min(allowed, available)
    return {"available": max(0, allowed)}
