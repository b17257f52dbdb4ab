"""The node log: one structured line per call, in a file, never on stdout or stderr.

Secret values of the call are replaced by ``***`` in every record, whatever logger wrote it.
Python warnings are captured into the same file.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from flexhub.call import MIN_SECRET_CHARS, Call
from flexhub.errors import redact

if TYPE_CHECKING:
    from flexhub.config import NodeConfig

__all__ = ["LOG_FILE", "log_call", "log_exception", "start_logging"]

LOG_FILE = "flexhub.log"
LOG = logging.getLogger("flexhub.calls")


class _Redact(logging.Filter):
    """Replace the call's secret values in a record's final text."""

    def __init__(self, secrets: list[str]) -> None:
        super().__init__()
        self.secrets = secrets

    def filter(self, record: logging.LogRecord) -> bool:
        if self.secrets:
            record.msg = redact(record.getMessage(), self.secrets, MIN_SECRET_CHARS)
            record.args = None
            if record.exc_info and record.exc_info[1] is not None:
                formatted = logging.Formatter().formatException(record.exc_info)
                record.exc_text = redact(formatted, self.secrets, MIN_SECRET_CHARS)
        return True


class _ReopeningFileHandler(logging.FileHandler):
    """Append to a file, reopening it when logrotate moved it away.

    (What ``logging.handlers.WatchedFileHandler`` does, without importing ``logging.handlers``,
    whose socket, pickle and queue imports cost every kubelet call a few milliseconds.)
    """

    def __init__(self, path: str) -> None:
        super().__init__(path, mode="a", encoding="utf-8", delay=False)
        self._identity = self._stat_identity()

    def _stat_identity(self) -> tuple[int, int]:
        try:
            st = os.stat(self.baseFilename)
        except OSError:
            return (-1, -1)
        return (st.st_dev, st.st_ino)

    def emit(self, record: logging.LogRecord) -> None:
        current = self._stat_identity()
        if current != self._identity:
            self.close()
            self.stream = self._open()
            self._identity = self._stat_identity()
        super().emit(record)


def start_logging(call: Call, config: Callable[[], NodeConfig]) -> None:
    """Send flexhub's loggers (and warnings) to ``<log_dir>/flexhub.log``.

    Logging must never break a call: when the config or the log directory is unusable the
    call goes on without a log.
    """
    try:
        cfg = config()
        os.makedirs(cfg.log_dir, mode=0o700, exist_ok=True)
        handler: logging.Handler = _ReopeningFileHandler(str(cfg.log_dir / LOG_FILE))
    except Exception:
        return
    handler.setFormatter(
        logging.Formatter("%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s")
    )
    handler.addFilter(_Redact(call.secrets))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(cfg.log_level.upper())
    logging.captureWarnings(True)


def log_call(call: Call, status: str, message: str, seconds: float) -> None:
    """Write the call's one summary line (JSON after the prefix)."""
    LOG.info(
        "call %s",
        json.dumps(
            {
                "op": call.operation,
                "backend": call.backend,
                "volume": call.volume,
                "pod": call.pod_uid,
                "dir": call.target,
                "status": status,
                "ms": round(seconds * 1000, 1),
                "message": message,
                "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            },
            ensure_ascii=False,
        ),
    )


def log_exception(call: Call) -> None:
    LOG.error("unexpected error in %s", call.operation, exc_info=True)
