"""The flexhub exception tree: every error knows its FlexVolume reply.

::

    FlexhubError                    status "Failure", exit 1
    ├── UsageError                  wrong argument count or shape from the caller
    ├── InvalidOptions              the options JSON is malformed or fails the backend's schema
    ├── BackendError                a backend is unknown, fails to import, or misbehaves
    ├── NotSupported                status "Not supported" (never for an op any backend implements)
    ├── LockTimeout                 a node lock could not be taken within its bound
    ├── StateError                  the node's state journal cannot be used
    ├── CommandError                an external command failed or timed out (args masked)
    │   └── CommandTimeout
    └── VolumeError                 the storage itself refuses: wrong filesystem, no device, ...

    CallTimeout (a BaseException)   the call ran past ``call_timeout``: raised by SIGALRM, so no
                                    ``except FlexhubError`` on the way swallows it

Messages are single lines and never hold a secret value: they are what kubelet copies into pod
events.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

__all__ = [
    "BackendError",
    "CallTimeout",
    "CommandError",
    "CommandTimeout",
    "FlexhubError",
    "InvalidOptions",
    "LockTimeout",
    "NotSupported",
    "StateError",
    "UsageError",
    "VolumeError",
    "one_line",
    "redact",
]


class FlexhubError(Exception):
    """Base of every error flexhub reports to its caller.

    :param message: the one-line text of the reply's ``message`` field.
    """

    status: ClassVar[str] = "Failure"
    exit_code: ClassVar[int] = 1

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = one_line(message)

    def __str__(self) -> str:
        return self.message


class CallTimeout(BaseException):
    """The call ran past the node's ``call_timeout``; raised in the main thread by SIGALRM.

    Not a :class:`FlexhubError`: code that tolerates a failed step (``except FlexhubError``)
    must not swallow it. Rollbacks (``except BaseException: undo; raise``) still run, and the
    ``with`` blocks of the locks release them on the way out.
    """

    status: ClassVar[str] = "Failure"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = one_line(message)

    def __str__(self) -> str:
        return self.message


class UsageError(FlexhubError):
    """The caller passed the wrong number or shape of arguments."""


class InvalidOptions(FlexhubError):
    """The options JSON is malformed or does not satisfy the backend's schema."""


class BackendError(FlexhubError):
    """A backend is unknown, cannot be imported, or broke its contract."""


class NotSupported(FlexhubError):
    """The operation is one flexhub does not implement (kubelet caches this per driver)."""

    status = "Not supported"

    def __init__(self, message: str = "") -> None:
        super().__init__(message)


class LockTimeout(FlexhubError):
    """A node lock could not be taken within its bound."""


class StateError(FlexhubError):
    """The state journal cannot be read or written."""


class CommandError(FlexhubError):
    """An external command failed; the message names it, with secret arguments masked."""

    def __init__(self, message: str, *, returncode: int | None = None, output: str = "") -> None:
        super().__init__(message)
        self.returncode = returncode
        self.output = output


class CommandTimeout(CommandError):
    """An external command ran past its timeout and its process group was killed."""


class VolumeError(FlexhubError):
    """The storage refuses the operation (wrong filesystem, missing device, no room...)."""


def redact(text: str, secrets: Iterable[str], min_length: int = 1) -> str:
    """Replace every secret value in ``text`` with ``***``, longest first.

    :param min_length: values shorter than this are left alone (a one-letter value would
        mangle every message it appears in by chance).
    """
    for value in sorted(
        {s for s in secrets if len(s) >= max(min_length, 1)}, key=len, reverse=True
    ):
        text = text.replace(value, "***")
    return text


def one_line(text: str, limit: int = 1000) -> str:
    """Fold ``text`` onto one line of at most ``limit`` characters."""
    folded = " ".join(str(text).split())
    if len(folded) > limit:
        folded = folded[: limit - 3] + "..."
    return folded
