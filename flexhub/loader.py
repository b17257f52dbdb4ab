"""Find backends: the entry-point group ``flexhub.backends``, loaded with stevedore.

Only the backend a call names is imported. stevedore keeps an entry-point cache under
``$XDG_CACHE_HOME``; kubelet runs drivers without ``HOME``, so flexhub points that at
``<state_dir>/cache`` before stevedore is imported.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from flexhub import ENTRY_POINT_GROUP
from flexhub.errors import BackendError, InvalidOptions

if TYPE_CHECKING:
    from flexhub.backend import Backend
    from flexhub.call import Call
    from flexhub.config import NodeConfig

__all__ = ["BackendInfo", "backend_factory", "installed_backends", "load_backend"]

LOG = logging.getLogger(__name__)
_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyz0123456789_.-")


def _prepare_cache(config: NodeConfig | None = None) -> None:
    if os.environ.get("XDG_CACHE_HOME"):
        return
    if config is None:
        from flexhub.config import load_config

        try:
            config = load_config()
        except Exception:
            return
    os.environ["XDG_CACHE_HOME"] = str(config.state_dir / "cache")


def installed_backends() -> list[str]:
    """Names registered in ``flexhub.backends`` (without importing any of them)."""
    from importlib.metadata import entry_points

    return sorted({ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)})


def load_backend(name: str | None, config: NodeConfig | None = None) -> type[Backend]:
    """Import and return the backend class registered as ``name``.

    :raises InvalidOptions: ``name`` is missing or not a backend name.
    :raises BackendError: no such backend, or it fails to import.
    """
    if not name:
        raise InvalidOptions(
            f"option 'backend' is required; installed backends: {_names_or_none()}"
        )
    if len(name) > 63 or not set(name) <= _NAME_CHARS:
        raise InvalidOptions(
            f"option 'backend' is not a backend name; installed: {_names_or_none()}"
        )
    _prepare_cache(config)
    from stevedore import driver, exception

    try:
        manager: Any = driver.DriverManager(ENTRY_POINT_GROUP, name, invoke_on_load=False)
    except exception.NoMatches:
        raise BackendError(
            f"unknown backend {name!r}; installed backends: {_names_or_none()}"
        ) from None
    except exception.MultipleMatches as exc:
        raise BackendError(f"backend {name!r} is registered twice: {exc}") from None
    except Exception as exc:
        LOG.warning("backend %s failed to import", name, exc_info=True)
        raise BackendError(
            f"backend {name!r} failed to import: {type(exc).__name__}: {exc}"
        ) from None
    cls = manager.driver
    from flexhub.backend import Backend

    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise BackendError(f"backend {name!r} does not provide a flexhub.backend.Backend class")
    return cls


def _names_or_none() -> str:
    names = installed_backends()
    return ", ".join(names) if names else "(none)"


def backend_factory(config: NodeConfig, call: Call | None = None) -> Callable[[str], Backend]:
    """Return ``load(name) -> Backend`` for ``unmount``, whose backend comes from the journal."""
    from flexhub.node import Node

    def load(name: str) -> Backend:
        if call is not None:
            call.backend = name
        return load_backend(name, config)(Node(config, backend=name))

    return load


@dataclass(frozen=True)
class BackendInfo:
    """What ``flexhub backends`` shows for one entry point."""

    name: str
    target: str
    distribution: str
    version: str
    error: str = ""


def describe_backends() -> list[BackendInfo]:
    """Every registered backend, with its distribution and whether it imports."""
    from importlib.metadata import entry_points

    infos = []
    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        dist = ep.dist
        error = ""
        try:
            load_backend(ep.name)
        except Exception as exc:
            error = str(exc)
        infos.append(
            BackendInfo(
                name=ep.name,
                target=ep.value,
                distribution=dist.name if dist else "?",
                version=dist.version if dist else "?",
                error=error,
            )
        )
    return infos
