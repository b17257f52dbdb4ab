"""pytest plugin: the suite never goes green by skipping, and never touches the node's paths.

- With ``CI=true`` every skipped test is reported as a failure: a missing capability (root,
  loop devices, ``/dev/fuse``, qemu, multipathd in the guest) must break CI, not empty it
  silently. That holds for a skip at collection time too (a module-level
  ``pytest.importorskip`` or ``pytest.skip(allow_module_level=True)``: the module's collection
  fails), and for ``xfail``: an expected failure is a known defect, and CI does not go green
  around one (an unexpected pass of a non-strict xfail fails as well).
- Every test is counted per tier: ``go`` (marker ``goharness``), ``vm`` (marker ``vm``),
  ``cluster`` (marker ``cluster``: the control-plane tier) or ``host``; the counts are printed
  at the end and, when ``FLEXHUB_TIER_REPORT`` names a file, written there as JSON for
  ``.ci/run``, which fails unless every tier some test is marked for ran
  (:func:`required_tiers`, :func:`tier_problems`).
- When ``FLEXHUB_FILE_DURATIONS`` names a file, the seconds each test file took (setup, call
  and teardown of its tests, summed) and the 50 slowest tests are written there as JSON:
  ``.ci/run`` balances its VM groups with the files' (``.ci/durations.json``) and merges the
  slowest tests of its concurrent sessions. The 50 tests that used the most CPU are written
  there too (:func:`cpu_seconds`: the session's own, its reaped children's, and what its
  live children, a VM's qemu or the control plane's processes among them, used meanwhile):
  on a 2-core machine running three sessions the CPU, not the wall time, is what to cut.
- The session runs with ``FLEXHUB_CONFIG`` naming a throw-away node config (state and log
  directories in a temporary directory), so a driver call a test forgot to configure lands
  there; and the node's real paths (``/etc/flexhub``, ``/var/lib/flexhub``,
  ``/var/log/flexhub``) are compared before and after every test: with ``CI=true`` a change
  fails the test that made it (elsewhere other processes may use them, so it is a warning).
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import tempfile
from collections import Counter
from collections.abc import Generator, Mapping, Sequence
from pathlib import Path

import pytest

NODE_PATHS = (Path("/etc/flexhub"), Path("/var/lib/flexhub"), Path("/var/log/flexhub"))
TIERS = ("host", "vm", "go", "cluster")
#: The marker that puts a test in each tier but ``host`` (every other test).
TIER_MARKERS = {"vm": "vm", "go": "goharness", "cluster": "cluster"}
REPORT_ENV = "FLEXHUB_TIER_REPORT"
DURATIONS_ENV = "FLEXHUB_FILE_DURATIONS"
PATHS_ENV = "FLEXHUB_TEST_NODE_PATHS"  # the guard's own tests point it elsewhere (colon-separated)

Snapshot = dict[str, tuple[int, int, int]]
#: pid -> (start time in ticks, CPU seconds with its reaped children) of a live child
Children = dict[int, tuple[int, float]]
_TICK = os.sysconf("SC_CLK_TCK")


def live_children(parent: int | None = None) -> Children:
    """This process's live children (``parent``'s) and the CPU each has used so far."""
    parent = os.getpid() if parent is None else parent
    found: Children = {}
    entries = _children_of(parent)
    for entry in entries:
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                fields = fh.read().rpartition(b")")[2].split()
        except OSError:
            continue
        if len(fields) > 19 and int(fields[1]) == parent:
            ticks = sum(int(f) for f in fields[11:15])  # utime stime cutime cstime
            found[int(entry)] = (int(fields[19]), ticks / _TICK)
    return found


def _children_of(parent: int) -> list[str]:
    """The pids of ``parent``'s children: from its threads' ``children`` files (a few reads,
    not one per process of the machine), else every pid (the caller checks the parent)."""
    try:
        tasks = os.listdir(f"/proc/{parent}/task")
        pids: list[str] = []
        for task in tasks:
            with open(f"/proc/{parent}/task/{task}/children") as fh:
                pids += fh.read().split()
        return pids
    except OSError:
        try:
            return [entry for entry in os.listdir("/proc") if entry.isdigit()]
        except OSError:
            return []


def cpu_seconds(before: tuple[float, Children], after: tuple[float, Children]) -> float:
    """CPU used between two :func:`cpu_mark` s: this process's and its reaped children's
    (``getrusage``), plus what live children used meanwhile. A child alive at the first mark
    and reaped by the second is in the second ``getrusage`` whole, so what it had used
    before is taken off."""
    (own0, live0), (own1, live1) = before, after
    total = own1 - own0
    for pid, (start, used) in live1.items():
        was = live0.get(pid)
        total += used - was[1] if was and was[0] == start else used
    for pid, (start, used) in live0.items():
        now = live1.get(pid)
        if now is None or now[0] != start:
            total -= used
    return max(total, 0.0)


def cpu_mark() -> tuple[float, Children]:
    """This process's CPU with its reaped children's, and its live children's."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    used = own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime
    return used, live_children()


def on_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def tier_of(item: pytest.Item) -> str:
    for tier in ("go", "vm", "cluster"):
        if item.get_closest_marker(TIER_MARKERS[tier]):
            return tier
    return "host"


def required_tiers(tests: Path) -> list[str]:
    """The tiers a CI run must have run: host and vm always, go and cluster once a test file
    under ``tests`` carries their marker (``mark.goharness``, ``mark.cluster``)."""
    needed = ["host", "vm"]
    sources = [
        p.read_text(errors="replace")
        for p in sorted(tests.rglob("*.py"))
        if p.name not in ("test_ci_guard.py", "ciplugin.py")
    ]
    for tier in ("go", "cluster"):
        pattern = re.compile(rf"\bmark\.{TIER_MARKERS[tier]}\b")
        if any(pattern.search(text) for text in sources):
            needed.append(tier)
    return needed


def tier_problems(tiers: Mapping[str, Mapping[str, int]], required: Sequence[str]) -> list[str]:
    """Why CI fails on the merged tier counts of its sessions: a tier that skipped tests, a
    required tier that ran none ([] when neither)."""
    bad = [
        f"{counts['skipped']} {tier} test(s) skipped"
        for tier, counts in tiers.items()
        if counts.get("skipped")
    ]
    bad += [f"no {tier} test ran" for tier in required if not sum(tiers.get(tier, {}).values())]
    return bad


def snapshot(paths: tuple[Path, ...]) -> Snapshot:
    """Every file and directory under ``paths`` with its inode, size and mtime."""
    seen: Snapshot = {}
    for top in paths:
        for here, dirs, files in os.walk(top):
            for name in [".", *dirs, *files]:
                path = os.path.join(here, name)
                try:
                    st = os.lstat(path)
                except OSError:
                    continue
                seen[os.path.normpath(path)] = (st.st_ino, st.st_size, st.st_mtime_ns)
    return seen


def changes(before: Snapshot, after: Snapshot) -> list[str]:
    """What differs between two snapshots, one line each."""
    out = [f"created {p}" for p in sorted(after.keys() - before.keys())]
    out += [f"removed {p}" for p in sorted(before.keys() - after.keys())]
    out += [f"modified {p}" for p in sorted(before.keys() & after.keys()) if before[p] != after[p]]
    return out


def _mount_points() -> list[str]:
    with open("/proc/self/mountinfo") as table:
        return [line.split()[4] for line in table]


def sandbox_config(base: Path) -> Path:
    """A node config whose every directory is under ``base``."""
    config = base / "flexhub.toml"
    config.write_text(
        f'state_dir = "{base / "state"}"\n'
        f'log_dir = "{base / "log"}"\n'
        f'[loopfile]\nroot = "{base / "loopfiles"}"\n'
    )
    return config


class CiGuard:
    """The plugin's state for one pytest run (an inner pytester run gets its own)."""

    def __init__(self, config: pytest.Config, node_paths: tuple[Path, ...] = NODE_PATHS) -> None:
        self.config = config
        self.node_paths = node_paths
        self.tiers: dict[str, str] = {}
        self.outcomes: dict[str, str] = {}
        self.touched: list[str] = []
        self.test_seconds: Counter[str] = Counter()
        self.test_cpu: Counter[str] = Counter()
        self.before: Snapshot = {}
        self.base = Path(tempfile.mkdtemp(prefix="flexhub-test-node-"))
        self.saved_env = os.environ.get("FLEXHUB_CONFIG")
        os.environ["FLEXHUB_CONFIG"] = str(sandbox_config(self.base))

    def _under_base(self, point: str) -> bool:
        return point == str(self.base) or point.startswith(f"{self.base}/")

    def restore(self) -> None:
        if self.saved_env is None:
            os.environ.pop("FLEXHUB_CONFIG", None)
        else:
            os.environ["FLEXHUB_CONFIG"] = self.saved_env

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        self.tiers = {item.nodeid: tier_of(item) for item in items}

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo[None]
    ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
        report = yield
        if not on_ci():
            return report
        if hasattr(report, "wasxfail"):
            what = "be an expected failure" if report.skipped else "pass while marked xfail"
            reason = report.wasxfail or "no reason given"
            del report.wasxfail
            report.outcome = "failed"
            report.longrepr = f"CI=true, so a test may not {what}: {reason}"
        elif report.skipped:
            report.outcome = "failed"
            report.longrepr = f"CI=true, so a test may not skip: {_reason(report)}"
        return report

    @pytest.hookimpl(wrapper=True)
    def pytest_make_collect_report(
        self, collector: pytest.Collector
    ) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
        """A module that skips while it is collected (``importorskip`` at module level) fails."""
        report = yield
        if report.skipped and on_ci():
            report.outcome = "failed"
            report.longrepr = f"CI=true, so a module may not skip: {_reason(report)}"
        return report

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        self.before = snapshot(self.node_paths)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Generator[None, object, object]:
        """The CPU a test used, setup and teardown included (written with the durations)."""
        if not os.environ.get(DURATIONS_ENV):
            return (yield)
        start = cpu_mark()
        try:
            return (yield)
        finally:
            self.test_cpu[item.nodeid] += cpu_seconds(start, cpu_mark())

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_teardown(self, item: pytest.Item) -> Generator[None, None, None]:
        yield
        diff = changes(self.before, snapshot(self.node_paths))
        if diff:
            self.touched.append(f"{item.nodeid}: {', '.join(diff[:5])}")
            if on_ci():
                pytest.fail(
                    "the test changed the node's real paths (give every driver call its "
                    f"own config): {'; '.join(diff[:5])}",
                    pytrace=False,
                )

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """A test's outcome is its worst phase: skipped, failed, or else passed."""
        self.test_seconds[report.nodeid] += report.duration
        if hasattr(report, "wasxfail"):
            self.outcomes[report.nodeid] = "xfailed" if report.skipped else "xpassed"
        elif report.skipped:
            self.outcomes[report.nodeid] = "skipped"
        elif report.failed and self.outcomes.get(report.nodeid) != "skipped":
            self.outcomes[report.nodeid] = "failed"
        else:
            self.outcomes.setdefault(report.nodeid, "passed")

    def summary(self) -> dict[str, dict[str, int]]:
        counts: dict[str, Counter[str]] = {tier: Counter() for tier in TIERS}
        for nodeid, outcome in self.outcomes.items():
            counts[self.tiers.get(nodeid, "host")][outcome] += 1
        return {tier: dict(counts[tier]) for tier in TIERS}

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        terminalreporter.section("tests per tier")
        for tier, counts in self.summary().items():
            total = sum(counts.values())
            detail = ", ".join(f"{n} {what}" for what, n in sorted(counts.items())) or "none ran"
            terminalreporter.write_line(f"{tier:5} {total:4}  ({detail})")
        for line in self.touched:
            terminalreporter.write_line(f"WARNING node path changed during {line}")

    def pytest_unconfigure(self) -> None:
        self.restore()
        if not any(self._under_base(line) for line in _mount_points()):
            shutil.rmtree(self.base, ignore_errors=True)
        report = os.environ.get(REPORT_ENV)
        if report:
            Path(report).write_text(json.dumps(self.summary()) + "\n")
        durations = os.environ.get(DURATIONS_ENV)
        if durations:
            files: Counter[str] = Counter()
            for nodeid, seconds in self.test_seconds.items():
                files[nodeid.split("::", 1)[0]] += seconds
            data = {
                "files": {name: round(t, 1) for name, t in sorted(files.items())},
                "slowest": [[n, round(t, 2)] for n, t in self.test_seconds.most_common(50)],
                "cpu": [[n, round(t, 2)] for n, t in self.test_cpu.most_common(50)],
                "cpu_total": round(sum(self.test_cpu.values()), 1),
            }
            Path(durations).write_text(json.dumps(data, indent=1) + "\n")


def _reason(report: pytest.TestReport | pytest.CollectReport) -> object:
    longrepr = report.longrepr
    return longrepr[2] if isinstance(longrepr, tuple) else longrepr


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "goharness: a test driven by the Go kubelet harness")
    paths = os.environ.get(PATHS_ENV)
    node_paths = tuple(Path(p) for p in paths.split(":")) if paths else NODE_PATHS
    config.pluginmanager.register(CiGuard(config, node_paths), "flexhub-ci-guard")


#: The order the tiers run in within one session (stable within a tier: file order).
TIER_ORDER = {"host": 0, "vm": 0, "cluster": 1, "go": 2}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The host tier first, then the control plane's, then the Go harness's: in one session
    (.ci/run's host session, or the README's one run) the tests that need nothing built run
    while the control plane and then the harness build in the background. With the cluster's
    files first (tests/cluster sorts before tests/core), a fresh machine's host session waited
    for the control plane's first build (2,537 s on 2026-12-06) doing nothing, and ran its
    host tests only after it: the critical path of the whole run."""
    items.sort(key=lambda item: TIER_ORDER[tier_of(item)])
