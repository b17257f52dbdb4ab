"""The node config's backend tables: each one names an installed backend, and holds only the
keys that backend declares (:attr:`flexhub.backend.Backend.settings_keys`).

A typo must not pass silently: ``[loopfle]`` would otherwise be ignored and loopfile's files go
to the default root. Every volume call checks the sections, and the table of the backend it
uses; ``init`` checks nothing (kubelet drops a driver whose ``init`` fails). ``flexhub doctor``
checks every table. Only the standard library is imported here (``difflib`` on an error).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any

from flexhub.errors import FlexhubError, did_you_mean

if TYPE_CHECKING:
    from flexhub.config import NodeConfig

__all__ = [
    "check_backend_table",
    "check_keys",
    "check_sections",
    "did_you_mean",  # re-exported: it lives in flexhub.errors, beside the other message helpers
]


def _where(config: NodeConfig) -> str:
    return f"node config {config.source}" if config.source is not None else "node config"


def check_sections(config: NodeConfig, names: Collection[str]) -> None:
    """Refuse a table of the node config that names no installed backend.

    :param names: the installed backends' names.
    :raises FlexhubError: naming the first unknown table, with the closest backend name.
    """
    unknown = sorted(set(config.backends) - set(names))
    if not unknown:
        return
    name = unknown[0]
    hint = did_you_mean(name, names, fmt="[{}]")
    installed = ", ".join(sorted(names)) or "(none)"
    raise FlexhubError(
        f"{_where(config)}: unknown section [{name[:80]}]{hint}: a table names a backend; "
        f"installed backends: {installed}"
    )


def check_keys(
    config: NodeConfig | None, backend: str, table: Mapping[str, Any], known: Collection[str]
) -> None:
    """Refuse a key of ``[backend]`` that is not in ``known``.

    :raises FlexhubError: naming the first unknown key, with the closest known one.
    """
    unknown = sorted(set(table) - set(known))
    if not unknown:
        return
    key = unknown[0]
    where = _where(config) if config is not None else "node config"
    listed = ", ".join(sorted(known)) or "none"
    raise FlexhubError(
        f"{where}: unknown setting {key[:80]!r} in [{backend}]{did_you_mean(key, known)}; "
        f"known: {listed}"
    )


def check_backend_table(config: NodeConfig, name: str, backend: Any) -> None:
    """Run ``backend.check_settings`` on ``[name]``; its error names the config file."""
    try:
        backend.check_settings(name, config.backend_table(name), config)
    except FlexhubError as exc:
        prefix = "node config: "
        if config.source is not None and exc.message.startswith(prefix):
            exc.message = f"{_where(config)}: {exc.message[len(prefix) :]}"
            exc.args = (exc.message,)
        raise
