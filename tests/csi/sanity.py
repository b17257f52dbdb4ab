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
from typing import Any

from flexhub.config import NodeConfig

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


def start_plugin(
    config: Path, endpoint: Path, log: Path, node_id: str = "node-1", **env: str
) -> subprocess.Popen[bytes]:
    """``python -m flexhub csi --mode both`` on ``endpoint``, returned once it listens."""
    if endpoint.exists():
        endpoint.unlink()
    with open(log, "a") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "flexhub", "csi", "--endpoint", f"unix://{endpoint}",
             "--mode", "both", "--node-id", node_id],
            env={**os.environ, "FLEXHUB_CONFIG": str(config), "PYTHONPATH": str(REPO), **env},
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd="/",
        )  # fmt: skip
    deadline = time.monotonic() + 60
    while not endpoint.is_socket():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"flexhub csi did not start: {log.read_text()[-2000:]}")
        time.sleep(0.05)
    # the socket exists from its bind, but takes calls only once the server started
    import grpc

    from flexhub.csi.proto import csi_pb2, csi_pb2_grpc

    with grpc.insecure_channel(f"unix://{endpoint}") as channel:
        identity = csi_pb2_grpc.IdentityStub(channel)
        identity.Probe(csi_pb2.ProbeRequest(), wait_for_ready=True, timeout=60)
    return proc


def stop_plugin(proc: subprocess.Popen[bytes]) -> int:
    """SIGTERM, then its exit code (SIGKILL after 30 s)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


@dataclass
class LoopfilePlugin:
    """A running plugin (tests/csi/conftest.py's ``loopfile_plugin``): the directory of its
    node (config, state, log and loopfile root) and its gRPC stubs."""

    top: Path
    controller: Any
    node: Any


@contextlib.contextmanager
def plugin(config: Path, endpoint: Path, log: Path, node_id: str = "node-1") -> Iterator[None]:
    """``python -m flexhub csi --mode both`` on ``endpoint`` until the block ends (SIGTERM)."""
    proc = start_plugin(config, endpoint, log, node_id)
    try:
        yield
    finally:
        code = stop_plugin(proc)
    if code != 0:
        raise RuntimeError(f"flexhub csi exited {code}: {log.read_text()[-2000:]}")


def plugin_config(top: Path) -> NodeConfig:
    """An in-process plugin's config: state, log and loopfile root under ``top``."""
    return NodeConfig(
        state_dir=top / "state",
        log_dir=top / "log",
        lock_timeout=10,
        command_timeout=30,
        backends={"loopfile": {"root": str(top / "loopfiles")}},
    )


def node_config(top: Path) -> Path:
    """A node config with its state, log and loopfile root under ``top`` (root's alone)."""
    for name in ("state", "log", "loopfiles"):
        (top / name).mkdir(mode=0o700)
    config = top / "flexhub.toml"
    config.write_text(
        f'state_dir = "{top / "state"}"\n'
        f'log_dir = "{top / "log"}"\n'
        "lock_timeout = 20\n"
        f'[loopfile]\nroot = "{top / "loopfiles"}"\n'
    )
    return config


def loops_backed_under(path: Path) -> list[str]:
    """The loop devices whose backing file lies under ``path``."""
    found = []
    for backing in Path("/sys/block").glob("loop*/loop/backing_file"):
        try:
            if backing.read_text().strip().startswith(f"{path}/"):
                found.append(backing.parent.parent.name)
        except OSError:
            continue
    return found


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
