"""The node configuration: a TOML file, ``/etc/flexhub/flexhub.toml`` unless ``FLEXHUB_CONFIG``.

A missing file means defaults. Example::

    state_dir = "/var/lib/flexhub"
    log_dir = "/var/log/flexhub"
    log_level = "info"
    lock_timeout = 60          # seconds to wait for a node lock
    command_timeout = 120      # default bound for one external command
    mount_timeout = 60         # bound for one mount command (NFS: a dead server)
    unmount_timeout = 30       # bound for each unmount step (normal, forced, lazy)
    call_timeout = 600         # bound for a whole mount, unmount or expandfs call
    release_retry_interval = 30  # first wait before retrying a release deferred for
                                 # unreachable storage (doubled after each try, up to 15 min)

    [loopfile]
    root = "/var/lib/flexhub/loopfiles"
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flexhub.errors import FlexhubError, did_you_mean
from flexhub.node.plainconfig import _LEVELS, _NUMBERS  # one list of the settings, both readers

__all__ = ["CONFIG_ENV", "DEFAULT_CONFIG_PATH", "NodeConfig", "load_config", "parse_config"]

CONFIG_ENV = "FLEXHUB_CONFIG"
DEFAULT_CONFIG_PATH = Path("/etc/flexhub/flexhub.toml")


class NodeConfig:
    """Settings for one node. Top-level tables of the file are backend tables.

    (A plain class rather than a dataclass: it is loaded on every kubelet call.)
    """

    __slots__ = (
        "backends",
        "call_timeout",
        "command_timeout",
        "lock_timeout",
        "log_dir",
        "log_level",
        "mount_timeout",
        "release_retry_interval",
        "source",
        "state_dir",
        "unmount_timeout",
    )

    def __init__(
        self,
        *,
        state_dir: Path = Path("/var/lib/flexhub"),
        log_dir: Path = Path("/var/log/flexhub"),
        log_level: str = "info",
        lock_timeout: float = 60.0,
        command_timeout: float = 120.0,
        mount_timeout: float = 60.0,
        unmount_timeout: float = 30.0,
        call_timeout: float = 600.0,
        release_retry_interval: float = 30.0,
        backends: Mapping[str, Mapping[str, Any]] | None = None,
        source: Path | None = None,
    ) -> None:
        self.state_dir = Path(state_dir)
        self.log_dir = Path(log_dir)
        self.log_level = log_level
        self.lock_timeout = float(lock_timeout)
        self.command_timeout = float(command_timeout)
        self.mount_timeout = float(mount_timeout)
        self.unmount_timeout = float(unmount_timeout)
        self.call_timeout = float(call_timeout)
        self.release_retry_interval = float(release_retry_interval)
        self.backends: Mapping[str, Mapping[str, Any]] = dict(backends or {})
        self.source = source

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in sorted(self.__slots__))
        return f"NodeConfig({fields})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, NodeConfig):
            return NotImplemented
        return all(getattr(self, n) == getattr(other, n) for n in self.__slots__)

    __hash__ = None  # type: ignore[assignment]

    def backend_table(self, name: str) -> Mapping[str, Any]:
        """The ``[name]`` table of the file, or an empty mapping."""
        return self.backends.get(name, {})


def config_path() -> Path:
    return Path(os.environ.get(CONFIG_ENV) or DEFAULT_CONFIG_PATH)


def load_config(path: Path | None = None) -> NodeConfig:
    """Read the node configuration.

    :raises FlexhubError: the file exists but is not valid TOML or holds a wrong value.
    """
    path = path or config_path()
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return NodeConfig()
    except OSError as exc:
        raise FlexhubError(f"cannot read node config {path}: {exc.strerror}") from None
    return parse_config(raw, path)


def parse_config(raw: bytes, path: Path) -> NodeConfig:
    """The node configuration these bytes hold, as :func:`load_config` reads it from
    ``path`` (named in the messages and kept as the config's source).

    :raises FlexhubError: not valid TOML or a wrong value.
    """
    from flexhub.node.plainconfig import plain_document

    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FlexhubError(f"node config {path} is not valid TOML: {exc}") from None
    # The plain form flexhub writes is read without tomllib (and datetime, and its regular
    # expressions: milliseconds on every kubelet call); anything else goes to tomllib.
    data: dict[str, Any] | None = plain_document(text)
    if data is None:
        import tomllib

        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise FlexhubError(f"node config {path} is not valid TOML: {exc}") from None
    kwargs: dict[str, Any] = {"source": path}
    backends: dict[str, Mapping[str, Any]] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            backends[key] = value
        elif key in ("state_dir", "log_dir"):
            if not isinstance(value, str) or not value.startswith("/"):
                raise FlexhubError(f"node config {path}: {key} must be an absolute path")
            kwargs[key] = Path(value)
        elif key in _NUMBERS:
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise FlexhubError(f"node config {path}: {key} must be a positive number")
            kwargs[key] = float(value)
        elif key == "log_level":
            if value not in _LEVELS:
                raise FlexhubError(f"node config {path}: log_level must be one of {_LEVELS}")
            kwargs[key] = value
        else:
            known = ("state_dir", "log_dir", "log_level", *_NUMBERS)
            raise FlexhubError(
                f"node config {path}: unknown setting {key[:80]!r}{did_you_mean(key, known)}"
            )
    kwargs["backends"] = backends
    return NodeConfig(**kwargs)
