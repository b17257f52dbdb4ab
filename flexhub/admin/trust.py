"""Whether a host path is root's alone: the rule for everything flexhub executes or believes.

flexhub runs as root and installs a driver that kubelet runs as root, so a file it executes,
installs into or reads a decision from (kubelet's executable and config file, the plugin
directory, the driver, the install record) must be one that no other user can have written or
replaced. A path is **trusted** when the path itself and every directory from the host's ``/``
down to it are

* owned by root (uid 0), and
* writable by nobody else: no group and no other write bit. The sticky bit does not excuse a
  write bit: in ``/tmp`` (1777) any user may create a name that does not exist yet, such as
  the plugin directory or its parent, so ``/tmp``, ``/var/tmp`` and every path below them are
  not trusted.

Symlinks are followed inside ``host_root`` as the host would follow them; a link's target is
checked like any other path (the link itself lies in a trusted directory, so root made it).
The answer is a host path; ``host_root`` is where the host's ``/`` is visible (the DaemonSet's
``/host``) and counts as the host's ``/``.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from flexhub.errors import UntrustedPath

__all__ = ["check_owner_and_mode", "trusted_path"]

_MAX_LINKS = 40


def check_owner_and_mode(path: str, info: os.stat_result) -> None:
    """:raises UntrustedPath: ``path`` (described by ``info``) is not root's alone."""
    mode = stat.S_IMODE(info.st_mode)
    if info.st_uid != 0:
        raise UntrustedPath(f"{path} is owned by uid {info.st_uid}, not root")
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UntrustedPath(f"{path} is writable by others (mode {mode:04o})")


def _on_host(host_root: Path, path: str) -> str:
    return os.path.join(host_root, path.lstrip("/"))


def trusted_path(path: str, host_root: Path = Path("/"), *, missing_ok: bool = False) -> str:
    """Resolve the absolute host path ``path`` and check it by the rule above.

    :param missing_ok: a missing tail is accepted (root is about to create it, e.g. the
        plugin directory ``install`` makes); its existing part is checked.
    :returns: the resolved host path (no symlink left in its existing part).
    :raises UntrustedPath: the first path on the way that is not trusted, named in the
        message; also a relative ``path``, a symlink loop, or (without ``missing_ok``) a
        missing path.
    """
    if not path.startswith("/"):
        raise UntrustedPath(f"{path} is not an absolute path")
    check_owner_and_mode("/", os.stat(host_root))
    parts = [p for p in path.split("/") if p]
    current = "/"
    links = 0
    while parts:
        name = parts.pop(0)
        if name == ".":
            continue
        if name == "..":
            current = os.path.dirname(current)  # resolved so far: no symlink in it
            continue
        candidate = os.path.join(current, name)
        try:
            info = os.lstat(_on_host(host_root, candidate))
        except FileNotFoundError:
            if not missing_ok:
                raise UntrustedPath(f"{candidate} does not exist") from None
            if ".." in parts:  # it would climb out of what is created
                raise UntrustedPath(f"{path}: '..' below the missing {candidate}") from None
            return os.path.join(candidate, *(p for p in parts if p != "."))
        except OSError as exc:
            raise UntrustedPath(f"{candidate}: {exc.strerror}") from None
        if stat.S_ISLNK(info.st_mode):
            links += 1
            if links > _MAX_LINKS:
                raise UntrustedPath(f"{path}: too many levels of symbolic links")
            target = os.readlink(_on_host(host_root, candidate))
            if target.startswith("/"):
                current = "/"
            parts = [p for p in target.split("/") if p] + parts
            continue
        check_owner_and_mode(candidate, info)
        if parts and not stat.S_ISDIR(info.st_mode):
            raise UntrustedPath(f"{candidate} is not a directory")
        current = candidate
    return current
