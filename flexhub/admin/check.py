"""One check's result (:class:`Check`: ``ok``, ``warn`` or ``fail``, a one-line detail and
the fix) and the table people read (:func:`render`), for ``flexhub doctor``."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["Check", "render"]


@dataclass(frozen=True)
class Check:
    """The result of one check."""

    name: str
    status: str  # "ok", "warn" or "fail"
    detail: str
    fix: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def render(checks: Iterable[Check]) -> list[str]:
    """A table for people: status, check, detail, and the fix under each problem."""
    rows = list(checks)
    width = max((len(c.name) for c in rows), default=0)
    lines = []
    for check in rows:
        lines.append(f"{check.status.upper():<4}  {check.name:<{width}}  {check.detail}")
        if check.fix:
            lines.append(f"{'':<4}  {'':<{width}}  fix: {check.fix}")
    failed = sum(1 for c in rows if c.status == "fail")
    warned = sum(1 for c in rows if c.status == "warn")
    lines.append(f"{len(rows)} checks: {failed} failed, {warned} warnings")
    return lines
