"""The node's record of the backing files it made: a file recorded here and missing now was
lost (deleted, or the disk under the loopfile root not mounted), and its volume's next mount
fails instead of making a new empty file in its place.

One small file per backing file, ``<state_dir>/loopfile/made/<sha256(path)>`` (0600, in a 0700
directory), holding ``{"file": "<path>"}``. Written once the file is in place (after its
creation, a copy, or any attach of an existing file, so that files an older flexhub made are
recorded at their next mount); removed before the file is, by the rollback of the first mount
that made it and by reclaim. A crash between the two leaves the file unrecorded (recorded at
its next attach), never a record without a file that was still wanted.

The record lives in the node's state dir, not beside the files: a loopfile root whose disk
did not come up is then an empty directory, and its volumes fail rather than start empty.
With the state dir lost too, nothing on the node says the file was made, and it is made anew
as at a first mount (the README's known limits).
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from flexhub.backend import (
    VolumeError,
    fsync_directory,
    remove_dead_temporaries,
    write_atomically,
)

if TYPE_CHECKING:
    from hashlib import sha256
else:
    try:  # CPython's built-in SHA-256, as the core's journal uses: no OpenSSL to load
        from _sha256 import sha256
    except ImportError:  # pragma: no cover - other interpreters and versions
        from hashlib import sha256

__all__ = ["forget", "missing", "record", "recorded"]

LOG = logging.getLogger(__name__)

_DIRECTORY = ("loopfile", "made")
#: The temporaries of :func:`record` (a killed writer's are removed by the next write).
_TEMPORARY = re.compile(r"\.[0-9a-f]{64}\.(?P<pid>[0-9]{1,10})\.tmp")


def _path(state_dir: Path, file: Path) -> Path:
    digest = sha256(str(file).encode("utf-8", "surrogateescape")).hexdigest()
    return Path(state_dir).joinpath(*_DIRECTORY, digest)


def recorded(state_dir: Path, file: Path) -> Path | None:
    """The record of ``file`` if this node made (or mounted) it before, else ``None``."""
    path = _path(state_dir, file)
    return path if os.path.lexists(path) else None


def record(state_dir: Path, file: Path) -> None:
    """Record that ``file`` exists as a volume's file on this node (a no-op when it is)."""
    path = _path(state_dir, file)
    if os.path.lexists(path):
        return
    # as _markers: the mode is the leaf's (a parents=True leaf made by the next line would
    # get the umask's)
    path.parent.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.parent.mkdir(mode=0o700, exist_ok=True)
    remove_dead_temporaries(path.parent, _TEMPORARY)
    try:
        write_atomically(path, json.dumps({"file": str(file)}).encode("utf-8", "surrogateescape"))
    except OSError as exc:
        raise VolumeError(f"cannot record {file} in {path.parent}: {exc.strerror}") from None


def forget(state_dir: Path, file: Path) -> None:
    """Remove the record of ``file`` (none is success), before the file itself is removed."""
    path = _path(state_dir, file)
    try:
        path.unlink()
    except FileNotFoundError:
        return
    except OSError as exc:
        raise VolumeError(f"cannot remove the record {path} of {file}: {exc.strerror}") from None
    fsync_directory(path.parent)


def missing(volume: str, file: Path, where: Path) -> VolumeError:
    """The one-line error of a volume whose file this node made and that is gone now."""
    return VolumeError(
        f"loopfile volume {volume}: its file {file} is missing, but this node made it before "
        f"(recorded in {where}): nothing is created in its place (restore the file; to start "
        "the volume anew, empty, remove that record)"
    )
