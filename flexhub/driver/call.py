"""The record of one kubelet call and its reply, shared by the dispatcher, the loader and the log.

This module sits below :mod:`flexhub.driver.kubelet`, :mod:`flexhub.driver.loader` and
:mod:`flexhub.driver.logs`, so that none of them imports another to name the call it
serves. Plain classes, not dataclasses: it is imported on every kubelet call.
"""

from __future__ import annotations

import json
from typing import Any

from flexhub.errors import MIN_SECRET_CHARS

__all__ = ["MIN_SECRET_CHARS", "Call", "Reply"]


class Reply:
    """One FlexVolume reply."""

    __slots__ = ("extra", "message", "status")

    def __init__(
        self, status: str = "Success", message: str = "", extra: dict[str, Any] | None = None
    ) -> None:
        self.status = status
        self.message = message
        self.extra = extra or {}

    def to_json(self) -> str:
        body: dict[str, Any] = {"status": self.status}
        if self.message:
            body["message"] = self.message
        body.update(self.extra)
        return json.dumps(body, separators=(",", ":"), ensure_ascii=True)

    @property
    def exit_code(self) -> int:
        return 0 if self.status == "Success" else 1


class Call:
    """What is known about the call being served, for the log line."""

    __slots__ = ("backend", "operation", "pod_uid", "secret_keys", "secrets", "target", "volume")

    def __init__(self, operation: str) -> None:
        self.operation = operation
        self.backend = ""
        self.volume = ""
        self.pod_uid = ""
        self.target = ""
        self.secrets: list[str] = []
        #: The names (never the values) of the secret keys the call carried, for the log.
        self.secret_keys: list[str] = []
