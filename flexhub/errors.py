"""The flexhub exception tree: every error knows its FlexVolume reply.

::

    FlexhubError                    status "Failure", exit 1
    ├── UsageError                  wrong argument count or shape from the caller
    ├── InvalidOptions              the options JSON is malformed or fails the backend's schema
    ├── BackendError                a backend is unknown, fails to import, or misbehaves
    ├── NotSupported                status "Not supported" (never for an op any backend implements)
    ├── LockTimeout                 a node lock could not be taken within its bound
    ├── StateError                  the node's state journal cannot be used
    ├── UntrustedPath               a path flexhub would run or believe is not root's alone
    ├── CommandError                an external command failed or timed out (args masked)
    │   └── CommandTimeout
    └── VolumeError                 the storage itself refuses: wrong filesystem, no device, ...
        ├── NoRoom                  the node or target has no room for the volume
        └── ReleaseDeferred         a detach that must wait for unreachable storage (unmount
                                    still succeeds; a later call of the node releases it)

    CallTimeout (a BaseException)   the call ran past ``call_timeout``: raised by SIGALRM, so no
                                    ``except FlexhubError`` on the way swallows it

Messages are single lines and never hold a secret value: they are what kubelet copies into pod
events.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

__all__ = [
    "MIN_SECRET_CHARS",
    "BackendError",
    "CallTimeout",
    "CommandError",
    "CommandTimeout",
    "ConvertError",
    "FlexhubError",
    "InvalidOptions",
    "LockTimeout",
    "NoRoom",
    "NotSupported",
    "ReleaseDeferred",
    "StateError",
    "UntrustedPath",
    "UsageError",
    "VolumeError",
    "did_you_mean",
    "forget_secrets",
    "one_line",
    "redact",
    "remember_secrets",
    "secret_forms",
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


class ConvertError(FlexhubError):
    """``flexhub convert`` refuses a claim now (not flexhub's, not bound, in use, ...): the
    step that refused changed nothing."""


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


class UntrustedPath(FlexhubError):
    """A path flexhub would execute, install into or believe (kubelet's executable and config,
    the plugin directory, the install record) is writable by a user other than root, or
    below a directory that is (:mod:`flexhub.admin.trust`); the message names that path."""


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


class NoRoom(VolumeError):
    """The node or the target has no room for the volume (CSI: ``RESOURCE_EXHAUSTED``)."""


class ReleaseDeferred(VolumeError):
    """Raised by :meth:`BlockBackend.detach` when the device cannot be released now without
    losing data: its storage is unreachable, and writes still queued for it would be thrown
    away with the device. The backend must have left the device as it was (or only partly
    released, so that calling ``detach`` again finishes the job).

    The core then answers the unmount with Success (the pod's mounts are gone), keeps the
    volume's record, and retries the release at the node's next unmount call until it
    succeeds. The message says what stays and why; it is logged and returned in the reply.
    """


#: Shorter secret values are not scrubbed from text (they would mangle any message by chance).
MIN_SECRET_CHARS = 3

#: The secret values of this process's call (one kubelet call per process), in every form.
_CALL_SECRETS: set[str] = set()


def secret_forms(value: str) -> set[str]:
    """The forms in which ``value`` can show up in text.

    As is, stripped (a password file from ``kubectl create secret --from-file`` ends in a
    newline), whitespace-folded (what :func:`one_line` makes of it), and escaped by ``repr``
    or JSON (``{value!r}`` in a message, a JSON log line).
    """
    import json

    return {
        value,
        value.strip(),
        " ".join(value.split()),
        repr(value)[1:-1],
        json.dumps(value)[1:-1],
        json.dumps(value, ensure_ascii=False)[1:-1],
    }


def remember_secrets(values: Iterable[str]) -> None:
    """Scrub ``values`` from every text this process redacts or folds onto one line."""
    for value in values:
        _CALL_SECRETS.update(f for f in secret_forms(value) if len(f) >= MIN_SECRET_CHARS)


def forget_secrets() -> None:
    """Forget the remembered secrets (tests that serve several calls in one process)."""
    _CALL_SECRETS.clear()


def redact(text: str, secrets: Iterable[str] = (), min_length: int = 1) -> str:
    """Replace every secret value in ``text`` with ``***``, longest first.

    Each value of ``secrets`` is replaced in every form of :func:`secret_forms`, and so is
    every value given to :func:`remember_secrets`.

    :param min_length: forms shorter than this are left alone (a one-letter value would
        mangle every message it appears in by chance).
    """
    values = set(_CALL_SECRETS)
    for secret in secrets:
        values.update(f for f in secret_forms(secret) if len(f) >= max(min_length, 1))
    for value in sorted(values, key=len, reverse=True):
        text = text.replace(value, "***")
    return text


def one_line(text: str, limit: int = 1000) -> str:
    """Fold ``text`` onto one line of at most ``limit`` characters.

    The call's secrets are redacted first: folding whitespace or cutting the text could
    otherwise leave a form or a piece of a secret that no later redaction recognises.
    """
    folded = " ".join(redact(str(text)).split())
    if len(folded) > limit:
        folded = folded[: limit - 3] + "..."
    return folded


def did_you_mean(word: str, choices: Iterable[str], *, fmt: str = "{}") -> str:
    """``" (did you mean X?)"`` for the closest of ``choices``, or ``""``."""
    import difflib

    close = difflib.get_close_matches(word, sorted(choices), n=1, cutoff=0.6)
    return f" (did you mean {fmt.format(close[0])}?)" if close else ""
