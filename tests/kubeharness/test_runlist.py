"""The Go harness's run list checker (runlist.py) against synthetic ``go test`` output: a
test that is missing, skipped or failed is named; a run of every listed test passes."""

from __future__ import annotations

import json

from tests.kubeharness import runlist

NAMES = ["TestLifecycle", "TestSecretType", "TestUnmountNotMounted"]

VERBOSE_ALL = """=== RUN   TestLifecycle
    lifecycle_test.go:120: mount pv-kh
--- PASS: TestLifecycle (12.30s)
=== RUN   TestSecretType
--- PASS: TestSecretType (0.41s)
=== RUN   TestUnmountNotMounted
--- PASS: TestUnmountNotMounted (0.20s)
PASS
"""


def _json(*events: tuple[str, str]) -> str:
    lines = [json.dumps({"Action": "start", "Package": "kh"})]
    for test, action in events:
        lines.append(json.dumps({"Action": "run", "Package": "kh", "Test": test}))
        lines.append(json.dumps({"Action": action, "Package": "kh", "Test": test}))
    return "\n".join([*lines, json.dumps({"Action": "pass", "Package": "kh"})]) + "\n"


def test_a_run_of_every_listed_test_passes() -> None:
    assert runlist.problems(VERBOSE_ALL, NAMES) == []
    every = _json(*((n, "pass") for n in NAMES))
    assert runlist.problems(every, NAMES) == []


def test_a_missing_test_fails() -> None:
    lost = VERBOSE_ALL.replace("--- PASS: TestSecretType (0.41s)\n", "")
    assert runlist.problems(lost, NAMES) == ["TestSecretType did not run"]
    assert runlist.problems(_json(("TestLifecycle", "pass")), NAMES) == [
        "TestSecretType did not run",
        "TestUnmountNotMounted did not run",
    ]
    assert runlist.problems("PASS\nok  \tkh\t0.01s\n", NAMES[:1]) == ["TestLifecycle did not run"]


def test_a_skipped_or_failed_test_fails() -> None:
    skipped = VERBOSE_ALL.replace(
        "--- PASS: TestSecretType (0.41s)", "--- SKIP: TestSecretType (0.00s)"
    )
    assert runlist.problems(skipped, NAMES) == ["TestSecretType was skipped"]
    events = _json(("TestLifecycle", "pass"), ("TestSecretType", "skip"))
    events += _json(("TestUnmountNotMounted", "fail"))
    assert runlist.problems(events, NAMES) == [
        "TestSecretType was skipped",
        "TestUnmountNotMounted failed",
    ]


def test_a_subtest_counts_only_for_itself() -> None:
    """A subtest's line (indented, ``Parent/child``) does not stand in for its parent."""
    sub = "=== RUN   TestLifecycle/mount\n    --- PASS: TestLifecycle/mount (1.00s)\n"
    assert runlist.problems(sub, ["TestLifecycle"]) == ["TestLifecycle did not run"]


def test_the_committed_list_is_every_go_test() -> None:
    """Every top-level test of the harness's Go files is in required.txt and nothing else, so
    a new Go test cannot be lost without the list saying so."""
    assert runlist.declared(), "no func Test* found in tests/kubeharness/*_test.go"
    assert sorted(runlist.required()) == runlist.declared()
