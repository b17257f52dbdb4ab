"""The ``nfs`` backend: an NFS export mounted on the pod's volume directory.

A PV names a server and an exported path, and optionally a version, mount options and a
sub-directory::

    options: {backend: nfs, server: nfs1.example.com, share: /exports/team,
              nfsVersion: "4.1", mountOptions: "nconnect=4,noatime",
              subPath: app/data, createSubPath: "true", subPathMode: "0770"}

One NFS mount per pod directory (a :class:`~flexhub.backend.FilesystemBackend`): the kernel
already shares one NFS superblock, and so one TCP connection and one page cache, between the
mounts of the same export with the same options, so a node-wide staging mount plus bind
mounts would add a second mount to clean up per volume and win nothing.

Mount (``mount -t nfs -o OPTS -- server:/share[/subPath] TARGET``):

* ``vers=`` comes from ``nfsVersion`` (or ``vers=``/``nfsvers=`` in ``mountOptions``, or
  ``kubernetes.io/fsType: nfs4`` which means ``vers=4``); absent, the client negotiates.
* Defaults, each added only when the PV does not set it: ``hard`` (a write is never silently
  dropped; a dead server makes I/O wait, not fail) and ``retry=0`` (``mount.nfs`` gives up at
  the first definite error instead of retrying for two minutes: kubelet retries the call with
  back-off anyway, and the error reaches the pod's events at once). Everything else is the
  kernel's default (for TCP: ``timeo=600,retrans=2``).
* ``kubernetes.io/readwrite: ro`` (or ``ro`` in ``mountOptions``) adds ``ro``; the result is
  checked in mountinfo.
* The command runs under ``[nfs] mount_timeout`` (default: the node's ``mount_timeout``). On
  timeout the node's runner kills its whole process group (``mount`` and ``mount.nfs``), and
  the directory is unmounted again in case the kernel finished the mount at the last moment.
* ``subPath``: the export's root is first mounted on a private directory under
  ``<state_dir>/nfs-tmp/`` (read-write when ``createSubPath: "true"``, else with the pod's
  options), the sub-directory is walked one component at a time with
  ``openat(O_NOFOLLOW|O_DIRECTORY)`` (:mod:`flexhub_nfs._subpath`), refusing any symlink, and
  made with ``mkdirat`` where missing when ``createSubPath: "true"`` (``subPathMode``, default
  ``0750``, applies exactly to the last segment; missing parents get ``0777`` less the umask);
  the walked directory is bind-mounted on the pod directory through its descriptor
  (``mount --no-canonicalize --bind /proc/<pid>/fd/<n>``), checked to be the same directory
  after the bind, and the private mount is removed. A symlink in the export (planted by a
  client, or served by a hostile server) therefore never makes flexhub create or mount
  anything outside the export.
* A stale mount already on the directory (ESTALE after a server restart) is unmounted and
  mounted again; the same export already mounted and healthy is success; anything else
  mounted there is a failure.

Unmount: when the mount answers ``stat`` and ``statvfs`` within ``[nfs] stat_timeout``
(default 5 s; ``statvfs`` always asks the server, so a stale handle shows at once), a plain
``umount`` bounded by ``[nfs] unmount_timeout`` (default: the node's ``unmount_timeout``). When
it does not (a dead or unreachable server, a stale handle), or the plain step fails,
``umount -f -l``: the forced flag aborts the RPCs in flight, the lazy flag detaches the mount at
once. After the detach the kernel's farewell to a dead NFSv4 server can block that command until
it is killed, so the step is bounded by ``[nfs] force_unmount_timeout`` (default 5 s) and its
success is judged from mountinfo, not from its exit status. No step canonicalizes the path
(``-c``: a ``stat`` of a dead hard mount blocks) or runs the ``umount.nfs`` helper (``-i``: for
v3 it calls the server's mountd). A dead server therefore costs at most
``stat_timeout + force_unmount_timeout`` (10 s by default), a live one a plain ``umount``.

fsGroup: ignored. The driver reports ``fsGroup: false``, so kubelet never chowns, and flexhub
never chowns an NFS share (a recursive chown of a shared export is slow, races other clients
and is often refused by root squashing). Give the export the right owner on the server, or use
``createSubPath`` with ``subPathMode``.

Expansion: success without change (an NFS volume's size is the server's).

Provisioning (:class:`~flexhub.provisioning.Provisioning`): a StorageClass names an export
(``server``, ``share``); each claim gets its own directory there, named by ``pathPattern``
(:mod:`flexhub.pathpattern`) and owned as ``uid``/``gid``/``mode`` say (default ``0:0``,
``2770``), and its PV mounts exactly that directory through ``subPath``. The provisioner mounts
the export read-write on a private directory for each call (the mount code above, with its
timeouts), makes, removes or renames the directory with a walk that never follows a symlink
(:mod:`flexhub.claimdir`), and unmounts. The claim's size is not enforced.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from flexhub import claimdir
from flexhub.backend import (
    CommandError,
    CommandTimeout,
    FilesystemBackend,
    FlexhubError,
    NodeConfig,
    NodeRequirements,
    Secrets,
    Volume,
    VolumeError,
    kernel_lacks,
)
from flexhub.provisioning import Claim, Provisioned, Provisioning
from flexhub_nfs import _subpath
from flexhub_nfs._options import Plan, build_plan

if TYPE_CHECKING:
    from flexhub.backend import MountEntry

__all__ = ["DEFAULT_FORCE_TIMEOUT", "DEFAULT_STAT_TIMEOUT", "NFS_TYPES", "NfsBackend"]

LOG = logging.getLogger(__name__)

#: Filesystem types an NFS mount shows in mountinfo.
NFS_TYPES = frozenset({"nfs", "nfs4"})
#: Seconds the health ``stat`` of a mount point may take before it counts as hung.
DEFAULT_STAT_TIMEOUT = 5.0
#: Seconds the forced and lazy ``umount`` of a dead mount may run before it is killed.
DEFAULT_FORCE_TIMEOUT = 5.0
#: Age in seconds after which a leftover ``nfs-tmp`` directory is garbage.
TEMP_MAX_AGE = 3600.0

_ID_PREFIX = "nfs:"
_SQUASH_HINT = " (does the server squash root? the provisioner needs no_root_squash)"

_T = TypeVar("_T")


def _same_source(shown: str, wanted: str) -> bool:
    return shown.rstrip("/") == wanted.rstrip("/")


def _holds(entry: MountEntry, plan: Plan) -> bool:
    """Whether a mount is ``plan``'s: the export itself, or a bind of its sub-directory."""
    if _same_source(entry.source, plan.source):
        return True
    return (
        bool(plan.sub_path)
        and _same_source(entry.source, plan.root_source)
        and entry.root.rstrip("/").endswith("/" + plan.sub_path)
    )


def _seconds(settings: Mapping[str, Any], key: str, default: float) -> float:
    value: Any = settings.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise FlexhubError(f"node config: [nfs] {key} must be a positive number")
    return float(value)


class NfsBackend(FilesystemBackend, Provisioning):
    """NFS exports mounted straight onto pod directories; a directory per claim on an
    export for a provisioning StorageClass."""

    schema_package = "flexhub_nfs"
    parameters_schema_file = "provision-schema.json"
    on_delete = frozenset({"delete", "retain", "archive"})
    node_requirements = NodeRequirements(
        commands=("mount.nfs", "mount", "umount"),
        kernel_modules=("nfs",),
        hint="install the NFS client (nfs-common on Debian/Ubuntu, nfs-utils on RHEL/Fedora)",
    )

    # --------------------------------------------------------------------------- settings

    settings_keys = frozenset(
        {"mount_timeout", "unmount_timeout", "force_unmount_timeout", "stat_timeout"}
    )

    @classmethod
    def check_settings(
        cls, name: str, settings: Mapping[str, Any], config: NodeConfig | None = None
    ) -> None:
        """``[nfs]``: known keys, each a positive number of seconds."""
        super().check_settings(name, settings, config)
        for key in sorted(cls.settings_keys):
            _seconds(settings, key, 1.0)

    def _seconds(self, key: str, default: float) -> float:
        return _seconds(self.node.settings, key, default)

    @property
    def mount_timeout(self) -> float:
        """Bound of one ``mount`` command: ``[nfs] mount_timeout`` or the node's."""
        return self._seconds("mount_timeout", self.node.config.mount_timeout)

    @property
    def unmount_timeout(self) -> float:
        """Bound of each ``umount`` step: ``[nfs] unmount_timeout`` or the node's."""
        return self._seconds("unmount_timeout", self.node.config.unmount_timeout)

    @property
    def force_timeout(self) -> float:
        """Bound of the forced and lazy ``umount``: ``[nfs] force_unmount_timeout`` (5 s)."""
        return self._seconds("force_unmount_timeout", DEFAULT_FORCE_TIMEOUT)

    @property
    def stat_timeout(self) -> float:
        """Bound of the health ``stat`` of a mount point: ``[nfs] stat_timeout`` (5 s)."""
        return self._seconds("stat_timeout", DEFAULT_STAT_TIMEOUT)

    # --------------------------------------------------------------------------- API

    @classmethod
    def check_options(cls, volume: Volume) -> None:
        """Check everything the schema cannot: contradictions, ranges, addresses."""
        build_plan(volume)

    def check(self, volume: Volume) -> None:
        """Note an fsGroup that NFS volumes ignore (the options were checked already)."""
        if volume.fs_group is not None:
            LOG.debug("fsGroup %d ignored: flexhub never chowns an NFS share", volume.fs_group)

    def volume_id(self, volume: Volume) -> str:
        """``nfs:<host>:<path>``, e.g. ``nfs:nfs1.example.com:/exports/team/app``."""
        return _ID_PREFIX + build_plan(volume).source

    def mount(self, target: Path, volume: Volume) -> Mapping[str, str]:
        """Mount the export (or its sub-directory) on ``target``.

        :raises CommandTimeout: the server did not answer within the mount timeout.
        :raises CommandError: ``mount`` failed (its message says why).
        :raises VolumeError: something else is mounted on ``target``, or the mount is not
            what was asked for (read-only).
        """
        plan = build_plan(volume)
        details = {"source": plan.source, "server": plan.host}
        if self._already_mounted(target, plan):
            LOG.info("%s already holds %s: nothing to do", target, plan.source)
            return self._with_version(target, details)
        started = time.monotonic()
        if plan.sub_path:
            self._mount_sub_path(target, plan)
        else:
            self._mount(plan.source, target, plan.options, plan)
        entry = self.node.mounts.at(target)
        if entry is None or entry.fs_type not in NFS_TYPES:
            self._cleanup(target)
            raise VolumeError(f"{target} is not an NFS mount after mounting {plan.source}")
        if plan.read_only and not entry.read_only:
            self._cleanup(target)
            raise VolumeError(f"the mount of {plan.source} on {target} did not become read-only")
        LOG.info(
            "mounted %s on %s (%s) in %.3fs",
            plan.source,
            target,
            ",".join(plan.options),
            time.monotonic() - started,
        )
        return self._with_version(target, details)

    def unmount(self, target: Path, details: Mapping[str, str]) -> None:
        """Unmount ``target``, also when its server is gone; see the module docstring.

        :raises CommandError: the mount is still there after the lazy unmount.
        """
        self._unmount(target)
        self.node.unmount(target)  # anything else stacked there: the core's escalation

    # --------------------------------------------------------------------------- provisioning

    @classmethod
    def check_parameters(cls, parameters: Mapping[str, str]) -> None:
        """A provisioning class's parameters: the export, mount options, pathPattern, owner
        and mode (see :mod:`flexhub_nfs._provision`)."""
        from flexhub_nfs import _provision

        _provision.read(parameters)

    def provision(
        self, claim: Claim, parameters: Mapping[str, str], secrets: Secrets
    ) -> Provisioned:
        """Make (or find) the claim's directory on the export, owned and moded as the class
        says, and return PV options that mount exactly it (``subPath``).

        The export is mounted read-write on a private directory for the call; the directory
        is made by a walk that never follows a symlink (:mod:`flexhub.claimdir`). The size is
        the claim's: NFS does not enforce it (the server's quota may).
        """
        from flexhub_nfs import _provision

        spec = _provision.read(parameters)
        path = _provision.directory(spec, claim)
        options = spec.pv_options(path)
        plan = build_plan(Volume(options={"backend": "nfs", **options}, fs_type=spec.fs_type))
        made = self._in_export(
            plan,
            f"making {path} in {plan.root_source}",
            self.mount_timeout,
            lambda root: claimdir.make(
                root, path, owner=(spec.uid, spec.gid), mode=spec.mode, hint=_SQUASH_HINT
            ),
        )
        LOG.info(
            "%s %s/%s for claim %s/%s (owner %d:%d, mode %04o)",
            "made" if made else "found",
            plan.root_source,
            path,
            claim.namespace,
            claim.name,
            spec.uid,
            spec.gid,
            spec.mode,
        )
        return claimdir.provisioned(claim, options, path, fs_type=spec.fs_type)

    def reclaim(
        self, options: Mapping[str, str], reclaim: Mapping[str, str], secrets: Secrets
    ) -> None:
        """Delete, archive or retain the recorded directory (:func:`flexhub.claimdir.reclaim`:
        only the PV's ``subPath`` whose name holds the claim's uid; gone already is success)."""

        def export() -> claimdir.MountedRoot:
            plan = build_plan(Volume(options={**options, "backend": "nfs"}))
            return claimdir.MountedRoot(
                plan.root_source,
                lambda what, bound, work: self._in_export(plan, what, bound, work),
            )

        claimdir.reclaim(
            options,
            reclaim,
            honoured=self.on_delete,
            location=f"{options.get('server')}:{options.get('share')}",
            root=export,
        )

    def _in_export(self, plan: Plan, what: str, bound: float, work: Callable[[int], _T]) -> _T:
        """Run ``work(root_fd)`` on the export's root, mounted read-write on a private
        directory, within ``bound`` seconds (a dead server makes it a CommandTimeout)."""
        with self._private_mount(plan, plan.root_options) as temp:
            return claimdir.in_root(
                temp, work, what=what, bound=bound, server=f"NFS server {plan.host}"
            )

    # --------------------------------------------------------------------------- mount

    def _healthy(self, path: Path) -> bool:
        """Whether the mount at ``path`` answers ``stat`` and ``statvfs`` (which always asks
        the server) within ``[nfs] stat_timeout``; a dead hard mount costs only the bound."""
        return not self.node.is_corrupted(path, self.stat_timeout)

    def _already_mounted(self, target: Path, plan: Plan) -> bool:
        """Whether ``target`` already holds a healthy mount of ``plan``; cleans a stale one."""
        entry = self.node.mounts.at(target)
        if entry is None:
            return False
        if entry.fs_type in NFS_TYPES and _holds(entry, plan):
            if self._healthy(target):
                if entry.read_only != plan.read_only:
                    raise VolumeError(
                        f"{target} already holds {plan.source} "
                        f"{'read-only' if entry.read_only else 'read-write'}"
                    )
                return True
            LOG.warning("%s holds a stale mount of %s: mounting it again", target, plan.source)
            self._unmount(target)  # raises rather than stack a new mount on a stale one
            return False
        raise VolumeError(f"{target} is already a mount point of {entry.source}")

    def _mount(self, source: str, target: Path, options: tuple[str, ...], plan: Plan) -> None:
        """Run the mount command under the mount timeout; leave ``target`` clean on failure."""
        argv = ["mount", "-t", "nfs", "-o", ",".join(options), "--", source, str(target)]
        bound = self.mount_timeout
        try:
            self.node.runner(argv, timeout=bound)
        except CommandTimeout:
            self._cleanup(target)
            raise CommandTimeout(
                f"NFS server {plan.host} did not answer within {bound:g}s: mount of {source} "
                "abandoned and its processes killed"
            ) from None
        except CommandError as exc:
            self._cleanup(target)
            output = exc.output or str(exc)
            lacking = kernel_lacks("nfs", output)
            if lacking:
                raise VolumeError(f"mount of NFS export {source} failed: {lacking}") from None
            missing = "No such file or directory" in output
            if missing and source == plan.source and plan.sub_path and not plan.create_sub_path:
                raise VolumeError(
                    f'{source} does not exist on the server (createSubPath: "true" creates it)'
                ) from None
            raise CommandError(
                f"mount of NFS export {source} failed (exit {exc.returncode}): {output}",
                returncode=exc.returncode,
                output=output,
            ) from None

    def _with_version(self, target: Path, details: dict[str, str]) -> dict[str, str]:
        """Add the negotiated version (``vers=`` of the superblock) to ``details``."""
        entry = self.node.mounts.at(target)
        if entry is not None:
            for option in (*entry.super_options, *entry.options):
                if option.startswith("vers="):
                    details["vers"] = option[len("vers=") :]
                    break
        return details

    def _mount_sub_path(self, target: Path, plan: Plan) -> None:
        """Mount the export's root on a private directory, walk (or make) the sub-directory
        without following a symlink, and bind-mount exactly that directory on ``target``.

        See :mod:`flexhub_nfs._subpath`: the walk holds a descriptor of every component, and
        the bind's source is that descriptor, so a symlink swapped in meanwhile changes
        nothing; the result is checked again (same device and inode) after the bind.
        """
        options = plan.root_options if plan.create_sub_path else plan.options
        with self._private_mount(plan, options) as temp:
            self._bind_sub_path(temp, target, plan)

    @contextlib.contextmanager
    def _private_mount(self, plan: Plan, options: tuple[str, ...]) -> Iterator[Path]:
        """The export's root mounted (under the mount timeout) on a new private directory
        ``<state_dir>/nfs-tmp/<random>``, unmounted and removed on the way out."""
        base = Path(os.path.realpath(self.node.state_dir)) / "nfs-tmp"
        base.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._collect_temp(base)
        temp = claimdir.temp_mount_point(base)
        try:
            self._mount(plan.root_source, temp, options, plan)
            try:
                yield temp
            finally:
                self._cleanup(temp)
        finally:
            with contextlib.suppress(OSError):
                temp.rmdir()

    def _bind_sub_path(self, temp: Path, target: Path, plan: Plan) -> None:
        bound = self.mount_timeout
        what = f"walking {plan.sub_path} in {plan.root_source}"

        def walk(root: int) -> int:
            return _subpath.open_sub_path(
                root, plan.sub_path, create=plan.create_sub_path, mode=plan.sub_path_mode
            )

        try:
            fd = claimdir.in_root(
                temp, walk, what=what, bound=bound, server=f"NFS server {plan.host}"
            )
        except _subpath.SubPathMissing as exc:
            raise VolumeError(
                f'{plan.source} does not exist on the server ({exc.message}; createSubPath: "true" '
                "creates it)"
            ) from None
        except VolumeError as exc:
            raise VolumeError(
                f"refusing subPath {plan.sub_path} of {plan.root_source}: {exc}"
            ) from None
        try:
            if plan.create_sub_path:
                LOG.info(
                    "made sure %s/%s exists (mode %04o)",
                    plan.root_source,
                    plan.sub_path,
                    plan.sub_path_mode,
                )
            source = f"/proc/{os.getpid()}/fd/{fd}"
            self.node.runner(
                ["mount", "--no-canonicalize", "--bind", "--", source, str(target)],
                timeout=bound,
            )
            try:
                if plan.read_only:
                    self.node.runner(
                        ["mount", "--no-canonicalize", "-o", "remount,bind,ro", "--", str(target)],
                        timeout=bound,
                    )
                if not self._holds_directory(target, fd):
                    raise VolumeError(
                        f"{target} does not hold {plan.source} after binding it: refused"
                    )
            except BaseException:
                self._cleanup(target)
                raise
        except CommandError as exc:
            raise CommandError(
                f"bind mount of {plan.source} on {target} failed: {exc.output or exc.message}",
                returncode=exc.returncode,
                output=exc.output,
            ) from None
        finally:
            os.close(fd)

    @staticmethod
    def _holds_directory(target: Path, fd: int) -> bool:
        """Whether ``target`` now shows the directory open as ``fd`` (device and inode)."""
        wanted, now = os.fstat(fd), os.stat(target)
        return (now.st_dev, now.st_ino) == (wanted.st_dev, wanted.st_ino)

    def _collect_temp(self, base: Path) -> None:
        """Unmount and remove ``nfs-tmp`` directories a crashed call left behind."""
        now = time.time()
        try:
            leftovers = list(base.iterdir())
        except OSError:
            return
        for path in leftovers:
            try:
                if not claimdir.temp_is_leftover(path, now, TEMP_MAX_AGE):
                    continue
                LOG.warning("removing leftover temporary NFS mount point %s", path)
                self._cleanup(path)
                path.rmdir()
            except (FlexhubError, OSError) as exc:
                LOG.warning("cannot remove leftover %s: %s", path, exc)

    # --------------------------------------------------------------------------- unmount

    def _cleanup(self, target: Path) -> None:
        """Unmount whatever is on ``target``, logging instead of raising (rollback paths)."""
        try:
            self._unmount(target)
            self.node.unmount(target)
        except FlexhubError as exc:
            LOG.error("cannot clean %s: %s", target, exc)

    def _unmount(self, target: Path) -> None:
        """Remove every mount stacked on ``target``: plain, then forced and lazy ``umount``.

        The plain step runs only when the mount answers a ``stat``; the forced and lazy step
        detaches at once and is bounded by ``force_unmount_timeout``, because after the detach
        the kernel's goodbye to a dead NFSv4 server blocks the command until it is killed.

        :raises CommandError: a mount is still there after the forced and lazy step.
        """
        where = os.path.normpath(os.path.abspath(target))
        for _ in range(32):  # stacked mounts, removed one by one
            entry = self.node.mounts.at(where)
            if entry is None:
                return
            started = time.monotonic()
            steps: list[tuple[tuple[str, ...], float]] = [(("-f", "-l"), self.force_timeout)]
            if entry.fs_type not in NFS_TYPES or self._healthy(Path(where)):
                steps.insert(0, ((), self.unmount_timeout))
            last: CommandError | None = None
            for flags, bound in steps:
                try:
                    self.node.runner(["umount", "-c", "-i", *flags, "--", where], timeout=bound)
                except CommandError as exc:
                    last = exc
                    LOG.warning("umount %s %s: %s", " ".join(flags), where, exc)
                now = self.node.mounts.at(where)
                if now is None or now.mount_id != entry.mount_id:
                    LOG.info(
                        "unmounted %s from %s (%s) in %.3fs",
                        entry.source,
                        where,
                        " ".join(flags) or "plain",
                        time.monotonic() - started,
                    )
                    break
            else:
                raise CommandError(f"cannot unmount {entry.source} from {where}: {last}")
        raise CommandError(f"more than 32 mounts stacked on {where}")
