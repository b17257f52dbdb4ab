"""Run a backend's provisioning side in the guest, as ``flexhub provisioner`` would: the
backend class with a real :class:`~flexhub.node.Node` (real runner, real mounts) calls
``provision``/``reclaim`` one after the other in one python process (python's start-up under
TCG is most of a call's cost). The request, secrets included, goes in on stdin, never argv.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

from tests.rig.vm import VM

__all__ = ["Op", "claim", "run_ops"]

LOG = logging.getLogger(__name__)

#: (The mount timeout is 20 s: a fresh smbd under TCG may take more than 8 s to answer the
#: first mount; a dead server is not what these tests are about.)
#: Runs every op of the request and prints one JSON list: per op, its result or its error.
SCRIPT = r"""
import json, logging, sys
from pathlib import Path
from flexhub.config import NodeConfig
from flexhub.errors import FlexhubError, InvalidOptions
from flexhub.node import Node
from flexhub.provisioning import Claim
from flexhub.volume import Secret, Secrets

request = json.load(sys.stdin)
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
name = request["backend"]
config = NodeConfig(
    state_dir=Path(request["state_dir"]), log_dir=Path(request["state_dir"]) / "log",
    mount_timeout=20, unmount_timeout=8, backends={name: {"stat_timeout": 3}},
)
if name == "nfs":
    from flexhub_nfs import NfsBackend as Backend
else:
    from flexhub_cifs import CifsBackend as Backend
backend = Backend(Node(config, backend=name))
secrets = Secrets({k: Secret(v) for k, v in request["secrets"].items()})
out = []
for op in request["ops"]:
    try:
        if op["op"] == "provision":
            c = op["claim"]
            made = backend.provision(Claim(**c), op["parameters"], secrets)
            # The PV exactly as flexhub provisioner writes it (what kubelet then reads).
            from flexhub.provisioner.pvs import build_pv
            pv = build_pv(Claim(**c), "class", "Delete", name, "delete", backend.reclaim_on,
                          made, "k8s/flexhub", "flexhub")
            out.append({"options": dict(made.options), "reclaim": dict(made.reclaim),
                        "size": made.size, "secret": made.secret, "fs_type": made.fs_type,
                        "pv": pv["spec"]["flexVolume"]})
        else:
            backend.reclaim(op["options"], op["reclaim"], secrets)
            out.append({"reclaimed": True})
    except InvalidOptions as exc:
        out.append({"error": "InvalidOptions", "message": str(exc)})
    except FlexhubError as exc:
        out.append({"error": type(exc).__name__, "message": str(exc)})
print(json.dumps(out))
"""


@dataclass
class Op:
    """One call: ``provision`` (claim, parameters) or ``reclaim`` (options, reclaim)."""

    op: str
    claim: dict[str, Any] | None = None
    parameters: dict[str, str] | None = None
    options: dict[str, str] | None = None
    reclaim: dict[str, str] | None = None

    def request(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


def claim(namespace: str = "team-a", name: str = "data", **extra: Any) -> dict[str, Any]:
    """A claim as the provisioner reads it (a fresh uid)."""
    return {
        "uid": str(uuid.uuid4()),
        "namespace": namespace,
        "name": name,
        "size": 1 << 30,
        **extra,
    }


def run_ops(
    vm: VM, backend: str, state_dir: str, ops: list[Op], secrets: dict[str, str] | None = None
) -> tuple[list[dict[str, Any]], float]:
    """Run ``ops`` in one guest process; return their results and the seconds it took."""
    request = {
        "backend": backend,
        "state_dir": state_dir,
        "secrets": secrets or {},
        "ops": [op.request() for op in ops],
    }
    started = time.monotonic()
    result = vm.run([vm.flexhub_python, "-I", "-c", SCRIPT], input=json.dumps(request), timeout=300)
    elapsed = time.monotonic() - started
    for value in (secrets or {}).values():  # never in a reply, a log line or an error
        assert value not in result.output, "a secret reached the provisioner's output"
    lines = result.stdout.strip().splitlines()
    assert lines, result.output
    answers: list[dict[str, Any]] = json.loads(lines[-1])
    if any("error" in answer for answer in answers):
        LOG.warning("provisioning in the guest: %s", result.stderr[-4000:])
    assert len(answers) == len(ops), result.output
    return answers, elapsed
