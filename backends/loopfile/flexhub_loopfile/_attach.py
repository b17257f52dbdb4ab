"""Attaching a backing file to a free loop device with ``losetup``.

A device is picked from ``/dev/loop-control`` (its ``/dev/loopN`` node made when missing) and
its ownership marker (:class:`flexhub_loopfile._loop.Markers`) written before ``losetup`` runs,
so a crash right after it still leaves the device flexhub's; a device taken meanwhile by
another process is skipped. Without ``/dev/loop-control``, ``losetup --find`` picks one.
``--direct-io=on`` is asked for, and dropped when that is what failed.
"""

from __future__ import annotations

import logging
from pathlib import Path

from flexhub.backend import CommandError, Node, VolumeError
from flexhub_loopfile import _loop

__all__ = ["attach_new"]

LOG = logging.getLogger(__name__)

_ATTEMPTS = 5
_BUSY = "Device or resource busy"
#: What losetup (util-linux 2.2x-2.4x) and libmount say when no free device node is usable.
_NO_FREE = (
    "cannot find an unused loop device",
    "could not find any free loop device",
    "No such file or directory",
)


def attach_new(node: Node, path: Path, markers: _loop.Markers) -> _loop.LoopDevice:
    """Attach ``path`` to a free loop device, leaving an ownership marker."""
    with node.lock("loopdev", "allocate"):
        markers.prune()
        for _ in range(_ATTEMPTS):
            index = _loop.free_index()
            if index is None:
                return _attach_with_find(node, path, markers)
            dev = _loop.LoopDevice(f"loop{index}", index)
            _loop.ensure_node(dev)
            markers.write(dev, path)  # pending: survives a crash right after losetup
            try:
                _losetup(node, ["losetup", "--show"], dev, path)
            except CommandError as exc:
                markers.remove(dev)
                if _BUSY in str(exc):
                    LOG.info("%s was taken meanwhile; trying another", dev.path)
                    continue
                raise VolumeError(f"cannot attach {path} to a loop device: {exc}") from None
            markers.write(dev, path, diskseq=dev.diskseq())
            LOG.info("attached %s to %s", path, dev.path)
            return dev
    raise VolumeError(f"cannot attach {path}: loop devices kept being taken by others")


def _losetup(node: Node, argv: list[str], dev: _loop.LoopDevice | None, path: Path) -> str:
    """Run ``losetup`` with ``--direct-io=on``, again without it if that is what failed.

    :returns: the device losetup printed.
    """
    tail = [dev.path, str(path)] if dev is not None else [str(path)]
    try:
        return node.runner([*argv, "--direct-io=on", *tail]).stdout.strip()
    except CommandError as exc:
        if _BUSY in str(exc) or any(text in str(exc) for text in _NO_FREE):
            raise
        # Perhaps only direct I/O was refused: the device may be attached anyway.
        attached = _loop.find_for_file(path)
        if attached is not None and (dev is None or attached == dev):
            LOG.info("%s attached without direct I/O: %s", attached.path, exc)
            return attached.path
        LOG.info("losetup with direct I/O failed (%s); retrying without", exc)
    return node.runner([*argv, *tail]).stdout.strip()


def _attach_with_find(node: Node, path: Path, markers: _loop.Markers) -> _loop.LoopDevice:
    """Attach with ``losetup --find`` (no ``/dev/loop-control``), creating missing nodes."""
    for attempt in range(2):
        try:
            shown = _losetup(node, ["losetup", "--find", "--show"], None, path)
        except CommandError as exc:
            if attempt == 0 and any(text in str(exc) for text in _NO_FREE):
                created = _create_free_nodes()
                if created:
                    continue
            raise VolumeError(f"cannot attach {path} to a loop device: {exc}") from None
        name, index = _loop.loop_name(shown)
        dev = _loop.LoopDevice(name, index)
        markers.write(dev, path, diskseq=dev.diskseq())
        LOG.info("attached %s to %s", path, dev.path)
        return dev
    raise VolumeError(f"cannot attach {path}: no free loop device")  # pragma: no cover


def _create_free_nodes() -> int:
    """Create ``/dev/loopN`` for every free loop device that lacks its node."""
    created = 0
    for dev in _loop.devices():
        if dev.backing_file() is None and not (_loop.DEV / dev.name).exists():
            _loop.ensure_node(dev)
            created += 1
    return created
