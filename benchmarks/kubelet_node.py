"""The benchmark's node for ``benchmarks/kubelet.py``: a temporary kubelet-style tree with
the driver installed (:class:`Bench`), the loopfile volumes mounted through it, and the
medians and figures the benchmark prints. Everything it made is unmounted through the
driver and removed when :func:`bench_node` ends."""

from __future__ import annotations

import concurrent.futures
import contextlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from flexhub.admin.harness import DriverReply, Kubelet, go_json
from flexhub.admin.install import install, shim_python

HERE = Path(__file__).resolve().parent
BASHJQ = HERE / "bashjq-driver.sh"
SHELL_MOUNT = HERE / "loopfile-mount.sh"
GiB = 1 << 30
SMALL = "16Mi"


def median_ms(func: Callable[[], object], runs: int) -> float:
    samples = []
    for _ in range(runs):
        started = time.perf_counter()
        func()
        samples.append((time.perf_counter() - started) * 1000)
    return statistics.median(samples)


def paired(
    func: Callable[[], object], reference: Callable[[], object], runs: int
) -> tuple[float, float]:
    """Medians of ``func`` and ``reference``, run alternately so that load drifts hit both."""
    mine: list[float] = []
    theirs: list[float] = []
    for _ in range(runs):
        mine.append(median_ms(func, 1))
        theirs.append(median_ms(reference, 1))
    return statistics.median(mine), statistics.median(theirs)


def run_quiet(argv: list[str]) -> None:
    subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, check=True, cwd="/")


@dataclass
class Figure:
    name: str
    value: float
    reference_name: str
    reference: float
    goal: str
    met: bool
    ratio: bool = True

    def line(self) -> str:
        if self.ratio:
            rel = f"{self.value / self.reference:5.2f}x"
        else:
            rel = f"{self.value - self.reference:+6.1f} ms"
        verdict = "met" if self.met else "NOT met"
        return (
            f"{self.name:<44} {self.value:8.1f} ms | {self.reference_name:<34} "
            f"{self.reference:8.1f} ms | {rel} | goal {self.goal}: {verdict}"
        )


class Bench:
    """A temporary node: config, installed driver, kubelet root, loopfile root."""

    def __init__(self, root: Path, runtime: Path | None = None) -> None:
        self.root = root
        config = root / "flexhub.toml"
        config.write_text(
            f'state_dir = "{root / "state"}"\nlog_dir = "{root / "log"}"\n'
            f'[loopfile]\nroot = "{root / "loop"}"\n'
        )
        self.driver = install(
            root / "plugins", config=config, runtime=str(runtime) if runtime else None
        )
        self.kubelet = Kubelet(driver=self.driver, root=root / "kubelet")
        self.python = self.driver_python()
        # the same interpreter started the same way as the shim starts it
        self.start = [self.python]
        if runtime is not None:
            loader, library = runtime / "lib" / "ld-linux-x86-64.so.2", runtime / "lib"
            self.start = [str(loader), "--library-path", str(library), self.python]
        # with site or not, as the shim starts it (a runtime's without, flexhub.admin.install)
        self.flags = ["-I", "-S"] if " -I -S -c " in self.driver.read_text() else ["-I"]
        self.pods: list[tuple[str, str]] = []  # (pod uid, pv) mounted through the driver
        self.unmount_failures: list[str] = []  # what the driver answered to failed unmounts
        self.counter = 0

    def driver_python(self) -> str:
        return shim_python(self.driver.read_text()) or sys.executable

    def bare_python(self) -> None:
        run_quiet([*self.start, *self.flags, "-c", "pass"])

    def new_volume(self, size: str = SMALL) -> tuple[str, dict[str, str]]:
        self.counter += 1
        pv = f"pv-{self.counter}"
        return pv, {"backend": "loopfile", "file": f"bench/{pv}.img", "size": size}

    def mount(
        self,
        pv: str,
        user: dict[str, str],
        uid: str | None = None,
        call: Callable[..., DriverReply] | None = None,
    ) -> DriverReply:
        """kubelet's mount of ``pv`` into a pod (``uid``, default a new one), through
        ``call`` (default the installed driver, as kubelet calls it)."""
        uid = uid or Kubelet.new_pod_uid()
        options = Kubelet.mount_options(user, pv=pv, pod_uid=uid)
        target = self.kubelet.pod_dir(uid, pv)
        target.mkdir(mode=0o750, parents=True, exist_ok=True)
        reply = (call or self.kubelet.call)("mount", str(target), go_json(options))
        if reply.ok:
            self.pods.append((uid, pv))
        else:
            with contextlib.suppress(OSError):
                target.rmdir()
        return reply

    def unmount_all(self, workers: int = 2) -> int:
        pods, self.pods = self.pods, []
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            replies = list(pool.map(lambda p: self.kubelet.unmount(*p), pods))
        failed = [r.message for r in replies if r is not None and not r.ok]
        self.unmount_failures += failed
        return len(failed)

    def shell_mount(self, name: str, size: int) -> None:
        staging = self.root / "shell" / f"{name}.staging"
        target = self.root / "shell" / f"{name}.pod"
        target.mkdir(parents=True)
        run_quiet(
            [
                "bash",
                str(SHELL_MOUNT),
                str(self.root / "shell" / f"{name}.img"),
                str(size),
                str(staging),
                str(target),
            ]
        )

    def cleanup(self) -> None:
        self.unmount_all()
        shell = self.root / "shell"
        if shell.exists():
            for target in sorted(shell.glob("*.pod")) + sorted(shell.glob("*.staging")):
                subprocess.run(["umount", str(target)], capture_output=True, check=False)
            for image in shell.glob("*.img"):
                listing = subprocess.run(
                    ["losetup", "-j", str(image), "-O", "NAME", "-n"],
                    capture_output=True,
                    text=True,
                    check=False,
                )
                for dev in listing.stdout.split():
                    subprocess.run(["losetup", "-d", dev], capture_output=True, check=False)


@contextlib.contextmanager
def bench_node(runtime: Path | None = None) -> Iterator[Bench]:
    tmp = Path(tempfile.mkdtemp(prefix="flexhub-bench-"))
    bench = Bench(tmp, runtime)
    try:
        yield bench
    finally:
        bench.cleanup()
        shutil.rmtree(tmp, ignore_errors=True)


def must(reply: DriverReply | None, what: str) -> None:
    if reply is not None and not reply.ok:
        raise SystemExit(f"benchmark: {what} failed: {reply.message}")
