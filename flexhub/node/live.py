"""A command that stays up between requests, each exchange bounded.

:meth:`flexhub.node.runner.SubprocessRunner.spawn` starts one: no shell, the runner's fixed
environment, its own session (process group), stdin, stdout and stderr pipes. A caller that
talks to a long-lived program (the iSCSI provisioner's ``ssh`` to a target host, which then
serves one request after another without a new connection or interpreter each time) writes a
request and reads stdout up to the answer's line, within a bound; past it the whole group is
killed, as :class:`~flexhub.node.runner.SubprocessRunner` kills a one-shot command. A command
whose stdout ends before the answer (it exited, its connection dropped) gives ``None``: the
caller decides whether to ask again. Nothing here logs or keeps what was written.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import TYPE_CHECKING

from flexhub.errors import CommandTimeout

if TYPE_CHECKING:
    import selectors
    import subprocess

__all__ = ["LiveCommand"]

LOG = logging.getLogger(__name__)

#: Bytes of stderr kept (its end), for a message when the command fails.
_STDERR_KEPT = 4096
#: Seconds :meth:`LiveCommand.close` lets the command end on its own once stdin is closed.
_CLOSE_WAIT = 2.0
_CHUNK = 65536


#: Bytes of stderr an exchange drops, at most, before it writes (what an earlier one left).
_STDERR_DROPPED = 64 * _STDERR_KEPT


def _kept_end(err: bytes) -> bytes:
    """The last :data:`_STDERR_KEPT` bytes of ``err``, from a line's start: a line cut at the
    front could hold the end of a secret value, which masking would not recognize."""
    if len(err) <= _STDERR_KEPT:
        return err
    return err[-_STDERR_KEPT:].partition(b"\n")[2]


class LiveCommand:
    """A running command; one exchange at a time (callers serialize their use).

    :param proc: the process (pipes for stdin, stdout and stderr, unbuffered, its own group).
    :param shown: the command as it may be logged (secrets masked).
    """

    def __init__(self, proc: subprocess.Popen[bytes], shown: str) -> None:
        self.proc = proc
        self.shown = shown
        #: When it started (``time.monotonic()``).
        self.started = time.monotonic()
        self._out = b""
        self._err = b""
        self._out_open = True
        self._err_open = True
        self._exchanged = False
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                os.set_blocking(pipe.fileno(), False)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def stderr(self) -> str:
        """The end of what the command wrote on stderr during the last exchange (and after,
        until it was reaped)."""
        return self._err.decode("utf-8", "replace")

    @property
    def returncode(self) -> int | None:
        """The exit status once the command has ended and been reaped, else ``None``."""
        return self.proc.poll()

    def alive(self) -> bool:
        """The command still runs and its stdout is open."""
        return self._out_open and self.proc.poll() is None

    def exchange(self, data: bytes, marker: bytes, timeout: float) -> bytes | None:
        """Write ``data``, then read stdout up to a line starting with ``marker``.

        :returns: that line, without its newline; ``None`` when stdout ended first (the
            command is then reaped, its group killed if it had not exited 2 s later). Other
            lines are skipped, and so is what an earlier exchange left read but unused; a
            line still in the pipe is not told apart here (a caller that needs it puts an id
            of the request in ``marker``). :attr:`stderr` then holds what arrived during this
            exchange only (a caller that sends several requests over one command still masks
            every earlier request's values in it: stderr a command wrote for one request may
            arrive during the next).
        :raises CommandTimeout: no such line within ``timeout`` seconds: the command's whole
            group was killed.
        """
        import selectors

        deadline = time.monotonic() + timeout
        # whatever an earlier exchange left answers nothing of this one, and what it wrote on
        # stderr is not this one's message (it may name that exchange's values): what is
        # already waiting on stderr after an earlier exchange is dropped too (before the first,
        # it is the command's own: why it failed to start, say)
        self._out = self._err = b""
        if self._exchanged:
            self._drop_waiting_stderr(deadline)
        self._exchanged = True
        pending = memoryview(data)
        with selectors.DefaultSelector() as selector:
            stdin = self.proc.stdin
            if pending and stdin is not None and not stdin.closed:
                selector.register(stdin.fileno(), selectors.EVENT_WRITE, "in")
            if self._out_open and self.proc.stdout is not None:
                selector.register(self.proc.stdout.fileno(), selectors.EVENT_READ, "out")
            if self._err_open and self.proc.stderr is not None:
                selector.register(self.proc.stderr.fileno(), selectors.EVENT_READ, "err")
            while self._out_open:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.kill()
                    raise CommandTimeout(
                        f"{self.shown} gave no answer within {timeout:g}s and was killed",
                        returncode=None,
                    )
                for key, _ in selector.select(left):
                    if key.data == "in":
                        pending = self._write(selector, key.fd, pending)
                    else:
                        self._read(selector, key.fd, key.data)
                        line = self._answer_in_buffer(marker)
                        if line is not None:
                            return line
        self._end(_CLOSE_WAIT)  # stdout ended: a moment to exit, then its group killed
        return None

    def close(self) -> None:
        """End the command: stdin closed (a serving program ends on it), then, if it is
        still there after a moment, its group killed; reaped either way."""
        stdin = self.proc.stdin
        if stdin is not None and not stdin.closed:
            with contextlib.suppress(OSError):  # a broken pipe: it has gone already
                stdin.close()
        self._end(_CLOSE_WAIT)

    def kill(self) -> None:
        """Kill the command's whole group and reap it (bounded)."""
        import signal

        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self._end(5.0)

    def _end(self, grace: float) -> None:
        """Reap the command: ``grace`` seconds to exit by itself, then its group killed and
        (bounded) reaped; then what it wrote last on stderr is read and the pipes closed."""
        import signal
        import subprocess

        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            try:
                self.proc.wait(5.0)
            except subprocess.TimeoutExpired:  # stuck in the kernel
                LOG.error("%s: pid %d did not end: left behind", self.shown, self.proc.pid)
        stderr = self.proc.stderr
        while self._err_open and stderr is not None:  # what it said last (it has ended)
            try:
                chunk = os.read(stderr.fileno(), _CHUNK)
            except OSError:
                break
            if not chunk:
                break
            self._err = _kept_end(self._err + chunk)
        self._close_pipes()

    def _close_pipes(self) -> None:
        self._out_open = self._err_open = False
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if pipe is not None and not pipe.closed:
                with contextlib.suppress(OSError):
                    pipe.close()

    def _drop_waiting_stderr(self, deadline: float) -> None:
        """Read and drop what is waiting on stderr; at most :data:`_STDERR_DROPPED` bytes and
        until ``deadline`` (a command that writes stderr without end still gets this
        exchange, bounded as ever)."""
        stderr = self.proc.stderr
        dropped = 0
        while self._err_open and stderr is not None and dropped < _STDERR_DROPPED:
            if time.monotonic() >= deadline:
                return
            try:
                chunk = os.read(stderr.fileno(), _CHUNK)
            except BlockingIOError:
                return  # nothing more waiting
            except OSError:
                chunk = b""
            if not chunk:
                self._err_open = False
            dropped += len(chunk)

    def _answer_in_buffer(self, marker: bytes) -> bytes | None:
        while b"\n" in self._out:
            line, self._out = self._out.split(b"\n", 1)
            if line.startswith(marker):
                return line
        return None

    def _write(self, selector: selectors.BaseSelector, fd: int, pending: memoryview) -> memoryview:
        try:
            written = os.write(fd, pending[:_CHUNK])
        except BlockingIOError:
            return pending
        except OSError:  # the command closed its stdin (it ended): read what it said
            selector.unregister(fd)
            return memoryview(b"")
        pending = pending[written:]
        if not pending:
            selector.unregister(fd)
        return pending

    def _read(self, selector: selectors.BaseSelector, fd: int, stream: str) -> None:
        """Read what ``fd`` (stdout or stderr) holds into its buffer; at its end, stop
        watching it. stderr keeps only its last :data:`_STDERR_KEPT` bytes."""
        try:
            chunk = os.read(fd, _CHUNK)
        except BlockingIOError:
            return
        if not chunk:
            selector.unregister(fd)
            if stream == "out":
                self._out_open = False
            else:
                self._err_open = False
        elif stream == "out":
            self._out += chunk
        else:
            self._err = _kept_end(self._err + chunk)
