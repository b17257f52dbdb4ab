"""CSI ``GetCapacity`` of the iscsi backend: the room a new LUN of a class has on its target
host, asked over the provisioner's SSH channel (:mod:`flexhub_iscsi._lio`, the remote
program's read-only action ``room``: :func:`flexhub_iscsi._lio_room.room`).

fileio: the directory's room by the provisioner's rule, ``(available + occupied) x overcommit
- promised`` (no more than ``available`` for a preallocating class), so an overcommitted class
is answered the promises it can still make, which may exceed the free bytes; block: the
volume group's free bytes.

CSI sends ``GetCapacity`` no secrets, so the SSH key is read from the node config's
``[iscsi] capacity_secret_dir`` (the class's Secret mounted into the controller's pod: files
``ssh-privatekey`` and ``ssh-knownhosts``); never logged nor put in an error.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from flexhub.backend import FlexhubError, Node, NotSupported, Secret, Secrets, remember_secrets

__all__ = ["MAX_KEY_FILE", "capacity", "room_spec", "secrets_from"]

#: The largest key or known-hosts file read (bytes).
MAX_KEY_FILE = 64 * 1024


def room_spec(parameters: Mapping[str, str]) -> tuple[Any, dict[str, Any]]:
    """The class checked and the remote ``room`` request for it."""
    from flexhub_iscsi import _lio

    if not parameters.get("targetHost"):
        raise NotSupported(
            "iscsi: the room of a target host is measured for a class's parameters "
            "(targetHost, fileioDirectory or volumeGroup, ...)"
        )
    lio = _lio.parse_class(parameters)
    if lio.backstore == "block":
        return lio, {"backstore": "block", "vg": lio.volume_group}
    return lio, {"directory": lio.directory, "sparse": lio.sparse, "overcommit": lio.overcommit}


def _read(directory: str, name: str) -> str:
    path = os.path.join(directory, name)
    try:
        # a mounted Secret's files are symlinks into its ..data: followed
        with open(path, "rb") as fh:
            data = fh.read(MAX_KEY_FILE + 1)
    except OSError as exc:
        raise FlexhubError(
            f"iscsi: [iscsi] capacity_secret_dir: cannot read {path}: {exc.strerror}"
        ) from None
    if len(data) > MAX_KEY_FILE:
        raise FlexhubError(f"iscsi: [iscsi] capacity_secret_dir: {path} is over 64 KiB")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise FlexhubError(f"iscsi: [iscsi] capacity_secret_dir: {path} is not text") from None


def secrets_from(directory: str) -> Secrets:
    """The SSH key and known hosts in ``directory`` (remembered for redaction)."""
    from flexhub_iscsi import _lio

    values = {key: _read(directory, key) for key in (_lio.PRIVATE_KEY, _lio.KNOWN_HOSTS_KEY)}
    remember_secrets([values[_lio.PRIVATE_KEY]])
    return Secrets({key: Secret(value) for key, value in values.items()})


def capacity(node: Node, directory: str, parameters: Mapping[str, str]) -> int:
    """The bytes a new LUN of the class ``parameters`` can have now on its target host."""
    from flexhub_iscsi import _lio_ssh

    lio, spec = room_spec(parameters)
    if not directory:
        raise NotSupported(
            "iscsi: GetCapacity needs [iscsi] capacity_secret_dir in the controller's node "
            "config (the class's Secret mounted: CSI sends this call no SSH key)"
        )
    done = _lio_ssh.Lio(node.runner, lio.ssh, secrets_from(directory)).call("room", spec, [])
    available = done.get("available")
    if isinstance(available, bool) or not isinstance(available, int) or available < 0:
        raise FlexhubError(f"iscsi: target host {lio.ssh.host} (room): no byte count answered")
    return available
