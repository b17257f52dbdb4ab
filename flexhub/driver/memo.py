"""Memos that keep jsonschema and stevedore off the kubelet path when their answer is known.

kubelet starts the driver anew for every call, so whatever a call learns is lost unless it is
written down. Two answers are worth keeping, under ``<state_dir>/cache`` (root's, 0700):

* which module and class provide each backend name (what stevedore's entry-point scan
  finds), in ``backends.json``;
* that an options object was valid for a backend's schema, as an empty file
  ``validated/<sha256>`` whose name digests everything validation depends on.

Both are keyed by :func:`environment_fingerprint`, the modification times of every
``sys.path`` directory and of the entry-point files of the backends: installing, upgrading
or removing any distribution (a backend, jsonschema, flexhub) changes it, and the next call
asks stevedore and jsonschema again. A memo is trusted only when it and its directories are
owned by this process's user and writable by nobody else; anything odd is a miss, never an
error. A miss costs what the call cost without memos.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flexhub.config import NodeConfig

__all__ = ["Memo", "environment_fingerprint", "known_backend_names"]


def environment_fingerprint(extra: tuple[str, ...] = ()) -> list[list[object]]:
    """``[path, mtime_ns]`` for each ``sys.path`` entry and each path of ``extra``.

    A path that does not exist counts as mtime ``-1``, so its later creation is a change.
    """
    seen: list[list[object]] = []
    for entry in (*sys.path, *extra):
        if not entry:
            continue
        try:
            mtime: int = os.stat(entry).st_mtime_ns
        except OSError:
            mtime = -1
        seen.append([entry, mtime])
    return seen


def _trusted(info: os.stat_result, uid: int) -> bool:
    return info.st_uid == uid and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


class Memo:
    """The memo directory ``<state_dir>/cache``.

    :param state_dir: flexhub's state directory.
    """

    def __init__(self, state_dir: Path) -> None:
        self.root = Path(state_dir) / "cache"
        self.uid = os.geteuid()

    def _trusted_dir(self, directory: Path) -> bool:
        try:
            info = os.lstat(directory)
        except OSError:
            return False
        return stat.S_ISDIR(info.st_mode) and _trusted(info, self.uid)

    def _ensure_dir(self, directory: Path) -> bool:
        from flexhub.node.statedir import private_dir

        try:  # state_dir itself 0700 too, when this call is the first to make it
            private_dir(self.root.parent, *directory.relative_to(self.root.parent).parts)
        except (OSError, ValueError):
            return False
        return self._trusted_dir(directory.parent) and self._trusted_dir(directory)

    # -- backends -------------------------------------------------------------------------------

    @property
    def backends_file(self) -> Path:
        return self.root / "backends.json"

    def read_json(self, path: Path) -> object:
        """The JSON in ``path`` if the file and its directory are trusted, else ``None``."""
        if not self._trusted_dir(path.parent):
            return None
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or not _trusted(info, self.uid):
                return None
            with os.fdopen(os.dup(fd), "rb") as handle:
                data = handle.read(1 << 20)
        finally:
            os.close(fd)
        try:
            return json.loads(data)
        except ValueError:
            return None

    def backend_names(self) -> list[str] | None:
        """Every backend name the current backends memo lists, or ``None`` (no memo, or one
        written before a distribution was installed, upgraded or removed)."""
        data = self.read_json(self.backends_file)
        if not isinstance(data, dict):
            return None
        files, names = data.get("files"), data.get("names")
        if not isinstance(files, list) or not isinstance(names, list):
            return None
        if not all(isinstance(n, str) for n in names):
            return None
        if data.get("fingerprint") != environment_fingerprint(tuple(str(f) for f in files)):
            return None
        return list(names)

    def remember_backends(self, *, create: bool = True) -> list[str]:
        """Scan the backends' entry points, write the backends memo, return every name.

        :param create: whether to make the memo directory (and the state directory) when
            missing; without, the memo is written only into an existing one.
        """
        from importlib.metadata import entry_points

        from flexhub import ENTRY_POINT_GROUP

        files: set[str] = set()
        targets: dict[str, list[str]] = {}
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            targets.setdefault(ep.name, []).append(ep.value)
            path = getattr(ep.dist, "_path", None)
            if path is not None:
                files.update((str(path), os.path.join(str(path), "entry_points.txt")))
        ordered = tuple(sorted(files))
        if not create and not self._trusted_dir(self.root):
            return sorted(targets)
        self.write_json(
            self.backends_file,
            {
                "fingerprint": environment_fingerprint(ordered),
                "files": list(ordered),
                "backends": {n: v[0] for n, v in sorted(targets.items()) if len(v) == 1},
                "names": sorted(targets),
            },
        )
        return sorted(targets)

    def write_json(self, path: Path, value: object) -> None:
        """Write ``value`` to ``path`` atomically (0600); a failure only loses the memo."""
        if not self._ensure_dir(path.parent):
            return
        tmp = path.parent / f".{path.name}.{os.getpid()}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                json.dump(value, handle, sort_keys=True)
            os.replace(tmp, path)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)

    # -- validation results ---------------------------------------------------------------------

    @property
    def validated_dir(self) -> Path:
        return self.root / "validated"

    def has_mark(self, name: str) -> bool:
        """Whether the mark ``validated/<name>`` exists and is trusted."""
        if not self._trusted_dir(self.root) or not self._trusted_dir(self.validated_dir):
            return False
        try:
            info = os.lstat(self.validated_dir / name)
        except OSError:
            return False
        return stat.S_ISREG(info.st_mode) and _trusted(info, self.uid)

    def put_mark(self, name: str) -> None:
        """Create the mark ``validated/<name>``; a failure only loses the memo."""
        if not self._ensure_dir(self.validated_dir):
            return
        try:
            fd = os.open(
                self.validated_dir / name,
                os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o600,
            )
            os.close(fd)
        except OSError:
            pass


def known_backend_names(config: NodeConfig) -> list[str]:
    """The installed backends' names: from the node's memo when it is current (no scan), else
    from the entry points (rewriting an existing memo, never making one: a bad config must
    leave a new node's state directory uncreated)."""
    memo = Memo(config.state_dir)
    names = memo.backend_names()
    return names if names is not None else memo.remember_backends(create=False)
