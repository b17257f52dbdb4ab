"""Test hook: the named steps of a mount and an unmount, where a test can stop or kill a call.

:func:`checkpoint` is called between steps with the names in :data:`CHECKPOINTS` (a block
mount) and :data:`UNMOUNT_CHECKPOINTS` (a block unmount). When the environment variable
``FLEXHUB_TEST_CRASH_AT`` equals the name, the process kills itself with SIGKILL, so tests
can interrupt a mount at each step; when ``FLEXHUB_TEST_PAUSE_AT`` does, it stops itself
(SIGSTOP) until the test sends SIGCONT, so tests can hold a call at a step while another
runs. When ``FLEXHUB_TEST_TRACE`` names a file, each checkpoint reached is appended to it
(one name a line), so a test learns which steps a backend's calls really take. All are inert
otherwise. ``attach-progress-<key>`` follows the journalling of a backend's
``record_progress(<key>=...)`` (``<key>``: the first key of that report).
"""

from __future__ import annotations

import logging
import os
import signal

__all__ = [
    "CHECKPOINTS",
    "CRASH_ENV",
    "PAUSE_ENV",
    "TRACE_ENV",
    "UNMOUNT_CHECKPOINTS",
    "checkpoint",
]

LOG = logging.getLogger(__name__)


CRASH_ENV = "FLEXHUB_TEST_CRASH_AT"
PAUSE_ENV = "FLEXHUB_TEST_PAUSE_AT"
#: Test hook: the file each checkpoint reached is appended to.
TRACE_ENV = "FLEXHUB_TEST_TRACE"

#: The steps of a block mount, in order, at which :func:`checkpoint` may crash the process
#: (``format-intent``, right before ``mkfs``, and ``formatted``, right after it, only when the
#: mount formats the device).
CHECKPOINTS = (
    "pod-record",
    "volume-intent",
    "attached",
    "volume-record",
    "format-intent",
    "formatted",
    "staged",
    "bound",
    "done",
)
#: The steps of a block unmount at which :func:`checkpoint` may crash the process (a filesystem
#: unmount reaches only ``unbound``).
UNMOUNT_CHECKPOINTS = ("unbound", "unstaged", "released")


def checkpoint(name: str) -> None:
    """Test hook: SIGKILL this process when ``$FLEXHUB_TEST_CRASH_AT`` is ``name``; stop it
    (SIGSTOP, until a SIGCONT) when ``$FLEXHUB_TEST_PAUSE_AT`` is; append ``name`` to the file
    ``$FLEXHUB_TEST_TRACE`` when set."""
    trace = os.environ.get(TRACE_ENV)
    if trace:
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(trace, flags, 0o600)
        try:
            os.write(fd, f"{name}\n".encode())
        finally:
            os.close(fd)
    if os.environ.get(CRASH_ENV) == name:
        LOG.warning("test hook: crashing at checkpoint %s", name)
        os.kill(os.getpid(), signal.SIGKILL)
    if os.environ.get(PAUSE_ENV) == name:
        LOG.warning("test hook: stopping at checkpoint %s until SIGCONT", name)
        os.kill(os.getpid(), signal.SIGSTOP)
