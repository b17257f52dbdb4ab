"""Unix sockets of ``flexhub csi``: a socket a previous plugin left is replaced, never a live
one or anything else; each is created root's alone (0600)."""

from __future__ import annotations

import contextlib
import os
import socket
import stat
from pathlib import Path
from typing import Any

from flexhub.errors import UsageError

__all__ = ["MAX_PATH", "listen", "remove_socket", "remove_stale"]

#: The longest path a unix socket may have (``sun_path`` less its NUL).
MAX_PATH = 107


def remove_stale(path: Path, option: str) -> None:
    """Remove a socket a previous plugin left at ``path``, never anything else; ``option``
    names where the path came from in the error."""
    try:
        info = path.lstat()
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise UsageError(f"{option}: {path} exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        path.unlink()
        return
    finally:
        probe.close()
    raise UsageError(f"{option}: another process serves {path}")


def listen(server: Any, path: Path, option: str) -> None:
    """Have the gRPC ``server`` listen on ``path`` (created 0600: the umask while it binds)."""
    if len(os.fsencode(path)) > MAX_PATH:
        raise UsageError(f"{option}: {path} is longer than a unix socket's {MAX_PATH} bytes")
    old = os.umask(0o177)
    try:
        if not server.add_insecure_port(f"unix://{path}"):
            raise UsageError(f"{option}: cannot listen on {path}")
    except RuntimeError:  # grpcio raises where it once answered 0
        raise UsageError(f"{option}: cannot listen on {path}") from None
    finally:
        os.umask(old)


def remove_socket(path: Path) -> None:
    """Remove the socket at ``path`` if one is there (a clean stop)."""
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISSOCK(path.lstat().st_mode):
            path.unlink()
