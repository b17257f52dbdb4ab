"""flexhub.claimdir, the claim-directory helper nfs and cifs share, on real directories (no
server: the walk only sees a tree; tests/vm/test_nfs_provision.py and test_cifs_provision.py
run it against a real NFS export and Samba share). The nfs way (a server that keeps owners and
modes: ``owner`` and ``mode`` given) and the cifs way (the server's: neither given) both."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from flexhub import claimdir
from flexhub.errors import CommandTimeout, InvalidOptions, VolumeError
from flexhub.provisioning import Claim

UID = "3f9a1c2e-5b7d-4e8f-9a0b-1c2d3e4f5a6b"


@pytest.fixture
def export(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    """An "export" directory and a descriptor of it; a sibling ``outside`` to escape to."""
    root = tmp_path / "export"
    root.mkdir()
    (tmp_path / "outside").mkdir()
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    yield root, fd
    os.close(fd)


def tree(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


# -- make, remove, archive: the nfs way (owner and mode given) --------------------------------------


def test_make_gives_owner_and_mode_and_is_idempotent(export: tuple[Path, int]) -> None:
    root, fd = export
    assert claimdir.make(fd, "team/claim-x", owner=(1234, 2345), mode=0o2770) is True
    info = (root / "team" / "claim-x").stat()
    assert (info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode)) == (1234, 2345, 0o2770)
    (root / "team" / "claim-x" / "data").write_text("kept")
    assert claimdir.make(fd, "team/claim-x", owner=(1234, 2345), mode=0o2770) is False
    assert tree(root) == ["team", "team/claim-x", "team/claim-x/data"]


def test_a_retried_make_gives_owner_and_mode_again(export: tuple[Path, int]) -> None:
    root, fd = export
    claimdir.make(fd, "claim-x", owner=(1234, 2345), mode=0o2770)
    os.chown(root / "claim-x", 0, 0)
    os.chmod(root / "claim-x", 0o700)
    assert claimdir.make(fd, "claim-x", owner=(1234, 2345), mode=0o2770) is False
    info = (root / "claim-x").stat()
    assert (info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode)) == (1234, 2345, 0o2770)


#: Runs make in a user namespace where only root is mapped, so that fchown to 1234 fails
#: (EINVAL) on a real filesystem: what a server that squashes root does to the provisioner.
UNMAPPED_MAKE = r"""
import json, os, sys
sys.path.insert(0, sys.argv[1])
from flexhub import claimdir
from flexhub.errors import VolumeError
fd = os.open(sys.argv[2], os.O_RDONLY | os.O_DIRECTORY)
try:
    claimdir.make(fd, sys.argv[3], owner=(1234, 2345), mode=0o2770, hint=" (squashed?)")
    print(json.dumps({"made": True}))
except VolumeError as exc:
    print(json.dumps({"error": str(exc)}))
"""


def make_unmapped(root: Path, path: str) -> dict[str, str]:
    repo = Path(__file__).resolve().parents[2]
    argv = ["unshare", "--user", "--map-root-user", sys.executable, "-c", UNMAPPED_MAKE]
    done = subprocess.run(
        [*argv, str(repo), str(root), path],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    result: dict[str, str] = json.loads(done.stdout)
    return result


def test_a_directory_made_is_removed_again_when_its_owner_cannot_be_set(
    export: tuple[Path, int],
) -> None:
    root, _ = export
    result = make_unmapped(root, "team/claim-x")
    assert result == {
        "error": "cannot give team/claim-x the owner 1234:2345 and mode 2770: Invalid argument"
        " (squashed?)"
    }
    assert tree(root) == ["team"]  # the parent stays (as mkdir -p's would); the claim's goes
    (root / "team" / "claim-y").mkdir()
    assert "error" in make_unmapped(root, "team/claim-y")
    assert tree(root) == ["team", "team/claim-y"]  # found, not made by the call: kept


def test_parents_made_get_exactly_0755_whatever_the_umask(export: tuple[Path, int]) -> None:
    root, fd = export
    old = os.umask(0)
    try:
        claimdir.make(fd, "a/b/claim-x", owner=(0, 0), mode=0o2770)
    finally:
        os.umask(old)
    modes = [stat.S_IMODE((root / p).stat().st_mode) for p in ("a", "a/b", "a/b/claim-x")]
    assert modes == [0o755, 0o755, 0o2770]


def test_make_refuses_a_symlink_on_the_way(export: tuple[Path, int]) -> None:
    root, fd = export
    (root / "team").symlink_to(root.parent / "outside")
    with pytest.raises(VolumeError, match="symbolic link"):
        claimdir.make(fd, "team/claim-x", owner=(0, 0), mode=0o2770)
    (root / "leaf").symlink_to(root.parent / "outside")
    with pytest.raises(VolumeError, match="symbolic link"):
        claimdir.make(fd, "leaf", owner=(0, 0), mode=0o700)
    assert list((root.parent / "outside").iterdir()) == []
    assert stat.S_IMODE((root.parent / "outside").stat().st_mode) != 0o700


def test_make_refuses_a_file_on_the_way(export: tuple[Path, int]) -> None:
    root, fd = export
    (root / "f").write_text("")
    with pytest.raises(VolumeError, match=r"^f is not a directory in the export: refused$"):
        claimdir.make(fd, "f/claim-x", owner=(0, 0), mode=0o770)
    with pytest.raises(VolumeError, match=r"^f is not a directory in the export: refused$"):
        claimdir.make(fd, "f", owner=(0, 0), mode=0o770)
    assert tree(root) == ["f"]


def test_remove_never_follows_a_symlink_inside(export: tuple[Path, int]) -> None:
    root, fd = export
    (root.parent / "outside" / "precious").write_text("x")
    claimdir.make(fd, "claim-x", owner=(0, 0), mode=0o770)
    (root / "claim-x" / "sub").mkdir()
    (root / "claim-x" / "sub" / "f").write_text("y")
    (root / "claim-x" / "link").symlink_to(root.parent / "outside")
    assert claimdir.remove(fd, "claim-x") is True
    assert tree(root) == [] and (root.parent / "outside" / "precious").read_text() == "x"
    assert claimdir.remove(fd, "claim-x") is False  # gone: success
    assert claimdir.remove(fd, "no/such/claim") is False


def test_remove_of_a_symlink_in_its_place_unlinks_only_the_link(
    export: tuple[Path, int],
) -> None:
    root, fd = export
    (root.parent / "outside" / "precious").write_text("x")
    (root / "claim-x").symlink_to(root.parent / "outside")
    assert claimdir.remove(fd, "claim-x") is True
    assert tree(root) == [] and (root.parent / "outside" / "precious").read_text() == "x"


@pytest.mark.parametrize("reclaim", [claimdir.remove, claimdir.archive])
def test_remove_and_archive_refuse_a_symlinked_parent(
    export: tuple[Path, int], reclaim: Callable[[int, str], object]
) -> None:
    root, fd = export
    (root.parent / "outside" / "claim-x").mkdir()
    (root / "team").symlink_to(root.parent / "outside")
    with pytest.raises(VolumeError, match=r"^team is a symbolic link in the export: refused$"):
        reclaim(fd, "team/claim-x")
    assert tree(root.parent / "outside") == ["claim-x"]


def test_archive_renames_beside_it(export: tuple[Path, int]) -> None:
    root, fd = export
    claimdir.make(fd, "t/claim-x", owner=(0, 0), mode=0o770)
    (root / "t" / "claim-x" / "f").write_text("kept")
    assert claimdir.archive(fd, "t/claim-x") == "t/archived-claim-x"
    assert (root / "t" / "archived-claim-x" / "f").read_text() == "kept"
    assert claimdir.archive(fd, "t/claim-x") == ""  # gone: success
    assert claimdir.archive(fd, "no/such/claim") == ""
    claimdir.make(fd, "t/claim-x", owner=(0, 0), mode=0o770)
    with pytest.raises(VolumeError, match="exists already"):
        claimdir.archive(fd, "t/claim-x")  # an archive is never replaced
    assert (root / "t" / "archived-claim-x" / "f").read_text() == "kept"


# -- the cifs way (the server keeps owner and modes) ------------------------------------------------


def test_make_and_remove_on_a_share(tmp_path: Path) -> None:
    root = tmp_path / "share"
    root.mkdir()
    (tmp_path / "outside").mkdir()
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert claimdir.make(fd, "a/b/claim-x", where="share") is True
        assert claimdir.make(fd, "a/b/claim-x", where="share") is False
        modes = [stat.S_IMODE((root / p).stat().st_mode) for p in ("a", "a/b", "a/b/claim-x")]
        assert all(m & 0o022 == 0 for m in modes)  # 0755 asked, never world-writable
        (root / "a" / "b" / "claim-x" / "link").symlink_to(tmp_path / "outside")
        assert claimdir.remove(fd, "a/b/claim-x", where="share") is True
        assert claimdir.remove(fd, "a/b/claim-x", where="share") is False
        (root / "l").symlink_to(tmp_path / "outside")
        with pytest.raises(VolumeError, match=r"^l is a symbolic link in the share: refused$"):
            claimdir.make(fd, "l/claim-y", where="share")
        assert list((tmp_path / "outside").iterdir()) == []
        assert sorted(p.name for p in root.iterdir()) == ["a", "l"]
    finally:
        os.close(fd)


# -- paths that are not plain ---------------------------------------------------------------------


BAD_PATHS = ["", "..", "a/..", "../claim-x", "/claim-x", "a//claim-x", "./claim-x", "a/", "a\0b"]


@pytest.mark.parametrize("path", BAD_PATHS)
def test_a_path_that_is_not_plain_is_refused_and_nothing_changes(
    export: tuple[Path, int], path: str
) -> None:
    """Whatever checked the path before (pathPattern, the reclaim record), the helper itself
    never walks ``..`` nor starts anywhere but the root: ``remove(root, "..")`` would
    otherwise delete the export's parent."""
    root, fd = export
    (root / "a").mkdir()
    (root.parent / "outside" / "precious").write_text("x")
    before = (tree(root.parent), stat.S_IMODE(root.stat().st_mode), root.stat().st_uid)
    calls: list[Callable[[], object]] = [
        lambda: claimdir.make(fd, path, owner=(1234, 1234), mode=0o700),
        lambda: claimdir.make(fd, path, where="share"),
        lambda: claimdir.remove(fd, path),
        lambda: claimdir.archive(fd, path),
    ]
    for call in calls:
        with pytest.raises(VolumeError, match="not a plain relative path"):
            call()
    assert (tree(root.parent), stat.S_IMODE(root.stat().st_mode), root.stat().st_uid) == before


# -- the bound, and the reclaim flow ----------------------------------------------------------------


def test_bounded_gives_up_on_a_call_that_hangs() -> None:
    release = threading.Event()
    try:
        with pytest.raises(CommandTimeout, match=r"walking x did not finish within 0\.1s"):
            claimdir.bounded(release.wait, 0.1, "walking x")
    finally:
        release.set()
    assert claimdir.bounded(lambda: 42, 5, "x") == 42
    with pytest.raises(VolumeError, match="boom"):
        claimdir.bounded(lambda: (_ for _ in ()).throw(VolumeError("boom")), 5, "x")


def test_in_root_names_the_server_that_did_not_answer(tmp_path: Path) -> None:
    release = threading.Event()
    try:
        with pytest.raises(
            CommandTimeout, match=r"^NFS server h did not answer within 0\.1s while making x$"
        ):
            claimdir.in_root(
                tmp_path,
                lambda fd: release.wait(),
                what="making x",
                bound=0.1,
                server="NFS server h",
            )
    finally:
        release.set()

    def inode(fd: int) -> int:
        return os.fstat(fd).st_ino

    assert claimdir.in_root(tmp_path, inode, what="x", bound=5, server="s") == (
        tmp_path.stat().st_ino
    )


class Export:
    """A directory standing for the mounted export: what a backend's MountedRoot runs on."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.opened = 0

    def __call__(self) -> claimdir.MountedRoot:
        self.opened += 1

        def run(what: str, bound: float, work: Callable[[int], object]) -> object:
            return claimdir.in_root(self.root, work, what=what, bound=bound, server="server h")

        return claimdir.MountedRoot("h:/export", run)


def reclaim(
    export: Export, path: str, on_delete: str, record: dict[str, str] | None = None
) -> None:
    claimdir.reclaim(
        {"server": "h", "share": "/export", "subPath": path},
        {"path": path, "claimUid": UID, "onDelete": on_delete, **(record or {})},
        honoured=frozenset({"delete", "retain", "archive"}),
        location="h:/export",
        root=export,
    )


def test_provisioned_records_what_reclaim_reads(tmp_path: Path) -> None:
    claim = Claim(uid=UID, namespace="team-a", name="db", size=1 << 30)
    path = f"team-a-db-pvc-{UID}"
    made = claimdir.provisioned(claim, {"subPath": path}, path, fs_type="nfs4")
    assert (made.size, made.reclaim, made.fs_type, made.secret) == (
        1 << 30,
        {"path": path, "claimUid": UID},
        "nfs4",
        None,
    )
    (tmp_path / path).mkdir()
    claimdir.reclaim(
        made.options,
        {**made.reclaim, "onDelete": "delete"},
        honoured=frozenset({"delete"}),
        location="h:/export",
        root=Export(tmp_path),
    )
    assert tree(tmp_path) == []


def test_reclaim_retain_archive_delete(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="flexhub.claimdir")
    path = f"team/pvc-{UID}"
    (tmp_path / path).mkdir(parents=True)
    (tmp_path / path / "f").write_text("kept")
    export = Export(tmp_path)
    reclaim(export, path, "retain")
    assert export.opened == 0  # retain mounts nothing
    assert f"retaining h:/export/{path}" in caplog.text
    reclaim(export, path, "archive")
    assert (tmp_path / "team" / f"archived-pvc-{UID}" / "f").read_text() == "kept"
    reclaim(export, path, "archive")  # gone: success
    assert f"archived h:/export/{path} as (already gone)" in caplog.text
    (tmp_path / path).mkdir()
    reclaim(export, path, "delete")
    reclaim(export, path, "delete")  # gone: success
    assert tree(tmp_path) == ["team", f"team/archived-pvc-{UID}", f"team/archived-pvc-{UID}/f"]
    assert f"removed h:/export/{path} (already gone)" in caplog.text


@pytest.mark.parametrize(
    ("on_delete", "record", "match"),
    [
        ("shred", {}, r"^invalid onDelete 'shred': not one of \['archive', 'delete', 'retain'\]$"),
        ("delete", {"claimUid": "x"}, r"claimUid"),
        ("archive", {"path": "other"}, r"not the PV's subPath"),
    ],
)
def test_reclaim_refuses_before_mounting(
    tmp_path: Path, on_delete: str, record: dict[str, str], match: str
) -> None:
    path = f"pvc-{UID}"
    (tmp_path / path).mkdir()
    export = Export(tmp_path)
    with pytest.raises(InvalidOptions, match=match):
        reclaim(export, path, on_delete, record)
    assert export.opened == 0 and tree(tmp_path) == [path]


def test_a_live_calls_temporary_mount_is_never_taken_for_a_leftover(tmp_path: Path) -> None:
    """nfs and cifs mount an export's root on a temporary directory per call and collect
    those a crashed call left. Mounted, the directory shows the export root's times (years
    old, often), so its age came from the wrong place: one provisioner worker (or driver
    call) unmounted another's live mount. The name says when and by whom it was made."""
    import subprocess
    import time

    from flexhub.claimdir import temp_is_leftover, temp_mount_point

    now = time.time()
    live = temp_mount_point(tmp_path)
    os.utime(live, (0, 0))  # what a mounted export root from 1970 shows
    assert not temp_is_leftover(live, now, 3600)  # young by its name
    assert not temp_is_leftover(live, now + 7200, 3600)  # old, but its process is alive
    proc = subprocess.Popen(["true"])
    proc.wait()
    crashed = tmp_path / f"{int(now)}-{proc.pid}-abcdef012345"
    crashed.mkdir()
    assert not temp_is_leftover(crashed, now + 60, 3600)
    assert temp_is_leftover(crashed, now + 7200, 3600)
    older = tmp_path / "0123456789abcdef"  # a name of the form before: by its age
    older.mkdir()
    assert not temp_is_leftover(older, time.time(), 3600)
    os.utime(older, (0, 0))
    assert temp_is_leftover(older, time.time(), 3600)
