"""``flexhub demo``: what kubelet makes flexhub do, for real, with no cluster.

It installs the driver into a temporary kubelet-style tree and replays kubelet's calls
(``kubelet-contract.md`` §8a, with kubelet's own JSON and directory handling) for one loopfile
PV: pod A mounts and writes, pod B mounts the same volume and reads, A and B unmount, pod C
mounts and finds the data, the volume grows online, everything is cleaned up.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from flexhub.admin.harness import DriverReply, Kubelet, go_json
from flexhub.admin.install import install

__all__ = ["run_demo"]

PV = "pv-demo"
MiB = 1024 * 1024


class _Demo:
    def __init__(self, root: Path, fs_type: str, out: Callable[[str], None]) -> None:
        self.root = root
        self.out = out
        self.fs_type = fs_type
        self.calls = 0
        self.failures: list[str] = []
        config = root / "flexhub.toml"
        config.write_text(
            f'state_dir = "{root / "state"}"\nlog_dir = "{root / "log"}"\n'
            f'[loopfile]\nroot = "{root / "loopfiles"}"\n'
        )
        self.driver = install(root / "plugins", config=config)
        self.kubelet = Kubelet(driver=self.driver, root=root / "kubelet")
        self.user = {"backend": "loopfile", "file": "demo/volume.img", "size": "512Mi"}

    def show(self, who: str, what: str, reply: DriverReply | None, seconds: float) -> bool:
        self.calls += 1
        what = what.replace(str(self.root), "$T")
        if reply is None:
            self.out(f"  {who}: {what} -> skipped by kubelet (already mounted / gone)")
            return True
        body = json.dumps(reply.reply, separators=(",", ":"))
        self.out(f"  {who}: {what}\n      <- exit {reply.returncode} {body}  ({seconds:.2f}s)")
        if not reply.ok:
            self.failures.append(f"{who} {what}: {reply.message}")
        return reply.ok

    def timed(self, func: Callable[[], DriverReply | None]) -> tuple[DriverReply | None, float]:
        started = time.monotonic()
        reply = func()
        return reply, time.monotonic() - started

    def mount(self, who: str, uid: str) -> bool:
        options = Kubelet.mount_options(
            self.user, pv=PV, pod_uid=uid, pod_name=who, fs_type=self.fs_type
        )
        target = self.kubelet.pod_dir(uid, PV)
        reply, secs = self.timed(lambda: self.kubelet.mount(uid, PV, options))
        return self.show(who, f"mount {target} '{go_json(options)}'", reply, secs)

    def unmount(self, who: str, uid: str) -> bool:
        target = self.kubelet.pod_dir(uid, PV)
        reply, secs = self.timed(lambda: self.kubelet.unmount(uid, PV))
        return self.show(who, f"unmount {target}", reply, secs)

    def check(self, ok: bool, text: str) -> bool:
        self.out(f"  {'ok' if ok else 'FAILED'}: {text}")
        if not ok:
            self.failures.append(text)
        return ok

    def run(self) -> bool:
        k = self.kubelet
        self.out(f"T={self.root}\ndriver installed: {self.driver}")
        reply, secs = self.timed(k.init)
        if not self.show("kubelet", "init", reply, secs):
            return False
        a, b, c = (k.new_pod_uid() for _ in range(3))
        if not self.mount("pod-a", a):
            return False
        (k.pod_dir(a, PV) / "hello.txt").write_text("written by pod-a\n")
        self.check(True, "pod-a wrote hello.txt")
        if not self.mount("pod-b", b):
            return False
        seen = (k.pod_dir(b, PV) / "hello.txt").read_text()
        self.check(seen == "written by pod-a\n", f"pod-b reads pod-a's file: {seen.strip()!r}")
        self.unmount("pod-a", a)
        self.unmount("pod-b", b)
        if not self.mount("pod-c", c):
            return False
        target_c = k.pod_dir(c, PV)
        hello = target_c / "hello.txt"
        self.check(
            hello.exists() and hello.read_text() == "written by pod-a\n",
            "pod-c finds the data after every pod went away",
        )
        before = _fs_bytes(target_c)
        new_size = 1024 * MiB
        # kubelet sends the PV's options unchanged; the new size comes as an argument
        options = Kubelet.base_options(self.user, pv=PV, fs_type=self.fs_type)
        reply2, secs = self.timed(lambda: k.expandfs(c, PV, options, new_size, 512 * MiB))
        self.show(
            "kubelet",
            f"expandfs '{go_json(options)}' '' {target_c} {new_size} {512 * MiB}",
            reply2,
            secs,
        )
        after = _fs_bytes(target_c)
        self.check(after > before, f"df inside pod-c: {before // MiB} MiB -> {after // MiB} MiB")
        self.unmount("pod-c", c)
        return not self.failures


def _fs_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_blocks * st.f_frsize


def _leftovers(root: Path) -> list[str]:
    text = Path("/proc/self/mountinfo").read_text()
    mounts = [line.split()[4] for line in text.splitlines() if str(root) in line.split()[4]]
    loops = subprocess.run(
        ["losetup", "--list", "--noheadings", "--output", "NAME,BACK-FILE"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    return mounts + [line.split()[0] for line in loops.splitlines() if str(root) in line]


def run_demo(
    keep: bool = False, fs_type: str = "xfs", out: Callable[[str], None] | None = None
) -> int:
    """Run the demo; returns the exit code (0 when every step worked and nothing is left)."""
    write = out or (lambda text: print(text, flush=True))
    if os.geteuid() != 0:
        write(
            "flexhub demo needs root: it attaches loop devices and mounts filesystems "
            "(run it as root or with sudo)"
        )
        return 1
    root = Path(tempfile.mkdtemp(prefix="flexhub-demo-"))
    write(
        f"flexhub demo: replaying kubelet's FlexVolume calls for loopfile PV {PV!r} "
        f"({fs_type}) in {root}"
    )
    demo = _Demo(root, fs_type, write)
    try:
        demo.run()
    except Exception as exc:  # report, then still clean up
        demo.failures.append(f"{type(exc).__name__}: {exc}")
    finally:
        for uid_dir in sorted((root / "kubelet" / "pods").glob("*")):
            target = uid_dir / "volumes" / demo.kubelet.driver_dir_name / PV
            if target.exists():
                demo.kubelet.call("unmount", str(target))
    left = _leftovers(root)
    if left:
        demo.failures.append(f"left behind: {', '.join(left)}")
    if not keep and not left:
        shutil.rmtree(root, ignore_errors=True)
    write("")
    write(
        f"summary: {demo.calls} kubelet calls, {len(demo.failures)} problem(s); "
        f"{'nothing left mounted or attached' if not left else 'LEFT BEHIND: ' + ', '.join(left)}"
        + (f"; tree kept at {root}" if keep else "")
    )
    for failure in demo.failures:
        write(f"  problem: {failure}")
    return 0 if not demo.failures else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run_demo())
