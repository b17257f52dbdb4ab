"""Node services shared by every backend: commands, mounts, locks, the state journal.

Backends reach them through one :class:`Node` object (``self.node``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from flexhub.config import NodeConfig
from flexhub.node.journal import Journal
from flexhub.node.locks import lock as _lock
from flexhub.node.mounts import MountTable, cleanup_mount_point, is_corrupted
from flexhub.node.mounts import mount as _mount
from flexhub.node.runner import CommandRunner, SubprocessRunner

__all__ = ["Node"]


class Node:
    """The services a backend may use.

    :param config: the node configuration.
    :param backend: the name of the backend these services are for (selects its config table).
    :param runner: the command runner; tests pass a recording one.
    """

    def __init__(
        self,
        config: NodeConfig,
        backend: str = "",
        runner: CommandRunner | None = None,
    ) -> None:
        self.config = config
        self.backend = backend
        self.runner: CommandRunner = runner or SubprocessRunner(timeout=config.command_timeout)
        self.mounts = MountTable()
        self.journal = Journal(config.state_dir)
        #: Set by the core around ``BlockBackend.attach``: journals what the attach did.
        self.progress: Callable[[Mapping[str, str]], None] | None = None

    @property
    def state_dir(self) -> Path:
        return self.config.state_dir

    @property
    def settings(self) -> Mapping[str, Any]:
        """This backend's table of the node config (``[loopfile]`` for loopfile)."""
        return self.config.backend_table(self.backend)

    @contextmanager
    def lock(
        self, kind: str, key: str, timeout: float | None = None, shared: bool = False
    ) -> Iterator[None]:
        """Hold the cross-process lock on ``(kind, key)``, waiting at most ``timeout`` s
        (``0``: try once); ``shared`` locks coexist and keep exclusive ones out.

        :raises LockTimeout: the lock stayed busy for the whole bound.
        """
        bound = self.config.lock_timeout if timeout is None else timeout
        with _lock(self.state_dir / "locks", kind, key, bound, shared):
            yield

    def record_progress(self, **details: str) -> None:
        """Journal, before going on, what an attach has done so far (never a secret).

        Call it from :meth:`~flexhub.backend.BlockBackend.attach` right after each step that
        leaves something to release (``loop="/dev/loop3"``, ``portals="10.0.0.5:3260"``).
        The values are merged with those reported before and given to
        :meth:`~flexhub.backend.BlockBackend.release` if the attach never completes (a
        crash, a failure). Outside an attach it does nothing.

        :raises StateError: the journal cannot be written (the attach must stop).
        """
        if self.progress is not None:
            self.progress({str(k): str(v) for k, v in details.items()})

    def unmount(self, target: Path) -> None:
        """Unmount everything stacked on ``target``, escalating (normal, forced, lazy)."""
        cleanup_mount_point(self.runner, target, self.config.unmount_timeout, self.mounts)

    def mount(
        self,
        source: str,
        target: Path,
        fs_type: str | None = None,
        options: Sequence[str] = (),
        secrets: Sequence[str] = (),
    ) -> None:
        """``mount -t FS -o OPTS SOURCE TARGET`` bounded by ``mount_timeout``, options checked.

        :param secrets: values to mask in logs and errors (a password inside ``options``).
        :raises InvalidOptions: an option that could change what or how is mounted.
        :raises CommandError: mount failed or timed out.
        """
        _mount(
            self.runner,
            source,
            target,
            fs_type=fs_type,
            options=options,
            timeout=self.config.mount_timeout,
            secrets=secrets,
        )

    def is_corrupted(self, path: Path, timeout: float = 5.0) -> bool:
        """Whether ``path`` is a stale or broken mount point: ``stat`` or ``statvfs`` fails
        with a stale-mount error, or hangs past ``timeout`` seconds."""
        return is_corrupted(path, timeout)
