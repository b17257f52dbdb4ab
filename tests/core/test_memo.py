"""The kubelet path's memos and fast paths never change an answer (issue 14).

The backend memo (which class provides a backend name) and the validation memo (that an
options object is valid) must be invalidated by the very next call after a schema, an option
or the installed backends change; memos that another user could have written are ignored;
the cheap ``unmount`` answer is given only when nothing is recorded or mounted, checked
against real mounts.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from flexhub.admin.harness import DriverReply, go_json
from flexhub.driver.memo import Memo
from flexhub.driver.validation import _memo_key, validate_options
from flexhub.errors import InvalidOptions
from flexhub.node.fastpath import nothing_to_unmount, pod_record_path
from flexhub.node.journal import Journal
from tests.conftest import TEST_SITE, needs_root, run_flexhub

PYTHON = sys.executable
ECHO = {"backend": "echo", "tag": "t1"}


def options(user: dict[str, str], **extra: str) -> str:
    base = {
        "kubernetes.io/fsType": "",
        "kubernetes.io/readwrite": "rw",
        "kubernetes.io/pvOrVolumeName": "pv-1",
    }
    return go_json({**base, **extra, **user})


@pytest.fixture
def site(tmp_path: Path) -> Path:
    """A private copy of the test backends' site directory, free to edit."""
    copy = tmp_path / "site"
    shutil.copytree(TEST_SITE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def call(site: Path, config: Path, *args: str) -> DriverReply:
    return run_flexhub(list(args), config, env={"PYTHONPATH": str(site)})


def marks(node_tree: dict[str, Path]) -> list[str]:
    directory = node_tree["state"] / "cache" / "validated"
    return sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []


def test_a_changed_schema_takes_effect_on_the_next_call(
    node_tree: dict[str, Path], site: Path
) -> None:
    first = call(site, node_tree["config"], "attach", options(ECHO), "node-1")
    assert first.ok, first.reply
    assert len(marks(node_tree)) == 1
    assert call(site, node_tree["config"], "attach", options(ECHO), "node-1").ok
    schema_file = site / "flexhub_testbackends" / "echo.json"
    schema = json.loads(schema_file.read_text())
    schema["properties"]["tag"]["pattern"] = "^only-this$"
    schema_file.write_text(json.dumps(schema))
    after = call(site, node_tree["config"], "attach", options(ECHO), "node-1")
    assert after.status == "Failure"
    assert "$.tag" in after.message


def test_a_changed_option_is_validated_again(node_tree: dict[str, Path], site: Path) -> None:
    assert call(site, node_tree["config"], "attach", options(ECHO), "node-1").ok
    bad = call(site, node_tree["config"], "attach", options({**ECHO, "tag": "Bad!"}), "node-1")
    assert bad.status == "Failure"
    assert "$.tag" in bad.message


def test_a_changed_installation_takes_effect_on_the_next_call(
    node_tree: dict[str, Path], site: Path
) -> None:
    assert call(site, node_tree["config"], "attach", options(ECHO), "node-1").ok
    remembered = json.loads((node_tree["state"] / "cache" / "backends.json").read_text())
    assert remembered["backends"]["echo"] == "flexhub_testbackends.echo:EchoBackend"
    entry_points = site / "flexhub_testbackends-0.0.dist-info" / "entry_points.txt"
    before = entry_points.stat()
    entry_points.write_text(
        entry_points.read_text().replace(
            "echo = flexhub_testbackends.echo:EchoBackend",
            "echo = flexhub_testbackends.broken:BrokenBackend",
        )
    )
    # 1 ms later than before: stevedore's own cache (mtimes as 32-bit floats) cannot tell
    os.utime(entry_points, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000))
    broken = call(site, node_tree["config"], "attach", options(ECHO), "node-1")
    assert broken.status == "Failure"
    assert "failed to import" in broken.message
    shutil.rmtree(site / "flexhub_testbackends-0.0.dist-info")
    gone = call(site, node_tree["config"], "attach", options(ECHO), "node-1")
    assert gone.status == "Failure"
    assert "unknown backend 'echo'" in gone.message


def test_per_pod_keys_stay_bounded(node_tree: dict[str, Path], site: Path) -> None:
    long_name = "p" * 4097
    reply = call(
        site,
        node_tree["config"],
        "attach",
        options(ECHO, **{"kubernetes.io/pod.name": long_name}),
        "node-1",
    )
    assert reply.status == "Failure"
    assert "kubernetes.io/pod.name" in reply.message


def _echo_backend(site: Path) -> type:
    sys.path.insert(0, str(site))
    try:
        from flexhub_testbackends.echo import EchoBackend  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(site))
    return EchoBackend  # type: ignore[no-any-return]


@needs_root
def test_a_mark_another_user_could_write_is_ignored(tmp_path: Path, site: Path) -> None:
    backend = _echo_backend(site)
    invalid = {"backend": "echo", "tag": "NOT VALID"}
    memo = Memo(tmp_path / "state")
    mark = _memo_key(backend, invalid)
    memo.put_mark(mark)  # as if an earlier call had found it valid
    validate_options(backend, invalid, memo)  # trusted: root's own 0600 mark
    os.chown(memo.validated_dir / mark, 65534, 65534)
    with pytest.raises(InvalidOptions):
        validate_options(backend, invalid, memo)
    os.chown(memo.validated_dir / mark, 0, 0)
    os.chmod(memo.validated_dir, 0o777)
    with pytest.raises(InvalidOptions):
        validate_options(backend, invalid, memo)


def test_fast_path_names_the_journal_file(tmp_path: Path) -> None:
    journal = Journal(tmp_path)
    target = "/var/lib/kubelet/pods/u/volumes/k8s~flexhub/pv"
    assert pod_record_path(tmp_path, target) == journal._pod_path(target)


@needs_root
def test_fast_path_sees_real_mounts_records_and_symlinked_roots(tmp_path: Path) -> None:
    state = tmp_path / "state"
    real = tmp_path / "disk" / "kubelet" / "pods" / "u" / "volumes" / "k8s~flexhub"
    real.mkdir(parents=True)
    (tmp_path / "kubelet").symlink_to(tmp_path / "disk" / "kubelet")
    given = tmp_path / "kubelet" / "pods" / "u" / "volumes" / "k8s~flexhub" / "pv"
    (real / "pv").mkdir()
    assert nothing_to_unmount(state, given)
    subprocess.run(["mount", "-t", "tmpfs", "t", str(real / "pv")], check=True)
    try:
        assert not nothing_to_unmount(state, given)  # mountinfo shows the resolved path
    finally:
        subprocess.run(["umount", str(real / "pv")], check=True)
    (real / "pv" / "sub").mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "t", str(real / "pv" / "sub")], check=True)
    try:
        assert not nothing_to_unmount(state, given)  # something mounted below it
    finally:
        subprocess.run(["umount", str(real / "pv" / "sub")], check=True)
    assert nothing_to_unmount(state, given)
    record = pod_record_path(state, str(given))
    record.parent.mkdir(parents=True)
    record.write_text("{}")
    assert not nothing_to_unmount(state, given)  # a record, even a corrupt one
