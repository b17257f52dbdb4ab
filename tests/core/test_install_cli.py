"""``install --config`` refuses a file the driver could not use; ``uninstall`` refuses while
flexhub volumes are mounted (real driver processes, a real tmpfs mount by the echo backend)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from flexhub.admin.harness import Kubelet, go_json
from flexhub.admin.install import install
from tests.conftest import KUBELET_ENV, PYTHON, TEST_SITE, needs_root, run_flexhub


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**KUBELET_ENV, "PYTHONPATH": str(TEST_SITE)}
    return subprocess.run(
        [PYTHON, "-m", "flexhub", *args], env=env, capture_output=True, text=True, check=False
    )


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        (None, "no such file"),
        ("state_dir = [\n", "is not valid TOML"),
        ("stat_dir = '/x'\n", "unknown setting 'stat_dir' (did you mean state_dir?)"),
        ("[loopfle]\n", "unknown section [loopfle] (did you mean [loopfile]?)"),
    ],
)
def test_install_refuses_a_config_the_driver_cannot_use(
    tmp_path: Path, text: str | None, needle: str
) -> None:
    config = tmp_path / "flexhub.toml"
    if text is not None:
        config.write_text(text)
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    proc = cli("install", "--plugin-dir", str(plugins), "--config", str(config))
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert len(proc.stderr.splitlines()) == 1 and needle in proc.stderr, proc.stderr
    assert list(plugins.iterdir()) == []


@needs_root
def test_uninstall_refuses_while_volumes_are_mounted(node_tree: dict[str, Path]) -> None:
    driver = install(node_tree["plugins"], config=node_tree["config"])
    target = node_tree["kubelet"] / "pods" / "uid-1" / "volumes" / "k8s~flexhub" / "pv-1"
    target.mkdir(parents=True)
    options = go_json(
        Kubelet.mount_options({"backend": "echo", "tag": "t"}, pv="pv-1", pod_uid="uid-1")
    )
    assert run_flexhub(["mount", str(target), options], node_tree["config"]).ok
    try:
        proc = cli("uninstall", "--plugin-dir", str(node_tree["plugins"]))
        assert proc.returncode == 1
        assert "1 flexhub volume(s) still mounted" in proc.stderr and str(target) in proc.stderr
        assert "--force" in proc.stderr and len(proc.stderr.splitlines()) == 1
        assert driver.exists()
        proc = cli("uninstall", "--plugin-dir", str(node_tree["plugins"]), "--force")
        assert proc.returncode == 0, proc.stderr
        assert not driver.exists()
    finally:
        assert run_flexhub(["unmount", str(target)], node_tree["config"]).ok
    assert not os.path.ismount(target)


def test_uninstall_with_nothing_mounted(node_tree: dict[str, Path]) -> None:
    driver = install(node_tree["plugins"], config=node_tree["config"])
    proc = cli("uninstall", "--plugin-dir", str(node_tree["plugins"]))
    assert proc.returncode == 0 and proc.stdout == "removed\n", proc.stderr
    assert not driver.exists()


def test_uninstall_refuses_while_a_release_waits_or_a_volume_is_attached(
    node_tree: dict[str, Path],
) -> None:
    """A volume whose release waits (storage unreachable, or its filesystem alive in another
    mount namespace) is attached though nothing is mounted: only the driver's next unmount
    releases it, so uninstalling would strand it (found by a hostile review; failed before:
    the journal's records were not counted)."""
    from flexhub.node.journal import Journal, VolumeRecord

    driver = install(node_tree["plugins"], config=node_tree["config"])
    journal = Journal(node_tree["state"])
    waiting = "iscsi:iqn.2020-01.org.example:t1:0"
    attached = "loopfile:/var/lib/flexhub/loopfiles/ns/a.img"
    for volume_id, device in ((waiting, "/dev/sdz"), (attached, "/dev/loop9")):
        staging = str(node_tree["state"] / "staging" / volume_id[-4:])
        journal.put_volume(
            VolumeRecord(volume_id, volume_id.split(":")[0], device, staging, "ext4", {})
        )
    journal.defer_release(waiting)
    proc = cli("uninstall", "--plugin-dir", str(node_tree["plugins"]))
    assert proc.returncode == 1 and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert f"{waiting}: its release waits" in proc.stderr
    assert f"{attached}: attached or its attach interrupted" in proc.stderr
    assert driver.exists()
