"""The program the provisioner runs on an iSCSI target host (Linux LIO), over SSH.

It is never imported by flexhub: :func:`flexhub_iscsi._lio_ssh.remote_program` reads this
file's text (after its parts') and sends it on the standard input of the loader
:data:`flexhub_iscsi._lio.REMOTE_COMMAND` (``/usr/bin/python3 -I -c`` on the target host, root,
with ``python3-rtslib-fb``, the library ``targetcli`` is built on), which runs it: :func:`serve`
then reads requests from the same stdin, one JSON line each, and answers each with one line on
stdout, :data:`MARK` followed by JSON (``{"ok": ...}`` or ``{"error": "one line"}``, after the
request's ``id`` when it gave one). It ends
when stdin ends, after any refusal, or when no request has come for :data:`IDLE` seconds.
Nothing of a request is on any command line there or here: CHAP values travel on stdin only.

Every request that changes something runs under one lock file (``/run/flexhub-lio.lock``), so
two provisioner workers never edit the LIO configuration (or its saved copy) at once, nor both
take the last room (a request waits for it as long as its ``wait`` says, then is refused
unrun), and ends with a save of its claim's objects into the saved configuration (the file
``saveconfig`` writes: :mod:`flexhub_iscsi._lio_save`) so that a reboot of the target host
keeps the LUNs. A fileio file made or grown must fit the directory's room
(:mod:`flexhub_iscsi._lio_room`, the class's ``overcommit``). Actions (all idempotent):

``provision``  the fileio backing file (created 0600 in a root-owned directory no one else
    can write, never through a symlink) or the logical volume (``"backstore": "block"``), its
    storage object, the target with TPG 1, LUN 0, the network portals, the ACLs (or demo
    mode) and CHAP; whatever exists already is kept when it matches, and refused when it does
    not (another file behind the storage object, an LV of that name not tagged as ours or in
    use by something else).
``delete``     the target, the storage object and the backing file or LV (zeroed first);
    gone is success. Every check runs before anything is deleted.
``expand``     grows the file and the storage object's size, or the LV (never shrinks; the
    range ``lvextend`` adds is zeroed before the new size is answered).
``room``       read only, without the lock: the room of a class (:mod:`~._lio_capacity`).

Logical volumes: ``lvm`` and ``blkdiscard`` run with an argument list (no shell), stdin from
/dev/null, a fixed environment and a timeout. An LV this program makes is tagged
``flexhub:<claim uid>``; one of the claim's name without that tag is someone else's, and is
never used, resized, zeroed or removed. No claim ever reads another's data: a reclaimed LV is
zeroed whole (``blkdiscard --zeroout``) before ``lvremove`` frees its extents, so the extents
a later ``lvcreate`` or ``lvextend`` is given read zeros when the volume group is flexhub's
alone; the range an ``lvextend`` adds is zeroed too (extents freed some other way). A zeroing
that fails, times out or is killed leaves the LV (and, for an expansion, a tag naming where
the unzeroed range begins): the retry zeroes again. ``lvcreate`` zeroes an LV's first blocks
and wipes signatures; the node makes the filesystem.
"""

# This file runs under the target host's python3 (3.7 or later), standard library and
# rtslib-fb only. It is sent after the texts of its parts (:data:`flexhub_iscsi._lio.
# REMOTE_PARTS`: the refusals, the room check, the saved configuration, the logical volumes),
# whose names it uses as its own; imported on the host (the tests), it imports them.

from __future__ import annotations

import errno
import fcntl
import glob
import json
import os
import signal
import stat
import sys
import time
from typing import Any

if __name__ != "__main__":  # imported on the host; sent, the parts' texts come before this
    from flexhub_iscsi._lio_capacity import room
    from flexhub_iscsi._lio_errors import NoRoomLeft, Refused
    from flexhub_iscsi._lio_files import check_directory, grow, open_file, ratio
    from flexhub_iscsi._lio_lvm import (
        ZERO_TAG,
        activate,
        check_closed,
        check_ours,
        delete_lv,
        device_of,
        logical_volume,
        lv_path,
        lvm,
        tag_of,
        volume_group,
        zero,
        zero_pending,
    )
    from flexhub_iscsi._lio_room import check_room
    from flexhub_iscsi._lio_save import SAVE_FILE, merged, read_saved, stamp, write_saved
    from flexhub_iscsi._lio_snap import delete_snapshot, prepare_copy, snapshot

MARK = "FLEXHUB-LIO "
#: configfs's storage objects: ``core/<kind>_<index>/<name>``.
CORE = "/sys/kernel/config/target/core"
LOCK = "/run/flexhub-lio.lock"
#: Seconds :func:`serve` waits for a request before the program ends (the provisioner gives
#: a kept connection no request after 60 s idle).
IDLE = 120


#: The request being answered: its ``id`` (echoed first in its answer, so that the provisioner
#: never takes another request's answer for its own), if it gave one.
ANSWERING = {"id": ""}


def answer(payload: dict[str, Any]) -> None:
    if ANSWERING["id"]:
        payload = {"id": ANSWERING["id"], **payload}
    sys.stdout.write(MARK + json.dumps(payload) + "\n")
    sys.stdout.flush()


def rts() -> Any:
    try:
        import rtslib_fb  # type: ignore[import-not-found]
    except ImportError:
        raise Refused(
            "python3 cannot import rtslib_fb: install targetcli-fb (or python3-rtslib-fb)"
        ) from None

    return rtslib_fb


def udev_path(so: Any) -> str:
    """A storage object's backing path ("" for a kind without one, as a ramdisk)."""
    try:
        return str(so.udev_path or "")
    except Exception:
        return ""


def users_of(lib: Any, path: str, name: str) -> list[str]:
    """Storage objects other than ``name`` (block) on the device ``path`` names."""
    try:
        want = os.stat(path).st_rdev
    except OSError:
        return []
    found = []
    for so in lib.RTSRoot().storage_objects:
        if so.plugin == "block" and so.name == name:
            continue
        try:
            st = os.stat(udev_path(so))
        except OSError:
            continue
        if stat.S_ISBLK(st.st_mode) and st.st_rdev == want:
            found.append(f"{so.plugin} {so.name}")
    return found


def named(lib: Any, name: str) -> list[Any]:
    """Every storage object called ``name``, of any kind: built from its own configfs
    directory (``core/<kind>_<index>/<name>``), the others' never read."""
    paths = glob.glob(os.path.join(CORE, "*_*", glob.escape(name)))
    return [lib.tcm.StorageObject.so_from_path(p) for p in sorted(paths) if os.path.isdir(p)]


def block_object(lib: Any, spec: dict[str, Any]) -> Any:
    """The claim's iblock storage object on its LV, or ``None``; another object of that name
    is refused."""
    mine = None
    for so in named(lib, spec["name"]):
        if so.plugin != "block" or udev_path(so) != lv_path(spec):
            raise Refused(
                "storage object {} exists on another backing store ({} {})".format(
                    spec["name"], so.plugin, udev_path(so) or "-"
                )
            )
        mine = so
    return mine


def provision_block(lib: Any, spec: dict[str, Any]) -> tuple[Any, bool]:
    """The claim's LV (made, or found and checked) and its iblock storage object."""
    extent = volume_group(spec)
    so = block_object(lib, spec)
    lv = logical_volume(spec)
    made = False
    where = "{}/{}".format(spec["vg"], spec["name"])
    if lv is None:
        if so is not None:
            raise Refused("storage object {} exists but its LV {} does not".format(
                spec["name"], where))  # fmt: skip
        extents = max(1, -(-spec["size"] // extent))
        lvm(
            "create " + where,
            "lvcreate", "--yes", "--extents", str(extents), "--name", spec["name"],
            "--addtag", tag_of(spec), "--activate", "y", "--setactivationskip", "n",
            "--zero", "y", "--wipesignatures", "y", "--", spec["vg"],
        )  # fmt: skip
        made = True
        lv = logical_volume(spec)
        if lv is None:
            raise Refused(f"create {where}: lvcreate left no logical volume")
    else:
        check_ours(spec, lv)
    try:
        lv = activate(spec, lv)
        if so is None:
            others = users_of(lib, lv_path(spec), spec["name"])
            if others:
                raise Refused("logical volume {} is in use by {}".format(where, ", ".join(others)))
            if lv["lv_attr"][5:6] == "o":
                raise Refused(f"logical volume {where} is open (mounted or in use)")
            so = lib.BlockStorageObject(spec["name"], dev=lv_path(spec), write_back=False)
    except BaseException:
        if made:  # this call made the LV: leave nothing behind
            undo(delete_lv, spec, False)
        raise
    return so, made


def undo(step: Any, *args: Any) -> None:
    """A clean-up step after a failure: its own failure must not hide the first one (a later
    provision finds the tagged LV and completes it)."""
    try:
        step(*args)
    except Exception as exc:
        sys.stderr.write(f"clean-up failed: {type(exc).__name__}: {exc}\n")


def expand_block(lib: Any, spec: dict[str, Any]) -> int:
    extent = volume_group(spec)
    so = block_object(lib, spec)
    where = "{}/{}".format(spec["vg"], spec["name"])
    if so is None:
        raise Refused("storage object {} does not exist".format(spec["name"]))
    lv = logical_volume(spec)
    if lv is None:
        raise Refused(f"logical volume {where} does not exist")
    check_ours(spec, lv)
    extents = max(1, -(-spec["size"] // extent))
    start = zero_pending(lv)  # an earlier expansion's range not zeroed yet
    if int(lv["lv_size"]) < extents * extent:
        if start is None:  # marked first: a crash after lvextend still zeroes that range
            start = int(lv["lv_size"])
            lvm("mark " + where, "lvchange", "--addtag", f"{ZERO_TAG}{start}", "--", where)
        lvm("extend " + where, "lvextend", "--extents", str(extents), "--", where)
    lv = logical_volume(spec)
    if lv is None:
        raise Refused(f"logical volume {where} does not exist")
    if start is not None:
        # the new extents may hold data of an LV freed outside flexhub: zeroed before the
        # size is answered (the node grows its filesystem only after that answer)
        lv = activate(spec, lv)
        if int(lv["lv_size"]) > start:
            zero(device_of(spec), start, int(lv["lv_size"]) - start, shared=True)
        for tag in lv["lv_tags"].split(","):
            if tag.startswith(ZERO_TAG):
                lvm("unmark " + where, "lvchange", "--deltag", tag, "--", where)
    # iblock reads the block device's size on every READ CAPACITY: nothing to tell LIO.
    return int(lv["lv_size"])


def storage_object(lib: Any, name: str) -> Any:
    try:
        return lib.FileIOStorageObject(name)
    except lib.RTSLibNotInCFS:
        return None


def target_of(lib: Any, fabric: Any, iqn: str) -> Any:
    try:
        return lib.Target(fabric, iqn, mode="lookup")
    except lib.RTSLibNotInCFS:
        return None


def ensure_pr_dir() -> None:
    """LIO keeps persistent-reservation state under <dbroot>/pr: without that directory a
    REGISTER answers NOT READY, and the node's fencing needs persistent reservations."""
    try:
        with open("/sys/kernel/config/target/dbroot") as fh:
            dbroot = fh.read().strip()
    except OSError:
        return
    if dbroot:
        os.makedirs(os.path.join(dbroot, "pr"), mode=0o700, exist_ok=True)


def save(lib: Any, spec: dict[str, Any]) -> None:
    """Write the claim's storage object and target, as they are now or gone, into the saved
    configuration; the first save of a target host (no file yet) dumps the whole target.
    Only the claim's own objects are looked up and dumped (:mod:`_lio_save`). A file another
    tool (targetcli's ``saveconfig``) replaced while this merged is read and merged again,
    so that its write is not lost under this one."""
    path = getattr(getattr(lib, "root", None), "default_save_file", None) or SAVE_FILE
    block = spec.get("backstore") == "block"
    own = None
    for _ in range(5):
        before = stamp(path)
        config = read_saved(path)
        if config is None:
            config = lib.RTSRoot().dump()
        else:
            if own is None:
                kind = lib.BlockStorageObject if block else lib.FileIOStorageObject
                try:
                    so = kind(spec["name"]).dump()
                except lib.RTSLibNotInCFS:
                    so = None
                target = target_of(lib, lib.FabricModule("iscsi"), spec["iqn"])
                own = (so, None if target is None else target.dump())
            config = merged(
                config, "block" if block else "fileio", spec["name"], own[0], spec["iqn"], own[1]
            )
        if stamp(path) == before:
            write_saved(path, config)
            return
    raise Refused(f"{path} changes under every save: try again")


def set_chap(node: Any, chap: dict[str, str]) -> None:
    node.chap_userid = chap["userid"]
    node.chap_password = chap["password"]
    if chap.get("mutual_userid"):
        node.chap_mutual_userid = chap["mutual_userid"]
        node.chap_mutual_password = chap["mutual_password"]


def provision(spec: dict[str, Any], copied: bool = False) -> dict[str, Any]:
    """``copied``: the calling :func:`restore` made the backing file or LV as a copy, so a
    failure at any step removes it again (an LV zeroed first: it holds data); one found
    made before the call is never removed."""
    lib = rts()
    root = lib.RTSRoot()  # loads the target modules and mounts configfs when needed
    del root
    ensure_pr_dir()
    block = spec.get("backstore") == "block"
    made = new_target = False
    so = None
    path = ""
    if not block:
        path = os.path.join(spec["directory"], spec["file"])
        so = storage_object(lib, spec["name"])
        if so is not None and so.udev_path != path:
            raise Refused("storage object {} exists with another backing file".format(spec["name"]))
    try:
        if block:
            so, made = provision_block(lib, spec)
        elif so is None:
            check_directory(spec["directory"])
            check_room(spec["directory"], spec["file"], spec["size"], ratio(spec), spec["sparse"])
            fd, made = open_file(spec, create=True)
            try:
                grow(fd, spec["size"], spec["sparse"])
                size = os.fstat(fd).st_size
            finally:
                os.close(fd)
            so = lib.FileIOStorageObject(spec["name"], dev=path, size=size, write_back=False)
        made = made or copied
        fabric = lib.FabricModule("iscsi")
        new_target = target_of(lib, fabric, spec["iqn"]) is None
        target = lib.Target(fabric, spec["iqn"], mode="any")
        tpg = lib.TPG(target, 1, mode="any")
        luns = {lun.lun: lun for lun in tpg.luns}
        lun = luns.get(0)
        if lun is None:
            lun = lib.LUN(tpg, 0, storage_object=so)
        elif lun.storage_object.name != so.name:
            raise Refused("target {} has another LUN 0".format(spec["iqn"]))
        for ip, port in spec["portals"]:
            lib.NetworkPortal(tpg, ip, port, mode="any")
        chap = spec.get("chap")
        if spec["initiators"]:
            tpg.set_attribute("generate_node_acls", "0")
            for name in spec["initiators"]:
                acl = lib.NodeACL(tpg, name, mode="any")
                if not any(m.mapped_lun == 0 for m in acl.mapped_luns):
                    lib.MappedLUN(acl, 0, tpg_lun=lun)
                if chap:
                    set_chap(acl, chap)
        else:
            tpg.set_attribute("generate_node_acls", "1")
            tpg.set_attribute("cache_dynamic_acls", "1")
            tpg.set_attribute("demo_mode_write_protect", "0")
            if chap:
                set_chap(tpg, chap)
        tpg.set_attribute("authentication", "1" if chap else "0")
        tpg.enable = True
        save(lib, spec)
    except BaseException:
        # this call made the file or LV (``copied``: a restore's copy, made before this
        # call began, whichever step failed): leave nothing of this call behind
        if made or copied:
            target = target_of(lib, lib.FabricModule("iscsi"), spec["iqn"])
            if target is not None and new_target:  # one that was there is not this call's
                target.delete()
            if block:
                for so in named(lib, spec["name"]):
                    if so.plugin == "block":
                        so.delete()
                undo(delete_lv, spec, copied)  # no PV names it yet: zeroed if it has data
            else:
                so = storage_object(lib, spec["name"])
                if so is not None:
                    so.delete()
                os.unlink(path)
        raise
    return {"size": int(so.size), "created": made}


def delete(spec: dict[str, Any]) -> dict[str, Any]:
    """Every check first (the volume group, the backstore's device, the LV's tag, or the
    backing file), then the target, the storage object, a save, and the LV or file: a refusal
    changes nothing."""
    lib = rts()
    lib.RTSRoot()
    gone = []
    block = spec.get("backstore") == "block"
    lv = None
    fd = -1
    if block:
        volume_group(spec)  # a missing group is an error, never "gone": its disks may be away
        so = block_object(lib, spec)
        lv = logical_volume(spec)
        if lv is not None:
            check_ours(spec, lv)
            if so is None:  # open with no backstore of ours: someone else's user
                check_closed(spec, lv)
    else:
        so = storage_object(lib, spec["name"])
        try:
            fd, _ = open_file(spec, create=False)
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                raise
        if fd >= 0:
            os.close(fd)
    target = target_of(lib, lib.FabricModule("iscsi"), spec["iqn"])
    if target is not None:
        target.delete()
        gone.append("target")
    if so is not None:
        so.delete()
        gone.append("backstore")
    # before the zeroing, which may take long or be cut short; also when nothing was left
    # to delete: a call killed before its save left the claim in the saved file
    save(lib, spec)
    if block:
        if lv is not None and delete_lv(spec):  # checked again, zeroed, removed
            gone.append("logical volume")
        return {"deleted": gone}
    if fd >= 0:
        check_directory(spec["directory"])
        os.unlink(os.path.join(spec["directory"], spec["file"]))
        gone.append("file")
    return {"deleted": gone}


def expand(spec: dict[str, Any]) -> dict[str, Any]:
    lib = rts()
    lib.RTSRoot()
    if spec.get("backstore") == "block":
        return {"size": expand_block(lib, spec)}
    so = storage_object(lib, spec["name"])
    path = os.path.join(spec["directory"], spec["file"])
    if so is None:
        raise Refused("storage object {} does not exist".format(spec["name"]))
    if so.udev_path != path:
        raise Refused("storage object {} has another backing file".format(spec["name"]))
    current = int(so.size)
    if spec["size"] <= current:
        save(lib, spec)  # a growth whose save failed (ENOSPC, killed) is saved by its retry
        return {"size": current}
    check_directory(spec["directory"])
    if ratio(spec) > 0:  # 0: a PV from before room accounting, not counted
        check_room(spec["directory"], spec["file"], spec["size"], ratio(spec), spec["sparse"])
    fd, _ = open_file(spec, create=False)
    try:
        grow(fd, spec["size"], spec["sparse"])
    finally:
        os.close(fd)
    # The fileio backstore of a regular file reports fd_dev_size on every READ CAPACITY.
    with open(os.path.join(so.path, "control"), "w") as fh:
        fh.write("fd_dev_size={:d}".format(spec["size"]))
    save(lib, spec)
    return {"size": int(lib.FileIOStorageObject(spec["name"]).size)}


def restore(spec: dict[str, Any]) -> dict[str, Any]:
    """``provision`` of a claim whose file or LV is first made a copy of ``spec["source"]``
    (a snapshot, or another claim's LUN: :func:`prepare_copy`)."""
    lib = rts()  # before anything is copied: a host without rtslib refuses at once
    lib.RTSRoot()
    # provision's own refusal before it changes anything, made before the copy too: a
    # storage object of the claim's name on another file or device
    if spec.get("backstore") == "block":
        block_object(lib, spec)
    else:
        so = storage_object(lib, spec["name"])
        if so is not None and so.udev_path != os.path.join(spec["directory"], spec["file"]):
            raise Refused("storage object {} exists with another backing file".format(spec["name"]))
    copied, how = prepare_copy(spec)
    done = provision(spec, copied)
    done["how"] = how
    return done


ACTIONS = {
    "provision": provision,
    "delete": delete,
    "expand": expand,
    "snapshot": snapshot,
    "delete_snapshot": delete_snapshot,
    "restore": restore,
    "room": room,  # read only: no lock, no save
}
#: The actions that change nothing: they take no lock (a long copy holds it).
READ_ONLY = frozenset({"room"})


def take(lock: int, wait: float) -> None:
    """The lock, within ``wait`` seconds (the provisioner's bound less a margin): a call that
    cannot have it by then is refused, never run after its caller gave up (the program goes on
    when ssh is killed: it has no terminal to hang up)."""
    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise Refused(
                    f"another flexhub call held {LOCK} for all of {wait:.0f} s: nothing done, "
                    "try again"
                ) from None
            time.sleep(0.1)


def main(request: dict[str, Any]) -> None:
    ANSWERING["id"] = str(request.get("id", ""))
    if os.geteuid() != 0:
        answer({"error": "must run as root on the target host (sshUser)"})
        sys.exit(3)
    lock = os.open(LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        if request["action"] not in READ_ONLY:
            take(lock, float(request.get("wait", 90)))
        result = ACTIONS[request["action"]](request["spec"])
    except Refused as exc:
        answer({"error": str(exc)})
        sys.exit(3)
    except NoRoomLeft as exc:  # the provisioner's NoRoom
        answer({"error": str(exc), "room": True})
        sys.exit(3)
    except Exception as exc:  # one line; rtslib's messages name objects, never CHAP values
        text = str(exc).splitlines()[0] if str(exc) else ""
        answer({"error": f"{type(exc).__name__}: {text}"})
        sys.exit(3)
    finally:
        os.close(lock)
    answer({"ok": result})


def serve() -> None:
    """Answer the requests on stdin, one JSON line each, until it ends. Waiting for one is
    bounded by :data:`IDLE` (SIGALRM's default action ends the program); a request once read
    runs without that bound (its own ``wait`` bounds its lock)."""
    stream = sys.stdin.buffer
    while True:
        signal.alarm(IDLE)
        line = stream.readline()
        signal.alarm(0)
        if not line:
            return
        if line.strip():
            main(json.loads(line))
