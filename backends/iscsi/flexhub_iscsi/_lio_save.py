"""Part of the remote program (:mod:`flexhub_iscsi._lio_remote`): the saved LIO configuration,
updated one claim at a time.

rtslib's ``saveconfig`` (``RTSRoot.save_to_file``, with or without its ``so_path``) walks
the whole target (``RTSRoot.dump()``: every storage object's and every target's attributes,
parameters, ACLs and LUNs, read from configfs) on every save: a call on a target of n claims
then reads n claims' objects, and n calls read n squared of them. A call here writes its own claim
instead: the saved file is read, the claim's storage object (``plugin``, ``name``) and target
(``wwn``) entries are replaced by their ``dump()``, or dropped when they are gone, and every
other entry is kept as it was, in its place. Only the first save of a target host (no saved
file yet, or one that cannot be read) dumps the whole target, once. The file has the shape
``saveconfig`` writes and ``targetctl restore`` (``RTSRoot.restore_from_file``) reads.

The file is replaced atomically: written (0600) to a temporary file in its directory, synced,
then renamed over it, so a crash leaves the old file or the new one, never a part.

Standard library only: this text runs on the target host (python3 3.7 or later).
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any

#: Where rtslib-fb keeps the saved configuration (its ``default_save_file``).
SAVE_FILE = "/etc/rtslib-fb-target/saveconfig.json"


def stamp(path: str) -> Any:
    """What tells that ``path`` was replaced or rewritten: (inode, size, mtime), or None."""
    try:
        found = os.stat(path)
    except FileNotFoundError:
        return None
    return (found.st_ino, found.st_size, found.st_mtime_ns)


def read_saved(path: str) -> Any:
    """The saved configuration (a dict), or ``None`` when there is none or it is not one
    (then the caller saves the whole target again). A file that cannot be read now (EIO,
    EMFILE) is an error, never taken for none: its entries would be lost."""
    try:
        with open(path, encoding="utf-8") as fh:
            config = json.load(fh)
    except FileNotFoundError:
        return None
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(config, dict):
        return None
    if not isinstance(config.get("storage_objects", []), list):
        return None
    if not isinstance(config.get("targets", []), list):
        return None
    return config


def merged(
    config: dict[str, Any],
    plugin: str,
    name: str,
    storage_object: Any,
    wwn: str,
    target: Any,
) -> dict[str, Any]:
    """``config`` with the storage object ``plugin``/``name`` and the target ``wwn`` set to
    the given dumps (``None``: removed); every other entry as it was, in its place."""

    def put(entries: list[Any], mine: Any, key: Any) -> list[Any]:
        out: list[Any] = []
        placed = False
        for entry in entries:
            if isinstance(entry, dict) and key(entry):
                if mine is not None and not placed:
                    out.append(mine)
                    placed = True
                continue
            out.append(entry)
        if mine is not None and not placed:
            out.append(mine)
        return out

    result = dict(config)
    result["storage_objects"] = put(
        list(config.get("storage_objects", [])),
        storage_object,
        lambda so: so.get("plugin") == plugin and so.get("name") == name,
    )
    result["targets"] = put(list(config.get("targets", [])), target, lambda t: t.get("wwn") == wwn)
    return result


def write_saved(path: str, config: dict[str, Any]) -> None:
    """Replace ``path`` with ``config`` (0600, in a 0700 directory made if missing): a
    temporary file beside it, synced, renamed over it, the directory synced."""
    directory = os.path.dirname(path)
    os.makedirs(directory, mode=0o700, exist_ok=True)
    temporary = f"{path}.flexhub-new"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(temporary)  # a killed call's leftover
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(json.dumps(config, sort_keys=True, indent=2) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.rename(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
