"""Split the VM tier's test files (the Go harness's guest runs among them) into groups of about
equal measured duration.

    python3 .ci/split.py N COLLECTED DURATIONS...  # prints N lines, one group's files each

COLLECTED is ``pytest --collect-only -q -m vm``'s output (one node id a line);
each DURATIONS file (``.ci/durations.json``, then the last run's on this machine, which wins)
holds the seconds each file took in a measured run (written by ``tests/ciplugin.py`` under
``FLEXHUB_FILE_DURATIONS``; a missing or broken file counts as empty). A file in none is
estimated at its
number of tests times the mean seconds per test of the measured files. Longest file first, each
into the group with the least time so far; within a group the files keep the order of the
collection (pytest's own order), except that the Go harness's files go last: its binary builds
in the background while the group runs the rest.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

GO_FILES_UNDER = "tests/kubeharness/"


def load_durations(path: Path) -> dict[str, float]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    files = data.get("files", data) if isinstance(data, dict) else {}
    return {str(k): float(v) for k, v in files.items() if isinstance(v, int | float)}


def split(
    collected: list[str], durations: dict[str, float], groups: int
) -> tuple[list[list[str]], list[float]]:
    counts: Counter[str] = Counter()
    order: list[str] = []
    for line in collected:
        if "::" not in line:
            continue
        name = line.split("::", 1)[0]
        if name not in counts:
            order.append(name)
        counts[name] += 1
    known = [f for f in order if f in durations]
    per_test = sum(durations[f] for f in known) / max(1, sum(counts[f] for f in known)) or 20.0
    cost = {f: durations.get(f, counts[f] * per_test) for f in order}
    buckets: list[list[str]] = [[] for _ in range(groups)]
    totals = [0.0] * groups
    for name in sorted(order, key=lambda f: (-cost[f], f)):
        i = totals.index(min(totals))
        buckets[i].append(name)
        totals[i] += cost[name]
    for bucket in buckets:
        bucket.sort(key=lambda f: (f.startswith(GO_FILES_UNDER), order.index(f)))
    return buckets, totals


def main() -> None:
    groups, collected = int(sys.argv[1]), Path(sys.argv[2])
    durations: dict[str, float] = {}
    for path in sys.argv[3:]:
        durations.update(load_durations(Path(path)))
    buckets, totals = split(collected.read_text().splitlines(), durations, groups)
    for bucket, total in zip(buckets, totals, strict=True):
        print(f"group of ~{total:.0f}s: {' '.join(bucket) or '(empty)'}", file=sys.stderr)
        print(" ".join(bucket))


if __name__ == "__main__":
    main()
