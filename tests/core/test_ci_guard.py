"""The suite's own guard (tests/ciplugin.py): under CI nothing skips, tiers are counted, and no
test touches the node's real paths. Each test runs an inner pytest session with the plugin."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests import ciplugin

SKIPPING = """
import pytest

needs_thing = pytest.mark.skipif(True, reason="needs a thing")

@pytest.fixture
def capability():
    pytest.skip("no /dev/thing")

def test_runs():
    pass

@needs_thing
def test_marked():
    pass

def test_fixture(capability):
    pass

def test_inline():
    pytest.skip("multipathd does not start")

def test_import():
    pytest.importorskip("no_such_module_anywhere")

@pytest.mark.xfail(reason="known", strict=True)
def test_expected_failure():
    assert False

@pytest.mark.xfail(reason="flaky")
def test_unexpected_pass():
    pass

@pytest.mark.vm
def test_in_vm():
    pass

@pytest.mark.goharness
def test_from_go():
    pass

@pytest.mark.cluster
def test_on_a_cluster():
    pass
"""


def run_inner(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, ci: str | None
) -> tuple[pytest.RunResult, dict[str, dict[str, int]]]:
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    report = pytester.path / "tiers.json"
    monkeypatch.setenv(ciplugin.REPORT_ENV, str(report))
    pytester.makeini("[pytest]\nmarkers =\n    vm: the VM tier\n    cluster: the cluster tier\n")
    pytester.makepyfile(test_inner=SKIPPING)
    result = pytester.runpytest_subprocess("-p", "tests.ciplugin", "-p", "no:cacheprovider")
    return result, json.loads(report.read_text())


@pytest.fixture(autouse=True)
def importable(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    repo = str(Path(__file__).resolve().parents[2])
    monkeypatch.setenv("PYTHONPATH", repo)


def test_every_kind_of_skip_fails_under_ci(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    result, tiers = run_inner(pytester, monkeypatch, "true")
    outcomes = result.parseoutcomes()
    assert outcomes.get("skipped", 0) == 0, result.stdout.str()
    # the skipif marker and the fixture skip in setup (errors); the inline skip, importorskip,
    # the strict xfail that failed and the non-strict one that passed in the call (failures)
    assert outcomes["failed"] == 4 and outcomes["errors"] == 2, outcomes
    assert "xfailed" not in outcomes and "xpassed" not in outcomes, outcomes
    assert outcomes["passed"] == 4, outcomes
    result.stdout.fnmatch_lines(["*CI=true, so a test may not skip: *no /dev/thing*"])
    result.stdout.fnmatch_lines(["*CI=true, so a test may not be an expected failure: known*"])
    result.stdout.fnmatch_lines(["*CI=true, so a test may not pass while marked xfail: flaky*"])
    assert result.ret == 1
    assert tiers["host"] == {"failed": 6, "passed": 1}
    assert tiers["vm"] == {"passed": 1} and tiers["go"] == {"passed": 1}
    assert tiers["cluster"] == {"passed": 1}  # a tier of its own, not counted as host
    result.stdout.fnmatch_lines(["*tests per tier*", "host *7*", "vm *1*", "go *1*", "cluster *1*"])


def test_without_ci_skips_stay_skips_and_are_counted(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    result, tiers = run_inner(pytester, monkeypatch, None)
    outcomes = result.parseoutcomes()
    assert outcomes["skipped"] == 4 and outcomes["xfailed"] == 1 and outcomes["xpassed"] == 1
    assert result.ret == 0
    assert tiers["host"] == {"skipped": 4, "passed": 1, "xfailed": 1, "xpassed": 1}


MODULE_SKIP = """
import pytest

pytest.importorskip("no_such_module_anywhere")

def test_never_collected():
    pass
"""


@pytest.mark.parametrize("ci", ["true", None])
def test_a_module_that_skips_at_collection_fails_under_ci(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, ci: str | None
) -> None:
    """A module-level importorskip skips the whole module before any test item exists, so
    the item-level hook never sees it: the collection report must fail under CI."""
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    pytester.makepyfile(test_optional="\n", test_module_skip=MODULE_SKIP)
    (pytester.path / "test_optional.py").write_text("def test_here():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "tests.ciplugin", "-p", "no:cacheprovider")
    outcomes = result.parseoutcomes()
    if ci:
        assert outcomes.get("skipped", 0) == 0 and outcomes["errors"] == 1, outcomes
        result.stdout.fnmatch_lines(
            ["*ERROR collecting test_module_skip.py*", "*CI=true, so a module may not skip: *"]
        )
        assert result.ret != 0
    else:
        assert outcomes == {"passed": 1, "skipped": 1}, outcomes
        assert result.ret == 0


TOUCHING = """
import os
from pathlib import Path

def test_forgot_its_config():
    Path(os.environ["NODE_DIR"], "locks").mkdir()

def test_own_config(tmp_path):
    (tmp_path / "locks").mkdir()
"""


@pytest.mark.parametrize("ci", ["true", None])
def test_a_test_that_touches_node_paths_fails_under_ci(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, ci: str | None
) -> None:
    node = tmp_path / "var-lib-flexhub"
    node.mkdir()
    monkeypatch.setenv("NODE_DIR", str(node))
    monkeypatch.setenv(ciplugin.PATHS_ENV, f"{node}:{tmp_path / 'etc-flexhub'}")
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    pytester.makepyfile(test_inner=TOUCHING)
    result = pytester.runpytest_subprocess("-p", "tests.ciplugin", "-p", "no:cacheprovider")
    outcomes = result.parseoutcomes()
    result.stdout.fnmatch_lines(
        [f"*node path changed during test_inner.py::test_forgot_its_config: created {node}/locks*"]
    )
    if ci:
        assert outcomes == {"passed": 2, "errors": 1}, outcomes
        result.stdout.fnmatch_lines(["*ERROR at teardown of test_forgot_its_config*"])
    else:
        assert outcomes == {"passed": 2}, outcomes


def test_snapshot_sees_created_modified_and_removed(tmp_path: Path) -> None:
    node = tmp_path / "var-lib-flexhub"
    (node / "locks").mkdir(parents=True)
    (node / "locks" / "old.lock").write_text("")
    before = ciplugin.snapshot((node, tmp_path / "absent"))
    assert ciplugin.changes(before, ciplugin.snapshot((node,))) == []
    (node / "locks" / "pod-1.lock").write_text("")
    (node / "locks" / "old.lock").unlink()
    diff = ciplugin.changes(before, ciplugin.snapshot((node, tmp_path / "absent")))
    assert f"created {node}/locks/pod-1.lock" in diff
    assert f"removed {node}/locks/old.lock" in diff
    assert f"modified {node}/locks" in diff


def test_session_config_is_a_throwaway_tree() -> None:
    import os
    import tomllib

    config = Path(os.environ["FLEXHUB_CONFIG"])
    assert not config.is_relative_to("/etc")
    data = tomllib.loads(config.read_text())
    for key in ("state_dir", "log_dir"):
        assert Path(data[key]).parent == config.parent, data
    assert Path(data["loopfile"]["root"]).parent == config.parent


def test_ci_requires_every_tier_that_has_tests_to_have_run(tmp_path: Path) -> None:
    """.ci/run's verdict over the sessions' tier reports: a tier whose marker some test
    carries must have run (the cluster tier too, now a tier of its own), and a skip fails."""
    tests = tmp_path / "tests"
    (tests / "cluster").mkdir(parents=True)
    (tests / "test_host.py").write_text("def test_x():\n    pass\n")
    assert ciplugin.required_tiers(tests) == ["host", "vm"]
    (tests / "cluster" / "test_pods.py").write_text(
        "import pytest\n\npytestmark = [pytest.mark.cluster]\n"
    )
    (tests / "test_go.py").write_text(
        "import pytest\n\n@pytest.mark.goharness\ndef test_g(): ...\n"
    )
    assert ciplugin.required_tiers(tests) == ["host", "vm", "go", "cluster"]

    ran = {"host": {"passed": 900}, "vm": {"passed": 300}, "go": {"passed": 20}}
    required = ["host", "vm", "go", "cluster"]
    assert ciplugin.tier_problems({**ran, "cluster": {"passed": 80}}, required) == []
    assert ciplugin.tier_problems(ran, required) == ["no cluster test ran"]
    assert ciplugin.tier_problems({**ran, "cluster": {}}, required) == ["no cluster test ran"]
    skipped = {**ran, "cluster": {"passed": 79, "skipped": 1}}
    assert ciplugin.tier_problems(skipped, required) == ["1 cluster test(s) skipped"]


#: The CI script whose own text the tests below check and run.
CI_RUN = Path(__file__).resolve().parents[2] / ".ci" / "run"


def test_ci_run_uses_the_tier_verdict() -> None:
    """.ci/run decides with these functions (not a copy of them that could drift)."""
    script = CI_RUN.read_text()
    assert "ciplugin.required_tiers(" in script and "ciplugin.tier_problems(" in script


#: .ci/run's phase lines (name, start offset, seconds), as its background builds write them.
WARM_PHASES = [("pip: python packages", 0, 20), ("go: control plane build (background)", 0, 0),
               ("go: sidecars build (background)", 1, 0), ("runtime build (background)", 20, 138),
               ("go: harness build (background)", 0, 9), ("tests: vm-1", 36, 2600)]  # fmt: skip


@pytest.mark.parametrize(
    ("changed", "cold"),
    [
        ({}, 0),  # every Go build cached; the runtime rebuilt for new sources: kept
        ({"go: control plane build (background)": 2128}, 1),  # a fresh machine
        ({"go: sidecars build (background)": 121}, 1),  # a new pin
        ({"go: harness build (background)": 120}, 0),
    ],
)
def test_ci_run_keeps_no_durations_from_a_run_beside_a_cold_go_build(
    tmp_path: Path, changed: dict[str, int], cold: int
) -> None:
    """The seconds per VM file of a run beside a cold Go build (a fresh machine) would
    misbalance the next warm run's split: .ci/run's own rule (run from its text) says cold,
    and the cache is written only when it says warm."""
    script = CI_RUN.read_text()
    [line] = [x for x in script.splitlines() if x.startswith("go_cold=$(")]
    phases = tmp_path / "phases"
    phases.write_text(
        "".join(f"{n}\t{at}\t{changed.get(n, took)}\n" for n, at, took in WARM_PHASES)
    )
    found = subprocess.run(
        ["bash", "-c", f'{line}\necho "$go_cold"'],
        env={"PATH": os.environ["PATH"], "phases": str(phases)},
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert found.stdout.strip() == str(cold)
    # the rule gates the write, and runs once every build has recorded its time
    gate = "FLEXHUB_CI_SESSIONS_OK=$((vm_status == 0 && go_cold == 0))"
    assert script.count("go_cold=") == 1 and gate in script
    assert script.index("stop_go_builds\nwait || true\n") < script.index(line) < script.index(gate)
    write = script.index('(cache / "durations.json.tmp").write_text')
    gated = 'if files and os.environ.get("FLEXHUB_CI_SESSIONS_OK") == "1":'
    assert gated in script[:write]


#: Python that burns 0.6 s of CPU, however loaded the machine is.
BURN = "import time\nend = time.process_time() + 0.6\nwhile time.process_time() < end: pass"

CPU_TESTS = f"""
import os, subprocess, sys, time

BURN = {BURN!r}

def test_burns_in_a_child():
    subprocess.run([sys.executable, "-c", BURN], check=True)

def test_sleeps():
    time.sleep(0.6)

def test_a_live_child_burns_meanwhile(live):
    # until the child has burnt its 0.6 s, however loaded the machine is
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        with open(f"/proc/{{live.pid}}/stat", "rb") as fh:
            fields = fh.read().rpartition(b")")[2].split()
        if sum(int(f) for f in fields[11:13]) >= 0.55 * os.sysconf("SC_CLK_TCK"):
            break
        time.sleep(0.05)
"""

CPU_CONFTEST = f"""
import subprocess, sys, pytest

BURN = {BURN!r}

@pytest.fixture(scope="session")
def live():
    # a long-running child started by an earlier test's fixture, as a VM's qemu is: what it
    # uses while a test runs counts for that test
    proc = subprocess.Popen([sys.executable, "-c", BURN + "\\ntime.sleep(3600)"])
    yield proc
    proc.kill()
    proc.wait()
"""


def test_each_test_s_cpu_is_written_with_the_durations(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CPU a test used, its children's and its live children's included, is written
    with the durations (the lever on a CPU-bound CI is CPU, not wall time)."""
    durations = pytester.path / "durations.json"
    monkeypatch.setenv(ciplugin.DURATIONS_ENV, str(durations))
    monkeypatch.delenv("CI", raising=False)
    pytester.makeconftest(CPU_CONFTEST)
    pytester.makepyfile(test_cpu=CPU_TESTS)
    result = pytester.runpytest_subprocess("-p", "tests.ciplugin", "-p", "no:cacheprovider")
    assert result.ret == 0
    cpu = dict(json.loads(durations.read_text())["cpu"])
    assert cpu["test_cpu.py::test_burns_in_a_child"] >= 0.5
    assert cpu["test_cpu.py::test_sleeps"] < 0.3
    assert cpu["test_cpu.py::test_a_live_child_burns_meanwhile"] >= 0.5


def test_cpu_seconds_counts_a_child_reaped_meanwhile_once() -> None:
    """A child alive at the first mark and reaped before the second is whole in the second
    getrusage: what it had used before the first mark is taken off; a pid reused by a new
    child (another start time) counts as new."""
    before = (10.0, {7: (100, 2.0), 8: (200, 1.0)})
    after = (13.5, {8: (999, 0.25)})  # 7 reaped (3.5 s whole in getrusage), 8 reused
    assert ciplugin.cpu_seconds(before, after) == pytest.approx(3.5 - 2.0 - 1.0 + 0.25)
