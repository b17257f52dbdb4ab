"""The public API for flexhub backends: the one module a backend imports.

A backend is a class registered under the entry-point group ``flexhub.backends``; the entry
point's name is what a PV author writes in ``backend``::

    [project.entry-points."flexhub.backends"]
    loopfile = "flexhub_loopfile:LoopfileBackend"

flexhub's core parses kubelet's call, validates the options against the backend's JSON Schema,
takes the locks, keeps the state journal, formats and mounts block devices safely, shares one
staging mount between the pods of a node, and writes the one JSON reply. A backend only does
what is specific to its storage, through the services in :class:`Node`. It never writes to
stdout, parses argv or builds replies; it raises a :class:`FlexhubError` subclass to fail.

There are two kinds:

* :class:`FilesystemBackend` (NFS): mounts its storage straight onto the pod directory.
* :class:`BlockBackend` (loop files, iSCSI): produces a block device; the core formats it if
  blank, mounts it once per node on a staging directory and bind-mounts it into every pod.

.. versionadded:: 0.1
"""

from __future__ import annotations

import abc
import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from flexhub.config import NodeConfig
from flexhub.errors import (
    BackendError,
    CommandError,
    CommandTimeout,
    FlexhubError,
    InvalidOptions,
    LockTimeout,
    NoRoom,
    NotSupported,
    ReleaseDeferred,
    StateError,
    VolumeError,
    redact,
    remember_secrets,
)
from flexhub.node import Node
from flexhub.node.frozen import Frozen
from flexhub.node.kernel import missing_filesystem as kernel_lacks
from flexhub.node.mounts import MountEntry
from flexhub.node.runner import CommandRunner, Result
from flexhub.node.statedir import fsync_directory, remove_dead_temporaries, write_atomically
from flexhub.settings import check_keys
from flexhub.volume import PodInfo, Secret, Secrets, Volume, has_control_character

if TYPE_CHECKING:
    from flexhub.node.live import LiveCommand

__all__ = [
    "Attachment",
    "Backend",
    "BackendError",
    "BlockBackend",
    "CommandError",
    "CommandRunner",
    "CommandTimeout",
    "FilesystemBackend",
    "FlexhubError",
    "Frozen",
    "InvalidOptions",
    "LiveCommand",
    "LockTimeout",
    "MountEntry",
    "NoRoom",
    "Node",
    "NodeConfig",
    "NodeRequirements",
    "NotSupported",
    "PodInfo",
    "ReleaseDeferred",
    "Result",
    "Secret",
    "Secrets",
    "StateError",
    "Volume",
    "VolumeError",
    "VolumeTrouble",
    "check_keys",
    "fsync_directory",
    "has_control_character",
    "kernel_lacks",
    "redact",
    "remember_secrets",
    "remove_dead_temporaries",
    "write_atomically",
]


def __getattr__(name: str) -> Any:
    # LiveCommand is loaded on first use: only a provisioner keeps a command up, and a
    # kubelet call of a node driver imports this module
    if name == "LiveCommand":
        from flexhub.node.live import LiveCommand

        return LiveCommand
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class NodeRequirements(Frozen):
    """What a backend needs on the node, checked by ``flexhub doctor`` (never per call).

    ``commands`` are looked up where the runner looks (``/usr/sbin:/usr/bin:/sbin:/bin``),
    ``kernel_modules`` must be loaded, built in or loadable, ``daemons`` must be running
    (by process name); ``hint`` tells the operator what to install.

    .. versionadded:: 0.2
    """

    # the fields, in order
    __slots__ = (  # noqa: RUF023
        "commands",
        "kernel_modules",
        "daemons",
        "hint",
    )
    commands: tuple[str, ...]
    kernel_modules: tuple[str, ...]
    daemons: tuple[str, ...]
    hint: str

    def __init__(
        self,
        commands: tuple[str, ...] = (),
        kernel_modules: tuple[str, ...] = (),
        daemons: tuple[str, ...] = (),
        hint: str = "",
    ) -> None:
        self._set(commands=commands, kernel_modules=kernel_modules, daemons=daemons, hint=hint)


class Attachment(Frozen):
    """A block device a :class:`BlockBackend` made available on this node.

    ``details`` are what the backend needs to release it later (kept in the state journal,
    so **never a secret**), for example ``{"loop": "/dev/loop3", "created": "true"}``.

    ``blank`` is what the backend knows about the device's content, consulted only when
    ``blkid`` finds no signature on it: ``True`` when it was never written (a file created by
    this very call, or one with no data extents on a freshly attached device), ``False`` when
    it holds data (never formatted), ``None`` when the backend cannot tell; the core then
    formats only if the device's first and last MiB read back as zeros. Never journalled.
    """

    __slots__ = ("device", "details", "blank")  # noqa: RUF023 - the fields, in order
    _compare = ("device", "details")  # not ``blank``
    device: str
    details: Mapping[str, str]
    blank: bool | None

    def __init__(
        self, device: str, details: Mapping[str, str] | None = None, blank: bool | None = None
    ) -> None:
        self._set(device=device, details={} if details is None else details, blank=blank)


class VolumeTrouble(Frozen):
    """What a volume's attachment on this node lacks (:meth:`BlockBackend.health`).

    ``status`` is ``"degraded"`` (it still serves, with less: a multipath path lost) or
    ``"inaccessible"`` (it does not: every path down); ``reason`` one CamelCase word;
    ``message`` one line naming what is wrong, **never a secret**.

    .. versionadded:: 0.3
    """

    __slots__ = ("status", "reason", "message")  # noqa: RUF023 - the fields, in order
    status: str
    reason: str
    message: str

    def __init__(self, status: str, reason: str, message: str) -> None:
        if status not in ("degraded", "inaccessible"):
            raise ValueError(f"VolumeTrouble status {status!r}: degraded or inaccessible")
        self._set(status=status, reason=reason, message=message)


class Backend(abc.ABC):
    """Base of every backend.

    :param node: the node services (command runner, mount table, locks, this backend's
        table of the node config).
    """

    #: The package holding the schema file, and its name. The schema is JSON Schema draft
    #: 2020-12 over the options object (all values strings); ``kubernetes.io/*`` keys are
    #: allowed by the core and need not be listed.
    schema_package: ClassVar[str] = ""
    schema_file: ClassVar[str] = "schema.json"
    #: What the backend needs on the node (``flexhub doctor`` checks it).
    node_requirements: ClassVar[NodeRequirements] = NodeRequirements()
    #: The keys of this backend's table of the node config (``[<name>]``): any other key there
    #: fails every volume call of this backend, naming it. ``None`` (the default, for
    #: backends written before 0.2) declares nothing: the table is not checked, and
    #: ``flexhub doctor`` warns when it is not empty. Declare ``frozenset()`` for a backend
    #: that reads no settings.
    #:
    #: .. versionadded:: 0.2
    settings_keys: ClassVar[frozenset[str] | None] = None

    def __init__(self, node: Node) -> None:
        self.node = node

    @classmethod
    def schema(cls) -> dict[str, Any]:
        """Return the backend's JSON Schema as a dict."""
        package = cls.schema_package or cls.__module__
        try:
            from importlib import resources

            text = resources.files(package).joinpath(cls.schema_file).read_text("utf-8")
            loaded = json.loads(text)
        except (OSError, ValueError, ModuleNotFoundError) as exc:
            raise BackendError(
                f"backend schema {package}/{cls.schema_file} unreadable: {exc}"
            ) from None
        if not isinstance(loaded, dict):
            raise BackendError(f"backend schema {package}/{cls.schema_file} is not an object")
        return loaded

    @classmethod
    def check_settings(
        cls, name: str, settings: Mapping[str, Any], config: NodeConfig | None = None
    ) -> None:
        """Check this backend's table ``[name]`` of the node config.

        The default refuses keys outside :attr:`settings_keys` (when declared). Override it to
        check values too, calling ``super().check_settings(...)`` first. Runs on every volume
        call that sets up storage (not ``init`` nor ``unmount``) and in ``flexhub doctor``.

        :raises FlexhubError: one line naming the table, the key and what is wrong.

        .. versionadded:: 0.2
        """
        if cls.settings_keys is not None:
            from flexhub.settings import check_keys

            check_keys(config, name, settings, cls.settings_keys)

    @classmethod  # noqa: B027 - an optional hook
    def check_options(cls, volume: Volume) -> None:
        """Check rules on the options alone that a schema cannot express (contradictions,
        ranges), needing neither the node nor secrets.

        Runs on every call after schema validation, and in ``flexhub validate``.
        Raise :class:`InvalidOptions`.
        """

    @classmethod
    def secret_needed(cls, options: Mapping[str, str]) -> str:
        """Why a volume with these options needs a Secret (``secretRef`` in the manifest),
        or ``""`` when it does not. ``flexhub validate`` reports a missing ``secretRef``
        with this reason; calls check the secrets themselves in :meth:`check`.

        .. versionadded:: 0.2
        """
        return ""

    def check(self, volume: Volume) -> None:  # noqa: B027 - optional hook
        """Check what depends on this node or on the call (paths on the node, secrets).

        Runs after :meth:`check_options` and before any change. Raise :class:`InvalidOptions`.
        """

    @abc.abstractmethod
    def volume_id(self, volume: Volume) -> str:
        """Return the node-wide identity of the storage, e.g. ``"nfs:srv1:/export/a"``.

        Two volumes with the same id are the same storage: they share locks and, for block
        backends, one staging mount.
        """


class FilesystemBackend(Backend):
    """A backend whose storage mounts straight onto a directory (NFS, ...).

    The core holds only the pod directory's lock around :meth:`mount` and :meth:`unmount`,
    so mounts and unmounts of one volume on different pod directories run in parallel (each
    must be safe to run alongside the others). Set :attr:`volume_lock` to have the core also
    hold the volume's lock, or take ``self.node.lock(...)`` on what really needs it.
    """

    #: Whether the core serialises every mount and unmount of one volume id on the node.
    volume_lock: ClassVar[bool] = False

    @abc.abstractmethod
    def mount(self, target: Path, volume: Volume) -> Mapping[str, str]:
        """Mount ``volume`` on the existing, empty directory ``target``.

        :returns: non-secret details to journal (given back to :meth:`unmount`).
        """

    def unmount(self, target: Path, details: Mapping[str, str]) -> None:
        """Unmount ``target``; by default, the core's unmount with escalation."""
        self.node.unmount(target)

    def collect_leftovers(self) -> None:
        """Remove what a call of this backend that was killed left on the node (a private
        file written for a mount command, ...); by default nothing.

        The core calls it after every ``unmount`` of a pod directory of this backend, also
        when nothing was mounted there (a ``mount`` killed before its mount command finished
        leaves a record but no mount) or the directory is gone. It must only touch what the
        backend itself made, and never raise: log instead.
        """

    def expand(self, target: Path, volume: Volume, new_size: int) -> None:
        """Grow the volume to ``new_size`` bytes; by default nothing (size is the server's)."""


class BlockBackend(Backend):
    """A backend that provides a block device; the core formats, stages and binds it."""

    #: Whether other nodes may mount the same device at the same time (a SAN LUN), as
    #: opposed to a node-local one (a loop file). For such a device the core mounts a
    #: read-only staging mount with ``norecovery`` (the journal another node writes is never
    #: replayed) and never remounts a read-only staging mount read-write (its cache may be
    #: stale). Keeping two nodes from writing is the backend's job, in :meth:`attach`.
    #:
    #: .. versionadded:: 0.2
    shared_device: ClassVar[bool] = False

    @abc.abstractmethod
    def attach(self, volume: Volume) -> Attachment:
        """Make the volume's block device present on this node and return it.

        Idempotent: when the device is already present, return it again. The core calls it
        (for a read-write ``volume``) before every read-write staging mount, also when the
        device is already attached for a read-only one: where a backend fences other
        writers (iSCSI reserves the LUN), it does so here, for every read-write volume.
        """

    def access(self, volume: Volume) -> Mapping[str, str]:
        """The volume's *connection identity*: what lets this node reach the storage.

        The core journals it with the staged volume (so **never a secret**: digest secret
        parts with a node-local key, e.g. HMAC) and compares it on every later ``mount`` of
        the same volume id that would share the staging mount without calling
        :meth:`attach`: any key whose value differs (or is missing on one side) makes that
        mount a Failure naming the keys, never the values. So a volume that names the same
        storage with other credentials cannot ride on a device attached with the right ones.
        The default, ``{}``, lets every volume of the same id share.

        .. versionadded:: 0.2
        """
        return {}

    def health(self, attachment: Attachment) -> list[VolumeTrouble]:
        """What this node's attachment lacks beyond its staging mount answering a stat, which
        the core checks itself (CSI ``NodeGetVolumeHealth``): a session down, a path lost.
        ``attachment`` is the journalled one (its ``details`` as :meth:`attach` returned).

        Read only and quick (sysfs, no command, no I/O to the storage): the core bounds it and
        takes an exception or a late answer for "nothing known". The default knows nothing.

        .. versionadded:: 0.3
        """
        return []

    @abc.abstractmethod
    def detach(self, attachment: Attachment) -> None:
        """Release a device returned by :meth:`attach`; no-op when already gone.

        Raise :class:`ReleaseDeferred` when the storage is unreachable and releasing now
        would throw away writes still queued for it: the unmount succeeds, the record stays,
        and the core calls ``detach`` again at the node's next unmount until it succeeds.

        .. versionchanged:: 0.2 may raise :class:`ReleaseDeferred`.
        """

    def discard(self, attachment: Attachment) -> None:
        """Undo what :meth:`attach` created for a ``mount`` that then failed.

        Called only by the rollback of the very call whose attach returned ``attachment``,
        after :meth:`detach` released it and no pod uses the volume; never by ``unmount``.
        Remove only what that attach created and nothing else has used since (loopfile: the
        backing file it made). Default: nothing.

        .. versionadded:: 0.2
        """

    def release_waits(self, attachment: Attachment) -> str:
        """Why releasing ``attachment`` now must wait, found without changing anything
        (``""``: nothing known). The core asks before it checks the device itself (an
        exclusive open, which fails while a filesystem still writes back to unreachable
        storage), so that the reason it names is the storage's; :meth:`detach` must still
        raise :class:`ReleaseDeferred` on its own.

        .. versionadded:: 0.2
        """
        return ""

    def still_attached(self, attachment: Attachment) -> bool | None:
        """Whether the device path of ``attachment`` still is that attachment's device, found
        without changing anything: ``False`` when the name now maps something else (after a
        reboot, or the loss of the device, the kernel reused it), ``None`` when unknown.

        The core asks before its exclusive-open busy check of a release: a device that is
        no longer the volume's is not probed (another volume, or anything else, may hold it),
        and :meth:`detach` goes on (it must leave a device that is not the attachment's
        alone). Default: ``None``, the device is probed.

        .. versionadded:: 0.2
        """
        return None

    #: Whether :meth:`release` is implemented (the backend reports its attach's progress).
    releases_partial: ClassVar[bool] = False

    def release(self, partial: Mapping[str, str]) -> None:
        """Undo an attach that never returned (a crash, a failure) from what it reported.

        ``partial`` merges every ``self.node.record_progress(...)`` of that attach (possibly
        empty: it stopped before its first report). Release exactly that, never by attaching
        again; no-op for what is already gone. Set :attr:`releases_partial` when implementing
        it; backends that do not are asked to attach again and detach instead.

        .. versionadded:: 0.2
        """
        raise NotSupported(f"{type(self).__name__} cannot release a partial attach")

    def expand(self, attachment: Attachment, volume: Volume, new_size: int) -> None:
        """Make the block device ``new_size`` bytes (or larger) before the filesystem grows."""
        raise VolumeError(f"backend {volume.backend!r} cannot expand volumes")
