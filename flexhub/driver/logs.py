"""The node log: one structured line per call, in a file, never on stdout or stderr.

Secret values of the call are replaced by ``***`` in every record, whatever logger wrote it.
Python warnings are captured into the same file.

The :mod:`logging` machinery (:mod:`flexhub.driver.logsetup`) is set up only for calls that import
modules which log; the lean calls write their summary line directly, in the same format, so
that they do not pay for importing it.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from flexhub.driver.call import MIN_SECRET_CHARS, Call
from flexhub.errors import redact

if TYPE_CHECKING:
    from flexhub.config import NodeConfig

__all__ = ["LOG_FILE", "configure_logging", "log_call", "log_exception", "start_logging"]

LOG_FILE = "flexhub.log"
_LOGGER = "flexhub.calls"
_LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40}


class _State:
    path = ""
    level = "info"
    call: Call | None = None
    configured = False


def start_logging(call: Call, config: Callable[[], NodeConfig]) -> None:
    """Choose ``<log_dir>/flexhub.log`` as this call's log.

    Logging must never break a call: when the config or the log directory is unusable the
    call goes on without a log.
    """
    _State.call = call
    try:
        cfg = config()
        if cfg.log_dir.is_relative_to(cfg.state_dir):  # state_dir 0700 on this path too
            from flexhub.node.statedir import private_dir

            private_dir(cfg.state_dir, *cfg.log_dir.relative_to(cfg.state_dir).parts)
        else:
            os.makedirs(cfg.log_dir, mode=0o700, exist_ok=True)
    except Exception:
        return
    _State.path = str(cfg.log_dir / LOG_FILE)
    _State.level = cfg.log_level


def configure_logging() -> None:
    """Send flexhub's loggers (and warnings) to the call's log file (idempotent)."""
    if _State.configured or not _State.path:
        return
    from flexhub.driver import logsetup

    try:
        logsetup.install(
            _State.path, _State.level, _State.call.secrets if _State.call is not None else []
        )
    except OSError:
        return
    _State.configured = True


def log_call(call: Call, status: str, message: str, seconds: float) -> None:
    """Write the call's one summary line (JSON after the prefix)."""
    line = "call " + json.dumps(
        {
            "op": call.operation,
            "backend": call.backend,
            "volume": call.volume,
            "pod": call.pod_uid,
            "dir": call.target,
            "secrets": sorted(call.secret_keys),
            "status": status,
            "ms": round(seconds * 1000, 1),
            "message": message,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        },
        ensure_ascii=False,
    )
    if _State.configured:
        import logging

        logging.getLogger(_LOGGER).info("%s", line)
    elif _State.path and _LEVELS.get(_State.level, 20) <= _LEVELS["info"]:
        _append(redact(line, call.secrets, MIN_SECRET_CHARS))


def _append(message: str) -> None:
    """Append one line in :data:`flexhub.driver.logsetup.FORMAT` without the logging module."""
    now = time.time()
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now))
    text = f"{stamp},{int(now * 1000) % 1000:03d} {os.getpid()} INFO {_LOGGER}: {message}\n"
    try:
        fd = os.open(_State.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError:
        return
    try:
        os.write(fd, text.encode("utf-8", "replace"))
    except OSError:
        pass
    finally:
        os.close(fd)


def log_exception(call: Call) -> None:
    configure_logging()
    import logging

    logging.getLogger(_LOGGER).error("unexpected error in %s", call.operation, exc_info=True)
