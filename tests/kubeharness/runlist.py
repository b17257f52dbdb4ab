"""Which Go harness tests ran: every test named in ``required.txt`` must have run and passed
in each harness run, so a test that Go skips, a test lost to a rename, a build tag or a
``-test.run`` that selects too little fails the pytest test that ran the harness instead of
passing with less checked. ``go test -v`` (``--- PASS: TestX (1.2s)``) and ``go test -json``
output are both read."""

from __future__ import annotations

import json
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
REQUIRED = HERE / "required.txt"
_VERBOSE = re.compile(r"^\s*--- (PASS|FAIL|SKIP): (\S+)", re.M)
_FUNC = re.compile(r"^func (Test\w+)\(t \*testing\.T\)", re.M)


def required(path: Path = REQUIRED) -> list[str]:
    """The committed list: one top-level test name a line; ``#`` comments and blanks ignored."""
    names = []
    for line in path.read_text().splitlines():
        name = line.split("#", 1)[0].strip()
        if name:
            names.append(name)
    return names


def outcomes(output: str) -> dict[str, str]:
    """Each test's outcome (``pass``, ``fail``, ``skip``) from ``go test -v`` or ``-json``
    output; a test reported twice keeps its worst outcome."""
    found: list[tuple[str, str]] = []
    for line in output.splitlines():
        if line.startswith("{"):
            try:
                event = json.loads(line)
            except ValueError:
                continue
            action, test = event.get("Action"), event.get("Test")
            if isinstance(test, str) and action in ("pass", "fail", "skip"):
                found.append((test, action))
    found += [(m.group(2), m.group(1).lower()) for m in _VERBOSE.finditer(output)]
    rank = {"pass": 0, "skip": 1, "fail": 2}
    result: dict[str, str] = {}
    for test, outcome in found:
        if rank[outcome] >= rank[result.get(test, "pass")]:
            result[test] = outcome
    return result


def problems(output: str, names: list[str]) -> list[str]:
    """What is wrong with a harness run's output against the tests it must run (none: [])."""
    seen = outcomes(output)
    out = []
    for name in names:
        outcome = seen.get(name)
        if outcome is None:
            out.append(f"{name} did not run")
        elif outcome == "skip":
            out.append(f"{name} was skipped")
        elif outcome == "fail":
            out.append(f"{name} failed")
    return out


def declared(directory: Path = HERE) -> list[str]:
    """The top-level ``func TestX(t *testing.T)`` of the harness's Go files."""
    names: list[str] = []
    for path in sorted(directory.glob("*_test.go")):
        names += _FUNC.findall(path.read_text())
    return sorted(names)
