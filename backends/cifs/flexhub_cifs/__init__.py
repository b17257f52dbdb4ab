"""The ``cifs`` backend: an SMB/CIFS share mounted on the pod's volume directory.

Written as a third party would: it imports only flexhub's public backend modules
(:mod:`flexhub.backend`, :mod:`flexhub.provisioning`, :mod:`flexhub.pathpattern`,
:mod:`flexhub.claimdir`). A PV names a server, a share, and optionally a dialect, a
sub-directory, ownership and mount options; the credentials come only from the PV's Secret
(``secretRef``, keys ``username``, ``password``, ``domain``)::

    options: {backend: cifs, server: files.example.com, share: team, vers: "3.1.1",
              subPath: app/data, mountOptions: "seal,noatime"}
    secretRef: {name: team-smb}     # type k8s/flexhub; data: username, password[, domain]

One mount per pod directory (a :class:`~flexhub.backend.FilesystemBackend`), like nfs: the
kernel shares one SMB session and TCP connection between mounts of the same share with the
same user and password.

Mount (``mount -t cifs -o OPTS,credentials=FILE -- //server/share TARGET``):

* ``vers`` is the dialect (2.1, 3, 3.0, 3.02, 3.1.1); absent, ``vers=default`` (the client
  negotiates SMB 2.1 or later; a kernel too old to know it fails rather than speak SMB1).
  SMB1 (``1.0``) is refused, as is ``vers=`` in ``mountOptions``.
* The credentials go through a file created 0600 in a private 0700 directory under the state
  directory and removed as soon as the command returns (:mod:`flexhub_cifs._credentials`):
  never on a command line, never in an environment.
* ``hard`` unless the PV says ``soft`` (a write is never silently dropped), as for NFS.
* ``uid``, ``gid``, ``file_mode``, ``dir_mode`` are options of their own; with a pod fsGroup,
  ``gid`` defaults to it and both modes to ``0770`` (owner and group, nobody else).
* ``kubernetes.io/readwrite: ro`` (or ``ro`` in ``mountOptions``) mounts ``ro``; checked in
  mountinfo.
* The command runs under ``[cifs] mount_timeout`` (default: the node's ``mount_timeout``); on
  timeout the runner kills its process group and the directory is unmounted again.
* ``subPath`` (must exist): the share's root is mounted on a private directory under
  ``<state_dir>/cifs-tmp/``, the sub-directory walked with ``openat(O_NOFOLLOW|O_DIRECTORY)``
  (:mod:`flexhub_cifs._subpath`), refusing any symlink, bind-mounted on the pod directory
  through its descriptor, checked, and the private mount removed (the same decisions as nfs).
* A stale mount already on the directory is unmounted and mounted again; the same share
  already mounted and healthy is success; anything else mounted there is a failure.

Unmount: when the mount answers ``stat`` and ``statvfs`` within ``[cifs] stat_timeout``
(default 5 s), a plain ``umount`` bounded by ``[cifs] unmount_timeout``; otherwise (a dead
server), or when the plain step fails, ``umount -f -l`` bounded by
``[cifs] force_unmount_timeout`` (default 5 s), judged from mountinfo. A dead server costs at
most ``stat_timeout + force_unmount_timeout``.

Expansion: success without change (the share's size is the server's).

Provisioning (:class:`~flexhub.provisioning.Provisioning`): a StorageClass names a share
(``server``, ``share``) and the Secret of its credentials (``secretName``,
``secretNamespace``); each claim gets its own directory there, named by ``pathPattern``
(:mod:`flexhub.pathpattern`), and its PV mounts exactly that directory through ``subPath``,
with the class's ``uid``/``gid`` and modes (``mode`` -> ``dir_mode``, ``fileMode`` ->
``file_mode``) and the class's Secret as its ``secretRef``. The provisioner mounts the share
on a private directory for each call (the mount code above, with its timeouts and its
credentials file), makes, removes or renames the directory with a walk that never follows a
symlink (:mod:`flexhub.claimdir`), and unmounts. The claim's size is not enforced.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol, TypeVar

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
from flexhub_cifs import _subpath
from flexhub_cifs._credentials import collect_leftovers, credentials_file
from flexhub_cifs._options import Credentials, Plan, build_plan, credentials

__all__ = ["CIFS_TYPES", "DEFAULT_FORCE_TIMEOUT", "DEFAULT_STAT_TIMEOUT", "CifsBackend"]

LOG = logging.getLogger(__name__)

#: Filesystem types a CIFS mount shows in mountinfo.
CIFS_TYPES = frozenset({"cifs", "smb3"})
DEFAULT_STAT_TIMEOUT = 5.0
DEFAULT_FORCE_TIMEOUT = 5.0
#: Age in seconds after which a leftover ``cifs-tmp`` directory is garbage.
TEMP_MAX_AGE = 3600.0

_ID_PREFIX = "cifs:"

_T = TypeVar("_T")


class _Entry(Protocol):
    """What this backend reads of a mountinfo entry (``node.mounts.at``)."""

    @property
    def source(self) -> str: ...
    @property
    def root(self) -> str: ...


def _same(shown: str, wanted: str) -> bool:
    return shown.rstrip("/").lower() == wanted.rstrip("/").lower()


def _holds(entry: _Entry, plan: Plan) -> bool:
    """Whether a mount is ``plan``'s: the share itself, or a bind of its sub-directory."""
    if not plan.sub_path:
        return _same(entry.source, plan.root_source) and entry.root.rstrip("/") == ""
    return _same(entry.source, plan.root_source) and entry.root.rstrip("/").endswith(
        "/" + plan.sub_path
    )


def _seconds(settings: Mapping[str, Any], key: str, default: float) -> float:
    value: Any = settings.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise FlexhubError(f"node config: [cifs] {key} must be a positive number")
    return float(value)


class CifsBackend(FilesystemBackend, Provisioning):
    """SMB/CIFS shares mounted straight onto pod directories; a directory per claim on a
    share for a provisioning StorageClass."""

    schema_package = "flexhub_cifs"
    parameters_schema_file = "provision-schema.json"
    on_delete = frozenset({"delete", "retain", "archive"})
    node_requirements = NodeRequirements(
        commands=("mount.cifs", "mount", "umount"),
        kernel_modules=("cifs",),
        hint="install the CIFS client (cifs-utils on Debian/Ubuntu and RHEL/Fedora)",
    )

    @classmethod
    def secret_needed(cls, options: Mapping[str, str]) -> str:
        """Always: the username and password come only from the PV's Secret."""
        return "cifs takes the username and password only from a Secret"

    # --------------------------------------------------------------------------- settings

    settings_keys = frozenset(
        {"mount_timeout", "unmount_timeout", "force_unmount_timeout", "stat_timeout"}
    )

    @classmethod
    def check_settings(
        cls, name: str, settings: Mapping[str, Any], config: NodeConfig | None = None
    ) -> None:
        """``[cifs]``: known keys, each a positive number of seconds."""
        super().check_settings(name, settings, config)
        for key in sorted(cls.settings_keys):
            _seconds(settings, key, 1.0)

    def _seconds(self, key: str, default: float) -> float:
        return _seconds(self.node.settings, key, default)

    @property
    def mount_timeout(self) -> float:
        """Bound of one ``mount`` command: ``[cifs] mount_timeout`` or the node's."""
        return self._seconds("mount_timeout", self.node.config.mount_timeout)

    @property
    def unmount_timeout(self) -> float:
        """Bound of each plain ``umount``: ``[cifs] unmount_timeout`` or the node's."""
        return self._seconds("unmount_timeout", self.node.config.unmount_timeout)

    @property
    def force_timeout(self) -> float:
        """Bound of the forced and lazy ``umount``: ``[cifs] force_unmount_timeout`` (5 s)."""
        return self._seconds("force_unmount_timeout", DEFAULT_FORCE_TIMEOUT)

    @property
    def stat_timeout(self) -> float:
        """Bound of the health ``stat`` of a mount point: ``[cifs] stat_timeout`` (5 s)."""
        return self._seconds("stat_timeout", DEFAULT_STAT_TIMEOUT)

    # --------------------------------------------------------------------------- API

    @classmethod
    def check_options(cls, volume: Volume) -> None:
        """Check everything the schema cannot: the allow-list, SMB1, ids, modes."""
        build_plan(volume)

    def check(self, volume: Volume) -> None:
        """Check the Secret's credentials (keys named, values never shown)."""
        credentials(volume.secrets)

    def volume_id(self, volume: Volume) -> str:
        """``cifs://<host>/<share>[/<subPath>]``, e.g. ``cifs://files.example.com/team``."""
        return _ID_PREFIX + build_plan(volume).source

    def mount(self, target: Path, volume: Volume) -> Mapping[str, str]:
        """Mount the share (or its sub-directory) on ``target``.

        :raises CommandTimeout: the server did not answer within the mount timeout.
        :raises CommandError: ``mount`` failed (its message says why, never the password).
        :raises VolumeError: something else is mounted on ``target``, or the mount is not
            what was asked for (read-only).
        """
        plan = build_plan(volume)
        creds = credentials(volume.secrets)
        collect_leftovers(self.node.state_dir)
        details = {"source": plan.source, "server": plan.host}
        if self._already_mounted(target, plan):
            LOG.info("%s already holds %s: nothing to do", target, plan.source)
            return self._with_version(target, details)
        started = time.monotonic()
        if plan.sub_path:
            self._mount_sub_path(target, plan, creds)
        else:
            self._mount(target, plan, creds)
        entry = self.node.mounts.at(target)
        if entry is None or entry.fs_type not in CIFS_TYPES:
            self._cleanup(target)
            raise VolumeError(f"{target} is not a CIFS mount after mounting {plan.source}")
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
        collect_leftovers(self.node.state_dir)
        self._unmount(target)
        self.node.unmount(target)  # anything else stacked there: the core's escalation

    def collect_leftovers(self) -> None:
        """Remove the credentials files of calls that were killed (see ``_credentials``):
        the core calls this on every unmount of a CIFS pod directory, mounted or not."""
        collect_leftovers(self.node.state_dir)

    # --------------------------------------------------------------------------- provisioning

    @classmethod
    def check_parameters(cls, parameters: Mapping[str, str]) -> None:
        """A provisioning class's parameters: the share, its Secret, mount options,
        pathPattern, owner and modes (see :mod:`flexhub_cifs._provision`)."""
        from flexhub_cifs import _provision

        _provision.read(parameters)

    def provision(
        self, claim: Claim, parameters: Mapping[str, str], secrets: Secrets
    ) -> Provisioned:
        """Make (or find) the claim's directory on the share and return PV options that
        mount exactly it (``subPath``) with the class's owner and modes, and the class's
        Secret as the PV's ``secretRef``.

        The share is mounted on a private directory for the call with the Secret's
        credentials (in a private file, never on a command line); the directory is made by a
        walk that never follows a symlink (:mod:`flexhub.claimdir`). The size is the
        claim's: SMB does not enforce it (the server's quota may).
        """
        from flexhub.pathpattern import render
        from flexhub_cifs import _provision

        spec = _provision.read(parameters)
        path = render(spec.pattern, claim)
        creds = credentials(secrets)
        options = spec.pv_options(path)
        plan = build_plan(Volume(options={"backend": "cifs", **options}, fs_type=spec.fs_type))
        made = self._in_share(
            plan,
            creds,
            f"making {path} in {plan.root_source}",
            self.mount_timeout,
            lambda root: claimdir.make(root, path, where="share"),
        )
        LOG.info(
            "%s %s/%s for claim %s/%s",
            "made" if made else "found",
            plan.root_source,
            path,
            claim.namespace,
            claim.name,
        )
        return claimdir.provisioned(claim, options, path, fs_type=spec.fs_type, secret=spec.secret)

    def reclaim(
        self, options: Mapping[str, str], reclaim: Mapping[str, str], secrets: Secrets
    ) -> None:
        """Delete, archive or retain the recorded directory (:func:`flexhub.claimdir.reclaim`:
        only the PV's ``subPath`` whose name holds the claim's uid; gone already is success)."""

        def share() -> claimdir.MountedRoot:
            creds = credentials(secrets)
            plan = build_plan(Volume(options={**options, "backend": "cifs"}))
            return claimdir.MountedRoot(
                plan.root_source,
                lambda what, bound, work: self._in_share(plan, creds, what, bound, work),
                where="share",
            )

        claimdir.reclaim(
            options,
            reclaim,
            honoured=self.on_delete,
            location=f"//{options.get('server')}/{options.get('share')}",
            root=share,
        )

    def _in_share(
        self, plan: Plan, creds: Credentials, what: str, bound: float, work: Callable[[int], _T]
    ) -> _T:
        """Run ``work(root_fd)`` on the share's root, mounted on a private directory,
        within ``bound`` seconds (a dead server makes it a CommandTimeout)."""
        collect_leftovers(self.node.state_dir)
        with self._private_mount(plan, creds) as temp:
            return claimdir.in_root(
                temp, work, what=what, bound=bound, server=f"CIFS server {plan.host}"
            )

    # --------------------------------------------------------------------------- mount

    def _healthy(self, path: Path) -> bool:
        return not self.node.is_corrupted(path, self.stat_timeout)

    def _already_mounted(self, target: Path, plan: Plan) -> bool:
        """Whether ``target`` already holds a healthy mount of ``plan``; cleans a stale one."""
        entry = self.node.mounts.at(target)
        if entry is None:
            return False
        if entry.fs_type in CIFS_TYPES and _holds(entry, plan):
            if self._healthy(target):
                if entry.read_only != plan.read_only:
                    raise VolumeError(
                        f"{target} already holds {plan.source} "
                        f"{'read-only' if entry.read_only else 'read-write'}"
                    )
                return True
            LOG.warning("%s holds a stale mount of %s: mounting it again", target, plan.source)
            self._unmount(target)
            return False
        raise VolumeError(f"{target} is already a mount point of {entry.source}")

    def _mount(self, target: Path, plan: Plan, creds: Credentials) -> None:
        """Mount the share's root on ``target`` under the mount timeout, the credentials in
        a private file removed when the command returns; leave ``target`` clean on failure."""
        bound = self.mount_timeout
        source = plan.root_source
        try:
            with credentials_file(self.node.state_dir, creds.file_text()) as path:
                options = ",".join((*plan.options, f"credentials={path}"))
                self.node.runner(
                    ["mount", "-t", "cifs", "-o", options, "--", source, str(target)],
                    timeout=bound,
                    secrets=[creds.password],
                )
        except CommandTimeout:
            self._cleanup(target)
            raise CommandTimeout(
                f"CIFS server {plan.host} did not answer within {bound:g}s: mount of {source} "
                "abandoned and its processes killed"
            ) from None
        except CommandError as exc:
            self._cleanup(target)
            output = exc.output or str(exc)
            lacking = kernel_lacks("cifs", output)
            if lacking:
                raise VolumeError(f"mount of CIFS share {source} failed: {lacking}") from None
            hint = ""
            if "error(13)" in output:
                hint = " (the server refused the Secret's username/password/domain, or the share)"
            elif "error(2)" in output:
                hint = " (no such share on the server)"
            raise CommandError(
                f"mount of CIFS share {source} failed (exit {exc.returncode}){hint}: {output}",
                returncode=exc.returncode,
                output=output,
            ) from None

    def _with_version(self, target: Path, details: dict[str, str]) -> dict[str, str]:
        """Add the negotiated dialect (``vers=`` of the superblock) to ``details``."""
        entry = self.node.mounts.at(target)
        if entry is not None:
            for option in (*entry.super_options, *entry.options):
                if option.startswith("vers="):
                    details["vers"] = option[len("vers=") :]
                    break
        return details

    def _mount_sub_path(self, target: Path, plan: Plan, creds: Credentials) -> None:
        """Mount the share's root on a private directory, walk the sub-directory without
        following a symlink, and bind-mount exactly that directory on ``target``."""
        with self._private_mount(plan, creds) as temp:
            self._bind_sub_path(temp, target, plan)

    @contextlib.contextmanager
    def _private_mount(self, plan: Plan, creds: Credentials) -> Iterator[Path]:
        """The share's root mounted (under the mount timeout, the credentials in a private
        file) on a new private directory ``<state_dir>/cifs-tmp/<random>``, unmounted and
        removed on the way out."""
        base = Path(os.path.realpath(self.node.state_dir)) / "cifs-tmp"
        base.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._collect_temp(base)
        temp = claimdir.temp_mount_point(base)
        try:
            self._mount(temp, plan, creds)
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
            return _subpath.open_sub_path(root, plan.sub_path)

        try:
            fd = claimdir.in_root(
                temp, walk, what=what, bound=bound, server=f"CIFS server {plan.host}"
            )
        except _subpath.SubPathMissing as exc:
            raise VolumeError(
                f"{plan.source} does not exist on the server ({exc.message})"
            ) from None
        except VolumeError as exc:
            raise VolumeError(
                f"refusing subPath {plan.sub_path} of {plan.root_source}: {exc}"
            ) from None
        try:
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
                wanted, now = os.fstat(fd), os.stat(target)
                if (now.st_dev, now.st_ino) != (wanted.st_dev, wanted.st_ino):
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

    def _collect_temp(self, base: Path) -> None:
        """Unmount and remove ``cifs-tmp`` directories a crashed call left behind."""
        now = time.time()
        try:
            leftovers = list(base.iterdir())
        except OSError:
            return
        for path in leftovers:
            try:
                if not claimdir.temp_is_leftover(path, now, TEMP_MAX_AGE):
                    continue
                LOG.warning("removing leftover temporary CIFS mount point %s", path)
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

        :raises CommandError: a mount is still there after the forced and lazy step.
        """
        where = os.path.normpath(os.path.abspath(target))
        for _ in range(32):  # stacked mounts, removed one by one
            entry = self.node.mounts.at(where)
            if entry is None:
                return
            started = time.monotonic()
            steps: list[tuple[tuple[str, ...], float]] = [(("-f", "-l"), self.force_timeout)]
            if entry.fs_type not in CIFS_TYPES or self._healthy(Path(where)):
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
