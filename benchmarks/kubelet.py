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
import os
import statistics
import sys
import time
from pathlib import Path

# The node and the profile live beside this file (run as a script, its directory is on the
# path); their names are re-exported here, where the benchmark's readers found them.
from kubelet_node import (
    BASHJQ,
    HERE,
    SHELL_MOUNT,
    SMALL,
    Bench,
    Figure,
    GiB,
    bench_node,
    median_ms,
    must,
    paired,
    run_quiet,
)
from kubelet_profile import PROFILE_BOOTSTRAP, PROFILE_CALLS, profile_lines

from flexhub.admin.harness import Kubelet, go_json

__all__ = [
    "BASHJQ",
    "HERE",
    "PROFILE_BOOTSTRAP",
    "PROFILE_CALLS",
    "SHELL_MOUNT",
    "SMALL",
    "Bench",
    "Figure",
    "GiB",
    "bench_node",
    "concurrency",
    "main",
    "median_ms",
    "must",
    "paired",
    "per_call",
    "profile_lines",
    "run_quiet",
    "with_volumes",
]


def per_call(bench: Bench, runs: int) -> tuple[list[Figure], dict[str, float]]:
    k = bench.kubelet
    bare_name = f"bare python {' '.join(bench.flags)} -c pass"
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
