"""flexhub's CSI plugin in the VM rig's guest, as a node runs it: ``flexhub csi`` through the
relocatable runtime, one long-running process with its own node config, state and log under a
root-only directory, stopped with SIGTERM; and a small gRPC client there for the node calls
(the guest's unix socket is out of the host's reach)."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

import pytest

from tests.rig.vm import VM

#: Runs in the guest: one Node service call, the request as JSON on stdin; prints the status
#: code's name and message, and the reply (protobuf's JSON form).
CLIENT = r"""
import json, sys
import grpc
from google.protobuf import json_format
from flexhub.csi.proto import csi_pb2, csi_pb2_grpc
socket, method = sys.argv[1], sys.argv[2]
request = json_format.ParseDict(json.load(sys.stdin), getattr(csi_pb2, method + "Request")())
with grpc.insecure_channel("unix://" + socket) as channel:
    try:
        reply = getattr(csi_pb2_grpc.NodeStub(channel), method)(request, timeout=float(sys.argv[3]))
        print(json.dumps({"code": "OK", "message": "", "reply": json_format.MessageToDict(reply)}))
    except grpc.RpcError as exc:
        print(json.dumps({"code": exc.code().name, "message": exc.details()}))
"""
CLIENT_PATH = "/run/flexhub-csi-client.py"


def prepare(vm: VM, base: str, settings: str = "") -> str:
    """A fresh ``base`` (0700) with the node config (``settings``: more TOML) and the
    directories the runs use (state, log, mnt, stage). Returns the config's path."""
    vm.run(["rm", "-rf", base])
    vm.run(["mkdir", "-p", f"{base}/state", f"{base}/log", f"{base}/mnt", f"{base}/stage"])
    vm.run(["chmod", "0700", base])
    config = f"{base}/flexhub.toml"
    vm.write_file(
        config,
        f'state_dir = "{base}/state"\nlog_dir = "{base}/log"\nlock_timeout = 20\n{settings}',
    )
    return config


def start(vm: VM, base: str, mode: str = "both", node_id: str = "vm-node") -> int:
    """``flexhub csi`` on ``<base>/csi.sock`` with ``<base>/flexhub.toml`` (log
    ``<base>/plugin.log``); its pid once it listens."""
    socket = f"{base}/csi.sock"
    pid = vm.spawn(
        [vm.flexhub_python, "-I", "-m", "flexhub", "csi", "--mode", mode, "--node-id", node_id,
         "--endpoint", f"unix://{socket}", "--config", f"{base}/flexhub.toml"],
        log=f"{base}/plugin.log",
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while vm.run(["test", "-S", socket], check=False).rc != 0:
        if time.monotonic() > deadline:
            pytest.fail(
                f"flexhub csi did not listen: {vm.read_file(f'{base}/plugin.log')[-1500:]!r}"
            )
        time.sleep(1)
    return pid


def stop(vm: VM, base: str, pid: int) -> None:
    """SIGTERM; wait (30 s at most) until it removed its socket, as it does when it stops."""
    vm.run(["kill", "-TERM", str(pid)], check=False)
    deadline = time.monotonic() + 30
    while (
        vm.run(["test", "-S", f"{base}/csi.sock"], check=False).rc == 0
        and time.monotonic() < deadline
    ):
        time.sleep(0.5)


def node_call(
    vm: VM, base: str, method: str, request: Mapping[str, Any], timeout: float = 240
) -> tuple[str, str]:
    """A Node service call (``NodeStageVolume``, ...) on the plugin of ``base``, the request in
    protobuf's JSON form: ``(status code name, message)``, ``("OK", "")`` on success."""
    code, message, _ = node_answer(vm, base, method, request, timeout)
    return code, message


def node_answer(
    vm: VM, base: str, method: str, request: Mapping[str, Any], timeout: float = 240
) -> tuple[str, str, dict[str, Any]]:
    """:func:`node_call`, and the reply in protobuf's JSON form (``{}`` on an error)."""
    vm.write_file(CLIENT_PATH, CLIENT)
    res = vm.run(
        [vm.flexhub_python, "-I", CLIENT_PATH, f"{base}/csi.sock", method, str(timeout)],
        input=json.dumps(request),
        timeout=timeout + 60,
    )
    answer = json.loads(res.stdout.strip().splitlines()[-1])
    return str(answer["code"]), str(answer["message"]), dict(answer.get("reply") or {})
