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
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Any

from flexhub.backend import (
    Attachment,
    BlockBackend,
    CommandError,
    FlexhubError,
    InvalidOptions,
    Node,
    NodeConfig,
    NodeRequirements,
    NoRoom,
    Secrets,
    Volume,
    VolumeError,
)
from flexhub.provisioning import Claim, Provisioned, Provisioning
from flexhub_loopfile import _loop, _made, _provision, _room, _tenancy
from flexhub_loopfile._copies import Copies
from flexhub_loopfile._quantity import parse_quantity, quantity

__all__ = ["DEFAULT_ROOT", "LoopfileBackend"]

LOG = logging.getLogger(__name__)

#: Where backing files live unless the node config's ``[loopfile] root`` says otherwise.
DEFAULT_ROOT = "/var/lib/flexhub/loopfiles"
#: Files are sized in whole 4 KiB blocks (what every filesystem here uses).
BLOCK = 4096

_ID_PREFIX = "loopfile:"
#: Suffix of a file being created (no ``file`` option may end with it).
_NEW_SUFFIX = _room.NEW_SUFFIX
_ATTEMPTS = 5
_BUSY = "Device or resource busy"
#: What losetup (util-linux 2.2x-2.4x) and libmount say when no free device node is usable.
_NO_FREE = (
    "cannot find an unused loop device",
    "could not find any free loop device",
    "No such file or directory",
)


def _round_up(size: int) -> int:
    return -(-size // BLOCK) * BLOCK


def _has_data(path: Path) -> bool | None:
    """Whether ``path`` has a data extent (``SEEK_DATA``); ``None`` when it cannot tell.

    Holes and preallocated (unwritten) extents are not data on ext4, xfs, btrfs and tmpfs.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        os.lseek(fd, 0, os.SEEK_DATA)
    except OSError as exc:
        return False if exc.errno == errno.ENXIO else None
    finally:
        os.close(fd)
    return True


def _free_bytes(directory: Path) -> int:
    try:
        vfs = os.statvfs(directory)
    except OSError:
        return 0
    return vfs.f_bavail * vfs.f_frsize


class _Created:
    """A backing file an attach of this instance created (for :meth:`LoopfileBackend.discard`)."""

    # (a frozen dataclass written out: ``@dataclass`` compiles its methods on every import,
    # and kubelet starts the driver anew for every call)
    __slots__ = ("directories", "identity", "size")
    identity: tuple[int, int]
    size: int
    directories: tuple[Path, ...]

    def __init__(self, identity: tuple[int, int], size: int, directories: tuple[Path, ...]) -> None:
        object.__setattr__(self, "identity", identity)
        object.__setattr__(self, "size", size)
        object.__setattr__(self, "directories", directories)

    def _key(self) -> tuple[tuple[int, int], int, tuple[Path, ...]]:
        return (self.identity, self.size, self.directories)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"cannot assign to field {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"cannot delete field {name!r}")

    def __reduce__(self) -> tuple[type[_Created], tuple[object, ...]]:
        return (type(self), self._key())  # copy and pickle through __init__, as a dataclass

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Created) or type(other) is not type(self):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        shown = f"identity={self.identity!r}, size={self.size!r}"
        return f"_Created({shown}, directories={self.directories!r})"


def _root_of(settings: Mapping[str, Any]) -> Path:
    """The resolved loopfile root of ``[loopfile]`` (it need not exist yet).

    :raises FlexhubError: ``root`` is not a usable absolute path.
    """
    raw = settings.get("root", DEFAULT_ROOT)
    if not isinstance(raw, str) or not raw.startswith("/") or "\0" in raw:
        raise FlexhubError("node config: [loopfile] root must be an absolute path")
    try:
        root = Path(raw).resolve()
    except (OSError, RuntimeError) as exc:
        raise FlexhubError(f"node config: [loopfile] root {raw} unusable: {exc}") from None
    if root == Path("/"):
        raise FlexhubError("node config: [loopfile] root must not be /")
    return root


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
        _root_of(settings)
        _tenancy.check_settings(settings)

    # --------------------------------------------------------------------------- paths

    def _root(self) -> Path:
        """The resolved loopfile root (it need not exist yet).

        :raises FlexhubError: the node config's root is not a usable absolute path.
        """
        return _root_of(self.node.settings)

    @staticmethod
    def _relative(volume: Volume) -> str:
        """The ``file`` option, checked to be a plain relative path.

        :raises InvalidOptions: ``file`` is missing, absolute, too long or has ``..``.
        """
        text = volume.options.get("file", "")
        if not text:
            raise InvalidOptions("option 'file' is required")
        if "\0" in text or len(text) > 255:
            raise InvalidOptions("option 'file' is not a valid path")
        if text.startswith("/"):
            raise InvalidOptions(f"option 'file' must be relative to the loopfile root: {text}")
        parts = text.split("/")
        if any(part in ("", ".", "..") for part in parts):
            raise InvalidOptions(
                f"option 'file' must not contain empty, '.' or '..' segments: {text}"
            )
        if text.endswith(_NEW_SUFFIX):
            # the name of a file being created, which the root's account does not count
            raise InvalidOptions(f"option 'file' must not end with {_NEW_SUFFIX}: {text}")
        return text

    def _base(self, volume: Volume) -> Path:
        """Where ``file`` is resolved: the pod namespace's area, or the root without isolation.

        :raises InvalidOptions: isolation is on and the call names no valid namespace.
        """
        root = self._root()
        if not _tenancy.isolated(self.node.settings):
            return root
        return _tenancy.area(root, _tenancy.namespace_of(volume))

    def _resolve(self, volume: Volume) -> Path:
        """The backing file of ``volume``, symlinks resolved, checked to be inside its area.

        :raises InvalidOptions: ``file`` is missing, absolute, has ``..``, escapes the root (or
            its namespace's area) through a symlink, or names something that is not a regular
            file; or the call names no namespace while isolation is on.
        """
        text = self._relative(volume)
        base = self._base(volume)
        if base == self._root() and text.split("/", 1)[0] == _tenancy.SNAPSHOTS:
            raise InvalidOptions(
                f"option 'file' must not start with {_tenancy.SNAPSHOTS}/ (the loopfile "
                f"root's snapshots): {text}"
            )
        return self._inside(base, text)

    @staticmethod
    def _inside(base: Path, text: str) -> Path:
        try:
            path = (base / PurePosixPath(text)).resolve()
        except (OSError, RuntimeError) as exc:
            raise InvalidOptions(f"option 'file' cannot be resolved: {text}: {exc}") from None
        if path == base or not path.is_relative_to(base):
            raise InvalidOptions(f"option 'file' escapes the loopfile root: {text}")
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            # The nearest existing ancestor must be a directory inside the root.
            ancestor = path.parent
            while not ancestor.exists() and ancestor != base:
                ancestor = ancestor.parent
            if ancestor.exists() and not ancestor.is_dir():
                raise InvalidOptions(
                    f"option 'file': {ancestor} is not a directory: {text}"
                ) from None
            return path
        except OSError as exc:
            raise InvalidOptions(f"option 'file' cannot be read: {text}: {exc.strerror}") from None
        if not stat.S_ISREG(st.st_mode):
            raise InvalidOptions(f"option 'file' is not a regular file: {text}")
        return path

    def _legacy(self, volume: Volume, path: Path) -> Path | None:
        """The pre-isolation file ``<root>/<file>`` a namespaced mount may adopt, if any.

        ``None`` without isolation, when the namespace's own file exists, or when there is no
        regular file at the old location (outside every namespace's area).
        """
        if not _tenancy.isolated(self.node.settings) or path.exists():
            return None
        root = self._root()
        text = self._relative(volume)
        if text.split("/", 1)[0] in (_tenancy.AREA, _tenancy.SNAPSHOTS):
            return None
        try:
            legacy = self._inside(root, text)
        except InvalidOptions:
            return None
        if (
            legacy.is_relative_to(root / _tenancy.AREA)
            or legacy.is_relative_to(root / _tenancy.SNAPSHOTS)
            or not legacy.is_file()
        ):
            return None
        return legacy

    def _adopt(self, volume: Volume, path: Path) -> None:
        """Move a pre-isolation file into the namespace's area (the volume lock is held)."""
        legacy = self._legacy(volume, path)
        if legacy is None:
            return
        if _tenancy.legacy_mode(self.node.settings) == "refuse":
            raise InvalidOptions(
                f"{legacy} predates namespace isolation: an operator must move it to {path} "
                '(or set [loopfile] legacy = "adopt")'
            )
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            os.rename(legacy, path)  # atomic: only one namespace can take it
        except FileNotFoundError:
            LOG.info("%s was adopted by another namespace meanwhile", legacy)
            return
        except OSError as exc:
            raise VolumeError(f"cannot move {legacy} to {path}: {exc.strerror}") from None
        self._fsync_dir(path.parent)
        self._fsync_dir(legacy.parent)
        _made.forget(self._state_dir(), legacy)  # the new place is recorded by this attach
        LOG.warning("adopted pre-isolation file %s into namespace area as %s", legacy, path)

    @staticmethod
    def _size(volume: Volume) -> int | None:
        text = volume.options.get("size", "")
        if not text:
            return None
        try:
            return parse_quantity(text)
        except ValueError as exc:
            raise InvalidOptions(f"option 'size': {exc}") from None

    @staticmethod
    def _max_size(volume: Volume) -> int | None:
        """Option ``maxSize`` in bytes (``None``: no bound but the node's room).

        :raises InvalidOptions: it is not a quantity, or ``size`` is larger.
        """
        text = volume.options.get("maxSize", "")
        if not text:
            return None
        try:
            most = parse_quantity(text)
        except ValueError as exc:
            raise InvalidOptions(f"option 'maxSize': {exc}") from None
        size = LoopfileBackend._size(volume)
        if size is not None and size > most:
            raise InvalidOptions(
                f"option 'size' {volume.options['size']} is more than the volume's maxSize {text}"
            )
        return most

    @classmethod
    def check_parameters(cls, parameters: Mapping[str, str]) -> None:
        """``maxSize`` is a quantity of at most 1Ei, more than zero."""
        _provision.max_size(parameters)

    @staticmethod
    def _preallocate(options: Mapping[str, str]) -> bool:
        return options.get("preallocate", "false") == "true"

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
        self._max_size(volume)
        if volume.pod is None and _tenancy.isolated(self.node.settings):
            self._relative(volume)
            self._size(volume)
            return
        path = self._resolve(volume)
        size = self._size(volume)
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
                    self._check_size(existing, os.stat(existing).st_size, size, note=False)

    def volume_id(self, volume: Volume) -> str:
        """``loopfile:<resolved path>``: two PVs naming the same file are one volume.

        With isolation the path is inside the namespace's area, so the id names it too.
        """
        return _ID_PREFIX + str(self._resolve(volume))

    def attach(self, volume: Volume) -> Attachment:
        """Create the file if needed and return a loop device mapping it."""
        path = self._resolve(volume)
        self._adopt(volume, path)
        self.node.record_progress(file=str(path))
        created = self._ensure_file(path, volume)
        try:
            return self._attach_file(path, created)
        except BaseException:
            if created:
                self._discard_file(path)
            raise

    def _attach_file(self, path: Path, created: bool) -> Attachment:
        data = None if created else _has_data(path)
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
        dev = self._attach_new(path, markers)
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
                self._fsync_dir(path.parent)
            except (OSError, VolumeError) as exc:
                LOG.warning("cannot remove %s, made by this failed mount: %s", path, exc)
                return
            self._remove_dirs(list(created.directories))
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
        target = max(_round_up(new_size), current)  # the file never shrinks
        if target > current:
            preallocate = self._preallocate(volume.options)
            with self._room_lock():
                self._check_room(path, target, preallocate)
                self._grow(path, current, target, preallocate)
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
        text = self._relative(Volume(options=dict(options)))
        _tenancy.check_settings(self.node.settings)
        _provision.reclaim(self.node, self._root(), text, reclaim, self._room_lock)

    def check_expansion(self, options: Mapping[str, str], new_size: int) -> None:
        """The provisioner's early refusal of a growth past the PV's ``maxSize`` (the node's
        :meth:`expand` refuses it too)."""
        self._check_growth(Volume(options=dict(options)), new_size)

    def _check_growth(self, volume: Volume, new_size: int) -> None:
        most = self._max_size(volume)
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
        text = self._relative(volume)
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
    def _check_size(path: Path, current: int, size: int, *, note: bool = True) -> None:
        """An existing file must be at least ``size`` bytes, as asked (a file flexhub makes is
        rounded up to whole blocks, a given one need not be); a file larger than ``size``
        rounded up is logged if ``note``.

        :raises VolumeError: the file is smaller than option ``size``.
        """
        if current < size:
            have, want = _room.human(current), _room.human(size)
            if have == want:  # e.g. 99,999,999 and 100,000,000 bytes: both 95.4 MiB
                have, want = f"{current} bytes", f"{size} bytes"
            raise VolumeError(
                f"{path} is {have} but option 'size' asks for {want}: refusing to mount it at "
                f"another size (mount it with a 'size' of at most {have}, or none, and expand "
                "its PVC; or name a new file)"
            )
        if current > _round_up(size) and note:
            LOG.info(
                "%s is %d bytes, larger than option 'size' (%d): not shrunk, mounted at its size",
                path,
                current,
                size,
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
            size = self._size(volume)
            if size is not None:
                self._check_size(path, st.st_size, size)
            _made.record(self._state_dir(), path)  # also a file an older flexhub made
            return False
        made_before = _made.recorded(self._state_dir(), path)
        if made_before is not None:
            raise _made.missing(self._relative(volume), path, made_before)
        size = self._size(volume)
        if size is None:
            raise InvalidOptions(
                f"option 'size' is required: {volume.options.get('file')} does not exist yet"
            )
        size = _round_up(size)
        if len(path.relative_to(self._root()).parts) > _room.MAX_DEPTH + 1:
            # reachable only through symlinks in the root; the account would not see it
            raise InvalidOptions(f"option 'file' is too deep under the loopfile root: {path}")
        with self._room_lock():
            self._remove_leftovers(path)
            # Checked before anything is made: a refusal creates nothing.
            self._check_room(path, size, self._preallocate(volume.options))
            made = self._make_parents(path)
            try:
                created = self._create(path, volume, size)
            except BaseException:
                self._remove_dirs(made)
                raise
            _made.record(self._state_dir(), path)
        if created:
            st = os.stat(path)
            self._created[str(path)] = _Created((st.st_dev, st.st_ino), size, tuple(made))
        return created

    @staticmethod
    def _remove_leftovers(path: Path) -> None:
        """Remove what a creation of ``path`` that was killed left (the volume lock is held:
        none is in progress), before its blocks are counted."""
        if not path.parent.is_dir():
            return
        for stale in path.parent.glob(f".{path.name}.*{_NEW_SUFFIX}"):
            with contextlib.suppress(OSError):
                stale.unlink()
                LOG.info("removed %s, left by an interrupted creation", stale)

    def _make_parents(self, path: Path) -> list[Path]:
        """Create the missing directories above ``path`` (0700).

        :returns: those this call made, deepest first.
        """
        missing: list[Path] = []
        for directory in path.parents:
            if os.path.lexists(directory):
                break
            missing.append(directory)
        made: list[Path] = []
        for directory in reversed(missing):
            try:
                directory.mkdir(mode=0o700)
            except FileExistsError:
                continue
            made.insert(0, directory)
        return made

    @staticmethod
    def _remove_dirs(made: list[Path]) -> None:
        for directory in made:  # deepest first; only while empty
            try:
                directory.rmdir()
            except OSError:
                break

    def _create(self, path: Path, volume: Volume, size: int) -> bool:
        """Make the file at ``size`` in its (existing) directory; ``False`` if it appeared."""
        base = self._base(volume)
        # Re-check now that the directories exist: nothing may have sneaked a symlink in.
        real_parent = path.parent.resolve()
        if real_parent != path.parent or not real_parent.is_relative_to(base):
            raise InvalidOptions(f"option 'file' escapes the loopfile root: {path}")
        # what secrets.token_hex(4) returns, without importing secrets (random, hmac, base64)
        tmp = path.with_name(f".{path.name}.{os.urandom(4).hex()}{_NEW_SUFFIX}")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(tmp, flags, 0o600)
        try:
            try:
                if self._preallocate(volume.options):
                    os.posix_fallocate(fd, 0, size)
                else:
                    os.ftruncate(fd, size)
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.link(tmp, path)
            except FileExistsError:
                LOG.info("%s appeared while being created; using it", path)
                return False
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise NoRoom(
                    f"not enough room on the node for {path}: need {_room.human(size)}, "
                    f"{_room.human(_free_bytes(path.parent))} free"
                ) from None
            raise VolumeError(f"cannot create {path}: {exc.strerror or exc}") from None
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        self._fsync_dir(path.parent)
        LOG.info(
            "created %s: %d bytes, %s",
            path,
            size,
            "preallocated" if self._preallocate(volume.options) else "sparse",
        )
        return True

    @staticmethod
    def _fsync_dir(directory: Path) -> None:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    @staticmethod
    def _grow(path: Path, current: int, target: int, preallocate: bool) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            try:
                if preallocate:
                    os.posix_fallocate(fd, current, target - current)
                else:
                    os.ftruncate(fd, target)
                os.fsync(fd)
            except OSError as exc:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, current)
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise NoRoom(
                        f"not enough room on the node to grow {path}: need "
                        f"{_room.human(target - current)} more, "
                        f"{_room.human(_free_bytes(path.parent))} free"
                    ) from None
                raise VolumeError(f"cannot grow {path}: {exc.strerror or exc}") from None
        finally:
            os.close(fd)

    def _attach_new(self, path: Path, markers: _loop.Markers) -> _loop.LoopDevice:
        """Attach ``path`` to a free loop device, leaving an ownership marker."""
        with self.node.lock("loopdev", "allocate"):
            markers.prune()
            for _ in range(_ATTEMPTS):
                index = _loop.free_index()
                if index is None:
                    return self._attach_with_find(path, markers)
                dev = _loop.LoopDevice(f"loop{index}", index)
                _loop.ensure_node(dev)
                markers.write(dev, path)  # pending: survives a crash right after losetup
                try:
                    self._losetup(["losetup", "--show"], dev, path)
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

    def _losetup(self, argv: list[str], dev: _loop.LoopDevice | None, path: Path) -> str:
        """Run ``losetup`` with ``--direct-io=on``, again without it if that is what failed.

        :returns: the device losetup printed.
        """
        tail = [dev.path, str(path)] if dev is not None else [str(path)]
        try:
            return self.node.runner([*argv, "--direct-io=on", *tail]).stdout.strip()
        except CommandError as exc:
            if _BUSY in str(exc) or any(text in str(exc) for text in _NO_FREE):
                raise
            # Perhaps only direct I/O was refused: the device may be attached anyway.
            attached = _loop.find_for_file(path)
            if attached is not None and (dev is None or attached == dev):
                LOG.info("%s attached without direct I/O: %s", attached.path, exc)
                return attached.path
            LOG.info("losetup with direct I/O failed (%s); retrying without", exc)
        return self.node.runner([*argv, *tail]).stdout.strip()

    def _attach_with_find(self, path: Path, markers: _loop.Markers) -> _loop.LoopDevice:
        """Attach with ``losetup --find`` (no ``/dev/loop-control``), creating missing nodes."""
        for attempt in range(2):
            try:
                shown = self._losetup(["losetup", "--find", "--show"], None, path)
            except CommandError as exc:
                if attempt == 0 and any(text in str(exc) for text in _NO_FREE):
                    created = self._create_free_nodes()
                    if created:
                        continue
                raise VolumeError(f"cannot attach {path} to a loop device: {exc}") from None
            name, index = _loop.loop_name(shown)
            dev = _loop.LoopDevice(name, index)
            markers.write(dev, path, diskseq=dev.diskseq())
            LOG.info("attached %s to %s", path, dev.path)
            return dev
        raise VolumeError(f"cannot attach {path}: no free loop device")  # pragma: no cover

    @staticmethod
    def _create_free_nodes() -> int:
        """Create ``/dev/loopN`` for every free loop device that lacks its node."""
        created = 0
        for dev in _loop.devices():
            if dev.backing_file() is None and not (_loop.DEV / dev.name).exists():
                _loop.ensure_node(dev)
                created += 1
        return created
