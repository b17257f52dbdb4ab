"""What a workload gets through a flexhub loopfile volume, as ratios against the host disk.

Run as root from a checkout where flexhub and flexhub-loopfile are installed, with ``fio``
on the PATH (``.ci/install-system.sh`` installs it)::

    python3 benchmarks/datapath.py [--repeat 3] [--size 1GiB] [--runtime 5]

The same fio jobs (4k random read and write at queue depth 1 and 32, 1 MiB sequential read
and write at queue depth 8, 4k writes with an ``fdatasync`` after each) run on three targets,
all on the filesystem that holds the temporary directory (``TMPDIR`` chooses it):

``host``
    a directory of that filesystem: the physical reference;
``flexhub``
    a loopfile volume whose file lives on that filesystem, mounted through the installed
    driver exactly as kubelet mounts it (``flexhub.admin.harness.Kubelet``; the backend attaches
    with direct I/O, as it does on a node);
``loop-buffered``
    the same file on a loop device attached without direct I/O (what many drivers do),
    mounted directly.

The volume gets the host filesystem's type (ext4 or xfs), so that every target runs the
same filesystem (``--fstype`` overrides it; ``--mount-options`` are the volume's
``mountOptions`` and the loop targets' ``mount -o``). Direct-I/O jobs use ``--direct=1``;
before each job the data file's pages (for a loop target: the backing file's pages as well)
are written back and dropped, so that every job starts cold. Each figure is the median over
``--repeat`` rounds (the targets' order rotates between rounds, so that load drifts hit all
of them), printed with its spread (min-max) and the median of its per-round ratios to
``host``, beside the goal (loopfile volume at least 0.9x the host for sequential jobs, 0.8x
for random and fsync'd small writes); goals are reported, never asserted.

``--also SPEC`` adds a loop target with other settings, to measure what flexhub could set:
SPEC is ``NAME:`` followed by comma-separated ``dio`` (direct I/O on), ``sector=N``
(``losetup --sector-size``) and ``queue.ATTR=VALUE`` (written to
``/sys/block/loopN/queue/ATTR`` after attaching), e.g. ``--also dio-4k:dio,sector=4096``.

``--job NAME`` runs only the named jobs. ``--smoke`` runs every job on every target for a
tenth of a second (CI runs it; about 15 s in all, most of it fio starting). The
benchmark leaves nothing mounted or attached: the volume is unmounted through the driver,
the plain loop devices are detached, and the temporary tree is removed.

``benchmarks/datapath_vm.py`` runs these jobs (``JOBS``, ``Results``) in the VM rig, on NFS
and iSCSI volumes against the guest's own loop device: emulated figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kubelet import Bench

from flexhub.admin.harness import Kubelet

MiB = 1 << 20
DATA = "fio.dat"
GOALS = {"sequential": 0.9, "random": 0.8}
RESERVED = ("host", "flexhub", "loop-buffered")


@dataclass(frozen=True)
class Job:
    """One fio job: its name, its kind (for the goal) and its fio options."""

    name: str
    kind: str  # "random" or "sequential": which goal applies
    rw: str
    bs: str
    iodepth: int
    direct: bool = True
    extra: tuple[str, ...] = ()

    @property
    def unit(self) -> str:
        return "MiB/s" if self.kind == "sequential" else "IOPS"

    def argv(self, data: Path | str, size: int, runtime: str, ramp: str) -> list[str]:
        """fio's command line for this job alone."""
        return ["fio", *self.section(data, size, runtime, ramp), "--output-format=json"]

    def section(self, data: Path | str, size: int, runtime: str, ramp: str) -> list[str]:
        """This job's options, from its ``--name`` on (one job of a fio command line)."""
        engine = "libaio" if self.direct else "sync"
        return [
            f"--name={self.name}",
            f"--filename={data}",
            f"--size={size}",
            f"--rw={self.rw}",
            f"--bs={self.bs}",
            f"--iodepth={self.iodepth}",
            f"--ioengine={engine}",
            f"--direct={int(self.direct)}",
            "--time_based=1",
            f"--runtime={runtime}",
            f"--ramp_time={ramp}",
            "--invalidate=1",
            "--thread",  # with --disk_util=0: half the start-up time of fio
            "--disk_util=0",
            *self.extra,
        ]


def batch_argv(
    jobs: Sequence[Job], data: Path | str, size: int, runtime: str, ramp: str
) -> list[str]:
    """One fio command line running ``jobs`` one after the other (``--stonewall``): a
    single fio start-up for all of them, where that start-up costs more than a short job
    (the smoke runs); no page cache is dropped between them."""
    argv = ["fio", "--output-format=json"]
    for job in jobs:
        argv += [*job.section(data, size, runtime, ramp), "--stonewall"]
    return argv


def prepare_argv(data: Path | str, size: int) -> list[str]:
    """fio's command line that writes the data file once, in full, with direct I/O."""
    return [
        "fio",
        "--name=prepare",
        f"--filename={data}",
        f"--size={size}",
        "--rw=write",
        "--bs=1m",
        "--iodepth=8",
        "--ioengine=libaio",
        "--direct=1",
        "--end_fsync=1",
        "--thread",
        "--disk_util=0",
        "--output-format=json",
    ]


JOBS = (
    Job("randread-4k-qd1", "random", "randread", "4k", 1),
    Job("randread-4k-qd32", "random", "randread", "4k", 32),
    Job("randwrite-4k-qd1", "random", "randwrite", "4k", 1),
    Job("randwrite-4k-qd32", "random", "randwrite", "4k", 32),
    Job("seqread-1m-qd8", "sequential", "read", "1m", 8),
    Job("seqwrite-1m-qd8", "sequential", "write", "1m", 8),
    Job("fsync-4k-write", "random", "write", "4k", 1, direct=False, extra=("--fdatasync=1",)),
)


def run(argv: Sequence[str], timeout: float = 600.0) -> str:
    """Run a command (no shell); its output, or exit with a one-line failure."""
    try:
        proc = subprocess.run(
            list(argv),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            check=False,
            cwd="/",
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        raise SystemExit(f"benchmark: {argv[0]} did not finish in {timeout:.0f}s") from None
    if proc.returncode != 0:
        raise SystemExit(f"benchmark: {argv[0]} failed: {(proc.stderr or proc.stdout).strip()}")
    return proc.stdout


def fio_figure(job: Job, output: str, index: int = 0) -> float:
    """IOPS (random jobs) or MiB/s (sequential jobs) of the ``index``-th job of fio's JSON
    output."""
    report = json.loads(output[output.index("{") :])  # fio may print notes before the JSON
    found = report["jobs"][index]
    if found["jobname"] != job.name:
        raise SystemExit(f"benchmark: fio reported {found['jobname']!r} for {job.name!r}")
    side = found["write" if "write" in job.rw else "read"]
    if job.kind == "sequential":
        return float(side["bw_bytes"]) / MiB
    return float(side["iops"])


def drop_pages(path: Path) -> None:
    """Write back and drop the page cache of one file (nobody else's pages are touched)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def unescape(field_text: str) -> str:
    r"""Undo the kernel's octal escapes (``\040``) in a mountinfo field."""
    out, i = [], 0
    while i < len(field_text):
        if field_text[i] == "\\" and field_text[i + 1 : i + 4].isdigit():
            out.append(chr(int(field_text[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field_text[i])
            i += 1
    return "".join(out)


def mount_of(directory: Path) -> tuple[str, str, str]:
    """``(source, fstype, options)`` of the mount at ``directory``."""
    wanted = os.path.realpath(directory)
    found = None
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if unescape(fields[4]) == wanted:
            found = (unescape(tail[1]), tail[0], f"{fields[5]},{tail[2]}")
    if found is None:
        raise SystemExit(f"benchmark: nothing is mounted at {directory}")
    return found


def filesystem_type(directory: Path) -> str:
    """The type of the filesystem holding ``directory`` (its longest mount-point prefix)."""
    path = os.path.realpath(directory)
    best, fstype = "", ""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        point = unescape(left.split()[4])
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, fstype = point, right.split()[0]
    return fstype


def loop_settings(device: str) -> str:
    """What the kernel says about a loop device: direct I/O, block size, queue."""
    name = device.rsplit("/", 1)[-1]
    base = Path("/sys/block") / name

    def read(*parts: str) -> str:
        try:
            return base.joinpath(*parts).read_text().strip()
        except OSError:
            return "?"

    scheduler = read("queue", "scheduler")
    if "[" in scheduler:
        scheduler = scheduler.split("[", 1)[1].split("]", 1)[0]
    return (
        f"{name}: dio={read('loop', 'dio')} logical_block_size="
        f"{read('queue', 'logical_block_size')} scheduler={scheduler} "
        f"nr_requests={read('queue', 'nr_requests')} rotational={read('queue', 'rotational')} "
        f"discard_max_bytes={read('queue', 'discard_max_bytes')}"
    )


@dataclass(frozen=True)
class LoopSpec:
    """How a plain (non-flexhub) loop target attaches its device."""

    name: str
    direct_io: bool = False
    sector_size: int | None = None
    queue: tuple[tuple[str, str], ...] = ()

    @classmethod
    def parse(cls, text: str) -> LoopSpec:
        name, sep, rest = text.partition(":")
        if not sep or not re.fullmatch(r"[a-z0-9][a-z0-9-]{0,13}", name) or name in RESERVED:
            raise argparse.ArgumentTypeError(f"{text!r}: want NAME:SETTING,... (see --help)")
        direct_io, sector, queue = False, None, []
        for item in filter(None, rest.split(",")):
            key, _, value = item.partition("=")
            if key == "dio" and not value:
                direct_io = True
            elif key == "sector" and value.isdigit():
                sector = int(value)
            elif key.startswith("queue.") and key[6:].isidentifier() and value:
                queue.append((key[6:], value))
            else:
                raise argparse.ArgumentTypeError(f"{text!r}: unknown setting {item!r}")
        return cls(name, direct_io, sector, tuple(queue))


@contextlib.contextmanager
def plain_loop(
    spec: LoopSpec, image: Path, fstype: str, options: str, mountpoint: Path
) -> Iterator[str]:
    """Attach ``image`` as ``spec`` says, mount it at ``mountpoint``; undo both afterwards."""
    argv = ["losetup", "--find", "--show", f"--direct-io={'on' if spec.direct_io else 'off'}"]
    if spec.sector_size is not None:
        argv.append(f"--sector-size={spec.sector_size}")
    device = run([*argv, str(image)]).strip()
    mounted = False
    try:
        name = device.rsplit("/", 1)[-1]
        for attr, value in spec.queue:
            setting = Path("/sys/block") / name / "queue" / attr
            try:
                setting.write_text(value)
            except OSError as exc:
                raise SystemExit(f"benchmark: cannot set {setting}: {exc.strerror}") from None
        mountpoint.mkdir(parents=True, exist_ok=True)
        run(["mount", "-t", fstype, *(["-o", options] if options else []), device, str(mountpoint)])
        mounted = True
        yield device
    finally:
        if mounted:
            subprocess.run(["umount", str(mountpoint)], capture_output=True, check=False)
        subprocess.run(["losetup", "-d", device], capture_output=True, check=False)


@dataclass
class Results:
    """figures[job][target] = one value per round; targets in print order. Ratios are to
    ``reference``; the goals are shown for ``goal_target`` (none if it is None); ``label``
    ends every line."""

    targets: list[str]
    figures: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    reference: str = "host"
    goal_target: str | None = "flexhub"
    label: str = ""

    def add(self, job: str, target: str, value: float) -> None:
        self.figures.setdefault(job, {}).setdefault(target, []).append(value)

    def lines(self) -> list[str]:
        out = []
        for job in JOBS:
            if job.name not in self.figures:
                continue
            host = self.figures[job.name][self.reference]
            for target in self.targets:
                values = self.figures[job.name].get(target, [])
                if not values:
                    continue
                median = statistics.median(values)
                text = (
                    f"{job.name:<18} {target:<14} {median:10.1f} {job.unit:<5} "
                    f"(min {min(values):.1f} max {max(values):.1f})"
                )
                if target != self.reference:
                    ratios = [v / h for v, h in zip(values, host, strict=True)]
                    ratio = statistics.median(ratios)
                    text += (
                        f" | {ratio:5.2f}x {self.reference} ({min(ratios):.2f}-{max(ratios):.2f})"
                    )
                    if target == self.goal_target:
                        goal = GOALS[job.kind]
                        verdict = "met" if ratio >= goal else "NOT met"
                        text += f" | goal >= {goal}x: {verdict}"
                out.append(text + self.label)
        return out


@dataclass
class DataPath:
    """One benchmark node: the host directory, the flexhub volume and its plain loop twins."""

    bench: Bench
    size: int
    runtime: str
    ramp: str
    fstype: str
    mount_options: str
    specs: list[LoopSpec]
    selected: tuple[Job, ...] = JOBS
    job_timeout: float = 120.0
    pv: str = "pv-datapath"
    image: Path | None = None

    @property
    def host_dir(self) -> Path:
        return self.bench.root / "host"

    def user_options(self) -> dict[str, str]:
        # room for the data file, the journal and the filesystem's own metadata
        volume = self.size + max(self.size // 4, 64 * MiB)
        options = {
            "backend": "loopfile",
            "file": f"bench/{self.pv}.img",
            "size": str(volume),
            "kubernetes.io/fsType": self.fstype,
        }
        if self.mount_options:
            options["mountOptions"] = self.mount_options
        return options

    def prepare(self, directory: Path) -> None:
        """Write the data file once, in full, so that no job measures allocation."""
        data = directory / DATA
        if data.exists() and data.stat().st_size == self.size:
            return
        run(prepare_argv(data, self.size))

    def jobs(self, directory: Path, results: Results, target: str) -> None:
        self.prepare(directory)
        for job in self.selected:
            drop_pages(directory / DATA)
            if self.image is not None and target != "host":
                drop_pages(self.image)
            argv = job.argv(directory / DATA, self.size, self.runtime, self.ramp)
            # a job runs for ramp + runtime; the rest is fio starting and stopping
            results.add(job.name, target, fio_figure(job, run(argv, self.job_timeout)))

    def host(self, results: Results) -> None:
        self.jobs(self.host_dir, results, "host")

    def flexhub(self, results: Results, notes: list[str]) -> None:
        uid = Kubelet.new_pod_uid()
        reply = self.bench.mount(self.pv, self.user_options(), uid)
        if not reply.ok:
            raise SystemExit(f"benchmark: mount through the driver failed: {reply.message}")
        try:
            target = self.bench.kubelet.pod_dir(uid, self.pv)
            device, fstype, options = mount_of(target)
            image = Path(
                Path("/sys/block", device.rsplit("/", 1)[-1], "loop", "backing_file")
                .read_text()
                .strip()
            )
            if self.image is None:
                self.image = image
                notes.append(f"# flexhub volume: {fstype} ({options}) on {loop_settings(device)}")
                notes.append(f"#   file {image}")
                if os.stat(image.parent).st_dev != os.stat(self.host_dir).st_dev:
                    raise SystemExit("benchmark: the loopfile root is on another filesystem")
            self.jobs(target, results, "flexhub")
        finally:
            failed = self.bench.unmount_all()
            if failed:
                raise SystemExit("benchmark: unmount through the driver failed")

    def loop(self, spec: LoopSpec, results: Results, notes: list[str]) -> None:
        assert self.image is not None, "the flexhub round makes the file"
        mountpoint = self.bench.root / "plain" / spec.name
        with plain_loop(spec, self.image, self.fstype, self.mount_options, mountpoint) as device:
            if not any(note.startswith(f"# {spec.name}:") for note in notes):
                _, fstype, options = mount_of(mountpoint)
                notes.append(f"# {spec.name}: {fstype} ({options}) on {loop_settings(device)}")
            self.jobs(mountpoint, results, spec.name)

    def rounds(self, repeat: int) -> tuple[Results, list[str]]:
        results = Results(["host", "flexhub", *(spec.name for spec in self.specs)])
        notes: list[str] = []
        self.host_dir.mkdir(exist_ok=True)
        steps = ["host", "flexhub", *(spec.name for spec in self.specs)]
        for number in range(repeat):
            shift = number % len(steps)
            order = steps[shift:] + steps[:shift]
            if self.image is None:  # the first round makes the file before a loop target
                order.remove("flexhub")
                order.insert(0, "flexhub")
            started = time.monotonic()
            for step in order:
                if step == "host":
                    self.host(results)
                elif step == "flexhub":
                    self.flexhub(results, notes)
                else:
                    self.loop(next(s for s in self.specs if s.name == step), results, notes)
            print(
                f"# round {number + 1}/{repeat} ({' '.join(order)}): "
                f"{time.monotonic() - started:.0f}s",
                flush=True,
            )
        return results, notes


def size_bytes(text: str) -> int:
    units = {"KiB": 1 << 10, "MiB": MiB, "GiB": 1 << 30}
    for suffix, factor in units.items():
        if text.endswith(suffix) and text[: -len(suffix)].isdigit():
            return int(text[: -len(suffix)]) * factor
    if text.isdigit():
        return int(text)
    raise argparse.ArgumentTypeError(f"{text!r}: want a size like 512MiB or 1GiB")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3, help="rounds over every target")
    parser.add_argument("--size", type=size_bytes, default=1 << 30, help="fio data file")
    parser.add_argument("--runtime", type=float, default=5.0, help="seconds per job")
    parser.add_argument("--ramp", type=float, default=1.0, help="unmeasured seconds per job")
    parser.add_argument("--fstype", help="volume filesystem (default: the host's)")
    parser.add_argument("--mount-options", default="", help="the volume's mountOptions")
    parser.add_argument(
        "--also",
        type=LoopSpec.parse,
        action="append",
        default=[],
        metavar="NAME:SETTINGS",
        help="another loop target (see above)",
    )
    parser.add_argument(
        "--job",
        action="append",
        choices=[job.name for job in JOBS],
        help="run only this job (repeatable; default: all)",
    )
    parser.add_argument("--smoke", action="store_true", help="a few seconds in all, for CI")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("benchmark: needs root (loop devices and mounts)", file=sys.stderr)
        return 2
    if shutil.which("fio") is None:
        print("benchmark: fio is not installed (.ci/install-system.sh)", file=sys.stderr)
        return 2
    repeat, size, runtime, ramp = args.repeat, args.size, args.runtime, args.ramp
    if repeat < 1 or runtime < 0.01 or ramp < 0 or size < MiB:
        parser.error("want --repeat >= 1, --runtime >= 0.01, --ramp >= 0, --size >= 1MiB")
    if args.smoke:
        repeat, size, runtime, ramp = 1, 8 * MiB, 0.1, 0.0
    base = Path(tempfile.gettempdir())
    host_fs = filesystem_type(base)
    fstype = args.fstype or host_fs
    if fstype not in ("ext4", "xfs"):
        print(f"benchmark: {base} is {host_fs!r}; pass --fstype ext4 or xfs", file=sys.stderr)
        return 2
    specs = [LoopSpec("loop-buffered"), *args.also]
    if len({spec.name for spec in specs}) != len(specs):
        parser.error("every --also needs a name of its own")
    print(
        f"# flexhub data-path benchmark, {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} "
        f"cpus, {run(['fio', '--version']).strip()}, {os.uname().release}; host {base} "
        f"({host_fs}), volumes {fstype}; data file {size // MiB} MiB, {runtime:g}s "
        f"(+{ramp:g}s ramp) per job, medians of {repeat} round(s)"
    )
    # SIGTERM unwinds like Ctrl-C: the finally clauses unmount and detach what is ours
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    tmp = Path(tempfile.mkdtemp(prefix="flexhub-bench-"))
    bench = Bench(tmp)
    try:
        node = DataPath(
            bench,
            size,
            f"{int(runtime * 1000)}ms",
            f"{int(ramp * 1000)}ms",
            fstype,
            args.mount_options,
            specs,
            tuple(job for job in JOBS if not args.job or job.name in args.job),
            job_timeout=runtime + ramp + 120.0,
        )
        results, notes = node.rounds(repeat)
        for note in notes:
            print(note)
        for line in results.lines():
            print(line)
    finally:
        bench.cleanup()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
