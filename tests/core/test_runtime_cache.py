"""The test runtime cache (tests/runtime_cache.py) hands out only a runtime that no one but
root can have planted or changed: the VM guests and the deploy tests run it as root."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.conftest import needs_root
from tests.runtime_cache import MARKER, cached_runtime, runtime_inputs_digest

pytestmark = needs_root


def runtime_dir(runtime: Path) -> Path:
    """A directory laid out as a runtime (its marker and ``bin/``), made with its parents."""
    (runtime / "bin").mkdir(parents=True)
    (runtime / MARKER).write_text(json.dumps({"python": "bin/python3.11"}))
    return runtime


def plant(cache: Path, owner: int = 0, mode: int = 0o755) -> Path:
    """A runtime entry for this checkout's inputs, as a build leaves it (or as someone else
    put it there)."""
    cache.mkdir(mode=0o755)
    return plant_into(cache, owner, mode)


def plant_into(cache: Path, owner: int = 0, mode: int = 0o755) -> Path:
    """:func:`plant` into an existing cache directory."""
    runtime = runtime_dir(cache / runtime_inputs_digest() / "flexhub-0.1.0-planted")
    (runtime / "bin" / "python3.11").write_text("#!/bin/sh\n")
    for path in (runtime.parent, runtime, runtime / "bin", runtime / "bin" / "python3.11"):
        os.chown(path, owner, owner)
        path.chmod(mode)
    return runtime


def test_a_root_runtime_is_found_and_not_rebuilt(trusted_dir: Path) -> None:
    runtime = plant(trusted_dir / "cache")
    assert cached_runtime(trusted_dir / "cache") == runtime


def test_a_runtime_another_user_owns_is_refused(trusted_dir: Path) -> None:
    runtime = plant(trusted_dir / "cache", owner=65534)
    with pytest.raises(RuntimeError, match="refusing the test runtime") as caught:
        cached_runtime(trusted_dir / "cache")
    assert str(runtime.parent) in str(caught.value)


def test_a_runtime_with_a_file_others_may_write_is_refused(trusted_dir: Path) -> None:
    runtime = plant(trusted_dir / "cache")
    (runtime / "bin" / "python3.11").chmod(0o777)
    with pytest.raises(RuntimeError, match=r"python3\.11 is not root.s alone"):
        cached_runtime(trusted_dir / "cache")


def test_a_cache_others_may_write_is_refused(trusted_dir: Path) -> None:
    plant(trusted_dir / "cache")
    (trusted_dir / "cache").chmod(0o777)
    with pytest.raises(RuntimeError, match="refusing the test runtime"):
        cached_runtime(trusted_dir / "cache")


def test_a_build_of_one_profile_does_not_hold_up_another(
    trusted_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The VM guests' (full) runtime is handed out while the node profile's build is under
    way (.ci/run builds both in the background, full first, and the VM sessions start
    meanwhile)."""
    import threading

    import tests.runtime_cache as runtime_cache

    runtime = plant(trusted_dir / "cache")
    building, release = threading.Event(), threading.Event()

    def slow_build(out: Path, profile: str = "full") -> Path:
        building.set()
        release.wait(60)
        raise RuntimeError("the node build, cut short by the test")

    failed: list[BaseException] = []

    def node_build() -> None:
        try:
            cached_runtime(trusted_dir / "cache", profile="node")
        except RuntimeError as exc:  # checked below: a thread's failure fails no test
            failed.append(exc)

    monkeypatch.setattr(runtime_cache, "build_runtime", slow_build)
    node = threading.Thread(target=node_build)
    node.start()
    try:
        assert building.wait(30)
        found: list[Path] = []
        asking = threading.Thread(
            target=lambda: found.append(cached_runtime(trusted_dir / "cache"))
        )
        asking.start()
        asking.join(timeout=30)
        held_up = asking.is_alive()
    finally:
        release.set()
        node.join()
    asking.join()
    assert not held_up
    assert found == [runtime]
    assert [str(exc) for exc in failed] == ["the node build, cut short by the test"]


def test_two_sessions_asking_for_one_runtime_build_it_once(
    trusted_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second session waits for the first one's build and uses it (no second build, no
    clash renaming two builds into one entry)."""
    import threading
    import time

    import tests.runtime_cache as runtime_cache

    builds: list[str] = []

    def build(out: Path, profile: str = "full") -> Path:
        builds.append(profile)
        time.sleep(0.5)  # long enough for the other session to ask meanwhile
        return runtime_dir(out / "flexhub-0.1.0-built")

    (trusted_dir / "cache").mkdir(mode=0o755)
    monkeypatch.setattr(runtime_cache, "build_runtime", build)
    found: list[Path] = []
    sessions = [
        threading.Thread(target=lambda: found.append(cached_runtime(trusted_dir / "cache")))
        for _ in range(2)
    ]
    for session in sessions:
        session.start()
    for session in sessions:
        session.join(timeout=60)
    assert builds == ["full"]
    assert len(found) == 2 and found[0] == found[1]
    assert found[0].name == "flexhub-0.1.0-built"


def test_the_lock_is_roots_alone_and_never_a_symlink(trusted_dir: Path) -> None:
    """A lock file no other user can open (so none can hold the cache up), and a symlink
    planted in its place is refused, not followed."""
    runtime = plant(trusted_dir / "cache")
    assert cached_runtime(trusted_dir / "cache") == runtime
    lock = trusted_dir / "cache" / f".lock-{runtime_inputs_digest()}"
    assert lock.stat().st_mode & 0o777 == 0o600
    lock.unlink()
    target = trusted_dir / "elsewhere"
    lock.symlink_to(target)
    with pytest.raises(OSError):
        cached_runtime(trusted_dir / "cache")
    assert not target.exists()


def test_an_entry_made_meanwhile_by_a_session_without_this_lock_is_used(
    trusted_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkout from before the per-entry locks took another lock file: when its build
    lands first, this session's rename fails and the entry it made is used."""
    import tests.runtime_cache as runtime_cache

    (trusted_dir / "cache").mkdir(mode=0o755)
    planted: list[Path] = []

    def build(out: Path, profile: str = "full") -> Path:
        planted.append(plant_into(trusted_dir / "cache"))  # the other session's, first
        return runtime_dir(out / "flexhub-0.1.0-mine")

    monkeypatch.setattr(runtime_cache, "build_runtime", build)
    assert cached_runtime(trusted_dir / "cache") == planted[0]
    assert not list((trusted_dir / "cache").glob(".build-*"))
