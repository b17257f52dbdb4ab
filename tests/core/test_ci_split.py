""".ci/split.py: the VM and Go tiers' files in groups of about equal measured duration."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]


def load_split() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ci_split", REPO / ".ci" / "split.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


COLLECTED = [
    "tests/vm/test_a.py::test_1",
    "tests/vm/test_a.py::test_2",
    "tests/kubeharness/test_kubeharness.py::test_go",
    "tests/vm/test_b.py::test_1",
    "tests/vm/test_c.py::test_1[x]",
    "tests/vm/test_c.py::test_1[y]",
    "tests/vm/test_new.py::test_1",
    "",
    "7 tests collected in 1.00s",
]


def test_groups_balance_measured_seconds_and_estimate_new_files() -> None:
    split = load_split()
    durations = {
        "tests/vm/test_a.py": 600.0,
        "tests/vm/test_b.py": 500.0,
        "tests/vm/test_c.py": 200.0,
        "tests/kubeharness/test_kubeharness.py": 300.0,
    }
    groups, totals = split.split(COLLECTED, durations, 2)
    assert sorted(f for g in groups for f in g) == sorted(
        {line.split("::")[0] for line in COLLECTED if "::" in line}
    )
    # the new file is estimated at its one test times the mean (1600 s / 6 tests)
    assert abs(sum(totals) - (1600 + 1600 / 6)) < 0.01
    assert max(totals) - min(totals) <= 1600 / 6 + 0.01, (groups, totals)
    for group in groups:  # collection order, the Go harness last
        if "tests/kubeharness/test_kubeharness.py" in group:
            assert group[-1] == "tests/kubeharness/test_kubeharness.py"
        positions = [COLLECTED.index(next(c for c in COLLECTED if c.startswith(f))) for f in group]
        go_free = [p for f, p in zip(group, positions, strict=True) if "kubeharness" not in f]
        assert go_free == sorted(go_free)


def test_durations_file_in_either_shape(tmp_path: Path) -> None:
    split = load_split()
    flat, nested, broken = tmp_path / "flat.json", tmp_path / "nested.json", tmp_path / "x.json"
    flat.write_text(json.dumps({"tests/vm/test_a.py": 1.5}))
    nested.write_text(json.dumps({"files": {"tests/vm/test_a.py": 2}, "slowest": []}))
    broken.write_text("{")
    assert split.load_durations(flat) == {"tests/vm/test_a.py": 1.5}
    assert split.load_durations(nested) == {"tests/vm/test_a.py": 2.0}
    assert split.load_durations(broken) == {}
    assert split.load_durations(tmp_path / "missing.json") == {}
    groups, _ = split.split(COLLECTED, {}, 2)  # nothing measured: by number of tests
    assert all(groups)
