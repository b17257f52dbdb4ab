"""flexhub's own kubelet plugin registration (``--registration-dir``) and liveness endpoint
(``--health-port``): the kubelet's two calls over a real gRPC unix socket, ``/healthz`` over
real HTTP, and ``flexhub csi`` as a process (the cluster tier has the stock kubelet call it:
tests/cluster/test_csi_node.py)."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from flexhub.csi import DRIVER_NAME, liveness, registration
from flexhub.csi.identity import IdentityService
from flexhub.csi.proto import csi_pb2
from flexhub.csi.proto import pluginregistration_pb2 as reg_pb
from flexhub.csi.proto import pluginregistration_pb2_grpc as reg_rpc
from flexhub.csi.server import build_server
from flexhub.errors import UsageError
from tests.csi.sanity import plugin_config

KUBELET_SIDE = Path("/var/lib/kubelet/plugins/flexhub.csi.k8s.io/csi.sock")


@pytest.fixture
def tmp_path() -> Iterator[Path]:
    """A short directory: a unix socket's path holds 107 bytes, pytest's are longer."""
    path = Path(tempfile.mkdtemp(prefix="fhreg."))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def registrar(tmp_path: Path) -> Iterator[tuple[registration.Registrar, Any]]:
    running = registration.start(tmp_path / "plugins_registry", KUBELET_SIDE)
    channel = grpc.insecure_channel(f"unix://{running.path}")
    try:
        yield running, reg_rpc.RegistrationStub(channel)
    finally:
        channel.close()
        running.stop(0)


def test_get_info_names_the_driver_and_the_csi_socket_as_the_kubelet_sees_it(
    registrar: tuple[registration.Registrar, Any], tmp_path: Path
) -> None:
    running, stub = registrar
    assert running.path == tmp_path / "plugins_registry" / "flexhub.csi.k8s.io-reg.sock"
    assert stat.S_IMODE(running.path.stat().st_mode) == 0o600
    info = stub.GetInfo(reg_pb.InfoRequest(), timeout=5)
    assert info.type == "CSIPlugin"
    assert info.name == DRIVER_NAME == "flexhub.csi.k8s.io"
    assert info.endpoint == str(KUBELET_SIDE)
    assert list(info.supported_versions) == ["1.0.0"]


def test_registration_status_is_logged_an_error_as_an_error(
    registrar: tuple[registration.Registrar, Any], caplog: pytest.LogCaptureFixture
) -> None:
    _, stub = registrar
    caplog.set_level(logging.INFO, logger="flexhub.csi.registration")
    stub.NotifyRegistrationStatus(reg_pb.RegistrationStatus(plugin_registered=True), timeout=5)
    stub.NotifyRegistrationStatus(
        reg_pb.RegistrationStatus(plugin_registered=False, error="bad\nversion 9.9"), timeout=5
    )
    records = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert (logging.INFO, f"kubelet registered {DRIVER_NAME} (CSI socket {KUBELET_SIDE})") in (
        records
    )
    assert (logging.ERROR, f"kubelet refused to register {DRIVER_NAME}: bad version 9.9") in (
        records
    )


def test_stop_removes_the_socket_so_the_kubelet_drops_the_plugin(tmp_path: Path) -> None:
    running = registration.start(tmp_path / "reg", KUBELET_SIDE)
    assert running.path.exists()
    running.stop(0)
    assert not running.path.exists()


def test_a_stale_socket_is_replaced_a_live_one_or_a_file_refused(tmp_path: Path) -> None:
    directory = tmp_path / "reg"
    directory.mkdir()
    path = directory / "flexhub.csi.k8s.io-reg.sock"
    left = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    left.bind(str(path))
    left.close()  # a plugin SIGKILLed left it
    running = registration.start(directory, KUBELET_SIDE)
    try:
        with pytest.raises(UsageError, match="another process serves"):
            registration.start(directory, KUBELET_SIDE)
    finally:
        running.stop(0)
    path.write_text("not a socket")
    with pytest.raises(UsageError, match="not a socket"):
        registration.start(directory, KUBELET_SIDE)
    assert path.read_text() == "not a socket"
    deep = tmp_path / ("d" * 100)
    with pytest.raises(UsageError, match="longer than a unix socket's 107 bytes"):
        registration.start(deep, KUBELET_SIDE)


def _get(port: int) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_healthz_answers_200_while_the_plugin_probes_ready_500_once_it_does_not(
    tmp_path: Path,
) -> None:
    sock = tmp_path / "csi.sock"
    server = build_server(plugin_config(tmp_path), f"unix://{sock}", "node", "n")
    live = liveness.start(sock, 0, "127.0.0.1")
    try:
        assert _get(live.port) == (200, "ok\n")
        server.stop(0).wait()  # the plugin's socket no longer answers
        code, text = _get(live.port)
        assert code == 500
        assert text.startswith("Probe failed: UNAVAILABLE")
    finally:
        live.stop()
        server.stop(0)


def test_healthz_answers_500_when_probe_says_not_ready(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from google.protobuf import wrappers_pb2

    def not_ready(self: Any, request: Any, context: Any) -> Any:
        return csi_pb2.ProbeResponse(ready=wrappers_pb2.BoolValue(value=False))

    monkeypatch.setattr(IdentityService, "Probe", not_ready)
    sock = tmp_path / "csi.sock"
    server = build_server(plugin_config(tmp_path), f"unix://{sock}", "node", "n")
    live = liveness.start(sock, 0, "127.0.0.1")
    try:
        assert _get(live.port) == (500, "Probe answered not ready\n")
    finally:
        live.stop()
        server.stop(0)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _cli(tmp_path: Path, *args: str) -> list[str]:
    config = tmp_path / "flexhub.toml"
    config.write_text(
        f'state_dir = "{tmp_path / "state"}"\nlog_dir = "{tmp_path / "log"}"\n\n'
        f'[loopfile]\nroot = "{tmp_path / "loopfiles"}"\n'
    )
    return [sys.executable, "-m", "flexhub", "csi", "--config", str(config), *args]


def test_flexhub_csi_registers_serves_healthz_and_deregisters_on_sigterm(tmp_path: Path) -> None:
    sock, reg_dir, port = tmp_path / "plugin" / "csi.sock", tmp_path / "registry", _free_port()
    argv = _cli(tmp_path, "--mode", "node", "--node-id", "n", "--endpoint", f"unix://{sock}",
                "--registration-dir", str(reg_dir), "--kubelet-endpoint", str(KUBELET_SIDE),
                "--health-port", str(port))  # fmt: skip
    reg_sock = reg_dir / "flexhub.csi.k8s.io-reg.sock"
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not reg_sock.exists() or not sock.exists():
            assert proc.poll() is None, proc.communicate()[0].decode()
            assert time.monotonic() < deadline, "no registration socket after 60 s"
            time.sleep(0.2)
        with grpc.insecure_channel(f"unix://{reg_sock}") as channel:
            info = reg_rpc.RegistrationStub(channel).GetInfo(reg_pb.InfoRequest(), timeout=10)
        assert (info.name, info.endpoint) == (DRIVER_NAME, str(KUBELET_SIDE))
        deadline = time.monotonic() + 30
        while True:
            try:
                assert _get(port) == (200, "ok\n")
                break
            except OSError:
                assert time.monotonic() < deadline, "no /healthz after 30 s"
                time.sleep(0.2)
        os.kill(proc.pid, signal.SIGTERM)
        out = proc.communicate(timeout=30)[0].decode()
        assert proc.returncode == 0, out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not reg_sock.exists(), "the registration socket outlived a clean stop"
    assert not sock.exists()


def test_registration_dir_is_refused_in_controller_mode(tmp_path: Path) -> None:
    argv = _cli(tmp_path, "--mode", "controller", "--node-id", "n", "--endpoint",
                f"unix://{tmp_path / 'c.sock'}", "--registration-dir", str(tmp_path / "r"))  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "--registration-dir: only a node plugin" in proc.stderr + proc.stdout
    assert not (tmp_path / "r").exists() and not (tmp_path / "c.sock").exists()
