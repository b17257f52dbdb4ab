"""``benchmarks/kubelet.py --profile CALL``: where one call kind's time goes. The call is
started with the shim's argv, environment, stdin and cwd under ``_lsprof``
(:data:`PROFILE_BOOTSTRAP`), as it is and with the modules it loads imported first; the
rounds' medians by own time and by flexhub's functions' cumulative time are its lines."""

from __future__ import annotations

import marshal
import resource
import statistics
import subprocess
from collections.abc import Callable
from pathlib import Path

from kubelet_node import HERE, Bench, median_ms, must

from flexhub.admin.harness import DriverReply, Kubelet, go_json, parse_reply

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
    for prefix in ("site-packages/", "dist-packages/", f"{HERE.parent}/", "/lib/python3.11/"):
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
