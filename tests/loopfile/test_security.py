"""Tenant isolation on the node, through the installed driver (README "Security").

Each test installs the driver with its own node config in a world-traversable directory
(``/var/tmp``, not pytest's private tmp), so that an unprivileged user's view can be checked
too, and drives it exactly as kubelet does, with real loop devices and mounts.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from flexhub.admin.harness import DriverReply, Kubelet, go_json
from flexhub.admin.install import install
from tests.conftest import needs_root
from tests.loopfile.conftest import loops_of

pytestmark = [needs_root, pytest.mark.root]

MiB = 1024 * 1024
NOBODY = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", "--"]


@dataclass
class Tree:
    """One node: its directories, its config file, and a kubelet for its driver."""

    base: Path
    kube: Kubelet

    @property
    def state(self) -> Path:
        return self.base / "state"

    @property
    def loopfiles(self) -> Path:
        return self.base / "loopfiles"

    @property
    def config(self) -> Path:
        return self.base / "flexhub.toml"

    def configure(self, loopfile: str = "") -> None:
        """(Re)write the node config; ``loopfile`` adds lines to its ``[loopfile]`` table."""
        self.config.write_text(
            f'state_dir = "{self.state}"\nlog_dir = "{self.base / "log"}"\nlock_timeout = 20\n'
            f'[loopfile]\nroot = "{self.loopfiles}"\n{loopfile}\n'
        )

    def mount(self, uid: str, user: dict[str, str], namespace: str, **kw: object) -> DriverReply:
        options = Kubelet.mount_options(user, pv="pv-1", pod_uid=uid, namespace=namespace, **kw)  # type: ignore[arg-type]
        reply = self.kube.mount(uid, "pv-1", options)
        assert reply is not None
        return reply

    def unmount(self, uid: str) -> None:
        reply = self.kube.unmount(uid, "pv-1")
        assert reply is not None and reply.ok, reply and reply.reply


def _mounts_under(path: Path) -> list[str]:
    points = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    return [p for p in points if p == str(path) or p.startswith(f"{path}/")]


@pytest.fixture
def tree() -> Iterator[Tree]:
    base = Path(tempfile.mkdtemp(prefix="flexhub-security-", dir="/var/tmp"))
    base.chmod(0o755)
    node = Tree(base, Kubelet(driver=Path("/nonexistent"), root=base / "kubelet"))
    node.configure()
    node.kube.driver = install(base / "plugins", config=node.config)
    try:
        yield node
    finally:
        for point in reversed(_mounts_under(base)):
            subprocess.run(["umount", "-l", point], check=False)
        for loop in loops_of(base):
            subprocess.run(["losetup", "-d", loop], check=False)
        shutil.rmtree(base, ignore_errors=True)


VOL = {"backend": "loopfile", "file": "shared/db.img", "size": "64Mi"}


def _write(tree: Tree, uid: str, name: str, text: str) -> None:
    (tree.kube.pod_dir(uid, "pv-1") / name).write_text(text)


def _names(tree: Tree, uid: str) -> set[str]:
    return {p.name for p in tree.kube.pod_dir(uid, "pv-1").iterdir()} - {"lost+found"}


# -- 1. loopfile: a file belongs to its namespace ---------------------------------------------


def test_another_namespace_naming_the_same_file_gets_its_own(tree: Tree) -> None:
    """team-b names team-a's file (and asks for an fsGroup): it gets a separate, empty file;
    team-a's data and group stay untouched."""
    a, b = tree.kube.new_pod_uid(), tree.kube.new_pod_uid()
    assert tree.mount(a, VOL, "team-a").ok
    _write(tree, a, "secret", "team-a's data")
    root_a = tree.kube.pod_dir(a, "pv-1")
    group_before = root_a.stat().st_gid
    reply = tree.mount(b, VOL, "team-b", fs_group=4242)
    assert reply.ok, reply.reply
    assert "secret" not in _names(tree, b)
    assert (root_a / "secret").read_text() == "team-a's data"
    assert root_a.stat().st_gid == group_before
    area = tree.loopfiles / "namespaces"
    file_a, file_b = area / "team-a" / "shared" / "db.img", area / "team-b" / "shared" / "db.img"
    assert file_a.is_file() and file_b.is_file()
    assert file_a.stat().st_ino != file_b.stat().st_ino
    assert not (tree.loopfiles / "shared").exists()
    tree.unmount(b)
    tree.unmount(a)


@pytest.mark.parametrize("namespace", ["", "../team-a", "Team_A", "a" * 64, "team-a/x"])
def test_invalid_namespace_fails_and_creates_nothing(tree: Tree, namespace: str) -> None:
    """A namespace becomes a path component: anything but a DNS label is a Failure."""
    reply = tree.mount(tree.kube.new_pod_uid(), VOL, namespace)
    assert reply.status == "Failure" and "namespace" in reply.message, reply.reply
    assert not tree.loopfiles.exists() or not any(tree.loopfiles.rglob("*.img"))


def test_isolation_none_keeps_one_file_for_every_namespace(tree: Tree) -> None:
    """``isolation = "none"`` (single-tenant nodes): today's behaviour, files in the root."""
    tree.configure('isolation = "none"')
    a, b = tree.kube.new_pod_uid(), tree.kube.new_pod_uid()
    assert tree.mount(a, VOL, "team-a").ok
    _write(tree, a, "secret", "shared")
    assert tree.mount(b, VOL, "team-b").ok
    assert (tree.kube.pod_dir(b, "pv-1") / "secret").read_text() == "shared"
    assert (tree.loopfiles / "shared" / "db.img").is_file()
    assert not (tree.loopfiles / "namespaces").exists()
    tree.unmount(a)
    tree.unmount(b)


def _legacy_file(tree: Tree) -> Path:
    """A file made before isolation existed, holding data, at the old place."""
    tree.configure('isolation = "none"')
    uid = tree.kube.new_pod_uid()
    assert tree.mount(uid, VOL, "team-a").ok
    _write(tree, uid, "old", "from before the upgrade")
    tree.unmount(uid)
    tree.configure()
    return tree.loopfiles / "shared" / "db.img"


def test_legacy_file_is_adopted_by_the_first_namespace_only(tree: Tree) -> None:
    """After the upgrade, the first namespace to mount a pre-isolation file takes it (moved
    into its area, data intact); another namespace then gets a new file of its own."""
    legacy = _legacy_file(tree)
    a, b = tree.kube.new_pod_uid(), tree.kube.new_pod_uid()
    reply = tree.mount(a, {k: v for k, v in VOL.items() if k != "size"}, "team-a")
    assert reply.ok, reply.reply
    assert (tree.kube.pod_dir(a, "pv-1") / "old").read_text() == "from before the upgrade"
    assert not legacy.exists()
    assert (tree.loopfiles / "namespaces" / "team-a" / "shared" / "db.img").is_file()
    assert tree.mount(b, VOL, "team-b").ok
    assert "old" not in _names(tree, b)
    tree.unmount(a)
    tree.unmount(b)
    again = tree.kube.new_pod_uid()
    assert tree.mount(again, VOL, "team-a").ok
    assert (tree.kube.pod_dir(again, "pv-1") / "old").read_text() == "from before the upgrade"
    tree.unmount(again)


def test_legacy_refuse_fails_and_moves_nothing(tree: Tree) -> None:
    """``legacy = "refuse"``: the mount fails and names where an operator must move the file."""
    legacy = _legacy_file(tree)
    tree.configure('legacy = "refuse"')
    reply = tree.mount(tree.kube.new_pod_uid(), VOL, "team-a")
    assert reply.status == "Failure", reply.reply
    assert str(tree.loopfiles / "namespaces" / "team-a" / "shared" / "db.img") in reply.message
    assert legacy.is_file()
    assert not (tree.loopfiles / "namespaces" / "team-a" / "shared" / "db.img").exists()


def test_legacy_file_smaller_than_size_is_refused_before_adoption(tree: Tree) -> None:
    """A PV asking for more than the pre-isolation file holds: refused naming both sizes, and
    the file stays where it was (a refusal moves nothing either)."""
    legacy = _legacy_file(tree)
    size = legacy.stat().st_size
    reply = tree.mount(tree.kube.new_pod_uid(), {**VOL, "size": f"{2 * size}"}, "team-a")
    assert reply.status == "Failure" and "option 'size' asks for" in reply.message, reply.reply
    assert legacy.is_file() and legacy.stat().st_size == size
    assert not (tree.loopfiles / "namespaces" / "team-a").exists()


def test_expandfs_grows_the_namespaced_file(tree: Tree) -> None:
    """expandfs carries no namespace: it grows the file journalled for the pod directory."""
    uid = tree.kube.new_pod_uid()
    user = {"backend": "loopfile", "file": "grow.img", "size": "300Mi"}
    assert tree.mount(uid, user, "team-a", fs_type="xfs").ok
    other = tree.kube.new_pod_uid()
    assert tree.mount(other, user, "team-b", fs_type="xfs").ok
    options = Kubelet.base_options(user, pv="pv-1", fs_type="xfs")
    reply = tree.kube.expandfs(uid, "pv-1", options, 600 * MiB, 300 * MiB)
    assert reply.ok, reply.reply
    area = tree.loopfiles / "namespaces"
    assert (area / "team-a" / "grow.img").stat().st_size == 600 * MiB
    assert (area / "team-b" / "grow.img").stat().st_size == 300 * MiB
    tree.unmount(uid)
    tree.unmount(other)


def test_interrupted_attach_is_released_in_its_namespace(tree: Tree) -> None:
    """A mount killed right after the attach leaves an intent record; the next unmount
    re-attaches in the same namespace's area to release the loop device (none is leaked)."""
    uid = tree.kube.new_pod_uid()
    target = tree.kube.pod_dir(uid, "pv-1")
    options = Kubelet.mount_options(VOL, pv="pv-1", pod_uid=uid, namespace="team-a")
    target.mkdir(parents=True)
    crashed = subprocess.run(
        [str(tree.kube.driver), "mount", str(target), go_json(options)],
        env={**tree.kube.env, "FLEXHUB_TEST_CRASH_AT": "attached"},
        capture_output=True,
        check=False,
    )
    assert crashed.returncode == -9, crashed
    image = tree.loopfiles / "namespaces" / "team-a" / "shared" / "db.img"
    assert loops_of(image), "the crash left no loop device: the test proves nothing"
    reply = tree.kube.call("unmount", str(target))
    assert reply.ok, reply.reply
    assert loops_of(image) == []


# -- 2. loopfile: no file larger than the free space ------------------------------------------


@pytest.fixture
def small_root(tree: Tree) -> Iterator[Path]:
    """The loopfile root on its own 128 MiB tmpfs."""
    tree.loopfiles.mkdir(mode=0o700)
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=128m,mode=0700", "tmpfs", str(tree.loopfiles)],
        check=True,
    )
    yield tree.loopfiles
    subprocess.run(["umount", "-l", str(tree.loopfiles)], check=False)


def test_new_file_larger_than_free_space_is_refused(tree: Tree, small_root: Path) -> None:
    """A 1 GiB file on a 128 MiB filesystem: Failure naming both sizes, nothing created."""
    user = {"backend": "loopfile", "file": "big.img", "size": "1Gi"}
    reply = tree.mount(tree.kube.new_pod_uid(), user, "team-a", fs_type="xfs")
    assert reply.status == "Failure", reply.reply
    assert "(1.00 GiB)" in reply.message and "128.0 MiB free" in reply.message, reply.message
    assert list(small_root.iterdir()) == []


def test_stated_overcommit_allows_a_sparse_file(tree: Tree, small_root: Path) -> None:
    """``overcommit = 16`` lets a sparse 1 GiB file live on 128 MiB; preallocation never."""
    tree.configure("overcommit = 16")
    uid = tree.kube.new_pod_uid()
    user = {"backend": "loopfile", "file": "big.img", "size": "1Gi"}
    reply = tree.mount(uid, user, "team-a", fs_type="xfs")
    assert reply.ok, reply.reply
    tree.unmount(uid)
    full = {**user, "file": "full.img", "preallocate": "true"}
    reply = tree.mount(tree.kube.new_pod_uid(), full, "team-a", fs_type="xfs")
    assert reply.status == "Failure" and "preallocating 1.00 GiB" in reply.message, reply.reply


# -- 4. the state directory is root's alone ---------------------------------------------------


def _as_nobody(*argv: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([*NOBODY, *argv], capture_output=True, check=False)


def test_state_dir_is_private_and_old_modes_are_tightened(tree: Tree) -> None:
    """An old state dir (0755, staging/ 0755) is tightened to 0700 on next use, and nobody
    can list or read a staged volume through it; the pod's own directory still works."""
    (tree.state / "staging").mkdir(parents=True)
    tree.state.chmod(0o755)
    (tree.state / "staging").chmod(0o755)
    uid = tree.kube.new_pod_uid()
    assert tree.mount(uid, VOL, "team-a").ok
    _write(tree, uid, "secret", "private")
    (tree.kube.pod_dir(uid, "pv-1") / "secret").chmod(0o644)
    staged = [Path(p) for p in _mounts_under(tree.state / "staging")]
    assert len(staged) == 1
    # the control: the unprivileged user reads the file through the pod's directory
    shown = _as_nobody("cat", str(tree.kube.pod_dir(uid, "pv-1") / "secret"))
    assert shown.returncode == 0 and shown.stdout == b"private", shown
    for argv in (
        ["ls", str(staged[0])],
        ["cat", str(staged[0] / "secret")],
        ["ls", str(tree.state)],
    ):
        denied = _as_nobody(*argv)
        assert denied.returncode != 0 and b"Permission denied" in denied.stderr, (argv, denied)
    private = [tree.state]
    for top, dirs, _ in os.walk(tree.state):
        dirs[:] = [d for d in dirs if Path(top, d) not in staged]  # the volumes' own roots
        if Path(top) == tree.state / "cache":
            dirs[:] = []  # stevedore's entry-point cache has its own modes, inside a 0700 dir
        private.extend(Path(top, d) for d in dirs)
    assert len(private) >= 6  # state, staging, pods, volumes, locks, loopfile, ...
    for directory in private:
        assert stat.S_IMODE(directory.stat().st_mode) & 0o077 == 0, directory
    tree.unmount(uid)
