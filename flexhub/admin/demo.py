"""``flexhub demo``: what kubelet makes flexhub do, for real, with no cluster.

It installs the driver into a temporary kubelet-style tree and replays kubelet's calls (in
its volume manager's order, with kubelet's own JSON and directory handling) for one loopfile
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
from flexhub.node.fs import SUPPORTED_FS_TYPES

__all__ = ["run_demo"]

PV = "pv-demo"
MiB = 1024 * 1024


#: The steps, for the ``[n/N]`` progress (each is one kubelet call).
STEPS = 8
#: Widest line the demo prints (a terminal's 80 columns, less a margin).
WIDTH = 78
#: The bit of CAP_SYS_RESOURCE in /proc/self/status's capability masks.
CAP_SYS_RESOURCE = 24


class _Paint:
    """ANSI colour when stdout is a terminal (and ``NO_COLOR`` is not set), none otherwise."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def __call__(self, text: str, colour: str) -> str:
        codes = {"green": "32", "red": "31", "dim": "2", "bold": "1"}
        return f"\x1b[{codes[colour]}m{text}\x1b[0m" if self.enabled else text


class _Demo:
    def __init__(
        self, root: Path, fs_type: str, out: Callable[[str], None], paint: _Paint, verbose: bool
    ) -> None:
        self.root = root
        self.out = out
        self.paint = paint
        self.verbose = verbose
        self.fs_type = fs_type
        self.calls = 0
        self.passed = 0
        self.failures: list[str] = []
        config = root / "flexhub.toml"
        config.write_text(
            f'state_dir = "{root / "state"}"\nlog_dir = "{root / "log"}"\n'
            f'[loopfile]\nroot = "{root / "loopfiles"}"\n'
        )
        self.driver = install(root / "plugins", config=config)
        self.kubelet = Kubelet(driver=self.driver, root=root / "kubelet")
        self.user = {"backend": "loopfile", "file": "demo/volume.img", "size": "512Mi"}

    def _wrapped(self, text: str, indent: str) -> None:
        import textwrap

        for line in textwrap.wrap(text, WIDTH - len(indent), break_on_hyphens=False) or [""]:
            self.out(indent + line)

    def show(self, title: str, call: str, reply: DriverReply | None, seconds: float) -> bool:
        """One progress line per call: ``[n/N] title .... ok 0.26s``, and why it failed."""
        self.calls += 1
        head = f"[{self.calls}/{STEPS}] {title}"
        ok = reply is None or reply.ok
        plain = "ok" if ok else "FAILED"
        status = self.paint(plain, "green" if ok else "red")
        timing = f"{seconds:5.2f}s" if reply is not None else "skipped"
        pad = max(WIDTH - len(head) - len(plain) - len(timing) - 1, 1)
        self.out(f"{head}{' ' * pad}{status} {timing}")
        if self.verbose and reply is not None:  # whole lines: JSON cut at a width is no JSON
            self.out("      $ " + call.replace(str(self.root), "$T"))
            self.out("      <- " + json.dumps(reply.reply, separators=(",", ":")))
        if reply is not None and not reply.ok:
            self._wrapped(reply.message, "      ")
            self.failures.append(f"{title}: {reply.message}")
        else:
            self.passed += 1
        return ok

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
        return self.show(f"{who} mounts {PV}", f"mount {target} '{go_json(options)}'", reply, secs)

    def unmount(self, who: str, uid: str) -> bool:
        target = self.kubelet.pod_dir(uid, PV)
        reply, secs = self.timed(lambda: self.kubelet.unmount(uid, PV))
        return self.show(f"{who} unmounts", f"unmount {target}", reply, secs)

    def check(self, ok: bool, text: str) -> bool:
        mark = self.paint("ok", "green") if ok else self.paint("FAILED", "red")
        self._wrapped(f"{text}: {mark}", "      ")
        if not ok:
            self.failures.append(text)
        return ok

    def run(self) -> bool:
        k = self.kubelet
        reply, secs = self.timed(k.init)
        if not self.show("init (kubelet probes the driver)", "init", reply, secs):
            return False
        a, b, c = (k.new_pod_uid() for _ in range(3))
        if not self.mount("pod-a", a):
            return False
        (k.pod_dir(a, PV) / "hello.txt").write_text("written by pod-a\n")
        self.check(True, "pod-a writes hello.txt")
        if not self.mount("pod-b", b):
            return False
        seen = (k.pod_dir(b, PV) / "hello.txt").read_text()
        self.check(seen == "written by pod-a\n", "pod-b reads pod-a's file")
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
            "expandfs: grow to 1 GiB online",
            f"expandfs '{go_json(options)}' '' {target_c} {new_size} {512 * MiB}",
            reply2,
            secs,
        )
        after = _fs_bytes(target_c)
        self.check(after > before, f"df in pod-c: {before // MiB} MiB -> {after // MiB} MiB")
        self.unmount("pod-c", c)
        return not self.failures

    def cause(self) -> str:
        """The plain reason of a failure the demo knows, or ``""``."""
        text = " ".join(self.failures)
        if (
            self.fs_type.startswith("ext")
            and "Permission denied to resize" in text
            and lacks_capability(CAP_SYS_RESOURCE)
        ):
            return (
                f"{self.fs_type} grows online only with CAP_SYS_RESOURCE, which this "
                "process lacks (a container without it?); kubelet has it on a node, so "
                "there the resize works. Here, use --fs-type xfs."
            )
        return ""


def lacks_capability(bit: int, status: Path = Path("/proc/self/status")) -> bool:
    """Whether this process's effective capabilities lack capability number ``bit``."""
    try:
        for line in status.read_text().splitlines():
            if line.startswith("CapEff:"):
                return not int(line.split()[1], 16) & (1 << bit)
    except (OSError, ValueError, IndexError):
        pass
    return False


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
    keep: bool = False,
    fs_type: str = "xfs",
    out: Callable[[str], None] | None = None,
    *,
    verbose: bool = False,
    colour: bool | None = None,
) -> int:
    """Run the demo; returns the exit code (0 when every step worked and nothing is left).

    :param colour: ANSI colours; by default when stdout is a terminal and ``NO_COLOR`` unset.
    """
    write = out or (lambda text: print(text, flush=True))
    if fs_type not in SUPPORTED_FS_TYPES:
        made = ", ".join(sorted(SUPPORTED_FS_TYPES))
        made = made[: made.rfind(", ")] + " or" + made[made.rfind(",") + 1 :]
        write(f"flexhub demo: --fs-type {fs_type[:40]} is not one it makes: use {made}")
        return 1
    if os.geteuid() != 0:
        write(
            "flexhub demo needs root: it attaches loop devices and mounts filesystems "
            "(run it as root or with sudo)"
        )
        return 1
    if colour is None:
        colour = out is None and sys.stdout.isatty() and not os.environ.get("NO_COLOR")
    paint = _Paint(colour)
    root = Path(tempfile.mkdtemp(prefix="flexhub-demo-"))
    write(paint(f"flexhub demo: kubelet's calls for a loopfile volume ({fs_type})", "bold"))
    write(f"  in {root}" + ("" if keep else " (removed at the end)"))
    write("")
    demo = _Demo(root, fs_type, write, paint, verbose)
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
    verdict = paint("ok", "green") if not demo.failures else paint("FAILED", "red")
    write(f"summary: {verdict}: {demo.passed} of {demo.calls} kubelet calls ok")
    write("  " + ("nothing left mounted or attached" if not left else "LEFT BEHIND (see below)"))
    if keep:
        write(f"  tree kept at {root}")
    cause = demo.cause()
    if cause:
        demo._wrapped(f"cause: {cause}", "  ")
    elif demo.failures:
        for failure in demo.failures:
            demo._wrapped(f"problem: {failure}", "  ")
    return 0 if not demo.failures else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run_demo())
