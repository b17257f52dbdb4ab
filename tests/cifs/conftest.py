"""Fixtures for the cifs backend's host tests, built only on flexhub's public backend API.

The backend gets a small fake node (the attributes of :class:`flexhub.backend.Node` it uses):
a recording runner that answers ``mount``/``umount`` by editing an in-memory mount table, and a
real temporary state directory, so the credentials file is created and removed for real.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from flexhub_cifs import CifsBackend

from flexhub.backend import CommandError, Result, Volume

PASSWORD = "Sup3r,secret=pass word"  # a comma, an equals sign, a space


@dataclass
class Entry:
    mount_id: int
    source: str
    root: str
    fs_type: str
    read_only: bool
    options: tuple[str, ...] = ()
    super_options: tuple[str, ...] = ()


@dataclass
class FakeMounts:
    entries: dict[str, list[Entry]] = field(default_factory=dict)
    next_id: int = 100

    def at(self, path: object) -> Entry | None:
        stack = self.entries.get(os.path.normpath(str(path)))
        return stack[-1] if stack else None

    def add(self, target: str, source: str, options: Sequence[str]) -> None:
        self.next_id += 1
        entry = Entry(
            self.next_id, source, "/", "cifs", "ro" in options, super_options=("vers=3.1.1",)
        )
        self.entries.setdefault(os.path.normpath(target), []).append(entry)


@dataclass
class Runner:
    """Records argv; answers from ``answer`` (argv -> Result or exception) or mounts."""

    mounts: FakeMounts
    calls: list[list[str]] = field(default_factory=list)
    answer: Callable[[list[str]], object] | None = None
    #: what each mount command found in its credentials file (mode, text)
    seen_files: list[tuple[int, str]] = field(default_factory=list)

    def __call__(
        self,
        argv: Sequence[str],
        *,
        timeout: float | None = None,
        check: bool = True,
        secrets: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> Result:
        args = [str(a) for a in argv]
        self.calls.append(args)
        if args[:3] == ["mount", "-t", "cifs"]:
            creds = next(o for o in args[4].split(",") if o.startswith("credentials="))
            path = creds.split("=", 1)[1]
            self.seen_files.append((os.stat(path).st_mode & 0o7777, Path(path).read_text()))
        if self.answer is not None:
            outcome = self.answer(args)
            if isinstance(outcome, BaseException):
                raise outcome
            if isinstance(outcome, Result):
                return outcome
        if args[:3] == ["mount", "-t", "cifs"]:
            options = args[4].split(",")
            self.mounts.add(args[-1], args[-2], options)
        elif args[0] == "umount":
            self.mounts.entries.get(os.path.normpath(args[-1]), [None]).pop()
        return Result(tuple(args), 0, "", "")


@dataclass
class Harness:
    backend: CifsBackend
    runner: Runner
    state_dir: Path

    def cred_files(self) -> list[str]:
        creds = self.state_dir / "cifs-creds"
        return sorted(os.listdir(creds)) if creds.exists() else []


@pytest.fixture
def harness(tmp_path: Path) -> Harness:
    mounts = FakeMounts()
    runner = Runner(mounts)
    state = tmp_path / "state"
    state.mkdir()
    node: Any = SimpleNamespace(
        runner=runner,
        mounts=mounts,
        state_dir=state,
        settings={},
        config=SimpleNamespace(mount_timeout=10.0, unmount_timeout=10.0),
        is_corrupted=lambda path, timeout=5.0: False,
        unmount=lambda target: None,
    )
    return Harness(CifsBackend(node), runner, state)


def volume(
    options: Mapping[str, str] | None = None,
    *,
    secrets: Mapping[str, str] | None = None,
    fs_group: int | None = None,
    read_only: bool = False,
    fs_type: str = "",
) -> Volume:
    """A volume as the core builds it from kubelet's options (secrets base64-encoded)."""
    import base64

    raw: dict[str, str] = {
        "backend": "cifs",
        "server": "files.example.com",
        "share": "team",
        "kubernetes.io/readwrite": "ro" if read_only else "rw",
        "kubernetes.io/fsType": fs_type,
        **(options or {}),
    }
    if fs_group is not None:
        raw["kubernetes.io/mounterArgs.FsGroup"] = str(fs_group)
    if secrets is None:
        secrets = {"username": "bob", "password": PASSWORD}
    for key, value in secrets.items():
        raw[f"kubernetes.io/secret/{key}"] = base64.b64encode(value.encode()).decode()
    return Volume.from_options(raw)


def failing(message: str, returncode: int = 32) -> Callable[[list[str]], object]:
    def answer(argv: list[str]) -> object:
        if argv[:3] == ["mount", "-t", "cifs"]:
            return CommandError(f"mount failed: {message}", returncode=returncode, output=message)
        return None

    return answer
