"""flexhub's exception tree onto CSI status codes, and one call at a time per volume.

=============================================  =====================
flexhub error                                  CSI status code
=============================================  =====================
:class:`~flexhub.errors.InvalidOptions`,       ``INVALID_ARGUMENT``
:class:`~flexhub.errors.UsageError`,
:class:`~flexhub.errors.NotSupported`
:class:`~flexhub.errors.LockTimeout`           ``ABORTED`` (another call holds the volume)
:class:`~flexhub.errors.NoRoom`                ``RESOURCE_EXHAUSTED``
:class:`~flexhub.errors.VolumeError`,          ``FAILED_PRECONDITION``
:class:`~flexhub.errors.UntrustedPath`
:class:`~flexhub.errors.CommandTimeout`,       ``DEADLINE_EXCEEDED``
:class:`~flexhub.errors.CallTimeout`
anything else                                  ``INTERNAL``
=============================================  =====================

Handlers raise :class:`CsiError` for what the spec names directly (``NOT_FOUND``,
``ALREADY_EXISTS``). Every message is one line with the call's secrets redacted.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import grpc
from google.protobuf.message import Message

from flexhub.errors import (
    CallTimeout,
    CommandTimeout,
    FlexhubError,
    InvalidOptions,
    LockTimeout,
    NoRoom,
    NotSupported,
    UntrustedPath,
    UsageError,
    VolumeError,
    one_line,
    redact,
)
from flexhub.volume import has_control_character

__all__ = ["CsiError", "InFlight", "code_of", "control_character_in", "rpc"]

LOG = logging.getLogger(__name__)


class CsiError(Exception):
    """A reply with a CSI status code the handler chose."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = one_line(message)


def code_of(exc: BaseException) -> grpc.StatusCode:
    """The CSI status code of a flexhub error (see the module)."""
    if isinstance(exc, CsiError):
        return exc.code
    if isinstance(exc, InvalidOptions | UsageError | NotSupported):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, LockTimeout):
        return grpc.StatusCode.ABORTED
    if isinstance(exc, NoRoom):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(exc, VolumeError | UntrustedPath):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(exc, CommandTimeout | CallTimeout):
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return grpc.StatusCode.INTERNAL


class InFlight:
    """The volumes a call of this process works on: a second call on the same volume while
    the first runs is refused with ``ABORTED`` at once (the spec's "operation pending for
    volume"), instead of queueing behind it. Across processes the node locks still hold."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._busy: set[str] = set()

    @contextmanager
    def hold(self, key: str) -> Iterator[None]:
        with self._mutex:
            if key in self._busy:
                raise CsiError(
                    grpc.StatusCode.ABORTED, f"an operation on {key} is already in progress"
                )
            self._busy.add(key)
        try:
            yield
        finally:
            with self._mutex:
                self._busy.discard(key)

    def busy(self, key: str) -> bool:
        """Whether a call works on ``key`` now."""
        with self._mutex:
            return key in self._busy


_F = TypeVar("_F", bound=Callable[..., Any])


#: The request fields that name a volume, snapshot, node, page or path: handlers log them and
#: make paths of them. A PV's ``volumeHandle`` is written by whoever writes PVs, a pod's path by
#: kubelet from names a tenant chose.
_NAMING_FIELDS = frozenset(
    ("name", "volume_id", "snapshot_id", "source_volume_id", "node_id", "starting_token",
     "target_path", "staging_target_path", "volume_path")
)  # fmt: skip


def control_character_in(message: Any) -> str:
    """The first naming field of ``message`` (or of a message it holds, such as a
    ``volume_content_source``) whose text holds a control character, or ``""``."""
    for field, value in message.ListFields():
        if isinstance(value, Message):  # not a repeated or map field: those are containers
            found = control_character_in(value)
            if found:
                return f"{field.name}.{found}"
        elif (
            field.name in _NAMING_FIELDS and isinstance(value, str) and has_control_character(value)
        ):
            return str(field.name)
    return ""


def rpc(method: _F) -> _F:
    """Turn a handler's flexhub error into its CSI status (``context.abort``), one line.

    A request naming anything with a control character (a newline would forge a line of the
    plugin's log) is refused with INVALID_ARGUMENT before the handler sees it."""

    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        name = method.__name__
        try:
            field = control_character_in(request)
            if field:
                raise CsiError(
                    grpc.StatusCode.INVALID_ARGUMENT, f"{field} holds a control character"
                )
            return method(self, request, context)
        except (FlexhubError, CsiError, CallTimeout) as exc:
            code = code_of(exc)
            message = exc.message
        except Exception as exc:  # a bug or an unexpected OS error: still one line, no secret
            LOG.exception("%s failed", name)
            code = grpc.StatusCode.INTERNAL
            message = one_line(f"{type(exc).__name__}: {exc}")
        secrets = [str(v) for v in getattr(request, "secrets", {}).values()]
        message = redact(message, secrets, min_length=3)
        LOG.warning("%s: %s: %s", name, code.name, message)
        context.abort(code, message)
        raise AssertionError("unreachable")  # context.abort raises

    return wrapper  # type: ignore[return-value]
