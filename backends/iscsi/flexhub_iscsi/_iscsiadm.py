"""``iscsiadm`` calls with CHAP values masked everywhere and its exit codes understood.

iscsiadm takes values only as ``-v VALUE`` arguments, visible in ``/proc/<pid>/cmdline``, so
flexhub never passes a CHAP value to it (:mod:`flexhub_iscsi._records` writes them into the
record files). Every call still passes them to the runner as ``secrets`` (masked in its logs
and errors, should one ever slip in), and every message built here from iscsiadm's own
output is scrubbed again.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from flexhub.backend import CommandError, CommandRunner, Result, VolumeError, redact

__all__ = [
    "ERR_AUTH",
    "ERR_NO_OBJS",
    "ERR_SESS_EXISTS",
    "ERR_SESS_NOT_FOUND",
    "Iscsiadm",
    "IscsiadmError",
    "scrub",
]

LOG = logging.getLogger(__name__)

#: open-iscsi's exit codes (``include/iscsi_err.h``) that flexhub acts on.
ERR_SESS_NOT_FOUND = 2
ERR_LOGIN = 5
ERR_SESS_EXISTS = 15
ERR_FATAL_LOGIN = 19
ERR_NO_OBJS = 21
ERR_AUTH = 24

_MEANING = {
    1: "generic error",
    2: "session not found",
    3: "out of memory",
    4: "connection failure",
    5: "login failed",
    6: "iSCSI database failure",
    7: "invalid argument",
    8: "connection timed out",
    9: "internal error",
    10: "logout failed",
    11: "PDU timed out",
    12: "transport not found",
    13: "permission denied",
    14: "transport capability failure",
    15: "session already exists",
    16: "invalid management request",
    18: "cannot talk to iscsid",
    19: "the target refused the login",
    20: "iscsid is not running or unreachable",
    21: "no records found",
    22: "sysfs lookup failed",
    24: "authentication failed",
    28: "device or resource busy",
    29: "try again",
    32: "session not connected",
}

_EXCERPT = 300


class IscsiadmError(VolumeError):
    """An iscsiadm call failed; ``returncode`` is its exit code (``None``: timed out)."""

    def __init__(self, message: str, returncode: int | None) -> None:
        super().__init__(message)
        self.returncode = returncode


def scrub(text: str, secrets: Sequence[str]) -> str:
    """Replace every secret value in ``text`` (longest first) with ``***``."""
    return redact(text, secrets)


def meaning(code: int | None) -> str:
    if code is None:
        return "timed out"
    return _MEANING.get(code, f"exit {code}")


class Iscsiadm:
    """Runs ``iscsiadm`` through the node's runner.

    :param runner: the node's command runner.
    :param timeout: bound of one call (logins and discovery pass their own).
    :param secrets: every CHAP value of the call: masked in argv, logs and errors.
    """

    def __init__(self, runner: CommandRunner, timeout: float, secrets: Sequence[str] = ()):
        self.runner = runner
        self.timeout = timeout
        self.secrets = [s for s in secrets if s]

    def scrub(self, text: str) -> str:
        return scrub(text, self.secrets)

    def run(
        self,
        args: Sequence[str],
        *,
        what: str,
        ok: Sequence[int] = (0,),
        timeout: float | None = None,
    ) -> Result:
        """Run ``iscsiadm ARGS``; an exit code outside ``ok`` raises.

        :param what: what the call does, for the error message ("log in to 10.0.0.1:3260").
        :raises IscsiadmError: the call failed; the message holds iscsiadm's output, scrubbed.
        """
        argv = ["iscsiadm", *args]
        try:
            result = self.runner(
                argv,
                timeout=self.timeout if timeout is None else timeout,
                check=False,
                secrets=self.secrets,
            )
        except CommandError as exc:  # could not start, or timed out (message already masked)
            raise IscsiadmError(self.scrub(f"iscsi: cannot {what}: {exc.message}"), None) from None
        if result.returncode not in ok:
            raise self.error(result, what)
        return result

    def error(self, result: Result, what: str) -> IscsiadmError:
        """The :class:`VolumeError` for a failed ``result``, secrets scrubbed."""
        output = " ".join((result.stderr.strip() or result.stdout.strip()).split())
        if len(output) > _EXCERPT:
            output = output[: _EXCERPT - 3] + "..."
        message = f"iscsi: cannot {what}: {meaning(result.returncode)}"
        if result.returncode in (ERR_AUTH, ERR_FATAL_LOGIN):
            message += " (check the CHAP credentials in the PV's secret and on the target)"
        if output:
            message += f": {output}"
        return IscsiadmError(self.scrub(message), result.returncode)
