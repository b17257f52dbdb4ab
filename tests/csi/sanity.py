"""Run csi-sanity against a ``flexhub csi`` process and read its JUnit report."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
SKIPS = HERE / "sanity-skips.tsv"


@dataclass
class Report:
    """csi-sanity's JUnit report: specs by status, skip messages, failure texts, seconds."""

    seconds: float
    passed: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    pending: list[str] = field(default_factory=list)

    def summary(self) -> str:
        total = len(self.passed) + len(self.failed) + len(self.skipped) + len(self.pending)
        return (
            f"csi-sanity: {total} specs, {len(self.passed)} passed, {len(self.failed)} failed, "
            f"{len(self.skipped)} skipped, {len(self.pending)} pending, in {self.seconds:.1f} s"
        )


def read_report(path: Path) -> Report:
    root = ET.parse(path).getroot()
    report = Report(seconds=float(root.get("time", "0")))
    for case in root.iter("testcase"):
        name, status = case.get("name", ""), case.get("status", "")
        if status == "passed":
            report.passed.append(name)
        elif status == "skipped":
            element = case.find("skipped")
            message = element.get("message", "") if element is not None else ""
            report.skipped[name] = message.removeprefix("skipped - ")
        elif status == "pending":
            report.pending.append(name)
        else:  # failed, panicked, interrupted...
            texts = [e.get("message", "") + "\n" + (e.text or "") for e in case]
            report.failed[name] = f"[{status}] " + "\n".join(texts)[-3000:]
    return report


def read_skips(path: Path = SKIPS) -> dict[str, tuple[str, str]]:
    """The committed skip list: spec -> (csi-sanity's skip message, why)."""
    skips: dict[str, tuple[str, str]] = {}
    for line in path.read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        spec, message, why = line.split("\t")
        skips[spec] = (message, why)
    return skips


@contextlib.contextmanager
def plugin(config: Path, endpoint: Path, log: Path, node_id: str = "node-1") -> Iterator[None]:
    """``python -m flexhub csi --mode both`` on ``endpoint`` until the block ends (SIGTERM)."""
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "flexhub", "csi", "--endpoint", f"unix://{endpoint}",
             "--mode", "both", "--node-id", node_id],
            env={**os.environ, "FLEXHUB_CONFIG": str(config), "PYTHONPATH": str(REPO)},
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd="/",
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not endpoint.is_socket():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"flexhub csi did not start: {log.read_text()[-2000:]}")
            time.sleep(0.05)
        yield
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"flexhub csi exited {proc.returncode}: {log.read_text()[-2000:]}")


def run_sanity(binary: Path, endpoint: Path, work: Path, *args: str) -> Report:
    junit = work / "junit.xml"
    out = work / "csi-sanity.out"
    with open(out, "w") as log:
        subprocess.run(
            [str(binary), f"--csi.endpoint=unix://{endpoint}",
             f"--csi.mountdir={work / 'mnt'}", f"--csi.stagingdir={work / 'stage'}",
             f"--ginkgo.junit-report={junit}", "--ginkgo.no-color", "--ginkgo.timeout=15m",
             *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=work,
            timeout=1200,
            check=False,
        )  # fmt: skip
    if not junit.exists():
        raise RuntimeError(f"csi-sanity wrote no report: {out.read_text()[-3000:]}")
    return read_report(junit)
