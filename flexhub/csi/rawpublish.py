"""NodePublishVolume of a raw block volume: the staged device node bind-mounted on the
target, a file the plugin creates (0600). Never formatted, never mounted as a filesystem.

A read-only bind does not stop writes through a device node (the kernel checks a mount's
read-only flag for files and directories, not for devices), so a read-only publish is served
only for a device attached read-only (a read-only access mode at stage); a read-write device
asked for read-only is ``INVALID_ARGUMENT``, never published writable.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Any

import grpc

from flexhub.csi.proto import csi_pb2
from flexhub.csi.status import CsiError

__all__ = ["publish_raw", "refuse_while_published"]

LOG = logging.getLogger(__name__)

_SINGLE_WRITER = csi_pb2.VolumeCapability.AccessMode.Mode.SINGLE_NODE_SINGLE_WRITER


def _read_only(device: str) -> bool:
    name = os.path.basename(os.path.realpath(device))
    try:
        return Path(f"/sys/class/block/{name}/ro").read_text().strip() == "1"
    except OSError:
        return False


def _binds_of(node: Any, device: str) -> list[str]:
    """The mount points that are binds of the device node ``device`` (devtmpfs, its name)."""
    root = "/" + os.path.basename(os.path.realpath(device))
    return [
        e.mount_point for e in node.mounts.entries() if e.root == root and e.fs_type == "devtmpfs"
    ]


def publish_raw(node: Any, volume_id: str, staging: Path, target: Path, request: Any) -> None:
    """Bind the device staged raw on ``staging`` on the file ``target``; idempotent.

    :raises CsiError: ``FAILED_PRECONDITION`` (not staged raw here; a single-writer volume
        published elsewhere), ``ALREADY_EXISTS`` (``target`` holds something else),
        ``INVALID_ARGUMENT`` (read-only asked of a read-write device).
    """
    from flexhub.node.mounts import bind_mount
    from flexhub.node.rawblock import raw_device

    device = raw_device(node, staging)
    if device is None:
        raise CsiError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"volume {volume_id} is not staged as a raw block volume on {staging}",
        )
    current = node.mounts.at(target)
    if current is not None:
        same = os.stat(target).st_rdev == os.stat(device).st_rdev
        if same and current.read_only == request.readonly:
            return
        raise CsiError(
            grpc.StatusCode.ALREADY_EXISTS,
            f"{target} is already a mount point of another volume or with other flags",
        )
    if request.readonly and not _read_only(device):
        raise CsiError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"volume {volume_id} is attached read-write: a raw block device cannot be made "
            "read-only per target (stage it with a read-only access mode)",
        )
    if request.volume_capability.access_mode.mode == _SINGLE_WRITER:
        others = [p for p in _binds_of(node, device) if p != str(target)]
        if others:
            raise CsiError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"volume {volume_id} is single-writer (SINGLE_NODE_SINGLE_WRITER) and already "
                f"published on {others[0]}",
            )
    if target.is_dir():
        raise CsiError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"{target} is a directory: a raw block volume is published on a file",
        )
    target.parent.mkdir(mode=0o750, parents=True, exist_ok=True)
    made = not target.exists()
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    os.close(fd)
    try:
        bind_mount(
            node.runner, device, target, request.readonly, node.mounts, node.config.mount_timeout
        )
    except BaseException:
        if made:
            with contextlib.suppress(OSError):
                target.unlink()
        raise
    LOG.info("published %s (%s) on %s", volume_id, device, target)


def refuse_while_published(node: Any, volume_id: str, staging: Path) -> None:
    """A raw block volume is not released while its device node is bound on a target: the
    release's exclusive open does not see a bind (it is no open), and the pod would be left
    with the node of a detached device (``FAILED_PRECONDITION``; unpublish first)."""
    from flexhub.node.rawblock import raw_device

    device = raw_device(node, staging)
    bound = _binds_of(node, device) if device is not None else []
    if bound:
        raise CsiError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"volume {volume_id} is still published on {bound[0]} (NodeUnpublishVolume first)",
        )
