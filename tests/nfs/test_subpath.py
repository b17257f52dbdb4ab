"""The subPath walker on real directories and symlinks (no NFS needed: it only sees a tree)."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from flexhub_nfs._subpath import SubPathMissing, open_sub_path

from flexhub.errors import VolumeError


@pytest.fixture
def export(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    """An "export" directory and a descriptor of it; a sibling ``outside`` to escape to."""
    root = tmp_path / "export"
    root.mkdir()
    (tmp_path / "outside").mkdir()
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    yield root, fd
    os.close(fd)


def same(fd: int, path: Path) -> bool:
    a, b = os.fstat(fd), os.stat(path)
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def outside_is_empty(root: Path) -> bool:
    return list((root.parent / "outside").iterdir()) == []


def test_existing_directories_are_opened(export: tuple[Path, int]) -> None:
    root, fd = export
    (root / "a" / "b").mkdir(parents=True)
    leaf = open_sub_path(fd, "a/b", create=False, mode=0o750)
    try:
        assert same(leaf, root / "a" / "b")
    finally:
        os.close(leaf)


def test_missing_is_named_without_create(export: tuple[Path, int]) -> None:
    root, fd = export
    (root / "a").mkdir()
    with pytest.raises(SubPathMissing, match="a/b does not exist"):
        open_sub_path(fd, "a/b/c", create=False, mode=0o750)
    assert sorted(p.name for p in root.rglob("*")) == ["a"]


def test_create_makes_parents_and_gives_the_leaf_exactly_its_mode(
    export: tuple[Path, int],
) -> None:
    root, fd = export
    old = os.umask(0o077)
    try:
        leaf = open_sub_path(fd, "a/b/c", create=True, mode=0o2770)
    finally:
        os.umask(old)
    os.close(leaf)
    assert stat.S_IMODE((root / "a" / "b" / "c").stat().st_mode) == 0o2770
    assert stat.S_IMODE((root / "a").stat().st_mode) == 0o700  # mkdir's default under umask
    again = open_sub_path(fd, "a/b/c", create=True, mode=0o700)  # existing: mode untouched
    os.close(again)
    assert stat.S_IMODE((root / "a" / "b" / "c").stat().st_mode) == 0o2770


@pytest.mark.parametrize("create", [True, False])
@pytest.mark.parametrize(
    ("plant", "sub_path"),
    [
        ("a", "a/b"),  # the first component, absolute target
        ("a", "a"),  # the leaf itself
        ("x/a", "x/a/b"),  # a middle component
    ],
)
@pytest.mark.parametrize("target", ["absolute", "relative"])
def test_symlinks_are_refused_and_nothing_is_made_outside(
    export: tuple[Path, int], create: bool, plant: str, sub_path: str, target: str
) -> None:
    root, fd = export
    link = root / plant
    link.parent.mkdir(parents=True, exist_ok=True)
    outside = root.parent / "outside"
    link.symlink_to(outside if target == "absolute" else os.path.relpath(outside, link.parent))
    with pytest.raises(VolumeError, match=f"{plant} is a symbolic link in the export"):
        open_sub_path(fd, sub_path, create=create, mode=0o777)
    assert outside_is_empty(root)


def test_a_symlink_to_the_root_of_the_node_is_refused(export: tuple[Path, int]) -> None:
    root, fd = export
    (root / "etc").symlink_to("/etc")
    (root / "up").symlink_to("../..")
    for sub_path in ("etc/flexhub-test-must-not-exist", "up/up/flexhub-test-must-not-exist"):
        with pytest.raises(VolumeError, match="symbolic link"):
            open_sub_path(fd, sub_path, create=True, mode=0o777)
    assert not Path("/etc/flexhub-test-must-not-exist").exists()


def test_a_file_is_not_a_directory(export: tuple[Path, int]) -> None:
    root, fd = export
    (root / "f").write_text("")
    with pytest.raises(VolumeError, match="f is not a directory"):
        open_sub_path(fd, "f/x", create=True, mode=0o750)


@pytest.mark.parametrize("sub_path", ["", "..", "a/../b", "a//b", "./a", "a/"])
def test_paths_that_are_not_plain_are_refused(export: tuple[Path, int], sub_path: str) -> None:
    _, fd = export
    with pytest.raises(VolumeError, match="not a plain relative path"):
        open_sub_path(fd, sub_path, create=True, mode=0o750)
