"""The ``logging`` side of the node log, imported only by calls that do real work.

:mod:`flexhub.driver.logs` writes the one summary line of a lean call (``unmount`` of a directory
with nothing on it, ``getvolumename``, ...) without importing :mod:`logging`; calls that
import the node services or a backend install this handler first, so every module logger
writes to the same file.
"""

from __future__ import annotations

import logging
import os

from flexhub.driver.call import MIN_SECRET_CHARS
from flexhub.errors import redact

__all__ = ["FORMAT", "RememberedRedact", "install"]

FORMAT = "%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s"


class _Redact(logging.Filter):
    """Replace the call's secret values in a record's final text."""

    def __init__(self, secrets: list[str]) -> None:
        super().__init__()
        self.secrets = secrets

    #: redact even with no secrets of its own: the values :func:`flexhub.errors.remember_secrets`
    #: was given (a long-running service's, the CSI plugin's)
    always = False

    def filter(self, record: logging.LogRecord) -> bool:
        if self.secrets or self.always:
            record.msg = redact(record.getMessage(), self.secrets, MIN_SECRET_CHARS)
            record.args = None
            if record.exc_info and record.exc_info[1] is not None:
                formatted = logging.Formatter().formatException(record.exc_info)
                record.exc_text = redact(formatted, self.secrets, MIN_SECRET_CHARS)
        return True


class RememberedRedact(_Redact):
    """Redact the remembered secret values (and the traceback's) from every record."""

    always = True

    def __init__(self) -> None:
        super().__init__([])


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


def install(path: str, level: str, secrets: list[str]) -> None:
    """Send every logger (and warnings) to ``path``, secrets of the call redacted.

    :raises OSError: the file cannot be opened.
    """
    handler: logging.Handler = _ReopeningFileHandler(path)
    handler.setFormatter(logging.Formatter(FORMAT))
    handler.addFilter(_Redact(secrets))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    logging.captureWarnings(True)
