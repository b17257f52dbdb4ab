"""Find backends: the entry-point group ``flexhub.backends``, loaded with stevedore.

Only the backend a call names is imported. stevedore keeps an entry-point cache under
``$XDG_CACHE_HOME``; kubelet runs drivers without ``HOME``, so flexhub points that at
``<state_dir>/cache`` before stevedore is imported.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from flexhub import ENTRY_POINT_GROUP
from flexhub.driver.memo import Memo, environment_fingerprint
from flexhub.errors import BackendError, InvalidOptions
from flexhub.node.frozen import Frozen

if TYPE_CHECKING:
    from flexhub.backend import Backend
    from flexhub.config import NodeConfig
    from flexhub.driver.call import Call

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
    from flexhub.node.statedir import private_dir

    with contextlib.suppress(OSError):  # stevedore would make it with the umask's mode
        private_dir(config.state_dir, "cache")
    os.environ["XDG_CACHE_HOME"] = str(config.state_dir / "cache")


def installed_backends() -> list[str]:
    """Names registered in ``flexhub.backends`` (without importing any of them)."""
    from importlib.metadata import entry_points

    return sorted({ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)})


def load_backend(name: str | None, config: NodeConfig | None = None) -> type[Backend]:
    """Import and return the backend class registered as ``name``.

    With ``config``, the answer of an earlier call is reused from the node's memo
    (:mod:`flexhub.driver.memo`) as long as no distribution was installed, upgraded or removed
    since; otherwise stevedore scans the entry points, and the memo is rewritten.

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
    memo = Memo(config.state_dir) if config is not None else None
    if memo is not None:
        remembered = _from_memo(memo, name)
        if remembered is not None:
            return remembered
    _prepare_cache(config)
    if memo is not None:
        _forget_stevedore_cache(memo)
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
    if not _is_backend(cls):
        raise BackendError(f"backend {name!r} does not provide a flexhub.backend.Backend class")
    if memo is not None:
        _remember(memo)
    return cast("type[Backend]", cls)


def _forget_stevedore_cache(memo: Memo) -> None:
    """Drop stevedore's own entry-point cache when flexhub's memo missed.

    stevedore keys its cache by the modification times of the path entries and entry-point
    files packed as 32-bit floats, about two minutes apart at today's dates, so an
    ``entry_points.txt`` changed in place can be served stale. flexhub's memo compares them
    exactly; when it misses, stevedore scans afresh (once per change, a few tens of ms).
    """
    if os.environ.get("XDG_CACHE_HOME") == str(memo.root):
        import shutil

        shutil.rmtree(memo.root / "python-entrypoints", ignore_errors=True)


def _is_backend(cls: object) -> bool:
    from flexhub.backend import Backend

    return isinstance(cls, type) and issubclass(cls, Backend)


def _from_memo(memo: Memo, name: str) -> type[Backend] | None:
    """The class the memo names for ``name``, if the memo is current; else ``None``."""
    data = memo.read_json(memo.backends_file)
    if not isinstance(data, dict):
        return None
    files = data.get("files")
    backends = data.get("backends")
    if not isinstance(files, list) or not isinstance(backends, dict):
        return None
    if data.get("fingerprint") != environment_fingerprint(tuple(str(f) for f in files)):
        return None
    target = backends.get(name)
    if not isinstance(target, str) or ":" not in target:
        return None
    module_name, _, attribute = target.partition(":")
    try:
        found: Any = importlib.import_module(module_name)
        for part in attribute.split("."):
            found = getattr(found, part)
    except Exception:  # a broken memo or backend: let stevedore say what is wrong
        return None
    return cast("type[Backend]", found) if _is_backend(found) else None


def _remember(memo: Memo) -> None:
    """Write every uniquely named backend entry point to the memo."""
    memo.remember_backends()


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


class BackendInfo(Frozen):
    """What ``flexhub backends`` shows for one entry point."""

    # the fields, in order
    __slots__ = (  # noqa: RUF023
        "name",
        "target",
        "distribution",
        "version",
        "error",
    )
    name: str
    target: str
    distribution: str
    version: str
    error: str

    def __init__(
        self, name: str, target: str, distribution: str, version: str, error: str = ""
    ) -> None:
        self._set(name=name, target=target, distribution=distribution, version=version, error=error)


def describe_backends(config: NodeConfig | None = None) -> list[BackendInfo]:
    """Every registered backend, with its distribution and whether it imports.

    :param config: the node config whose state directory keeps stevedore's cache.
    """
    from importlib.metadata import entry_points

    infos = []
    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        dist = ep.dist
        error = ""
        try:
            load_backend(ep.name, config)
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
