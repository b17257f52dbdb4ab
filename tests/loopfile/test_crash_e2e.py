"""SIGKILL at each step of mount and unmount of a **loopfile** volume (the shipped backend, not a
test backend), through the installed driver on real loop devices: the next call converges and
leaves no loop device, mount or journal record behind.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from flexhub.admin.harness import Kubelet, go_json, parse_reply
from flexhub.node.volumes import CHECKPOINTS, CRASH_ENV, UNMOUNT_CHECKPOINTS
from tests.conftest import needs_root
from tests.loopfile.conftest import loops_of, mounts_under
from tests.loopfile.test_driver_e2e import VOL

pytestmark = [needs_root, pytest.mark.root]


def call(k: Kubelet, *args: str, crash_at: str | None = None) -> subprocess.CompletedProcess[bytes]:
    """One driver call as kubelet makes it, optionally SIGKILLed at a step."""
    env = dict(k.env)
    if crash_at:
        env[CRASH_ENV] = crash_at
    return subprocess.run(
        [str(k.driver), *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        env=env,
        cwd="/",
        timeout=120,
        check=False,
    )


def assert_ok(proc: subprocess.CompletedProcess[bytes]) -> None:
    assert proc.returncode == 0 and parse_reply(proc.stdout)["status"] == "Success", proc


def assert_killed(proc: subprocess.CompletedProcess[bytes]) -> None:
    # the shim execs python or waits for it: either way SIGKILL, and no reply
    assert proc.returncode in (-9, 128 + 9), proc
    assert proc.stdout == b"", proc


def assert_clean(node_tree: dict[str, Path]) -> None:
    assert loops_of(node_tree["loopfiles"]) == []
    assert mounts_under(node_tree["kubelet"]) == []
    assert mounts_under(node_tree["state"]) == []
    assert list((node_tree["state"] / "pods").glob("*.json")) == []
    assert list((node_tree["state"] / "volumes").glob("*.json")) == []
    # no state-write temporary outlives its call (a killed writer's is removed by the next)
    assert [p for p in node_tree["state"].rglob("*.tmp") if "staging" not in p.parts] == []


def pod(k: Kubelet) -> tuple[Path, str]:
    uid = k.new_pod_uid()
    target = k.pod_dir(uid, "pv-1")
    target.mkdir(parents=True)
    return target, go_json(Kubelet.mount_options(VOL, pv="pv-1", pod_uid=uid))


@pytest.mark.parametrize("retry", [True, False], ids=["retry-then-unmount", "unmount"])
@pytest.mark.parametrize("point", CHECKPOINTS)
def test_sigkill_at_each_mount_step(
    kube: Kubelet,
    node_tree: dict[str, Path],
    point: str,
    retry: bool,
) -> None:
    target, options = pod(kube)
    assert_killed(call(kube, "mount", str(target), options, crash_at=point))
    if retry:
        assert_ok(call(kube, "mount", str(target), options))
        (target / "data").write_text("ok")
        assert (target / "data").read_text() == "ok"
    assert_ok(call(kube, "unmount", str(target)))
    assert_clean(node_tree)
    if retry:  # the data reached the file: a new pod finds it
        again, options = pod(kube)
        assert_ok(call(kube, "mount", str(again), options))
        assert (again / "data").read_text() == "ok"
        assert_ok(call(kube, "unmount", str(again)))
        assert_clean(node_tree)


@pytest.mark.parametrize("point", UNMOUNT_CHECKPOINTS)
def test_sigkill_at_each_unmount_step(
    kube: Kubelet,
    node_tree: dict[str, Path],
    point: str,
) -> None:
    target, options = pod(kube)
    assert_ok(call(kube, "mount", str(target), options))
    (target / "data").write_text("kept")
    assert_killed(call(kube, "unmount", str(target), crash_at=point))
    assert_ok(call(kube, "unmount", str(target)))
    assert_clean(node_tree)
    again, options = pod(kube)
    assert_ok(call(kube, "mount", str(again), options))
    assert (again / "data").read_text() == "kept"
    assert_ok(call(kube, "unmount", str(again)))
    assert_clean(node_tree)
