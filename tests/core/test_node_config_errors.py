"""A broken node config: one clear Failure on every volume operation, nothing changed; logging
trouble never fails a call; the log follows a rotation. Real driver processes, real tmpfs mounts.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from flexhub.admin.harness import Kubelet, go_json
from tests.conftest import needs_root, run_flexhub

ECHO = {"backend": "echo", "tag": "t1"}

BAD = {
    "unknown key": (
        "stat_dir = '/tmp/x'\n",
        "unknown setting 'stat_dir' (did you mean state_dir?)",
    ),
    "unknown section": (
        "[echoo]\ntag = 'x'\n",
        "unknown section [echoo] (did you mean [echo]?)",
    ),
    "relative state_dir": ("state_dir = 'var/lib/flexhub'\n", "state_dir must be an absolute path"),
    "zero timeout": ("lock_timeout = 0\n", "lock_timeout must be a positive number"),
    "negative timeout": ("mount_timeout = -5\n", "mount_timeout must be a positive number"),
    "bad log level": ("log_level = 'verbose'\n", "log_level must be one of"),
    "not TOML": ("state_dir = [\n", "is not valid TOML"),
}


def operations(target: Path) -> list[list[str]]:
    base = go_json(Kubelet.base_options(ECHO, pv="pv-1"))
    mount = go_json(Kubelet.mount_options(ECHO, pv="pv-1", pod_uid="uid-1"))
    return [
        ["mount", str(target), mount],
        ["unmount", str(target)],
        ["expandfs", base, "", str(target), "2097152", "1048576"],
        ["attach", base, "node-1"],
        ["mountdevice", str(target), "", base],
    ]


def assert_one_clear_failure(args: list[str], config: Path, needle: str) -> None:
    reply = run_flexhub(args, config)
    assert reply.returncode == 1, (args, reply.reply)
    assert reply.status == "Failure", (args, reply.reply)
    assert len(reply.output.splitlines()) == 1
    assert str(config) in reply.message and needle in reply.message, (args, reply.message)
    assert "\n" not in reply.message


@pytest.mark.parametrize("case", list(BAD))
def test_each_bad_config_fails_every_volume_operation(tmp_path: Path, case: str) -> None:
    text, needle = BAD[case]
    state = tmp_path / "state"
    config = tmp_path / "flexhub.toml"
    body = text if text.startswith("state_dir") else f"state_dir = '{state}'\n"
    body += f"log_dir = '{tmp_path / 'log'}'\n"
    config.write_text(body if text.startswith("state_dir") else body + text)
    target = tmp_path / "pod"
    target.mkdir()
    try:
        for args in operations(target):
            if case == "unknown section" and args[0] == "unmount":
                # nothing to unmount: Success whatever the tables say (a Failure would keep
                # the pod Terminating for a table no mount could have used)
                assert run_flexhub(args, config).reply == {"status": "Success"}
                continue
            assert_one_clear_failure(args, config, needle)
        assert run_flexhub(["init"], config).ok  # a failing init makes kubelet drop the driver
        assert not os.path.ismount(target)
    finally:
        if os.path.ismount(target):  # only a broken driver gets here
            subprocess.run(["umount", "-l", str(target)], check=False)
    assert not state.exists() and not Path("/var/lib/flexhub/var").exists()


def test_unreadable_config_fails_every_volume_operation(tmp_path: Path) -> None:
    config = tmp_path / "flexhub.toml"
    config.mkdir()  # exists, cannot be read as a file (root reads any mode)
    target = tmp_path / "pod"
    target.mkdir()
    for args in operations(target):
        assert_one_clear_failure(args, config, "cannot read node config")
    assert run_flexhub(["init"], config).ok


@needs_root
def test_unwritable_log_directory_does_not_fail_calls(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    config = tmp_path / "flexhub.toml"
    config.write_text(f"state_dir = '{tmp_path / 'state'}'\nlog_dir = '{blocker / 'log'}'\n")
    target = tmp_path / "pod"
    target.mkdir()
    mount = go_json(Kubelet.mount_options(ECHO, pv="pv-1", pod_uid="uid-1"))
    try:
        reply = run_flexhub(["mount", str(target), mount], config)
        assert reply.ok, reply.reply
        assert os.path.ismount(target)
    finally:
        reply = run_flexhub(["unmount", str(target)], config)
    assert reply.ok, reply.reply
    assert not os.path.ismount(target)


def volumes(log: Path) -> list[str]:
    """The volume of each call line in ``log``."""
    lines = [line for line in log.read_text().splitlines() if ": call {" in line]
    return [json.loads(line.split(": call ", 1)[1])["volume"] for line in lines]


def test_log_follows_rotation(tmp_path: Path, node_tree: dict[str, Path]) -> None:
    config = node_tree["config"]
    log = node_tree["log"] / "flexhub.log"
    assert run_flexhub(["getvolumename", go_json(Kubelet.base_options(ECHO, pv="pv-a"))], config).ok
    os.rename(log, log.with_suffix(".log.1"))  # logrotate's default: rename, no copytruncate
    assert run_flexhub(["getvolumename", go_json(Kubelet.base_options(ECHO, pv="pv-b"))], config).ok
    assert volumes(log.with_suffix(".log.1")) == ["pv-a"]
    assert volumes(log) == ["pv-b"]


LOOP = {"backend": "loopfile", "file": "data.img", "size": "16Mi"}


@needs_root
@pytest.mark.parametrize(
    ("table", "needle"),
    [
        (
            "[loopfile]\nroot = '{root}'\nisolaton = 'none'\n",
            "unknown setting 'isolaton' in [loopfile] (did you mean isolation?)",
        ),
        (
            "[loopfile]\nroot = '{root}'\nisolation = 'tenant'\n",
            '[loopfile] isolation must be "namespace" or "none"',
        ),
        ("[loopfle]\nroot = '{root}'\n", "unknown section [loopfle] (did you mean [loopfile]?)"),
    ],
)
def test_a_typo_in_a_backend_table_fails_its_mount(tmp_path: Path, table: str, needle: str) -> None:
    """Today's silent failure: ``[loopfle]`` was ignored and the file went to the default root."""
    root = tmp_path / "loopfiles"
    config = tmp_path / "flexhub.toml"
    config.write_text(
        f"state_dir = '{tmp_path / 'state'}'\nlog_dir = '{tmp_path / 'log'}'\n"
        + table.format(root=root)
    )
    target = tmp_path / "pod"
    target.mkdir()
    options = go_json(Kubelet.mount_options(LOOP, pv="pv-1", pod_uid="uid-1", namespace="ns1"))
    stray = Path("/var/lib/flexhub/loopfiles/namespaces/ns1/data.img")  # the default root's
    assert not stray.exists()
    try:
        reply = run_flexhub(["mount", str(target), options], config)
        assert reply.status == "Failure", reply.reply
        assert needle in reply.message and str(config) in reply.message, reply.message
        assert not os.path.ismount(target)
        assert not root.exists() and not stray.exists()
    finally:  # only a driver that ignored the typo gets here with something to undo
        if os.path.ismount(target):
            config.write_text(
                f"state_dir = '{tmp_path / 'state'}'\nlog_dir = '{tmp_path / 'log'}'\n"
            )
            run_flexhub(["unmount", str(target)], config)
        stray.unlink(missing_ok=True)


def test_a_backend_without_declared_settings_keeps_any_key(tmp_path: Path) -> None:
    """The echo test backend declares no ``settings_keys`` (a pre-0.2 third-party backend): its
    table is not checked, as before."""
    config = tmp_path / "flexhub.toml"
    config.write_text(
        f"state_dir = '{tmp_path / 'state'}'\nlog_dir = '{tmp_path / 'log'}'\n"
        "[echo]\nanything = 1\n"
    )
    reply = run_flexhub(["attach", go_json(Kubelet.base_options(ECHO, pv="pv-1")), "n"], config)
    assert reply.ok, reply.reply


@needs_root
def test_a_mounted_volume_still_unmounts_under_a_table_naming_no_backend(
    node_tree: dict[str, Path],
) -> None:
    """An upgrade that leaves a table no installed backend has (a backend dropped from the
    image, a typo the previous version ignored) must not strand the volumes mounted before:
    unmount takes its backend from the journal, answers Success and names the table (found by
    a hostile review; failed before: "unknown section [nfs_legacy]")."""
    target = node_tree["kubelet"] / "pods" / "uid-1" / "volumes" / "k8s~flexhub" / "pv-1"
    target.mkdir(parents=True)
    options = go_json(Kubelet.mount_options(ECHO, pv="pv-1", pod_uid="uid-1"))
    assert run_flexhub(["mount", str(target), options], node_tree["config"]).ok
    clean = node_tree["config"].read_text()
    node_tree["config"].write_text(clean + "[nfs_legacy]\nmount_timeout = 30\n")
    try:
        reply = run_flexhub(["unmount", str(target)], node_tree["config"])
        assert reply.ok, reply.reply
        assert "unknown section [nfs_legacy]" in reply.reply.get("message", "")
        assert not os.path.ismount(target)
        # a mount still fails on it
        again = run_flexhub(["mount", str(target), options], node_tree["config"])
        assert again.returncode == 1 and "unknown section [nfs_legacy]" in again.reply["message"]
    finally:
        node_tree["config"].write_text(clean)
        run_flexhub(["unmount", str(target)], node_tree["config"])
