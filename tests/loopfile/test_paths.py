"""Where a backing file may be: inside the root, a regular file, or not there yet."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from flexhub_loopfile import DEFAULT_ROOT, LoopfileBackend

from flexhub.backend import FlexhubError, InvalidOptions, PodInfo, Volume
from flexhub.config import NodeConfig
from flexhub.node import Node


def vol(**options: str) -> Volume:
    return Volume(options={"backend": "loopfile", **options})


def made(root: Path) -> Path:
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    return root


def test_new_file_inside_root(backend: LoopfileBackend, root: Path) -> None:
    backend.check(vol(file="db/pg.img", size="1Gi"))
    assert backend.volume_id(vol(file="db/pg.img")) == f"loopfile:{root.resolve()}/db/pg.img"
    assert not root.exists()  # check and volume_id never create anything


def test_size_required_for_a_new_file(backend: LoopfileBackend) -> None:
    with pytest.raises(InvalidOptions, match="option 'size' is required"):
        backend.check(vol(file="new.img"))


def test_size_optional_for_an_existing_file(backend: LoopfileBackend, root: Path) -> None:
    (made(root) / "old.img").write_bytes(b"\0" * 4096)
    backend.check(vol(file="old.img"))


@pytest.mark.parametrize("size", ["0", "2Ei", "lots"])
def test_bad_size(backend: LoopfileBackend, size: str) -> None:
    with pytest.raises(InvalidOptions, match="option 'size'"):
        backend.check(vol(file="a.img", size=size))


@pytest.mark.parametrize(
    "file",
    [
        "/etc/shadow",
        "../x.img",
        "a/../../x.img",
        "a/..",
        "..",
        ".",
        "a//b",
        "a/",
        "",
        "a\0b",
        ".x.img.0123abcd.flexhub-new",  # a creation's temporary name: never counted as a file
    ],
)
def test_bad_file_names(backend: LoopfileBackend, root: Path, file: str) -> None:
    with pytest.raises(InvalidOptions, match="option 'file'"):
        backend.check(vol(file=file, size="1Mi"))
    with pytest.raises(InvalidOptions, match="option 'file'"):
        backend.volume_id(vol(file=file))
    assert not root.exists()


def test_symlink_escaping_root(backend: LoopfileBackend, root: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("x")
    made(root)
    (root / "esc").symlink_to(outside)
    (root / "shadow.img").symlink_to("/etc/shadow")
    (root / "dangling.img").symlink_to(outside / "new.img")
    (root / "up").symlink_to("..")
    for file in ("esc/secret", "esc/new.img", "shadow.img", "dangling.img", "up/outside/x"):
        with pytest.raises(InvalidOptions, match="escapes the loopfile root"):
            backend.check(vol(file=file, size="1Mi"))
    assert sorted(os.listdir(outside)) == ["secret"]


def test_symlink_inside_root_is_the_same_volume(backend: LoopfileBackend, root: Path) -> None:
    made(root / "real")
    (root / "real" / "a.img").write_bytes(b"\0" * 4096)
    (root / "alias").symlink_to("real")
    (root / "b.img").symlink_to("real/a.img")
    ids = {backend.volume_id(vol(file=f)) for f in ("real/a.img", "alias/a.img", "b.img")}
    assert ids == {f"loopfile:{root.resolve()}/real/a.img"}


def test_not_a_regular_file(backend: LoopfileBackend, root: Path) -> None:
    made(root / "dir.img")
    os.mkfifo(root / "fifo.img")
    (root / "plain").write_text("x")
    for file in ("dir.img", "fifo.img"):
        with pytest.raises(InvalidOptions, match="not a regular file"):
            backend.check(vol(file=file, size="1Mi"))
    with pytest.raises(InvalidOptions, match=r"(?i)not a directory"):
        backend.check(vol(file="plain/x.img", size="1Mi"))


@pytest.mark.root
def test_device_nodes_refused(backend: LoopfileBackend, root: Path) -> None:
    made(root)
    os.mknod(root / "blk.img", 0o600 | stat.S_IFBLK, os.makedev(7, 0))
    os.mknod(root / "chr.img", 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    (root / "dev0.img").symlink_to("/dev/loop0")
    for file in ("blk.img", "chr.img"):
        with pytest.raises(InvalidOptions, match="not a regular file"):
            backend.attach(vol(file=file, size="1Mi"))
    with pytest.raises(InvalidOptions, match="escapes the loopfile root"):
        backend.attach(vol(file="dev0.img", size="1Mi"))
    assert sorted(os.listdir(root)) == ["blk.img", "chr.img", "dev0.img"]


def test_symlink_loop(backend: LoopfileBackend, root: Path) -> None:
    made(root)
    (root / "l1").symlink_to("l2")
    (root / "l2").symlink_to("l1")
    with pytest.raises(InvalidOptions, match="option 'file'"):
        backend.check(vol(file="l1", size="1Mi"))


@pytest.mark.parametrize("value", ["relative/root", "/", 5])
def test_bad_root_setting(tmp_path: Path, value: object) -> None:
    node = Node(
        NodeConfig(state_dir=tmp_path, backends={"loopfile": {"root": value}}),
        backend="loopfile",
    )
    with pytest.raises(FlexhubError, match=r"\[loopfile\] root"):
        LoopfileBackend(node).check(vol(file="a.img", size="1Mi"))


def test_default_root(tmp_path: Path) -> None:
    config = NodeConfig(state_dir=tmp_path, backends={"loopfile": {"isolation": "none"}})
    backend = LoopfileBackend(Node(config, backend="loopfile"))
    assert backend.volume_id(vol(file="a.img")) == f"loopfile:{DEFAULT_ROOT}/a.img"
    isolated = LoopfileBackend(Node(NodeConfig(state_dir=tmp_path), backend="loopfile"))
    volume = Volume(options={"backend": "loopfile", "file": "a.img"}, pod=PodInfo(namespace="ns"))
    assert isolated.volume_id(volume) == f"loopfile:{DEFAULT_ROOT}/namespaces/ns/a.img"


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("isolation", "namespaces"),
        ("isolation", True),
        ("legacy", "move"),
        ("overcommit", 0.5),
        ("overcommit", "2"),
        ("overcommit", True),
    ],
)
def test_bad_isolation_settings(tmp_path: Path, setting: str, value: object) -> None:
    config = NodeConfig(
        state_dir=tmp_path, backends={"loopfile": {"root": str(tmp_path), setting: value}}
    )
    volume = Volume(
        options={"backend": "loopfile", "file": "a.img", "size": "1Mi"},
        pod=PodInfo(namespace="ns"),
    )
    backend = LoopfileBackend(Node(config, backend="loopfile"))
    with pytest.raises(FlexhubError, match=rf"\[loopfile\] {setting}"):
        backend.check(volume)


def test_isolation_needs_a_namespace_but_expandfs_checks_only_the_shape(tmp_path: Path) -> None:
    config = NodeConfig(state_dir=tmp_path, backends={"loopfile": {"root": str(tmp_path)}})
    backend = LoopfileBackend(Node(config, backend="loopfile"))
    no_pod = vol(file="a.img")
    backend.check(no_pod)  # expandfs: the file comes from the journal
    with pytest.raises(InvalidOptions, match="names no pod"):
        backend.volume_id(no_pod)
    with pytest.raises(InvalidOptions, match=r"'\.\.' segments"):
        backend.check(vol(file="../a.img"))
    no_namespace = Volume(options={"backend": "loopfile", "file": "a.img"}, pod=PodInfo())
    with pytest.raises(InvalidOptions, match=r"no kubernetes\.io/pod\.namespace"):
        backend.volume_id(no_namespace)
