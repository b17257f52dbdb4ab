"""unmount through the installed driver after the loopfile package broke (real loop devices)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from flexhub.admin.harness import Kubelet
from flexhub.admin.install import install
from tests.conftest import needs_root
from tests.loopfile.conftest import loops_of, mounts_under
from tests.loopfile.test_driver_e2e import VOL, mount

pytestmark = [needs_root, pytest.mark.root]


def _break_loopfile(tmp_path: Path) -> Path:
    """A python for the driver in which ``import flexhub_loopfile`` fails, as it would after
    a botched upgrade: a shadowing package that raises, put first on the path."""
    shadow = tmp_path / "shadow" / "flexhub_loopfile"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text('raise ImportError("flexhub_loopfile is broken")\n')
    wrapper = tmp_path / "broken-python"
    wrapper.write_text(
        "#!/bin/sh\n"
        '[ "$1" = "-I" ] && shift\n'  # -I would ignore PYTHONPATH
        f'PYTHONPATH={shadow.parent} exec {sys.executable} "$@"\n'
    )
    wrapper.chmod(0o755)
    return wrapper


def test_unmount_with_a_broken_backend_unmounts_and_says_what_is_left(
    kube: Kubelet, node_tree: dict[str, Path], tmp_path: Path
) -> None:
    uid = kube.new_pod_uid()
    assert mount(kube, uid, VOL).ok
    image = node_tree["loopfiles"] / "namespaces" / "default" / "vols" / "a.img"
    (loop,) = loops_of(image)
    install(node_tree["plugins"], config=node_tree["config"], python=str(_break_loopfile(tmp_path)))
    other = kube.new_pod_uid()
    options = json.dumps(Kubelet.mount_options(VOL, pv="pv-1", pod_uid=other))
    assert (
        "flexhub_loopfile is broken"
        in kube.call("mount", str(kube.pod_dir(other, "pv-1")), options).message
    )  # the breakage is real

    reply = kube.unmount(uid, "pv-1")
    assert reply is not None and reply.ok, reply
    # Everything the core can do alone is done: no bind, no staging mount, the pod dir gone.
    assert mounts_under(node_tree["kubelet"]) == []
    assert mounts_under(node_tree["state"]) == []
    assert not kube.pod_dir(uid, "pv-1").exists()
    # The loop device needs the backend: it stays, the reply says so, the journal keeps it.
    assert loops_of(image) == [loop]
    assert f"{loop} of loopfile:{image}" in reply.message
    assert "left attached" in reply.message
    assert len(list((node_tree["state"] / "volumes").iterdir())) == 1

    # Repaired: the next unmount of that pod directory finds nothing; a new pod's mount
    # reuses the device and its unmount releases it.
    install(node_tree["plugins"], config=node_tree["config"])
    again = kube.new_pod_uid()
    assert mount(kube, again, VOL).ok
    assert loops_of(image) == [loop]
    assert kube.unmount(again, "pv-1").ok  # type: ignore[union-attr]
    assert loops_of(image) == []
    assert not list((node_tree["state"] / "volumes").iterdir())
