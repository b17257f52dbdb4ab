"""What kubelet pays per call, as ratios against references measured in the same run.

Run as root from a checkout where flexhub and flexhub-loopfile are installed::

    python3 benchmarks/kubelet.py [--runs 15] [--volumes 1000]

It installs the driver into a temporary kubelet-style tree and calls it exactly as kubelet
does (``flexhub.admin.harness.Kubelet``: argv list, stdin /dev/null, stderr merged, bare
environment, cwd /). Every figure is a median of ``--runs`` samples, printed beside its
reference and the ratio, with the goal of issue 14 (of issue 23 for a second pod's and a
first ``mount``); the goals are reported, never asserted. It asserts nothing and leaves
nothing mounted or attached (everything it made is unmounted through the driver, then the
tree is removed).

``--smoke`` runs every figure with tiny counts (CI runs it to keep the command working).
``--runtime DIR`` measures through a relocatable runtime (``deploy/build_runtime.py``), as
the DaemonSet installs it; "bare python" is then that runtime's interpreter started the same
way (its own loader and library path).

``--profile CALL`` (``init``, ``unmount``, ``mounted``, ``second``, ``first`` or ``all``)
prints, instead of the figures, where one call kind's time goes: each of ``--runs`` rounds
(default 5) times the call as kubelet makes it, then runs it twice under cProfile, started
with the shim's argv, environment, stdin and cwd: as it is (its imports' cumulative time is
reported) and with the modules that call loads imported before the profiler starts, whose
profile, by own time and by flexhub's functions' cumulative time, is the call's own work.
Only the main thread is profiled (a thread's work shows as the main thread's wait for it).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import marshal
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from flexhub.admin.harness import DriverReply, Kubelet, go_json, parse_reply
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
        self.pods: list[tuple[str, str]] = []  # (pod uid, pv) mounted through the driver
        self.unmount_failures: list[str] = []  # what the driver answered to failed unmounts
        self.counter = 0

    def driver_python(self) -> str:
        return shim_python(self.driver.read_text()) or sys.executable

    def bare_python(self) -> None:
        run_quiet([*self.start, "-I", "-c", "pass"])

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


def per_call(bench: Bench, runs: int) -> tuple[list[Figure], dict[str, float]]:
    k = bench.kubelet
    bare_name = "bare python -I -c pass"
    figures = []
    init, bare = paired(k.init, bench.bare_python, runs)
    figures.append(Figure("init", init, bare_name, bare, "<= 1.2x", init <= 1.2 * bare))
    gone = str(bench.root / "kubelet" / "pods" / "none" / "volumes" / "k8s~flexhub" / "x")
    unmount, bare = paired(
        lambda: must(k.call("unmount", gone), "unmount"), bench.bare_python, runs
    )
    figures.append(
        Figure(
            "unmount (directory not mounted)",
            unmount,
            bare_name,
            bare,
            "<= 1.2x",
            unmount <= 1.2 * bare,
        )
    )

    pv, user = bench.new_volume()
    uid = Kubelet.new_pod_uid()
    must(bench.mount(pv, user, uid), "first mount")
    target = str(k.pod_dir(uid, pv))
    raw = go_json(Kubelet.mount_options(user, pv=pv, pod_uid=uid))
    again, bashjq = paired(
        lambda: must(k.call("mount", target, raw), "idempotent mount"),
        lambda: run_quiet(["bash", str(BASHJQ), "mount", target, raw]),
        runs,
    )
    figures.append(
        Figure(
            "mount of an already-mounted directory",
            again,
            "bash+jq driver (5 jq, findmnt)",
            bashjq,
            "<= 0.5x",
            again <= 0.5 * bashjq,
        )
    )
    second, bare = paired(
        lambda: must(bench.mount(pv, user), "second pod's mount"), bench.bare_python, runs
    )
    figures.append(
        Figure(
            "second pod's mount of a staged volume",
            second,
            bare_name,
            bare,
            "<= 3x",
            second <= 3 * bare,
        )
    )

    first: list[float] = []
    shell: list[float] = []
    for i in range(runs):
        pv_new, user_new = bench.new_volume("1Gi")
        first.append(median_ms(lambda v=(pv_new, user_new): must(bench.mount(*v), "mount"), 1))  # type: ignore[misc]
        shell.append(median_ms(lambda i=i: bench.shell_mount(f"s{i}", GiB), 1))  # type: ignore[misc]
    first_ms, shell_ms = statistics.median(first), statistics.median(shell)
    figures.append(
        Figure(
            "first mount of a new 1 GiB loopfile",
            first_ms,
            "the same commands in sh",
            shell_ms,
            "<= +60 ms",
            first_ms - shell_ms <= 60,
            ratio=False,
        )
    )
    new_small = median_ms(lambda: must(bench.mount(*bench.new_volume()), "new volume"), runs)
    baseline = {"init": init, "idempotent": again, "new": new_small, "bare": bare}
    return figures, baseline


def with_volumes(bench: Bench, runs: int, volumes: int, empty: dict[str, float]) -> list[Figure]:
    k = bench.kubelet
    started = time.monotonic()
    news = [bench.new_volume() for _ in range(volumes)]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        replies = list(pool.map(lambda v: bench.mount(*v), news))
    failed = sum(1 for r in replies if not r.ok)
    print(
        f"# populated {volumes} volumes in {time.monotonic() - started:.0f}s "
        f"({failed} failed); {len(bench.pods)} pod mounts on the node"
    )
    pv, user = news[len(news) // 2]
    uid = Kubelet.new_pod_uid()
    must(bench.mount(pv, user, uid), "mount")
    target = str(k.pod_dir(uid, pv))
    raw = go_json(Kubelet.mount_options(user, pv=pv, pod_uid=uid))
    init = median_ms(k.init, runs)
    again = median_ms(lambda: must(k.call("mount", target, raw), "idempotent mount"), runs)
    new = median_ms(lambda: must(bench.mount(*bench.new_volume()), "new volume"), runs)
    n = f"{volumes} volumes"
    return [
        Figure(
            f"init, {n}",
            init,
            "init, empty node",
            empty["init"],
            "<= 1.1x",
            init <= 1.1 * empty["init"],
        ),
        Figure(
            f"idempotent mount, {n}",
            again,
            "idempotent mount, empty node",
            empty["idempotent"],
            "<= 1.1x",
            again <= 1.1 * empty["idempotent"],
        ),
        Figure(
            f"new volume's mount, {n}",
            new,
            "new volume's mount, empty node",
            empty["new"],
            "<= 1.2x",
            new <= 1.2 * empty["new"],
        ),
    ]


def concurrency(bench: Bench, count: int, pods: int) -> list[str]:
    lines = []
    walls = {}
    for workers in (1, 2):
        news = [bench.new_volume() for _ in range(count)]
        started = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            replies = list(pool.map(lambda v: bench.mount(*v), news))
        walls[workers] = time.perf_counter() - started
        failed = sum(1 for r in replies if not r.ok)
        lines.append(
            f"{workers} worker(s) mounting {count} new volumes: {walls[workers]:.2f}s, "
            f"{count / walls[workers]:.1f} mounts/s, {failed} failed"
        )
        bench.unmount_all()
    speedup = walls[1] / walls[2]
    lines.append(
        f"throughput 2 workers / 1 worker: {speedup:.2f}x | goal >= 1.6x: "
        f"{'met' if speedup >= 1.6 else 'NOT met'}"
    )
    volumes = [bench.new_volume() for _ in range(max(1, pods // 4))]
    plan = [volumes[i % len(volumes)] for i in range(pods)]
    with concurrent.futures.ThreadPoolExecutor(pods) as pool:
        replies = list(pool.map(lambda v: bench.mount(*v), plan))
    mount_failed = [r.message for r in replies if not r.ok]
    unmount_failed = bench.unmount_all(workers=pods)
    lines.append(
        f"{pods} pods over {len(volumes)} volumes at once: {len(mount_failed)} mount and "
        f"{unmount_failed} unmount failures | goal 0: "
        f"{'met' if not mount_failed and not unmount_failed else 'NOT met'}"
    )
    lines.extend(f"  mount failure: {m}" for m in sorted(set(mount_failed))[:5])
    return lines


# --- --profile CALL: where one call kind's time goes --------------------------------------

#: Run in place of the shim's bootstrap (``flexhub.admin.install``): the same ``main()``, under
#: ``_lsprof`` (nothing else is imported before the profiler starts), after importing first the
#: modules listed in the file named by its second argument (if not empty). It writes the stats
#: (pstats' form) to the file named by its first argument, and the modules the call loaded
#: (those not loaded when the interpreter started) to that name + ``.modules``, and the CPU
#: time (user and system, s) of the process and of the commands it ran to that name + ``.cpu``.
PROFILE_BOOTSTRAP = """import sys, _lsprof, resource
out, preload = sys.argv.pop(1), sys.argv.pop(1)
started = set(sys.modules)
if preload:
    import importlib
    for name in open(preload).read().split():
        try:
            importlib.import_module(name)
        except BaseException:
            pass
def cpu(who):
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime
before = cpu(resource.RUSAGE_SELF), cpu(resource.RUSAGE_CHILDREN)
profiler = _lsprof.Profiler()
profiler.enable()
try:
    from flexhub.__main__ import main
    code = main()
finally:
    profiler.disable()
    spent = cpu(resource.RUSAGE_SELF) - before[0], cpu(resource.RUSAGE_CHILDREN) - before[1]
    loaded = [name for name in sys.modules if name not in started]
    import cProfile, marshal, types
    holder = types.SimpleNamespace(getstats=profiler.getstats)
    cProfile.Profile.snapshot_stats(holder)
    with open(out, "wb") as f:
        marshal.dump(holder.stats, f)
    with open(out + ".modules", "w") as f:
        f.write("\\n".join(loaded))
    with open(out + ".cpu", "w") as f:
        f.write("%f %f" % spent)
sys.exit(code)"""

PROFILE_CALLS = {
    "init": "init",
    "unmount": "unmount (directory not mounted)",
    "mounted": "mount of an already-mounted directory",
    "second": "second pod's mount of a staged volume",
    "first": "first mount of a new 1 GiB loopfile",
}
Call = Callable[..., DriverReply]
Func = tuple[str, int, str]  # pstats' key: file, line, function


def profiled(bench: Bench, out: Path, preload: Path | None) -> Call:
    """A call like ``Kubelet.call`` (argv, environment, stdin and cwd as the shim gives the
    driver), run under the profiler: its stats go to ``out``."""

    def call(*args: str) -> DriverReply:
        argv = [*bench.start, "-I", "-c", PROFILE_BOOTSTRAP, str(out), str(preload or "")]
        env = dict(bench.kubelet.env, FLEXHUB_CONFIG=str(bench.root / "flexhub.toml"))
        proc = subprocess.run(
            [*argv, *args],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            env=env,
            cwd="/",
            timeout=600,
            check=False,
        )
        if not out.exists():
            error = proc.stderr.decode(errors="replace")[-800:]
            raise SystemExit(f"benchmark: the profiled {args[0]} wrote no profile: {error}")
        return DriverReply([*argv, *args], proc.returncode, proc.stdout, parse_reply(proc.stdout))

    return call


def call_kind(bench: Bench, kind: str) -> Callable[[Call | None], None]:
    """One call of ``kind`` (a key of :data:`PROFILE_CALLS`) through a given ``call``
    (``None``: the installed driver), the node set up for it first."""
    k = bench.kubelet
    if kind == "init":
        return lambda call: must((call or k.call)("init"), "init")
    if kind == "unmount":
        gone = str(bench.root / "kubelet" / "pods" / "none" / "volumes" / "k8s~flexhub" / "x")
        return lambda call: must((call or k.call)("unmount", gone), "unmount")
    if kind == "first":
        return lambda call: must(bench.mount(*bench.new_volume("1Gi"), call=call), "mount")
    pv, user = bench.new_volume()
    uid = Kubelet.new_pod_uid()
    must(bench.mount(pv, user, uid), "first mount")
    if kind == "second":
        return lambda call: must(bench.mount(pv, user, call=call), "second pod's mount")
    target = str(k.pod_dir(uid, pv))
    raw = go_json(Kubelet.mount_options(user, pv=pv, pod_uid=uid))
    return lambda call: must((call or k.call)("mount", target, raw), "idempotent mount")


def label(func: Func) -> str:
    filename, line, name = func
    if filename == "~":
        return name  # a built-in: <built-in method posix.fsync>
    for prefix in ("site-packages/", f"{HERE.parent}/", "/lib/python3.11/"):
        filename = filename.rsplit(prefix, 1)[-1]
    return f"{filename}:{line}({name})"


Row = tuple[float, float, float]  # calls, own time, cumulative time (s)


def children_cpu_ms() -> float:
    """CPU time (user and system) of every process this one has waited for, and theirs."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (usage.ru_utime + usage.ru_stime) * 1000


def read_profile(path: Path) -> dict[Func, Row]:
    """A profile written by :data:`PROFILE_BOOTSTRAP`: each function's calls, own and
    cumulative time (the file is the driver's, in the benchmark's own 0700 directory)."""
    stats: dict[Func, tuple[int, int, float, float, object]]
    stats = marshal.loads(path.read_bytes())  # noqa: S302
    return {func: (float(nc), tt, ct) for func, (_cc, nc, tt, ct, _callers) in stats.items()}


def medians(profiles: list[dict[Func, Row]]) -> dict[Func, Row]:
    """Per function, the median over the rounds of each column (0 in a round that did not
    call it): robust to one round's preemption on a loaded machine, as a sum is not."""
    funcs = {func for profile in profiles for func in profile}
    zero = (0.0, 0.0, 0.0)
    return {
        func: (
            statistics.median(p.get(func, zero)[0] for p in profiles),
            statistics.median(p.get(func, zero)[1] for p in profiles),
            statistics.median(p.get(func, zero)[2] for p in profiles),
        )
        for func in funcs
    }


def profile_lines(bench: Bench, kind: str, rounds: int, top: int = 12) -> list[str]:
    """Each round: the call as kubelet makes it (timed), then under the profiler twice: as it
    is, and with the modules that call loaded first (what is left is the call's own work).
    Every figure is a median over the rounds, in ms per call."""
    once = call_kind(bench, kind)
    once(None)  # the page cache and the node's state as on a node that has seen the call
    walls: list[float] = []
    cpus: list[float] = []
    full: list[dict[Func, Row]] = []
    warm: list[dict[Func, Row]] = []
    for i in range(rounds):
        before = children_cpu_ms()
        walls.append(median_ms(lambda: once(None), 1))
        cpus.append(children_cpu_ms() - before)
        cold_out, warm_out = bench.root / f"{kind}-{i}.full", bench.root / f"{kind}-{i}.warm"
        once(profiled(bench, cold_out, None))
        once(profiled(bench, warm_out, Path(f"{cold_out}.modules")))
        full.append(read_profile(cold_out))
        warm.append(read_profile(warm_out))

    def total(profile: dict[Func, Row]) -> float:
        return sum(row[1] for row in profile.values()) * 1000

    def imports(profile: dict[Func, Row]) -> float:
        return 1000 * sum(
            row[2]
            for func, row in profile.items()
            if func[0] == "<frozen importlib._bootstrap>" and func[2] == "_find_and_load"
        )

    modules = len(Path(f"{bench.root}/{kind}-0.full.modules").read_text().split())
    commands = [
        float(Path(f"{bench.root}/{kind}-{i}.warm.cpu").read_text().split()[1]) * 1000
        for i in range(rounds)
    ]
    lines = [
        f"## {PROFILE_CALLS[kind]}: medians of {rounds} rounds, ms per call",
        f"wall as kubelet waits (no profiler): {statistics.median(walls):.1f} ms; CPU (the "
        f"shim, the driver and its commands): {statistics.median(cpus):.1f} ms, of which the "
        f"commands {statistics.median(commands):.1f} ms",
        f"under the profiler, main(): {statistics.median(map(total, full)):.1f} ms, of which "
        f"imports ({modules} modules): {statistics.median(map(imports, full)):.1f} ms; "
        f"with those modules loaded first: {statistics.median(map(total, warm)):.1f} ms",
        "  with the modules loaded first, by own time (tottime):",
    ]
    work = medians(warm)
    own = sorted(work.items(), key=lambda item: item[1][1], reverse=True)
    own = [item for item in own if "_lsprof.Profiler" not in item[0][2]][:top]
    lines += [f"  {row[1] * 1000:8.2f} ms {row[0]:5.0f}x  {label(f)}" for f, row in own]
    lines.append("  flexhub's functions, by cumulative time:")
    mine = [item for item in work.items() if "flexhub" in item[0][0]]
    mine.sort(key=lambda item: item[1][2], reverse=True)
    lines += [f"  {row[2] * 1000:8.2f} ms {row[0]:5.0f}x  {label(f)}" for f, row in mine[:top]]
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, help="samples per figure (default 15)")
    parser.add_argument("--volumes", type=int, default=1000, help="volumes on the busy node")
    parser.add_argument("--smoke", action="store_true", help="tiny counts, for CI")
    parser.add_argument(
        "--runtime",
        type=Path,
        help="measure through a relocatable runtime (deploy/build_runtime.py) instead of "
        "this Python",
    )
    parser.add_argument(
        "--profile",
        choices=[*PROFILE_CALLS, "all"],
        help="instead of the figures: where one call kind's time goes, under cProfile "
        "(--runs rounds, default 5)",
    )
    parser.add_argument("--top", type=int, default=12, help="lines per --profile list")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("benchmark: needs root (loop devices and mounts)", file=sys.stderr)
        return 2
    if args.profile:
        kinds = list(PROFILE_CALLS) if args.profile == "all" else [args.profile]
        rounds = 1 if args.smoke else args.runs or 5
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
        print(f"# flexhub call profile, {time.strftime('%Y-%m-%d %H:%M')}, load average {load}")
        with bench_node(args.runtime) as bench:
            print(f"# driver {bench.driver} -> {bench.python}")
            for kind in kinds:
                print("\n".join(profile_lines(bench, kind, rounds, args.top)))
                bench.unmount_all()
            for message in bench.unmount_failures:
                print(f"# unmount failed: {message}")
        return 0
    runs, volumes, count, pods = args.runs or 15, args.volumes, 16, 64
    if args.smoke:
        runs, volumes, count, pods = 2, 4, 2, 8
    print(
        f"# flexhub kubelet-path benchmark, {time.strftime('%Y-%m-%d')}, {os.cpu_count()} cpus, "
        f"python {sys.version.split()[0]}; medians of {runs} runs"
    )
    with bench_node(args.runtime) as bench:
        print(f"# driver {bench.driver} -> {bench.python}")
        figures, empty = per_call(bench, runs)
        for figure in figures:
            print(figure.line())
        bench.unmount_all()
        for figure in with_volumes(bench, runs, volumes, empty):
            print(figure.line())
        bench.unmount_all()
        for line in concurrency(bench, count, pods):
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
