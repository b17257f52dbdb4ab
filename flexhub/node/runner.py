"""Run external commands safely: no shell, no inherited stdio, a timeout, secrets masked."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

from flexhub.errors import CommandError, CommandTimeout, one_line, redact
from flexhub.node.frozen import Frozen

if TYPE_CHECKING:
    import subprocess

    from flexhub.node.live import LiveCommand

# ``subprocess`` (with ``selectors`` and ``signal``) is imported when the first command runs:
# a call that runs none (a ``mount`` of a directory already mounted) does not pay for it.

__all__ = [
    "DEFAULT_ENV",
    "CommandRunner",
    "RecordingRunner",
    "Result",
    "SubprocessRunner",
    "mask",
    "mask_text",
]

LOG = logging.getLogger(__name__)

#: The environment every command starts from (``env`` arguments are merged on top).
DEFAULT_ENV: Mapping[str, str] = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"}

#: Substrings of an option or key name that mark the next value as secret.
_SECRET_NAMES = ("password", "passwd", "secret", "token", "credential")
_MASK = "***"
_EXCERPT = 400


class Result(Frozen):
    """What a finished command produced."""

    __slots__ = ("argv", "returncode", "stdout", "stderr")  # noqa: RUF023 - the fields, in order
    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str

    def __init__(self, argv: tuple[str, ...], returncode: int, stdout: str, stderr: str) -> None:
        self._set(argv=argv, returncode=returncode, stdout=stdout, stderr=stderr)


class CommandRunner(Protocol):
    """Something that runs a command; :class:`SubprocessRunner` in production."""

    def __call__(
        self,
        argv: Sequence[str],
        *,
        timeout: float | None = None,
        check: bool = True,
        secrets: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        input: str | None = None,
    ) -> Result:
        """Run ``argv`` and return its :class:`Result`.

        ``input`` is written to the command's stdin (then closed); ``None``: stdin is
        ``/dev/null``. It is how a secret reaches a command without a command line.

        :raises CommandError: ``check`` is true and the command exited non-zero.
        :raises CommandTimeout: the command ran past ``timeout`` and was killed.
        """
        ...


def mask_text(text: str, secrets: Sequence[str]) -> str:
    """Replace every non-empty value of ``secrets`` in ``text`` with ``***``."""
    return redact(text, secrets)


def _names_secret(word: str) -> bool:
    lowered = word.lower()
    return any(name in lowered for name in _SECRET_NAMES)


def mask(argv: Sequence[str], secrets: Sequence[str] = ()) -> list[str]:
    """Return ``argv`` safe to log: secret values and secret-looking arguments masked.

    Besides every value of ``secrets`` (also inside a longer argument), this masks the value
    after ``-v``/``--value`` when the preceding ``-n``/``--name`` names a password-like key
    (``iscsiadm -n node.session.auth.password -v X``), the value of ``--password X`` style
    options and of ``password=X`` pairs in an option list.
    """
    masked: list[str] = []
    previous_name = ""
    hide_next = False
    for index, arg in enumerate(argv):
        if hide_next:
            masked.append(_MASK)
            hide_next = False
            continue
        text = mask_text(arg, secrets)
        value_flag = index > 0 and arg in ("-v", "--value") and _names_secret(previous_name)
        long_flag = arg.startswith("--") and "=" not in arg and _names_secret(arg)
        if value_flag or long_flag:
            hide_next = True
        elif "=" in text:
            text = ",".join(
                f"{part.split('=', 1)[0]}={_MASK}"
                if "=" in part and _names_secret(part.split("=", 1)[0])
                else part
                for part in text.split(",")
            )
        if index > 0 and argv[index - 1] in ("-n", "--name"):
            previous_name = arg
        masked.append(text)
    return masked


def _excerpt(result_text: str, secrets: Sequence[str]) -> str:
    text = one_line(mask_text(result_text, secrets), limit=_EXCERPT)
    return text


#: Seconds to wait for a killed command to be reaped. A process in uninterruptible sleep
#: (I/O to a multipath map without paths, a hung NFS server) dies only when that I/O ends.
REAP_TIMEOUT = 5.0


def _reap(proc: subprocess.Popen[str], shown: str) -> str:
    """Wait at most :data:`REAP_TIMEOUT` for the killed ``proc``; "" or why it is left."""
    import subprocess

    try:
        proc.wait(timeout=REAP_TIMEOUT)
        return ""
    except subprocess.TimeoutExpired:
        LOG.error(
            "%s: pid %d did not exit %gs after SIGKILL (uninterruptible sleep?): left behind",
            shown,
            proc.pid,
            REAP_TIMEOUT,
        )
        return f"; pid {proc.pid} is stuck in the kernel and was left behind"


def _kill_group(proc: subprocess.Popen[str]) -> None:
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    except PermissionError:  # pragma: no cover - the group is ours
        proc.kill()


def _prepared(
    argv: Sequence[str], secrets: Sequence[str], env: Mapping[str, str] | None
) -> tuple[tuple[str, ...], str, dict[str, str]]:
    """A command's arguments, how it may be logged, and its environment (:data:`DEFAULT_ENV`
    with ``env`` on top)."""
    args = tuple(str(a) for a in argv)
    if not args:
        raise CommandError("empty command")
    full_env = dict(DEFAULT_ENV)
    if env:
        full_env.update(env)
    return args, " ".join(mask(args, secrets)), full_env


class SubprocessRunner:
    """The production runner.

    Each command runs without a shell, with stdin from ``/dev/null`` (or ``input``), its
    output captured, in its own session (process group), and is killed with its whole group
    after ``timeout``.

    :param timeout: default bound in seconds for one command.
    """

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout

    def __call__(
        self,
        argv: Sequence[str],
        *,
        timeout: float | None = None,
        check: bool = True,
        secrets: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        input: str | None = None,
    ) -> Result:
        """Run ``argv``; see :class:`CommandRunner`."""
        import subprocess

        args, shown, full_env = _prepared(argv, secrets, env)
        bound = self.timeout if timeout is None else timeout
        started = time.monotonic()
        try:
            proc = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL if input is None else subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                close_fds=True,
                env=full_env,
                text=True,
                errors="replace",
            )
        except OSError as exc:
            raise CommandError(f"{shown} could not start: {exc.strerror or exc}") from None
        try:
            stdout, stderr = proc.communicate(input=input, timeout=bound)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            try:
                # Grandchildren outside the group may still hold the pipes: do not wait long.
                stdout, stderr = proc.communicate(timeout=1.0)
            except subprocess.TimeoutExpired:
                for pipe in (proc.stdout, proc.stderr):
                    if pipe is not None:
                        pipe.close()
                stdout = stderr = ""
            stuck = _reap(proc, shown) if proc.returncode is None else ""
            LOG.debug("%s timed out after %.3fs", shown, time.monotonic() - started)
            raise CommandTimeout(
                f"{shown} timed out after {bound:g}s and was killed{stuck}", returncode=None
            ) from None
        finally:
            if proc.returncode is None:  # an unexpected exception: never leave it running
                _kill_group(proc)
                _reap(proc, shown)
        elapsed = time.monotonic() - started
        LOG.debug("%s exited %d in %.3fs", shown, proc.returncode, elapsed)
        result = Result(args, proc.returncode, stdout or "", stderr or "")
        if check and result.returncode != 0:
            raise command_error(result, secrets)
        return result

    def spawn(
        self,
        argv: Sequence[str],
        *,
        secrets: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> LiveCommand:
        """Start ``argv`` to stay up across requests (:class:`~flexhub.node.live.LiveCommand`):
        no shell, this runner's environment, its own session, pipes on stdin, stdout and
        stderr. Each exchange with it carries its own bound.

        :raises CommandError: the command could not start.
        """
        import subprocess

        from flexhub.node.live import LiveCommand

        args, shown, full_env = _prepared(argv, secrets, env)
        try:
            proc = subprocess.Popen(
                args,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                close_fds=True,
                env=full_env,
                bufsize=0,
            )
        except OSError as exc:
            raise CommandError(f"{shown} could not start: {exc.strerror or exc}") from None
        LOG.debug("%s started (pid %d)", shown, proc.pid)
        return LiveCommand(proc, shown)


def command_error(result: Result, secrets: Sequence[str] = ()) -> CommandError:
    """Build the :class:`CommandError` for a failed ``result``, secrets masked."""
    shown = " ".join(mask(result.argv, secrets))
    output = result.stderr.strip() or result.stdout.strip()
    excerpt = _excerpt(output, secrets)
    message = f"{shown} failed (exit {result.returncode})"
    if excerpt:
        message += f": {excerpt}"
    return CommandError(message, returncode=result.returncode, output=excerpt)


class RecordingRunner:
    """A test runner: records every (masked) argv and answers from a script.

    ``script`` maps an argv prefix (a tuple) to a :class:`Result` or an exception to raise,
    or a callable ``argv -> Result``; the longest matching prefix wins; the default answer is
    exit 0 with empty output.
    """

    def __init__(
        self,
        script: dict[tuple[str, ...], object] | None = None,
        calls: list[list[str]] | None = None,
        inputs: list[str | None] | None = None,
    ) -> None:
        self.script: dict[tuple[str, ...], object] = {} if script is None else script
        self.calls: list[list[str]] = [] if calls is None else calls
        #: The ``input`` of each call (``None`` for none), secrets masked, beside :attr:`calls`.
        self.inputs: list[str | None] = [] if inputs is None else inputs

    def __repr__(self) -> str:
        return (
            f"RecordingRunner(script={self.script!r}, calls={self.calls!r}, inputs={self.inputs!r})"
        )

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        assert isinstance(other, RecordingRunner)
        return (self.script, self.calls, self.inputs) == (other.script, other.calls, other.inputs)

    __hash__ = None  # type: ignore[assignment]  # (a mutable dataclass's)

    def __call__(
        self,
        argv: Sequence[str],
        *,
        timeout: float | None = None,
        check: bool = True,
        secrets: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        input: str | None = None,
    ) -> Result:
        """Record ``argv`` (and ``input``) and return the scripted answer."""
        args = tuple(str(a) for a in argv)
        self.calls.append(mask(args, secrets))
        self.inputs.append(None if input is None else mask_text(input, secrets))
        answer: object = None
        best = -1
        for prefix, value in self.script.items():
            if args[: len(prefix)] == prefix and len(prefix) > best:
                answer, best = value, len(prefix)
        if isinstance(answer, BaseException):
            raise answer
        if callable(answer):
            answer = answer(args)
        if isinstance(answer, Result):
            result = Result(args, answer.returncode, answer.stdout, answer.stderr)
        else:
            result = Result(args, 0, "", "")
        if check and result.returncode != 0:
            raise command_error(result, secrets)
        return result

    def answer(self, *prefix: str, rc: int = 0, stdout: str = "", stderr: str = "") -> None:
        """Script the answer to commands starting with ``prefix``."""
        self.script[tuple(prefix)] = Result(tuple(prefix), rc, stdout, stderr)
