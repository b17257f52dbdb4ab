"""Build Go programs from the Go module proxy at pinned versions, once per pin.

:func:`cached_build` is the one way every Go build of the tests is kept (the control plane,
the CSI sidecars, csi-sanity, the registry): into ``<key>.partial``, renamed into place whole
with a ``.complete`` marker (a build killed half way is never taken for a result), one build
at a time under the cache directory's lock (a second caller waits and then finds it), older
keys removed. The tools the tests run but nobody here wrote (csi-sanity, a registry, ...) are built with
``go install MODULE/cmd/X@VERSION`` into ``$FLEXHUB_CI_CACHE/<name>/<version>/`` (without that
cache, ``tests/<name>-bin/<version>/``, git-ignored): a new pin builds anew, an unchanged one
never does. The build goes into ``<version>.partial`` and is renamed into place with a
``.complete`` marker, so a build killed half way is never taken for a result. One build at a
time: a second caller waits on the lock and then finds the result. Older versions are removed.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO

HERE = Path(__file__).resolve().parent


def go(args: Sequence[str], *, cwd: Path, env: dict[str, str], timeout: float,
       log: Path | None) -> None:  # fmt: skip
    """Run ``go ARGS`` with its output in ``log`` (else stderr)."""
    out: IO[str] | None = open(log, "w") if log else None  # noqa: SIM115 - closed below
    try:
        subprocess.run(["go", *args], cwd=cwd, env=env, check=True, timeout=timeout,
                       stdout=out or sys.stderr, stderr=subprocess.STDOUT)  # fmt: skip
    finally:
        if out:
            out.close()


def cached_build(target: Path, complete: Callable[[Path], bool],
                 make: Callable[[Path], None]) -> Path:  # fmt: skip
    """``target`` once ``complete``; else ``make(partial)`` fills a fresh directory that
    becomes ``target`` with its ``.complete`` marker. Other keys beside it are removed."""
    if complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if complete(target):
            return target
        partial = target.with_name(target.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
        started = time.monotonic()
        make(partial)
        (partial / ".complete").write_text(f"built in {time.monotonic() - started:.0f} s\n")
        shutil.rmtree(target, ignore_errors=True)
        partial.rename(target)
    for old in target.parent.iterdir():  # a pin change would otherwise keep every old build
        if old.is_dir() and old != target and not old.name.endswith(".partial"):
            shutil.rmtree(old, ignore_errors=True)
    return target


class GoProgram:
    """Programs of one module at one version, built together into one cache directory."""

    def __init__(self, name: str, module: str, version: str, commands: Sequence[str],
                 timeout: float = 1800) -> None:  # fmt: skip
        self.name = name
        self.module = module
        self.version = version
        #: The packages under the module to install (``cmd/registry``), one binary each.
        self.commands = tuple(commands)
        self.timeout = timeout

    def bin_dir(self) -> Path:
        cache = os.environ.get("FLEXHUB_CI_CACHE")
        base = Path(cache) / self.name if cache else HERE / f"{self.name}-bin"
        return base / self.version

    def binary(self, command: str | None = None) -> Path:
        return self.bin_dir() / Path(command or self.commands[0]).name

    def complete(self, directory: Path | None = None) -> bool:
        directory = directory or self.bin_dir()
        return (directory / ".complete").exists() and all(
            (directory / Path(command).name).is_file() for command in self.commands
        )

    def build(self, log: Path | None = None) -> Path:
        """The directory holding the binaries, building them first if needed."""

        def make(partial: Path) -> None:
            env = {**os.environ, "CGO_ENABLED": "0", "GOFLAGS": "-mod=mod -buildvcs=false",
                   "GOBIN": str(partial)}  # fmt: skip
            packages = [f"{self.module}/{command}@{self.version}" for command in self.commands]
            go(["install", "-trimpath", "-ldflags=-s -w", *packages], cwd=partial, env=env,
               timeout=self.timeout, log=log)  # fmt: skip

        return cached_build(self.bin_dir(), self.complete, make)
