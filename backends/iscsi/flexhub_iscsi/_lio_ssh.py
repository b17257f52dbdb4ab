"""The provisioner's connection to an iSCSI target host: ``ssh``, one program, its requests.

Each ``ssh`` runs the fixed command :data:`~flexhub_iscsi._lio.REMOTE_COMMAND` on the target
host: ``/usr/bin/python3 -I -c`` with a loader that reads the program's length, the program
(:func:`remote_program`: the remote parts of :data:`~flexhub_iscsi._lio.REMOTE_PARTS`), then
runs it; the program answers requests, one JSON line each on its stdin (CHAP values among
them: never on a command line), one ``FLEXHUB-LIO`` line each on its stdout (the request's own
random ``id`` first: no other line is taken for its answer), until its stdin
ends or it has waited :data:`~flexhub_iscsi._lio_remote.IDLE` seconds for one, and ends after
any refusal.

**Kept open.** With a runner that can keep a command up (production's
:class:`~flexhub.node.runner.SubprocessRunner`), the ``ssh`` stays open after an answer and the
provisioner's next request to the same host, user, port, key and known host key goes to it:
no new connection (about 1.3 s of key exchange in an emulated guest) and no new interpreter
and ``import rtslib_fb`` (about 2 s there). At most :data:`KEPT` stay idle per target, for at
most :data:`IDLE` seconds (the program itself gives up after longer); each serves one request
at a time, and none gets a request :data:`LIFETIME` seconds after it started (so a key revoked
on the target host stops working by then). Every request has its own bound: past it the
``ssh`` (its whole group) is killed and never reused, as a one-shot call's would be. A kept
``ssh`` whose stdout ends before it answers (the connection dropped, the target host
rebooted, the program's own idle limit) is asked once more over a new connection, within the
same bound: every action is idempotent (named from the claim uid). The key and the known host
key are written to 0600 files in a private temporary directory only until the connection's
first answer (ssh has read them by then); only their digest names the kept connection. A
process that ends closes them (stdin closed: the program ends). With any other runner (the
tests' recording ones) each request is one call: the same text on stdin, then its end.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Mapping
from importlib import resources
from typing import Any

from flexhub.backend import (
    CommandError,
    CommandRunner,
    FlexhubError,
    InvalidOptions,
    LiveCommand,
    NoRoom,
    Secrets,
    redact,
)
from flexhub_iscsi._lio import (
    _FUTURE,
    CALL_TIMEOUT,
    CONNECT_TIMEOUT,
    KNOWN_HOSTS_KEY,
    LOCK_MARGIN,
    PRIVATE_KEY,
    REMOTE_COMMAND,
    REMOTE_PARTS,
    Ssh,
)

__all__ = ["IDLE", "KEPT", "LIFETIME", "SWEEP", "Lio", "remote_program", "request_line", "ssh_argv"]

LOG = logging.getLogger(__name__)

MARK = "FLEXHUB-LIO "
#: Seconds a kept ``ssh`` may sit idle and still be given a request; it is closed soon after
#: (the program on the target host waits 120 s for one before it ends by itself).
IDLE = 60.0
#: Kept ``ssh`` connections per target (host, port, user, key, known host key).
KEPT = 4
#: Seconds from its start after which a connection is given no more requests: a key revoked
#: on the target host (an open SSH connection outlives that) stops working within this.
LIFETIME = 300.0
#: Seconds between two looks for kept connections to close.
SWEEP = 5.0


def ssh_argv(ssh: Ssh, key_file: str, known_hosts: str) -> list[str]:
    """The ``ssh`` command: no config, no agent, no password prompt, strict host keys."""
    options = {
        "BatchMode": "yes",
        "StrictHostKeyChecking": "yes",
        "UserKnownHostsFile": known_hosts,
        "GlobalKnownHostsFile": "/dev/null",
        "CheckHostIP": "no",
        "UpdateHostKeys": "no",
        "IdentityFile": key_file,
        "IdentitiesOnly": "yes",
        "IdentityAgent": "none",
        "PasswordAuthentication": "no",
        "KbdInteractiveAuthentication": "no",
        "ControlMaster": "no",
        "ControlPath": "none",
        "ConnectTimeout": str(CONNECT_TIMEOUT),
        "ServerAliveInterval": "10",
        "ServerAliveCountMax": "3",
        "RequestTTY": "no",
        "ForwardAgent": "no",
        "ForwardX11": "no",
        "LogLevel": "ERROR",
    }
    argv = ["ssh", "-F", "/dev/null", "-T"]
    for name, value in options.items():
        argv += ["-o", f"{name}={value}"]
    argv += ["-p", str(ssh.port), "-l", ssh.user, "--", ssh.host, *REMOTE_COMMAND]
    return argv


def remote_program() -> str:
    """The program the loader runs: its :data:`REMOTE_PARTS` in order (one ``__future__``
    import first), then ``serve()``. ASCII only: its length in characters is its length in
    bytes, which the loader reads first."""
    package = resources.files("flexhub_iscsi")
    texts = [package.joinpath(part).read_text("utf-8") for part in REMOTE_PARTS]
    body = "\n\n".join(text.replace(_FUTURE, "", 1) for text in texts)
    program = f"{_FUTURE}{body}\n\nserve()\n"
    program.encode("ascii")  # UnicodeEncodeError: a part is not ASCII (a test checks them)
    return program


def request_line(request: Mapping[str, Any]) -> str:
    """One request as the program reads it: a JSON line (ASCII: every other character
    escaped, so no newline inside)."""
    return json.dumps(dict(request), ensure_ascii=True) + "\n"


def _line(request: Mapping[str, Any], deadline: float) -> tuple[str, str]:
    """``request`` with an ``id`` of its own and its ``wait`` for the target host's lock: the
    time left until ``deadline`` less :data:`~flexhub_iscsi._lio.LOCK_MARGIN` (at least 1 s),
    so that it is refused unrun rather than run after its caller gave up. Its line, and the
    start of the line that answers it (the program echoes the id first)."""
    wait = max(1.0, deadline - time.monotonic() - LOCK_MARGIN)
    ident = os.urandom(8).hex()
    line = request_line({**request, "id": ident, "wait": round(wait, 3)})
    return line, MARK + json.dumps({"id": ident})[:-1]


def _opening(request: str) -> str:
    program = remote_program()
    return f"{len(program)}\n{program}{request}"


def _loaded(line: str) -> dict[str, Any] | None:
    """The JSON object of an answer line, or ``None`` when it holds none."""
    try:
        loaded = json.loads(line[len(MARK) :])
    except ValueError:
        return None
    return loaded if isinstance(loaded, dict) else None


def _write_private(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, text.encode("utf-8"))
    finally:
        os.close(fd)


class _Kept:
    """The idle kept connections of this process, by target; closed when it exits.

    While any is kept, a daemon thread looks every :data:`SWEEP` seconds for those idle past
    :data:`IDLE`, past :data:`LIFETIME` or ended, and closes (reaps) them: no connection stays
    open long after its last request, and none that ended stays a zombie."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.idle: dict[tuple[Any, ...], list[tuple[float, LiveCommand]]] = {}
        self.registered = False
        self.sweeping = False

    def _stale(self) -> list[LiveCommand]:
        """Take the connections no longer to be used out of the pool (with :attr:`lock`)."""
        now = time.monotonic()
        stale: list[LiveCommand] = []
        for target in list(self.idle):
            usable = []
            for since, live in self.idle[target]:
                fresh = now - since <= IDLE and now - live.started <= LIFETIME
                if fresh and live.alive():
                    usable.append((since, live))
                else:
                    stale.append(live)
            if usable:
                self.idle[target] = usable
            else:
                del self.idle[target]
        return stale

    def take(self, key: tuple[Any, ...]) -> LiveCommand | None:
        """The most recently idle connection for ``key`` still usable, or ``None``. Those no
        longer to be used are closed on a thread of their own: a close may wait seconds for
        an unreachable host, and that is not this request's time."""
        with self.lock:
            stale = self._stale()
            kept = self.idle.get(key, [])
            found = kept.pop()[1] if kept else None
        if stale and not _start(_close_each, stale):
            _close_each(stale)
        return found

    def give(self, key: tuple[Any, ...], live: LiveCommand) -> None:
        """Keep ``live`` for the next request to ``key`` (or close it: enough are kept)."""
        with self.lock:
            kept = self.idle.setdefault(key, [])
            if len(kept) < KEPT:
                kept.append((time.monotonic(), live))
                if not self.registered:
                    atexit.register(self.close_all)
                    self.registered = True
                if not self.sweeping:
                    self.sweeping = _start(self._sweep)
                return
        live.close()

    def _sweep(self) -> None:
        while True:
            time.sleep(SWEEP)
            with self.lock:
                stale = self._stale()
                done = not self.idle
                if done:
                    self.sweeping = False
            _close_each(stale)
            if done:
                return

    def close_all(self) -> None:
        with self.lock:
            every = [live for kept in self.idle.values() for _, live in kept]
            self.idle.clear()
        _close_each(every)


def _close_each(lives: list[LiveCommand]) -> None:
    for live in lives:
        live.close()


def _start(target: Any, *args: Any) -> bool:
    """Run ``target(*args)`` on a daemon thread: whether one started (none can when the
    interpreter is ending, or out of threads: a close then runs in place, and a sweep is left
    to the next connection kept)."""
    try:
        threading.Thread(target=target, args=args, name="flexhub-lio-kept", daemon=True).start()
    except RuntimeError:
        return False
    return True


KEPT_CONNECTIONS = _Kept()
#: The values each kept connection's earlier requests masked: stderr the program wrote for one
#: request may arrive during a later one over the same connection, so every message read from
#: it is masked with all of them.
_CARRIED: weakref.WeakKeyDictionary[LiveCommand, frozenset[str]] = weakref.WeakKeyDictionary()


class Lio:
    """Runs requests on one target host through ``runner`` (``ssh``)."""

    def __init__(self, runner: CommandRunner, ssh: Ssh, secrets: Secrets) -> None:
        self.runner = runner
        self.ssh = ssh
        self.secrets = secrets

    def _credentials(self) -> tuple[str, str]:
        values = []
        for key in (PRIVATE_KEY, KNOWN_HOSTS_KEY):
            secret = self.secrets.get(key)
            value = secret.reveal() if secret is not None else ""
            if not value.strip():
                raise InvalidOptions(
                    f"the class's Secret has no {key}: the provisioner reaches the target "
                    "host with that SSH key"
                )
            values.append(value if value.endswith("\n") else value + "\n")
        return values[0], values[1]

    def call(
        self,
        action: str,
        spec: Mapping[str, Any],
        masked: list[str],
        timeout: float = CALL_TIMEOUT,
    ) -> dict[str, Any]:
        """Run ``action`` on the target host within ``timeout`` seconds; its ``ok`` answer.

        :raises FlexhubError: ssh failed, or the target host refused (one line).
        """
        credentials = self._credentials()
        deadline = time.monotonic() + timeout
        request = {"action": action, "spec": dict(spec)}
        spawn = getattr(self.runner, "spawn", None)
        if callable(spawn):
            answer, why, rc, shown = self._kept(
                spawn, credentials, request, masked, deadline, timeout
            )
        else:
            answer, why, rc = self._once(credentials, *_line(request, deadline), masked, timeout)
            shown = masked
        return self._answer(action, answer, why, rc, shown)

    def _once(
        self,
        credentials: tuple[str, str],
        request: str,
        marker: str,
        masked: list[str],
        timeout: float,
    ) -> tuple[dict[str, Any] | None, str, int | None]:
        """One ``ssh`` through the runner: the opening, then the end of stdin."""
        with _Keys(*credentials) as files:
            argv = ssh_argv(self.ssh, *files)
            try:
                result = self.runner(
                    argv, timeout=timeout, check=False, secrets=masked, input=_opening(request)
                )
            except CommandError as exc:  # a timeout, or ssh could not start
                raise FlexhubError(f"iscsi: target host {self.ssh.host}: {exc.message}") from None
        lines = (text for text in result.stdout.splitlines() if text.startswith(marker))
        line = next(lines, None)
        answer = None if line is None else _loaded(line)
        return answer, result.stderr.strip() or result.stdout.strip(), result.returncode

    def _kept(
        self,
        spawn: Any,
        credentials: tuple[str, str],
        request: dict[str, Any],
        masked: list[str],
        deadline: float,
        timeout: float,
    ) -> tuple[dict[str, Any] | None, str, int | None, list[str]]:
        """The request over a kept ``ssh`` to this target, else a new one (kept after); with
        the values its messages are masked with (those of every request the connection that
        answered carried)."""
        digest = hashlib.sha256("\0".join(credentials).encode("utf-8")).hexdigest()
        key = (self.ssh.host, self.ssh.port, self.ssh.user, digest)
        live = KEPT_CONNECTIONS.take(key)
        if live is not None:
            carried = [*_CARRIED.get(live, ()), *masked]
            sent, marker = _line(request, deadline)
            line = self._exchange(live, sent.encode("ascii"), marker, deadline, timeout)
            if line is not None:
                return (*self._keep(key, live, line, carried), carried)
            why = " ".join(redact(live.stderr, carried).split())[:200] or "no message"
            if deadline - time.monotonic() <= LOCK_MARGIN + 1:
                # too late to ask again: the lock's wait would have to end before it began
                ended = f"a kept connection ended without answering ({why})"
                return None, ended, live.returncode, carried
            LOG.info(
                "iscsi: a kept connection to %s ended without answering (%s): asking again "
                "over a new one",
                self.ssh.host,
                why,
            )
        sent, marker = _line(request, deadline)
        opening = _opening(sent).encode("ascii")
        with _Keys(*credentials) as files:
            try:
                live = spawn(ssh_argv(self.ssh, *files), secrets=masked)
            except CommandError as exc:  # ssh could not start
                raise FlexhubError(f"iscsi: target host {self.ssh.host}: {exc.message}") from None
            line = self._exchange(live, opening, marker, deadline, timeout)
        if line is not None:
            return (*self._keep(key, live, line, masked), masked)
        return None, live.stderr.strip(), live.returncode, masked

    def _exchange(
        self, live: LiveCommand, data: bytes, marker: str, deadline: float, timeout: float
    ) -> str | None:
        try:
            line = live.exchange(
                data, marker.encode("ascii"), max(0.0, deadline - time.monotonic())
            )
        except CommandError:  # timed out: killed with its group
            raise FlexhubError(
                f"iscsi: target host {self.ssh.host}: no answer within {timeout:g}s (ssh killed)"
            ) from None
        return None if line is None else line.decode("utf-8", "replace")

    @staticmethod
    def _keep(
        key: tuple[Any, ...], live: LiveCommand, line: str, carried: list[str]
    ) -> tuple[dict[str, Any] | None, str, int | None]:
        """``carried``: every value masked by a request over ``live``, this one's included
        (kept with it for the next request; this one's message is masked with them by
        :meth:`_answer`)."""
        answer = _loaded(line)
        if answer is not None and "ok" in answer:  # the program goes on: keep it
            _CARRIED[live] = frozenset(carried)
            KEPT_CONNECTIONS.give(key, live)
            return answer, "", 0
        live.close()  # a refusal: the program has ended
        return answer, live.stderr.strip(), live.returncode

    def _answer(
        self,
        action: str,
        answer: dict[str, Any] | None,
        why: str,
        rc: int | None,
        masked: list[str],
    ) -> dict[str, Any]:
        if answer is not None and "ok" in answer and rc == 0:
            ok: dict[str, Any] = answer["ok"]
            return ok
        room = False
        if answer is not None and "error" in answer:
            why = str(answer["error"])
            room = answer.get("room") is True
        else:
            why = why or "no answer"
            if rc == 255:
                why = f"ssh failed: {why}"
        why = " ".join(redact(why, masked).split())[:400]
        if room:  # the fileio directory's room (CSI: RESOURCE_EXHAUSTED)
            raise NoRoom(f"iscsi: target host {self.ssh.host} ({action}): {why}")
        raise FlexhubError(f"iscsi: target host {self.ssh.host} ({action}): {why}")


class _Keys:
    """The key and the known host key in 0600 files of a private directory, removed on
    exit; ``with`` gives their paths."""

    def __init__(self, key: str, known_hosts: str) -> None:
        self.texts = (key, known_hosts)
        self.private = ""

    def __enter__(self) -> tuple[str, str]:
        try:
            self.private = tempfile.mkdtemp(prefix="flexhub-ssh-")  # 0700, ours
        except OSError as exc:
            raise FlexhubError(f"iscsi: no private directory for the ssh key: {exc}") from None
        paths = (os.path.join(self.private, "id"), os.path.join(self.private, "known_hosts"))
        try:
            for path, text in zip(paths, self.texts, strict=True):
                _write_private(path, text)
        except OSError as exc:  # disk full: named, never the key
            shutil.rmtree(self.private, ignore_errors=True)
            raise FlexhubError(f"iscsi: cannot write the ssh key file: {exc.strerror}") from None
        return paths

    def __exit__(self, *_: object) -> None:
        shutil.rmtree(self.private, ignore_errors=True)
