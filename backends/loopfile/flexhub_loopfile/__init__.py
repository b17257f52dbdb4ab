"""The ``loopfile`` backend: a filesystem stored in a file on the node, on a loop device.

No server is needed, which makes it flexhub's embedded default. A PV names a file relative to
the node's loopfile root (``[loopfile] root`` in the node config, default
``/var/lib/flexhub/loopfiles``)::

    options: {backend: loopfile, file: db/pg.img, size: 10Gi}

Security: the file must stay inside the root. Absolute paths, ``..``, symlinks whose target
leaves the root and anything that is not a regular file (device nodes, directories, FIFOs) are
refused before anything is created, so a PV author cannot turn ``/etc/shadow`` or a host disk
into a volume. By default (``[loopfile] isolation = "namespace"``) ``file`` is resolved in the
pod namespace's own area, ``<root>/namespaces/<namespace>/``, so one namespace never reaches
another's files; see :mod:`flexhub_loopfile._tenancy` for that and the migration of older
files, and :mod:`flexhub_loopfile._room` for ``overcommit``: a new file, or a growth, that
would make the root's files together promise more than its filesystem holds is refused,
before anything is created.

Life cycle (the core takes the volume lock, formats, stages, binds and counts users):

* :meth:`LoopfileBackend.attach` creates the file when missing (sparse, or fully allocated
  with ``preallocate: "true"``; it appears atomically, already at its size), unless the node
  made it before (:mod:`flexhub_loopfile._made`): a lost file is a failure, never a new empty
  volume. An existing file
  smaller than ``size`` is refused with both sizes (never mounted at another size than the PV
  asks for); a larger one (grown by ``expandfs`` since) is mounted at its size, logged. Then
  it reuses the
  loop device already mapping that file or attaches a new one with ``losetup``
  (``--direct-io=on`` when the kernel and filesystem allow it). Missing ``/dev/loopN`` nodes
  are created.
* :meth:`LoopfileBackend.detach` detaches the device only if flexhub attached it: see
  :mod:`flexhub_loopfile._loop` for the ownership markers kept under
  ``<state_dir>/loopfile/created``. A device somebody else set up is left attached. The file
  always stays, except through :meth:`LoopfileBackend.discard`: the rollback of a mount that
  failed removes the file its own attach created (and the directories made for it), if it is
  still that inode, at that size, with one link and no loop device.
* :meth:`LoopfileBackend.expand` grows the file, refreshes the loop device's capacity
  (``losetup -c``) and checks it; the core then grows the filesystem. The file never
  shrinks: when it is already at least the new size (``size: 10Gi`` on a PV of ``10G``), the
  device is brought to the file's size and the core grows the filesystem to it.

File sizes are rounded up to a multiple of 4 KiB.

This module is the backend's API; the work is done by :mod:`~flexhub_loopfile._options` (the
volume's options: where its file is, its sizes), :mod:`~flexhub_loopfile._files` (backing files
made, grown and removed), :mod:`~flexhub_loopfile._attach` (``losetup``) and
:mod:`~flexhub_loopfile._loop` (loop devices and their ownership markers).
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flexhub.backend import (
    Attachment,
    BlockBackend,
    InvalidOptions,
    Node,
    NodeConfig,
    NodeRequirements,
    Secrets,
    Volume,
    VolumeError,
    fsync_directory,
)
from flexhub.provisioning import Claim, Provisioned, Provisioning
from flexhub_loopfile import _attach, _files, _loop, _made, _options, _provision, _room, _tenancy
from flexhub_loopfile._copies import Copies
from flexhub_loopfile._files import _Created
from flexhub_loopfile._options import DEFAULT_ROOT
from flexhub_loopfile._quantity import quantity

__all__ = ["DEFAULT_ROOT", "LoopfileBackend"]

LOG = logging.getLogger(__name__)

_ID_PREFIX = "loopfile:"


class LoopfileBackend(BlockBackend, Copies, Provisioning):
    """Block volumes backed by files under the node's loopfile root; StorageClasses make one
    file per claim on the node its pod is scheduled on (:mod:`flexhub_loopfile._provision`)."""

    def __init__(self, node: Node) -> None:
        super().__init__(node)
        #: Files (by path) that an attach of this very call created: only they may be
        #: discarded by the rollback of a failed mount.
        self._created: dict[str, _Created] = {}

    schema_package = "flexhub_loopfile"
    node_requirements = NodeRequirements(
        commands=("losetup", "blkid", "mkfs.ext4", "mkfs.xfs", "fsck", "mount", "umount"),
        kernel_modules=("loop",),
        hint="install util-linux, e2fsprogs and xfsprogs",
    )

    settings_keys = frozenset({"root", *_tenancy.SETTINGS})

    # Provisioning: the node's mount makes the file, the node's DaemonSet pod removes it; the
    # node's expandfs grows it. ``BlockBackend.expand`` is the node's (Provisioning's, which
    # the provisioner would call, is never called: ``expands_storage`` is False).
    parameters_schema_file = "provision-schema.json"
    reclaim_on = "node"
    expands_storage = False
    on_delete = frozenset({"delete", "retain"})

    @classmethod
    def check_settings(
        cls, name: str, settings: Mapping[str, Any], config: NodeConfig | None = None
    ) -> None:
        """``[loopfile]``: known keys, an absolute ``root`` other than ``/``, and the values of
        ``isolation``, ``legacy`` and ``overcommit``."""
        super().check_settings(name, settings, config)
        _options.root_of(settings)
        _tenancy.check_settings(settings)

    # --------------------------------------------------------------------------- options

    def _root(self) -> Path:
        """The resolved loopfile root (it need not exist yet).

        :raises FlexhubError: the node config's root is not a usable absolute path.
        """
        return _options.root_of(self.node.settings)

    def _resolve(self, volume: Volume) -> Path:
        """The backing file of ``volume`` (:func:`flexhub_loopfile._options.resolve`)."""
        return _options.resolve(self.node.settings, volume)

    def _base(self, volume: Volume) -> Path:
        return _options.base(self.node.settings, volume)

    def _legacy(self, volume: Volume, path: Path) -> Path | None:
        return _options.legacy(self.node.settings, volume, path)

    @classmethod
    def check_parameters(cls, parameters: Mapping[str, str]) -> None:
        """``maxSize`` is a quantity of at most 1Ei, more than zero."""
        _provision.max_size(parameters)

    def _state_dir(self) -> Path:
        return Path(self.node.state_dir)

    def _markers(self) -> _loop.Markers:
        own = Path(self.node.state_dir) / "loopfile"
        own.mkdir(mode=0o700, parents=True, exist_ok=True)  # not with the umask's mode
        return _loop.Markers(own / "created")

    # --------------------------------------------------------------------------- API

    def check(self, volume: Volume) -> None:
        """Check the file's place and kind, and that ``size`` is there when needed.

        A call without a pod (``expandfs``) only has its ``file`` checked for shape when
        isolation is on: the file is then found through the journal, not the options.
        """
        self._root()
        _tenancy.check_settings(self.node.settings)
        _options.max_size(volume)
        if volume.pod is None and _tenancy.isolated(self.node.settings):
            _options.relative(volume)
            _options.size(volume)
            return
        path = self._resolve(volume)
        size = _options.size(volume)
        if size is None and not path.exists() and self._legacy(volume, path) is None:
            raise InvalidOptions(
                f"option 'size' is required: {volume.options.get('file')} does not exist yet"
            )
        if volume.pod is not None and size is not None:
            # also when the volume is staged already (its mount then never reaches attach),
            # and before a pre-isolation file is adopted
            existing = path if path.exists() else self._legacy(volume, path)
            if existing is not None:
                with contextlib.suppress(FileNotFoundError):
                    _files.check_size(existing, os.stat(existing).st_size, size, note=False)

    def volume_id(self, volume: Volume) -> str:
        """``loopfile:<resolved path>``: two PVs naming the same file are one volume.

        With isolation the path is inside the namespace's area, so the id names it too.
        """
        return _ID_PREFIX + str(self._resolve(volume))

    def attach(self, volume: Volume) -> Attachment:
        """Create the file if needed and return a loop device mapping it."""
        path = self._resolve(volume)
        _options.adopt(self.node.settings, self._state_dir(), volume, path)
        self.node.record_progress(file=str(path))
        created = self._ensure_file(path, volume)
        try:
            return self._attach_file(path, created)
        except BaseException:
            if created:
                self._discard_file(path)
            raise

    def _attach_file(self, path: Path, created: bool) -> Attachment:
        data = None if created else _files.has_data(path)
        markers = self._markers()
        # A file this call just created (a new inode, renamed into place) cannot back any
        # loop device yet: only an existing file needs the scan of every device's backing file.
        dev = None if created else _loop.find_for_file(path)
        if dev is not None:
            _loop.ensure_node(dev)
            ours = markers.owns(dev, path)
            if ours and not (markers.read(dev) or {}).get("diskseq"):
                markers.write(dev, path, diskseq=dev.diskseq())  # complete a pending marker
            LOG.info("reusing %s for %s (%s)", dev.path, path, "ours" if ours else "not ours")
            # An attached device may hold writes the file does not show yet: "no data
            # extents" proves nothing then, only "has data" does.
            blank = True if created else (False if data else None)
            self.node.record_progress(loop=dev.path)
            return self._attachment(dev, path, created=ours, blank=blank)
        dev = _attach.attach_new(self.node, path, markers)
        self.node.record_progress(loop=dev.path)
        blank = True if created else (None if data is None else not data)
        return self._attachment(dev, path, created=True, blank=blank)

    releases_partial = True

    def release(self, partial: Mapping[str, str]) -> None:
        """Undo an attach that never returned: detach the loop device it reported or, if it
        stopped before reporting one, the device mapping its file; never attaches. As in
        :meth:`detach`, only a device flexhub attached (its ownership marker) is detached."""
        file = partial.get("file", "")
        loop = partial.get("loop", "")
        if not loop and file:
            dev = _loop.find_for_file(Path(file))
            loop = dev.path if dev is not None else ""
        if loop:
            self.detach(Attachment(loop, {"loop": loop, "file": file}))

    def discard(self, attachment: Attachment) -> None:
        """A mount failed after this call's attach created the file: remove it (see
        :meth:`_discard_file`), so that a later mount creates it again at its ``size``."""
        file = attachment.details.get("file", "")
        if file:
            self._discard_file(Path(file))

    def _discard_file(self, path: Path) -> None:
        """Remove ``path`` and the directories made for it, if this instance's attach created
        them and nothing else has used the file since: same inode, one link, the size it was
        made at, and no loop device mapping it. Anything else keeps the file (logged)."""
        created = self._created.pop(str(path), None)
        if created is None:
            return
        with self._room_lock():  # no creation beside it may be using its directories
            try:
                st = os.lstat(path)
            except OSError:
                return
            if (
                not stat.S_ISREG(st.st_mode)
                or (st.st_dev, st.st_ino) != created.identity
                or st.st_nlink != 1
                or st.st_size != created.size
                or any(dev.backing_identity() == created.identity for dev in _loop.devices())
            ):
                LOG.warning("keeping %s: it changed or is in use since this call made it", path)
                return
            try:
                _made.forget(self._state_dir(), path)  # first: a record never outlives its file
                path.unlink()
                fsync_directory(path.parent)
            except (OSError, VolumeError) as exc:
                LOG.warning("cannot remove %s, made by this failed mount: %s", path, exc)
                return
            _files.remove_dirs(list(created.directories))
        LOG.info("removed %s: this mount created it and failed", path)

    def detach(self, attachment: Attachment) -> None:
        """Detach the loop device if flexhub attached it; leave anybody else's alone."""
        name, index = _loop.loop_name(attachment.details.get("loop") or attachment.device)
        dev = _loop.LoopDevice(name, index)
        file = attachment.details.get("file", "")
        markers = self._markers()
        if dev.backing_file() is None:
            LOG.info("%s is already detached", dev.path)
            if (markers.read(dev) or {}).get("file") == file:
                markers.remove(dev)
            return
        if not file or not markers.owns(dev, Path(file)):
            LOG.info("leaving %s attached: flexhub did not attach it", dev.path)
            return
        result = self.node.runner(["losetup", "--detach", dev.path], check=False)
        if result.returncode != 0:
            text = (result.stderr or result.stdout).strip()
            if "No such device" not in text and dev.backing_file() is not None:
                raise VolumeError(f"cannot detach {dev.path} from {file}: {text}")
        markers.remove(dev)
        LOG.info("detached %s from %s", dev.path, file)

    def still_attached(self, attachment: Attachment) -> bool | None:
        """Whether the loop device still maps the attachment's file (the same inode): after a
        reboot, or a detach behind flexhub's back, the name may map another file. ``None``
        when that cannot be told (the file deleted or moved while attached)."""
        try:
            name, index = _loop.loop_name(attachment.details.get("loop") or attachment.device)
        except VolumeError:
            return None
        dev = _loop.LoopDevice(name, index)
        if dev.backing_file() is None:
            return False  # bound to nothing
        file = attachment.details.get("file", "")
        identity = dev.backing_identity()
        if not file or identity is None:
            return None
        try:
            st = os.stat(file)
        except OSError:
            return None
        return identity == (st.st_dev, st.st_ino)

    def expand(self, attachment: Attachment, volume: Volume, new_size: int) -> None:
        """Grow the file to ``new_size`` bytes and the loop device with it.

        The file is the one journalled at attach (``expandfs`` carries no namespace).
        """
        path = self._attached_file(attachment, volume)
        self._check_growth(volume, new_size)
        name, index = _loop.loop_name(attachment.details.get("loop") or attachment.device)
        dev = _loop.LoopDevice(name, index)
        try:
            st = os.stat(path)
        except OSError as exc:
            raise VolumeError(f"cannot expand {path}: {exc.strerror}") from None
        if dev.backing_identity() != (st.st_dev, st.st_ino):
            raise VolumeError(f"cannot expand {path}: {dev.path} no longer maps it")
        if new_size <= 0:
            raise VolumeError(f"cannot expand {path} to {new_size} bytes")
        current = st.st_size
        target = max(_files.round_up(new_size), current)  # the file never shrinks
        if target > current:
            preallocate = _options.preallocate(volume.options)
            with self._room_lock():
                self._check_room(path, target, preallocate)
                _files.grow(path, current, target, preallocate)
        else:
            # e.g. size 10Gi and a PV of 10G: the core still grows the filesystem to the device
            LOG.info("%s is already %d bytes (asked for %d)", path, current, new_size)
        if dev.size() < target:
            self.node.runner(["losetup", "--set-capacity", dev.path])
        if dev.size() < target:
            raise VolumeError(
                f"{dev.path} is {dev.size()} bytes after growing {path} to {target} bytes"
            )
        LOG.info("expanded %s from %d to %d bytes", path, current, target)

    # --------------------------------------------------------------------------- provisioning

    def provision(
        self, claim: Claim, parameters: Mapping[str, str], secrets: Secrets
    ) -> Provisioned:
        """The claim's PV: ``file: <directory>/pvc-<uid>.img``, ``size`` the claim's, on the
        claim's selected node; nothing is made here (the node's mount creates the file)."""
        return _provision.provision(claim, parameters)

    def reclaim(
        self, options: Mapping[str, str], reclaim: Mapping[str, str], secrets: Secrets
    ) -> None:
        """On the node: remove the PV's file unless it is in use or not a regular file (see
        :mod:`flexhub_loopfile._provision`); gone already is success."""
        text = _options.relative(Volume(options=dict(options)))
        _tenancy.check_settings(self.node.settings)
        _provision.reclaim(self.node, self._root(), text, reclaim, self._room_lock)

    def check_expansion(self, options: Mapping[str, str], new_size: int) -> None:
        """The provisioner's early refusal of a growth past the PV's ``maxSize`` (the node's
        :meth:`expand` refuses it too)."""
        self._check_growth(Volume(options=dict(options)), new_size)

    def _check_growth(self, volume: Volume, new_size: int) -> None:
        most = _options.max_size(volume)
        if most is not None and new_size > most:
            raise InvalidOptions(
                f"cannot grow {volume.options.get('file', '')} to {quantity(new_size)}: more "
                f"than its maxSize {volume.options['maxSize']} (its class's, when it was "
                "provisioned)"
            )

    # --------------------------------------------------------------------------- helpers

    def _attached_file(self, attachment: Attachment, volume: Volume) -> Path:
        """The backing file an attachment recorded, checked against the root and ``file``."""
        recorded = attachment.details.get("file", "")
        if not recorded:
            return self._resolve(volume)
        path = Path(recorded)
        text = _options.relative(volume)
        if not path.is_relative_to(self._root()) or not str(path).endswith("/" + text):
            raise VolumeError(f"the staged volume is {path}, not option 'file' {text}")
        return path

    def _room_lock(self) -> contextlib.AbstractContextManager[None]:
        """The node's lock on the loopfile root's account: held from the check of a new size
        to the file having it, so two volumes never both take the last room."""
        return self.node.lock("loopfile-room", str(self._root()))

    def _check_room(self, path: Path, size: int, preallocate: bool) -> None:
        """Refuse ``path`` at ``size`` bytes when the root's files would promise more than its
        filesystem holds (times ``[loopfile] overcommit``): see :mod:`flexhub_loopfile._room`.
        """
        _room.check(
            self._root(),
            path,
            size,
            ratio=_tenancy.overcommit(self.node.settings),
            preallocate=preallocate,
        )

    @staticmethod
    def _attachment(
        dev: _loop.LoopDevice, path: Path, *, created: bool, blank: bool | None
    ) -> Attachment:
        return Attachment(
            device=dev.path,
            details={"loop": dev.path, "file": str(path), "created": str(created).lower()},
            blank=blank,
        )

    def _ensure_file(self, path: Path, volume: Volume) -> bool:
        """Create the backing file at its size if it does not exist; it appears atomically.

        :returns: whether this call created it.
        """
        try:
            st = os.stat(path)
        except FileNotFoundError:
            pass
        else:
            if not stat.S_ISREG(st.st_mode):
                raise InvalidOptions(f"option 'file' is not a regular file: {path}")
            if st.st_size == 0:
                raise VolumeError(f"backing file {path} is empty")
            size = _options.size(volume)
            if size is not None:
                _files.check_size(path, st.st_size, size)
            _made.record(self._state_dir(), path)  # also a file an older flexhub made
            return False
        made_before = _made.recorded(self._state_dir(), path)
        if made_before is not None:
            raise _made.missing(_options.relative(volume), path, made_before)
        size = _options.size(volume)
        if size is None:
            raise InvalidOptions(
                f"option 'size' is required: {volume.options.get('file')} does not exist yet"
            )
        size = _files.round_up(size)
        if len(path.relative_to(self._root()).parts) > _room.MAX_DEPTH + 1:
            # reachable only through symlinks in the root; the account would not see it
            raise InvalidOptions(f"option 'file' is too deep under the loopfile root: {path}")
        with self._room_lock():
            _files.remove_leftovers(path)
            # Checked before anything is made: a refusal creates nothing.
            self._check_room(path, size, _options.preallocate(volume.options))
            made = _files.make_parents(path)
            try:
                created = _files.create(
                    path, self._base(volume), size, _options.preallocate(volume.options)
                )
            except BaseException:
                _files.remove_dirs(made)
                raise
            _made.record(self._state_dir(), path)
        if created:
            st = os.stat(path)
            self._created[str(path)] = _Created((st.st_dev, st.st_ino), size, tuple(made))
        return created
