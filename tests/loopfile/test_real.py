"""The loopfile backend against real loop devices (root only).

Every loop device these tests attach is detached again by the ``backend`` fixture.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from flexhub_loopfile import LoopfileBackend, _loop

from flexhub.backend import Attachment, InvalidOptions, Volume, VolumeError

pytestmark = pytest.mark.root

MiB = 1 << 20
GiB = 1 << 30


def vol(**options: str) -> Volume:
    return Volume(options={"backend": "loopfile", **options})


def losetup(*args: str) -> str:
    return subprocess.run(
        ["losetup", *args], check=True, capture_output=True, text=True
    ).stdout.strip()


def device_of(att: Attachment) -> _loop.LoopDevice:
    name, index = _loop.loop_name(att.device)
    return _loop.LoopDevice(name, index)


def make_file(path: Path, size: int) -> Path:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with open(path, "wb") as handle:
        handle.truncate(size)
    return path


def test_sparse_1gib(backend: LoopfileBackend, root: Path) -> None:
    att = backend.attach(vol(file="pv/sparse.img", size="1Gi"))
    path = root / "pv" / "sparse.img"
    st = os.stat(path)
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
    assert st.st_size == GiB
    assert st.st_blocks * 512 < MiB, f"sparse 1 GiB file uses {st.st_blocks * 512} bytes"
    dev = device_of(att)
    assert dev.size() == GiB
    assert dev.backing_file() == str(path.resolve())
    assert att.details == {"loop": att.device, "file": str(path.resolve()), "created": "true"}
    assert os.listdir(path.parent) == ["sparse.img"]  # no temporary file left behind


def test_interrupted_creation_is_cleaned_up(backend: LoopfileBackend, root: Path) -> None:
    stale = make_file(root / ".c.img.0badf00d.flexhub-new", 8 * MiB)
    backend.attach(vol(file="c.img", size="16Mi"))
    assert not stale.exists()
    assert os.listdir(root) == ["c.img"]


def test_size_rounded_up_to_4k(backend: LoopfileBackend, root: Path) -> None:
    att = backend.attach(vol(file="odd.img", size="1G"))
    assert os.stat(root / "odd.img").st_size == 1_000_001_536
    assert device_of(att).size() == 1_000_001_536


def test_preallocate(backend: LoopfileBackend, root: Path) -> None:
    backend.attach(vol(file="full.img", size="64Mi", preallocate="true"))
    st = os.stat(root / "full.img")
    assert st.st_size == 64 * MiB
    assert st.st_blocks * 512 >= 64 * MiB


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB tmpfs to run out of room on."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_preallocate_without_room(backend: LoopfileBackend, small_fs: Path) -> None:
    backend.node.config.backends["loopfile"]["root"] = str(small_fs / "root")  # type: ignore[index]
    with pytest.raises(VolumeError, match=r"not enough room for .*preallocating 64.0 MiB"):
        backend.attach(vol(file="big.img", size="64Mi", preallocate="true"))
    assert os.listdir(small_fs) == []  # nothing made, not even the root
    assert os.statvfs(small_fs).f_bfree * os.statvfs(small_fs).f_frsize > 15 * MiB


def test_escapes_create_nothing(backend: LoopfileBackend, root: Path, tmp_path: Path) -> None:
    root.mkdir(mode=0o700)
    outside = tmp_path / "outside"
    outside.mkdir()
    (root / "esc").symlink_to(outside)
    (root / "dev0.img").symlink_to("/dev/loop0")
    os.mknod(root / "blk.img", 0o600 | stat.S_IFBLK, os.makedev(7, 0))
    for file in ("esc/x.img", "dev0.img", "blk.img", "/etc/shadow", "../x.img", "a/../../x.img"):
        with pytest.raises(InvalidOptions, match="option 'file'"):
            backend.attach(vol(file=file, size="1Mi"))
    assert sorted(os.listdir(root)) == ["blk.img", "dev0.img", "esc"]
    assert os.listdir(outside) == []
    assert not (tmp_path / "x.img").exists()
    assert [d for d in _loop.devices() if str(tmp_path) in (d.backing_file() or "")] == []
    assert not (backend.node.state_dir / "loopfile").exists()  # no marker either


def test_attach_is_idempotent_and_detach_frees(backend: LoopfileBackend, root: Path) -> None:
    first = backend.attach(vol(file="a.img", size="16Mi"))
    second = backend.attach(vol(file="a.img", size="16Mi"))
    assert first == second
    dev = device_of(first)
    marker = backend.node.state_dir / "loopfile" / "created" / dev.name
    assert marker.exists()
    backend.detach(first)
    assert dev.backing_file() is None
    assert not marker.exists()
    assert (root / "a.img").exists()  # the data stays
    backend.detach(first)  # already gone: nothing to do
    third = backend.attach(vol(file="a.img"))  # existing file: no size needed
    assert device_of(third).backing_file() == str((root / "a.img").resolve())


def test_two_files_two_devices(backend: LoopfileBackend) -> None:
    a = backend.attach(vol(file="a.img", size="16Mi"))
    b = backend.attach(vol(file="b.img", size="16Mi"))
    assert a.device != b.device


def test_existing_file_smaller_than_size_is_refused(backend: LoopfileBackend, root: Path) -> None:
    """Never attached at another size than the PV asks for (issue 19): refused, unchanged."""
    path = make_file(root / "small.img", 16 * MiB)
    with pytest.raises(VolumeError, match=r"is 16\.0 MiB but option 'size' asks for 1\.00 GiB"):
        backend.attach(vol(file="small.img", size="1Gi"))
    assert os.stat(path).st_size == 16 * MiB
    assert _loop.find_for_file(path) is None


def test_empty_file_refused(backend: LoopfileBackend, root: Path) -> None:
    make_file(root / "empty.img", 0)
    with pytest.raises(VolumeError, match="is empty"):
        backend.attach(vol(file="empty.img"))


def test_foreign_device_reused_never_detached(backend: LoopfileBackend, root: Path) -> None:
    path = make_file(root / "foreign.img", 16 * MiB)
    foreign = losetup("--find", "--show", str(path))
    att = backend.attach(vol(file="foreign.img"))
    assert att.device == foreign
    assert att.details["created"] == "false"
    backend.detach(att)
    assert device_of(att).backing_file() == str(path.resolve())


def test_device_with_offset_is_not_reused(backend: LoopfileBackend, root: Path) -> None:
    path = make_file(root / "part.img", 16 * MiB)
    partial = losetup("--find", "--show", "--offset", "1048576", str(path))
    att = backend.attach(vol(file="part.img"))
    assert att.device != partial
    backend.detach(att)
    assert device_of(att).backing_file() is None
    assert _loop.LoopDevice(*_loop.loop_name(partial)).backing_file() == str(path.resolve())


def test_reattached_by_someone_else_is_not_ours(backend: LoopfileBackend, root: Path) -> None:
    """flexhub's marker survives, but the device was re-attached by another tool."""
    att = backend.attach(vol(file="x.img", size="16Mi"))
    losetup("--detach", att.device)  # e.g. an administrator, or a reboot
    losetup(att.device, str(root / "x.img"))  # same device, same file, not flexhub
    again = backend.attach(vol(file="x.img"))
    assert again.device == att.device
    assert again.details["created"] == "false"
    backend.detach(again)
    backend.detach(att)
    assert device_of(att).backing_file() == str((root / "x.img").resolve())


def test_marker_from_an_earlier_boot_is_not_ours(backend: LoopfileBackend, root: Path) -> None:
    path = make_file(root / "old.img", 16 * MiB)
    dev = _loop.LoopDevice(*_loop.loop_name(losetup("--find", "--show", str(path))))
    markers = backend._markers()
    markers.write(dev, path.resolve())  # pending, matching file ...
    data = (markers.directory / dev.name).read_text().replace(_loop.boot_id(), "old-boot")
    (markers.directory / dev.name).write_text(data)  # ... but from another boot
    att = backend.attach(vol(file="old.img"))
    assert att.details["created"] == "false"
    backend.detach(att)
    assert dev.backing_file() == str(path.resolve())


def test_crash_between_losetup_and_marker(backend: LoopfileBackend, root: Path) -> None:
    """A pending marker (written before losetup) makes the device ours after a crash."""
    path = make_file(root / "crash.img", 16 * MiB).resolve()
    index = _loop.free_index()
    assert index is not None
    dev = _loop.LoopDevice(f"loop{index}", index)
    backend._markers().write(dev, path)
    losetup(dev.path, str(path))
    att = backend.attach(vol(file="crash.img"))
    assert att.device == dev.path
    assert att.details["created"] == "true"
    assert backend._markers().read(dev)["diskseq"] == dev.diskseq()  # type: ignore[index]
    backend.detach(att)
    assert dev.backing_file() is None


# --------------------------------------------------------------------------- device nodes

LOOP_CONTROL = "/dev/loop-control"


@contextlib.contextmanager
def spare_loop_device() -> Iterator[int]:
    """Add a loop device at a high, unused index; remove it (and its node) afterwards."""
    used = {d.index for d in _loop.devices()}
    index = next(i for i in range(240, 10_000) if i not in used)
    fd = os.open(LOOP_CONTROL, os.O_RDWR)
    try:
        fcntl.ioctl(fd, _loop.LOOP_CTL_ADD, index)
        try:
            yield index
        finally:
            with contextlib.suppress(subprocess.CalledProcessError):
                losetup("--detach", f"/dev/loop{index}")
            with contextlib.suppress(OSError):
                fcntl.ioctl(fd, _loop.LOOP_CTL_REMOVE, index)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"/dev/loop{index}")
    finally:
        os.close(fd)


def test_missing_dev_node_is_created(
    backend: LoopfileBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    with spare_loop_device() as index:
        node = Path(f"/dev/loop{index}")
        with contextlib.suppress(FileNotFoundError):
            node.unlink()  # the device exists in the kernel, its node does not
        assert (_loop.SYS_BLOCK / f"loop{index}").exists()
        monkeypatch.setattr(_loop, "free_index", lambda: index)
        att = backend.attach(vol(file="n.img", size="16Mi"))
        assert att.device == str(node)
        st = os.lstat(node)
        assert stat.S_ISBLK(st.st_mode)
        assert (os.major(st.st_rdev), os.minor(st.st_rdev)) == _loop.LoopDevice(
            node.name, index
        ).devnum()
        assert device_of(att).size() == 16 * MiB
        backend.detach(att)
        assert device_of(att).backing_file() is None


def test_wrong_dev_node_refused(backend: LoopfileBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    with spare_loop_device() as index:
        node = Path(f"/dev/loop{index}")
        with contextlib.suppress(FileNotFoundError):
            node.unlink()
        os.mknod(node, 0o600 | stat.S_IFBLK, os.makedev(1, 3))  # not this loop device
        monkeypatch.setattr(_loop, "free_index", lambda: index)
        with pytest.raises(VolumeError, match="is not block device"):
            backend.attach(vol(file="w.img", size="16Mi"))
        assert not list((backend.node.state_dir / "loopfile" / "created").glob("loop*"))


# --------------------------------------------------------------------------- expand


def test_expand_grows_file_and_device(backend: LoopfileBackend, root: Path) -> None:
    volume = vol(file="grow.img", size="64Mi")
    att = backend.attach(volume)
    dev = device_of(att)
    backend.expand(att, volume, 128 * MiB)
    assert os.stat(root / "grow.img").st_size == 128 * MiB
    assert dev.size() == 128 * MiB
    assert os.stat(root / "grow.img").st_blocks * 512 < MiB  # still sparse
    backend.expand(att, volume, 128 * MiB)  # same size: nothing to do
    assert dev.size() == 128 * MiB
    backend.expand(att, volume, 64 * MiB)  # below the file's size: nothing ever shrinks
    assert os.stat(root / "grow.img").st_size == 128 * MiB
    assert dev.size() == 128 * MiB
    os.truncate(root / "grow.img", 192 * MiB)  # an interrupted expand grew only the file
    backend.expand(att, volume, 100 * MiB)
    assert dev.size() == 192 * MiB  # the device follows the file


def test_expand_preallocated(backend: LoopfileBackend, root: Path) -> None:
    volume = vol(file="pgrow.img", size="16Mi", preallocate="true")
    att = backend.attach(volume)
    backend.expand(att, volume, 48 * MiB)
    st = os.stat(root / "pgrow.img")
    assert st.st_size == 48 * MiB
    assert st.st_blocks * 512 >= 48 * MiB
    assert device_of(att).size() == 48 * MiB


def test_expand_refuses_a_device_of_another_file(backend: LoopfileBackend) -> None:
    a = backend.attach(vol(file="a.img", size="16Mi"))
    b = backend.attach(vol(file="b.img", size="16Mi"))
    swapped = Attachment(b.device, {**a.details, "loop": b.details["loop"]})
    with pytest.raises(VolumeError, match="no longer maps it"):
        backend.expand(swapped, vol(file="a.img"), 32 * MiB)
    with pytest.raises(VolumeError, match=r"not option 'file' b\.img"):
        backend.expand(a, vol(file="b.img"), 32 * MiB)


@pytest.fixture
def mountpoint(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    yield mnt
    subprocess.run(["umount", str(mnt)], check=False, capture_output=True)


CAP_SYS_RESOURCE = 24


def _has_cap(bit: int) -> bool:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> bit & 1)
    return False


@pytest.mark.parametrize("fs", ["ext4", "xfs"])
def test_expand_online(backend: LoopfileBackend, mountpoint: Path, fs: str) -> None:
    """The loop device grows under a mounted filesystem, which then grows.

    ext4's online resize ioctl needs CAP_SYS_RESOURCE; without it (some sandboxes) the
    filesystem is grown offline instead, which still proves the device grew.
    """
    volume = vol(file=f"{fs}.img", size="320Mi")
    att = backend.attach(volume)
    subprocess.run([f"mkfs.{fs}", "-q", att.device], check=True, capture_output=True)
    subprocess.run(["mount", att.device, str(mountpoint)], check=True)
    before = os.statvfs(mountpoint)
    backend.expand(att, volume, 640 * MiB)
    if fs == "xfs":
        subprocess.run(["xfs_growfs", str(mountpoint)], check=True, capture_output=True)
    elif _has_cap(CAP_SYS_RESOURCE):
        subprocess.run(["resize2fs", att.device], check=True, capture_output=True)
    else:
        subprocess.run(["umount", str(mountpoint)], check=True)
        subprocess.run(["e2fsck", "-fy", att.device], check=True, capture_output=True)
        subprocess.run(["resize2fs", att.device], check=True, capture_output=True)
        subprocess.run(["mount", att.device, str(mountpoint)], check=True)
    after = os.statvfs(mountpoint)
    assert after.f_blocks * after.f_frsize > before.f_blocks * before.f_frsize + 250 * MiB


def test_attach_tells_the_core_what_it_knows_about_blankness(
    backend: LoopfileBackend, root: Path
) -> None:
    created = backend.attach(vol(file="a.img", size="16Mi"))
    assert created.blank is True  # created by this very call
    # an attached device may hold writes the file does not show: the core must read it
    assert backend.attach(vol(file="a.img")).blank is None
    backend.detach(created)
    assert backend.attach(vol(file="a.img")).blank is True  # no data extents, fresh device
    backend.detach(created)
    with open(root / "a.img", "r+b") as handle:
        handle.seek(8 << 20)
        handle.write(b"rows")
    written = backend.attach(vol(file="a.img"))
    assert written.blank is False  # data extents: never formatted without a signature
    backend.detach(written)


def test_file_deeper_than_the_account_sees_is_refused(backend: LoopfileBackend, root: Path) -> None:
    """A symlink in the root can make a short ``file`` resolve deeper than the account's scan
    goes: refused, nothing made."""
    deep = root
    for _ in range(140):
        deep = deep / "d"
    deep.mkdir(parents=True)
    (root / "short").symlink_to(deep)
    with pytest.raises(InvalidOptions, match="too deep"):
        backend.attach(vol(file="short/x.img", size="16Mi"))
    assert not (deep / "x.img").exists()
