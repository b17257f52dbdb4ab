"""A volume's file that this node made once and that is missing now is a failure, never a new
empty volume (issue #32): real loop devices, filesystems and mounts, through the installed
driver as kubelet calls it, and through the backend for the cases between its calls."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from flexhub_loopfile import LoopfileBackend

from flexhub.admin.harness import Kubelet
from flexhub.config import load_config
from flexhub.errors import VolumeError
from flexhub.node import Node
from flexhub.provisioning import Claim
from flexhub.volume import PodInfo, Secrets, Volume
from tests.conftest import needs_root
from tests.loopfile.conftest import detach_under, loops_of, mounts_under

pytestmark = [needs_root, pytest.mark.root]

MiB = 1024 * 1024
NS = "team-a"


@pytest.fixture
def agent(node_tree: dict[str, Path]) -> Iterator[LoopfileBackend]:
    """The backend with the node's own config (what the driver and the node agent use)."""
    yield LoopfileBackend(Node(load_config(node_tree["config"]), backend="loopfile"))
    detach_under(node_tree["loopfiles"])


def _options(kube: Kubelet, uid: str, file: str = "db/pg.img") -> dict[str, str]:
    return Kubelet.mount_options(
        {"backend": "loopfile", "file": file, "size": str(64 * MiB)},
        pv="pv-db",
        pod_uid=uid,
        namespace=NS,
        fs_type="ext4",
    )


def _image(node_tree: dict[str, Path], file: str = "db/pg.img") -> Path:
    return node_tree["loopfiles"] / "namespaces" / NS / file


def _volume(file: str = "db/pg.img") -> Volume:
    return Volume(
        options={"file": file, "size": str(64 * MiB)}, pod=PodInfo(namespace=NS, name="p")
    )


def test_a_missing_file_of_a_volume_mounted_before_fails_and_creates_nothing(
    kube: Kubelet, node_tree: dict[str, Path]
) -> None:
    uid = kube.new_pod_uid()
    assert kube.mount(uid, "pv-db", _options(kube, uid)).ok  # type: ignore[union-attr]
    (kube.pod_dir(uid, "pv-db") / "data").write_bytes(b"kept")
    assert kube.unmount(uid, "pv-db").ok  # type: ignore[union-attr]
    image = _image(node_tree)
    image.unlink()  # lost: deleted by hand, or its disk not mounted under the root
    again = kube.new_pod_uid()
    reply = kube.mount(again, "pv-db", _options(kube, again))
    assert reply is not None and not reply.ok, reply.reply
    assert "\n" not in reply.message
    assert "db/pg.img" in reply.message and "missing" in reply.message, reply.message
    assert str(image) in reply.message
    assert not image.exists()  # nothing created in its place
    assert mounts_under(node_tree["kubelet"]) == [] and loops_of(node_tree["loopfiles"]) == []


def test_a_file_made_before_the_record_existed_is_recorded_at_its_next_mount(
    node_tree: dict[str, Path], agent: LoopfileBackend
) -> None:
    """A file an older flexhub made (no record) is recorded when it is next attached."""
    image = _image(node_tree)
    image.parent.mkdir(parents=True)
    with image.open("wb") as f:
        f.truncate(64 * MiB)
    attachment = agent.attach(_volume())
    agent.detach(attachment)
    image.unlink()
    with pytest.raises(VolumeError, match=r"db/pg\.img.*missing"):
        agent.attach(_volume())
    assert not image.exists()


def test_the_file_of_a_failed_first_mount_is_made_again(
    node_tree: dict[str, Path], agent: LoopfileBackend
) -> None:
    """The rollback of a first mount removes the file it made, and its record: the next mount
    is a first mount again."""
    attachment = agent.attach(_volume())
    agent.detach(attachment)
    agent.discard(attachment)
    assert not _image(node_tree).exists()
    again = agent.attach(_volume())
    assert again.blank is True and _image(node_tree).is_file()
    agent.detach(again)


def test_a_reclaimed_file_is_forgotten(node_tree: dict[str, Path], agent: LoopfileBackend) -> None:
    """Reclaim removes the record with the file: the name is free for a new volume."""
    uid = str(uuid.uuid4())
    file = f"claims/pvc-{uid}.img"
    agent.detach(agent.attach(_volume(file)))
    agent.reclaim({"file": file}, {"namespace": NS, "claimUid": uid}, Secrets())
    assert not _image(node_tree, file).exists()
    attachment = agent.attach(_volume(file))  # a new volume of the same name: made, empty
    assert attachment.blank is True
    agent.detach(attachment)


def test_a_lost_state_dir_and_file_are_a_first_mount_again(
    node_tree: dict[str, Path], agent: LoopfileBackend
) -> None:
    """The decision documented in the README: with the node's state dir lost too, nothing on
    the node tells the volume was made; its file is made anew, as at a first mount."""
    agent.detach(agent.attach(_volume()))
    _image(node_tree).unlink()
    shutil.rmtree(node_tree["state"] / "loopfile")
    attachment = agent.attach(_volume())
    assert attachment.blank is True
    agent.detach(attachment)


def test_a_missing_file_made_before_is_never_copied_as_an_empty_volume(
    node_tree: dict[str, Path], agent: LoopfileBackend
) -> None:
    """A clone of a volume whose file is lost is refused: only a volume never mounted is
    copied as an empty file."""
    agent.detach(agent.attach(_volume()))
    _image(node_tree).unlink()
    claim = Claim(
        uid=str(uuid.uuid4()), namespace=NS, name="copy", size=64 * MiB, selected_node="n"
    )
    with pytest.raises(VolumeError, match=r"db/pg\.img.*missing"):
        agent.clone(claim, {}, {"file": "db/pg.img", "size": str(64 * MiB)}, NS, Secrets())
    assert not (node_tree["loopfiles"] / "namespaces" / NS / "provisioned").exists()
