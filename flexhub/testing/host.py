"""Where the kit runs the driver: this machine (:class:`LocalHost`) or any other :class:`Host`.

A :class:`Host` is the little the kit needs from a node: run an argv (never through a shell)
with an environment and a timeout, write and read files, list the files under directories,
make and remove directories, and read the mount table. flexhub's own tests provide one that
runs the driver inside a VM; a backend author whose storage is only reachable elsewhere can
write their own.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

__all__ = ["Host", "LocalHost", "MountPoint", "RunResult"]


@dataclass(frozen=True)
class RunResult:
    """One command: its exit status (negative: killed by that signal), stdout with stderr
    merged, whether it was stopped at its timeout, and its wall time in seconds."""

    rc: int
    output: bytes
    timed_out: bool = False
    seconds: float = 0.0


@dataclass(frozen=True)
class MountPoint:
    source: str
    target: str
    fstype: str
    options: str


@runtime_checkable
class Host(Protocol):
    """The node the kit drives (see the module)."""

    def run(
        self, argv: Sequence[str], *, env: Mapping[str, str], timeout: float, cwd: str = "/"
    ) -> RunResult:
        """Run ``argv`` with exactly ``env``, stdin ``/dev/null``, stderr into stdout; stop
        it (and everything it started) at ``timeout`` seconds."""
        ...

    def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None: ...

    def read_file(self, path: str) -> bytes | None:
        """The file's bytes, or ``None`` if it does not exist."""
        ...

    def list_files(self, directories: Iterable[str]) -> list[str]:
        """Every regular file under ``directories`` (recursively, not crossing mounts)."""
        ...

    def make_dirs(self, path: str, mode: int = 0o750) -> None: ...

    def remove_dir(self, path: str) -> bool:
        """``rmdir``: ``True`` if it is gone afterwards."""
        ...

    def exists(self, path: str) -> bool:
        """``False`` only when nothing is at ``path`` (ENOENT), as kubelet's ``PathExists``:
        a mount point of unreachable storage, whose ``stat`` fails otherwise, is there."""
        ...

    def mounts(self) -> list[MountPoint]: ...

    def install_driver(self, plugin_dir: str, config: str, python: str | None) -> str:
        """Install flexhub as ``flexhub install`` does; return the driver's path."""
        ...

    def temp_dir(self) -> str:
        """A new empty private directory for one kit run."""
        ...

    def remove_tree(self, path: str) -> None: ...


def _unescape(field: str) -> str:
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def parse_proc_mounts(text: str) -> list[MountPoint]:
    found = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 4:
            found.append(MountPoint(*(_unescape(p) for p in parts[:4])))
    return found


class LocalHost:
    """This machine (the default). Not ``isolated``: other processes here make block devices
    too, so the kit does not count a new one as the backend's (a Host may set ``isolated =
    True`` when only the kit's driver makes block devices on it, as a dedicated VM)."""

    isolated = False

    def run(
        self, argv: Sequence[str], *, env: Mapping[str, str], timeout: float, cwd: str = "/"
    ) -> RunResult:
        started = time.monotonic()
        # Its own session, so that at the timeout everything it started is killed too, and a
        # grandchild that keeps the output pipe open cannot make the kit wait for ever.
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=dict(env),
            cwd=cwd,
            start_new_session=True,
        )
        try:
            output, _ = proc.communicate(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            timed_out = True
        return RunResult(proc.returncode, output, timed_out, time.monotonic() - started)

    def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        target.chmod(mode)

    def read_file(self, path: str) -> bytes | None:
        try:
            return Path(path).read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None

    def list_files(self, directories: Iterable[str]) -> list[str]:
        found: list[str] = []
        for directory in directories:
            if not os.path.isdir(directory):
                continue
            device = os.stat(directory).st_dev
            for root, dirs, files in os.walk(directory):
                dirs[:] = [d for d in dirs if os.lstat(os.path.join(root, d)).st_dev == device]
                found.extend(
                    os.path.join(root, f)
                    for f in files
                    if os.path.isfile(os.path.join(root, f))
                    and not os.path.islink(os.path.join(root, f))
                )
        return sorted(found)

    def make_dirs(self, path: str, mode: int = 0o750) -> None:
        os.makedirs(path, mode=mode, exist_ok=True)

    def remove_dir(self, path: str) -> bool:
        with contextlib.suppress(FileNotFoundError):
            os.rmdir(path)
        return not os.path.lexists(path)

    def exists(self, path: str) -> bool:
        try:
            os.lstat(path)
        except FileNotFoundError:
            return False
        except OSError:
            return True  # there, but unreadable (a dead mount): kubelet still calls unmount
        return True

    def mounts(self) -> list[MountPoint]:
        return parse_proc_mounts(Path("/proc/self/mounts").read_text())

    def install_driver(self, plugin_dir: str, config: str, python: str | None) -> str:
        from flexhub.admin.install import install

        return str(install(Path(plugin_dir), config=Path(config), python=python))

    def temp_dir(self) -> str:
        import tempfile

        return tempfile.mkdtemp(prefix="flexhub-kit-")

    def remove_tree(self, path: str) -> None:
        import shutil

        shutil.rmtree(path, ignore_errors=True)
