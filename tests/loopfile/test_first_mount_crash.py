"""A **new** loopfile volume's first mount, killed anywhere, converges on the next call (issue 32).

Through the installed driver on real loop devices: SIGKILL at each step of the first mount (the
format's own steps among them), and at random delays while ``mkfs`` runs, the driver and its
``mkfs`` killed together as a node reboot does. The retry formats again what flexhub began and
never finished and mounts a working filesystem; data somebody else wrote is still refused; no
state-write temporary outlives its call.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

from flexhub.admin.harness import Kubelet, go_json
from flexhub.node.checkpoints import TRACE_ENV
from flexhub.node.volumes import CHECKPOINTS, PAUSE_ENV
from tests.conftest import needs_root
from tests.kill_delays import kill_delays
from tests.loopfile.conftest import loops_of
from tests.loopfile.test_crash_e2e import assert_clean, assert_killed, assert_ok, call

pytestmark = [needs_root, pytest.mark.root]

ROUNDS = 8


def volume(name: str, size: str = "1Gi") -> dict[str, str]:
    return {"backend": "loopfile", "file": f"vols/{name}.img", "size": size}


def image(node_tree: dict[str, Path], name: str) -> Path:
    return node_tree["loopfiles"] / "namespaces" / "default" / "vols" / f"{name}.img"


def new_pod(k: Kubelet, vol: dict[str, str], fs_type: str) -> tuple[Path, str]:
    uid = k.new_pod_uid()
    target = k.pod_dir(uid, "pv-1")
    target.mkdir(parents=True)
    return target, go_json(Kubelet.mount_options(vol, pv="pv-1", pod_uid=uid, fs_type=fs_type))


def temporaries(state: Path) -> list[str]:
    """Every state-write temporary left under the state directory (no staging mount)."""
    return sorted(str(p) for p in state.rglob("*.tmp") if not p.is_relative_to(state / "staging"))


def converges(
    k: Kubelet, node_tree: dict[str, Path], target: Path, options: str, vol: dict[str, str], fs: str
) -> None:
    """The retried mount works, keeps data across pods, and leaves nothing behind."""
    assert_ok(call(k, "mount", str(target), options))
    (target / "data").write_text("ok")
    assert_ok(call(k, "unmount", str(target)))
    assert_clean(node_tree)
    assert temporaries(node_tree["state"]) == []
    again, options = new_pod(k, vol, fs)
    assert_ok(call(k, "mount", str(again), options))
    assert (again / "data").read_text() == "ok"
    found = subprocess.run(
        ["findmnt", "-n", "-o", "FSTYPE", "--target", str(again)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert found == [fs], found
    assert_ok(call(k, "unmount", str(again)))
    assert_clean(node_tree)
    assert temporaries(node_tree["state"]) == []


def _tree(root: int, old: frozenset[str] = frozenset()) -> dict[int, tuple[str, str]]:
    """``pid: (comm, state)`` of ``root``'s live descendants (one scan of /proc, skipping the
    pids in ``old``: processes that existed before ``root`` started the ones looked for;
    never a filter on pid order, which wraps)."""
    parents: dict[int, tuple[int, str, str]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit() or name in old:
            continue
        try:
            text = Path("/proc", name, "stat").read_text()
        except OSError:
            continue
        comm = text[text.index("(") + 1 : text.rindex(")")]
        state, ppid = text[text.rindex(")") + 2 :].split()[:2]
        parents[int(name)] = (int(ppid), comm, state)
    found: dict[int, tuple[str, str]] = {}
    frontier = {root}
    while frontier:
        frontier = {
            pid for pid, (ppid, _, _) in parents.items() if ppid in frontier and pid not in found
        }
        for pid in frontier:
            found[pid] = parents[pid][1:]
    return found


def _wait_stopped(pid: int) -> None:
    for _ in range(3000):
        text = Path(f"/proc/{pid}/stat").read_text()
        if text[text.rindex(")") + 2 :].split()[0] == "T":
            return
        time.sleep(0.01)
    raise AssertionError("the mount never reached its pause")


def _start_held(k: Kubelet, target: Path, options: str) -> tuple[subprocess.Popen[bytes], int]:
    """Start a first mount held at ``volume-record`` (right before the format), let it go
    on, and return it with its mkfs's pid (0 when it finished without one being seen)."""
    proc = subprocess.Popen(
        [str(k.driver), "mount", str(target), options],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**k.env, PAUSE_ENV: "volume-record"},
        cwd="/",
    )
    _wait_stopped(proc.pid)
    before = frozenset(os.listdir("/proc"))  # the held driver starts nothing meanwhile
    os.kill(proc.pid, signal.SIGCONT)
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline:
        for pid, (comm, _) in _tree(proc.pid, before).items():
            if comm.startswith("mkfs"):
                return proc, pid
    return proc, 0


def mkfs_window(k: Kubelet, node_tree: dict[str, Path], fs: str) -> float:
    """How long mkfs runs in a first mount on this machine now (its load changes it tenfold):
    one first mount held at its ``format-intent`` checkpoint (right before ``mkfs``), let go,
    and timed until its trace shows ``formatted`` (right after), then unmounted. Read from the
    driver's own checkpoints, never from a scan of /proc, which a loaded machine can starve
    past a short mkfs (CI 2026-12-05: "the watched first mount ran no mkfs")."""
    vol = volume("calibrate")
    target, options = new_pod(k, vol, fs)
    trace = node_tree["log"].parent / "calibrate.trace"
    proc = subprocess.Popen(
        [str(k.driver), "mount", str(target), options],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**k.env, PAUSE_ENV: "format-intent", TRACE_ENV: str(trace)},
        cwd="/",
    )
    _wait_stopped(proc.pid)
    seen = time.monotonic()
    os.kill(proc.pid, signal.SIGCONT)
    steps: list[str] = []
    while "formatted" not in steps and proc.poll() is None:
        steps = trace.read_text().split()
        time.sleep(0.0005)
    window = time.monotonic() - seen
    out, err = proc.communicate(timeout=120)
    assert_ok(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    steps = trace.read_text().split()
    assert steps[-4:] == ["formatted", "staged", "bound", "done"], steps
    assert_ok(call(k, "unmount", str(target)))
    assert_clean(node_tree)
    return max(window, 0.002)


def kill_during_mkfs(k: Kubelet, target: Path, options: str, delay: float) -> bool | None:
    """Run a first mount, held at ``volume-record`` (right before the format), let it go on,
    and once its mkfs runs wait ``delay`` s and SIGKILL the driver and everything it started
    (a node reboot). Returns whether mkfs was still running when it was killed; ``None`` when
    the mount finished first (no kill)."""
    proc, _ = _start_held(k, target, options)
    try:
        time.sleep(delay)
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGSTOP)
        tree = _tree(proc.pid)
        running = any(c.startswith("mkfs") and s not in ("Z", "X") for c, s in tree.values())
        for pid in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=60)
        # a reboot: nothing of the killed call is left (a killed mkfs may take a moment to
        # let go of the device, and an mkfs still running would refuse the retry's)
        deadline = time.monotonic() + 60
        while any(os.path.exists(f"/proc/{pid}") for pid in tree):
            assert time.monotonic() < deadline, f"killed processes linger: {tree}"
            time.sleep(0.01)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    if out:  # it replied (and may have been killed on its way out): not a crash
        assert_ok(subprocess.CompletedProcess(proc.args, 0, out, err))
        return None
    assert_killed(done)
    return running


@pytest.mark.parametrize("fs", ["ext4", "xfs"])
def test_sigkill_while_mkfs_runs_converges(
    kube: Kubelet,
    node_tree: dict[str, Path],
    fs: str,
) -> None:
    """The issue's failure: a first mount killed while mkfs runs left the new volume refused
    on every retry (``holds data flexhub cannot identify``). Kills spread at random over the
    mkfs window, each on a new volume; the retry of each converges."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    window = mkfs_window(kube, node_tree, fs)
    hits = rounds = 0
    # the hits so far, read before each extra round
    for n, delay in kill_delays(rng, window, ROUNDS, lambda: hits > 0):  # noqa: B023
        rounds += 1
        vol = volume(f"r{n}")
        target, options = new_pod(kube, vol, fs)
        hit = kill_during_mkfs(kube, target, options, delay)
        if hit is None:  # it finished before the kill: a mount like any other
            assert_ok(call(kube, "unmount", str(target)))
            assert_clean(node_tree)
            continue
        hits += hit
        try:
            converges(kube, node_tree, target, options, vol, fs)
        except AssertionError as exc:
            raise AssertionError(f"seed {seed}, round {n}, delay {delay:.4f}s: {exc}") from None
    print(f"{fs}: {hits} of {rounds} kills landed in a {window:.3f} s mkfs (seed {seed})")
    assert hits >= 1, f"no kill landed while mkfs ran (seed {seed})"


@pytest.mark.parametrize("point", CHECKPOINTS)
def test_sigkill_at_each_first_mount_step_xfs(
    kube: Kubelet,
    node_tree: dict[str, Path],
    point: str,
) -> None:
    """Every step of a new xfs volume's first mount (ext4: tests/loopfile/test_crash_e2e.py)."""
    vol = volume("x")
    target, options = new_pod(kube, vol, "xfs")
    assert_killed(call(kube, "mount", str(target), options, crash_at=point))
    converges(kube, node_tree, target, options, vol, "xfs")


def test_finished_format_is_never_redone(
    kube: Kubelet,
    node_tree: dict[str, Path],
) -> None:
    """Once mkfs completed, the intent is gone: data written later over the filesystem's
    signature (anyone's) is refused, never formatted."""
    vol = volume("done")
    target, options = new_pod(kube, vol, "ext4")
    assert_ok(call(kube, "mount", str(target), options))
    assert list((node_tree["state"] / "formats").glob("*")) == []
    assert_ok(call(kube, "unmount", str(target)))
    with image(node_tree, "done").open("r+b") as f:
        f.write(os.urandom(2 * 1024 * 1024))  # the superblock and more: no signature left
    before = image(node_tree, "done").read_bytes()[: 2 * 1024 * 1024]
    again, options = new_pod(kube, vol, "ext4")
    refused = call(kube, "mount", str(again), options)
    assert refused.returncode != 0 and b"cannot identify" in refused.stdout, refused
    assert image(node_tree, "done").read_bytes()[: 2 * 1024 * 1024] == before
    assert_clean(node_tree)


def test_interrupted_format_of_another_file_is_refused(
    kube: Kubelet,
    node_tree: dict[str, Path],
) -> None:
    """A format intent names one device (the backing file's identity): a file holding data
    that is put in its place is refused, never formatted."""
    vol = volume("swap")
    target, options = new_pod(kube, vol, "ext4")
    assert_killed(call(kube, "mount", str(target), options, crash_at="format-intent"))
    assert len(list((node_tree["state"] / "formats").glob("*.json"))) == 1
    path = image(node_tree, "swap")
    for loop in loops_of(path):  # as a reboot does: the file is then free to be replaced
        subprocess.run(["losetup", "--detach", loop], check=True)
    other = path.with_name("other.img")
    other.write_bytes(b"")
    with other.open("r+b") as f:
        f.truncate(path.stat().st_size)
        f.seek(4 * 1024 * 1024)
        f.write(b"somebody's data " * 4096)
    os.replace(other, path)  # same path and size, another inode
    refused = call(kube, "mount", str(target), options)
    assert refused.returncode != 0 and b"cannot identify" in refused.stdout, refused
    with path.open("rb") as f:
        f.seek(4 * 1024 * 1024)
        assert f.read(16) == b"somebody's data "
    assert_ok(call(kube, "unmount", str(target)))
    assert_clean(node_tree)


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_temporaries_of_dead_writers_are_removed(
    kube: Kubelet,
    node_tree: dict[str, Path],
    tmp_path: Path,
) -> None:
    """A state write killed between its temporary and its rename leaves the temporary; the
    next call removes it: only flexhub's own names, only when the writing process is gone,
    never through a symlink."""
    state = node_tree["state"]
    dead, alive = _dead_pid(), os.getpid()
    digest = "ab" * 32
    for sub in ("pods", "volumes", "loopfile/created"):
        (state / sub).mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(state, 0o700)
    os.chmod(state / "loopfile", 0o700)
    gone = [
        state / "pods" / f".{digest}.json.{dead}.tmp",
        state / "volumes" / f".{digest}.json.{dead}.tmp",
        state / "loopfile" / "created" / f".loop7.{dead}.tmp",
    ]
    kept = [
        state / "pods" / f".{digest}.json.{alive}.tmp",  # a live writer's
        state / "volumes" / f".notours.{dead}.tmp",  # not flexhub's name
        state / "loopfile" / "created" / f".loop8.{alive}.tmp",
        state / "volumes" / f".{digest}.json.9999999999.tmp",  # no pid a kernel gives: unknown
    ]
    for path in gone + kept:
        path.write_text("{}")
    precious = tmp_path / "precious"
    precious.write_text("keep")
    link = state / "volumes" / f".{'cd' * 32}.json.{dead}.tmp"
    link.symlink_to(precious)
    target, options = new_pod(kube, volume("t"), "ext4")
    assert_ok(call(kube, "mount", str(target), options))
    assert_ok(call(kube, "unmount", str(target)))
    assert [p for p in gone if os.path.lexists(p)] == []
    assert [p for p in kept if not p.exists()] == []
    assert link.is_symlink() and precious.read_text() == "keep"
    for path in [*kept, link]:
        path.unlink()
    assert_clean(node_tree)
