"""A loopfile volume's options, read and checked: where its file is (``file``, inside the
loopfile root or its namespace's area), and its sizes (``size``, ``maxSize``).

``file`` must stay inside the root: absolute paths, ``..``, symlinks whose target leaves the
root (or the namespace's area) and anything that is not a regular file are refused before
anything is created. A namespaced mount may adopt a pre-isolation file ``<root>/<file>``
(:mod:`flexhub_loopfile._tenancy`).
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Any

from flexhub.backend import FlexhubError, InvalidOptions, Volume, VolumeError, fsync_directory
from flexhub_loopfile import _files, _made, _tenancy
from flexhub_loopfile._quantity import parse_quantity

__all__ = [
    "DEFAULT_ROOT",
    "adopt",
    "base",
    "legacy",
    "max_size",
    "preallocate",
    "relative",
    "resolve",
    "root_of",
    "size",
]

LOG = logging.getLogger(__name__)

#: Where backing files live unless the node config's ``[loopfile] root`` says otherwise.
DEFAULT_ROOT = "/var/lib/flexhub/loopfiles"


def root_of(settings: Mapping[str, Any]) -> Path:
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


def relative(volume: Volume) -> str:
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
        raise InvalidOptions(f"option 'file' must not contain empty, '.' or '..' segments: {text}")
    if text.endswith(_files.NEW_SUFFIX):
        # the name of a file being created, which the root's account does not count
        raise InvalidOptions(f"option 'file' must not end with {_files.NEW_SUFFIX}: {text}")
    return text


def base(settings: Mapping[str, Any], volume: Volume) -> Path:
    """Where ``file`` is resolved: the pod namespace's area, or the root without isolation.

    :raises InvalidOptions: isolation is on and the call names no valid namespace.
    """
    root = root_of(settings)
    if not _tenancy.isolated(settings):
        return root
    return _tenancy.area(root, _tenancy.namespace_of(volume))


def resolve(settings: Mapping[str, Any], volume: Volume) -> Path:
    """The backing file of ``volume``, symlinks resolved, checked to be inside its area.

    :raises InvalidOptions: ``file`` is missing, absolute, has ``..``, escapes the root (or
        its namespace's area) through a symlink, or names something that is not a regular
        file; or the call names no namespace while isolation is on.
    """
    text = relative(volume)
    where = base(settings, volume)
    if where == root_of(settings) and text.split("/", 1)[0] == _tenancy.SNAPSHOTS:
        raise InvalidOptions(
            f"option 'file' must not start with {_tenancy.SNAPSHOTS}/ (the loopfile "
            f"root's snapshots): {text}"
        )
    return _inside(where, text)


def _inside(where: Path, text: str) -> Path:
    try:
        path = (where / PurePosixPath(text)).resolve()
    except (OSError, RuntimeError) as exc:
        raise InvalidOptions(f"option 'file' cannot be resolved: {text}: {exc}") from None
    if path == where or not path.is_relative_to(where):
        raise InvalidOptions(f"option 'file' escapes the loopfile root: {text}")
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        # The nearest existing ancestor must be a directory inside the root.
        ancestor = path.parent
        while not ancestor.exists() and ancestor != where:
            ancestor = ancestor.parent
        if ancestor.exists() and not ancestor.is_dir():
            raise InvalidOptions(f"option 'file': {ancestor} is not a directory: {text}") from None
        return path
    except OSError as exc:
        raise InvalidOptions(f"option 'file' cannot be read: {text}: {exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise InvalidOptions(f"option 'file' is not a regular file: {text}")
    return path


def legacy(settings: Mapping[str, Any], volume: Volume, path: Path) -> Path | None:
    """The pre-isolation file ``<root>/<file>`` a namespaced mount may adopt, if any.

    ``None`` without isolation, when the namespace's own file exists, or when there is no
    regular file at the old location (outside every namespace's area).
    """
    if not _tenancy.isolated(settings) or path.exists():
        return None
    root = root_of(settings)
    text = relative(volume)
    if text.split("/", 1)[0] in (_tenancy.AREA, _tenancy.SNAPSHOTS):
        return None
    try:
        old = _inside(root, text)
    except InvalidOptions:
        return None
    if (
        old.is_relative_to(root / _tenancy.AREA)
        or old.is_relative_to(root / _tenancy.SNAPSHOTS)
        or not old.is_file()
    ):
        return None
    return old


def adopt(settings: Mapping[str, Any], state_dir: Path, volume: Volume, path: Path) -> None:
    """Move a pre-isolation file into the namespace's area (the volume lock is held)."""
    old = legacy(settings, volume, path)
    if old is None:
        return
    if _tenancy.legacy_mode(settings) == "refuse":
        raise InvalidOptions(
            f"{old} predates namespace isolation: an operator must move it to {path} "
            '(or set [loopfile] legacy = "adopt")'
        )
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        os.rename(old, path)  # atomic: only one namespace can take it
    except FileNotFoundError:
        LOG.info("%s was adopted by another namespace meanwhile", old)
        return
    except OSError as exc:
        raise VolumeError(f"cannot move {old} to {path}: {exc.strerror}") from None
    fsync_directory(path.parent)
    fsync_directory(old.parent)
    _made.forget(state_dir, old)  # the new place is recorded by this attach
    LOG.warning("adopted pre-isolation file %s into namespace area as %s", old, path)


def size(volume: Volume) -> int | None:
    """Option ``size`` in bytes (``None``: not given)."""
    text = volume.options.get("size", "")
    if not text:
        return None
    try:
        return parse_quantity(text)
    except ValueError as exc:
        raise InvalidOptions(f"option 'size': {exc}") from None


def max_size(volume: Volume) -> int | None:
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
    wanted = size(volume)
    if wanted is not None and wanted > most:
        raise InvalidOptions(
            f"option 'size' {volume.options['size']} is more than the volume's maxSize {text}"
        )
    return most


def preallocate(options: Mapping[str, str]) -> bool:
    """Option ``preallocate``: the file is fully allocated, not sparse."""
    return options.get("preallocate", "false") == "true"
