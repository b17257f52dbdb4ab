"""The iSCSI provisioner at scale in the VM rig: N fileio LUNs made one call at a time.

    python3 benchmarks/iscsi_provision_vm.py [--luns 200] [--at 1,50,100,200] [--batch 25]

As root, from a checkout where the VM rig works (``.ci/install-rig.sh``). It boots a guest
(``tests/rig/vm.py``: qemu TCG, one vCPU, so EMULATED figures: they show how a call's cost
grows with the LUNs on the target, not what a real target host takes), starts sshd and the
kernel LIO target in it, and runs ``IscsiBackend.provision`` (the production runner, the real
``ssh`` to 127.0.0.1 and the remote program under rtslib-fb) for N claims of 1 MiB (sparse
fileio files on a tmpfs), then ``reclaim`` for each of them, newest first. Calls run in guest
processes of ``--batch`` calls each (flexhub's import is paid once a batch, not in a call).

It prints, for each LUN count of ``--at``, the seconds of the provision call that made that
many LUNs and of the reclaim call that left one fewer than that many (each the median of
that call and its two neighbours), and the size of the saved configuration
(``/etc/rtslib-fb-target/saveconfig.json``) at N. Then, for reference, what rtslib's whole
walk of the target costs at N LUNs in the guest: ``RTSRoot().dump()`` (what ``saveconfig``
writes) and a lookup of every storage object. Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # the VM rig lives in the checkout's tests/
    sys.path.insert(1, str(REPO))

from tests.rig import services  # noqa: E402
from tests.rig.vm import VM, RigError  # noqa: E402

MiB = 1024 * 1024
LUNS = f"{services.LUN_DIR}/bench"
PREFIX = "iqn.2026-01.io.flexhub.rig:bench"
SAVED = "/etc/rtslib-fb-target/saveconfig.json"
LABEL = " | emulated"
#: Rounds of a provision and a reclaim call at each sampled LUN count (``--fill rtslib``).
SAMPLES = 3

#: Runs in the guest: provisioner calls, the requests on stdin; their answers and seconds.
CALLS = r"""
import json, sys, time
from pathlib import Path
from flexhub.config import NodeConfig
from flexhub.errors import FlexhubError
from flexhub.node.services import Node
from flexhub.provisioning import Claim
from flexhub.volume import Secret, Secrets
from flexhub_iscsi import IscsiBackend

backend = IscsiBackend(Node(NodeConfig(state_dir=Path("/var/lib/flexhub-bench-lio")), "iscsi"))
answers = []
for req in json.load(sys.stdin):
    secrets = Secrets({k: Secret(v) for k, v in req["secrets"].items()})
    started = time.monotonic()
    try:
        if req["op"] == "provision":
            p = backend.provision(Claim(**req["claim"]), req["parameters"], secrets)
            out = {"options": dict(p.options), "reclaim": dict(p.reclaim)}
        else:
            backend.reclaim(req["options"], req["reclaim"], secrets)
            out = {}
    except FlexhubError as exc:
        out = {"error": exc.message}
    out["seconds"] = time.monotonic() - started
    answers.append(out)
print(json.dumps(answers))
"""

#: Runs in the guest under the system python3 (rtslib-fb): rtslib's whole walk, timed.
WALK = r"""
import json, time
import rtslib_fb
started = time.monotonic()
root = rtslib_fb.RTSRoot()
dump = root.dump()
dumped = time.monotonic() - started
started = time.monotonic()
objects = [so.name for so in root.storage_objects]
listed = time.monotonic() - started
print(json.dumps({"dump": dumped, "list": listed, "objects": len(objects),
                  "bytes": len(json.dumps(dump, sort_keys=True, indent=2))}))
"""


#: Runs in the guest under the system python3: ``count`` more LUNs as the provisioner makes
#: them (a sparse 1 MiB file, its fileio object, a target with TPG 1, LUN 0, a portal, an ACL
#: with CHAP), all straight through rtslib, then one save of the configuration.
FILL = r"""
import json, os, sys, uuid
import rtslib_fb as lib
spec = json.loads(sys.argv[1])
root = lib.RTSRoot()
fabric = lib.FabricModule("iscsi")
for _ in range(spec["count"]):
    name = "pvc-" + str(uuid.uuid4())
    path = os.path.join(spec["directory"], name + ".img")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, 1 << 20)
    os.close(fd)
    so = lib.FileIOStorageObject(name, dev=path, size=1 << 20, write_back=False)
    tpg = lib.TPG(lib.Target(fabric, spec["prefix"] + ":" + name), 1)
    lun = lib.LUN(tpg, 0, storage_object=so)
    lib.NetworkPortal(tpg, "127.0.0.1", 3260)
    tpg.set_attribute("generate_node_acls", "0")
    acl = lib.NodeACL(tpg, spec["initiator"])
    lib.MappedLUN(acl, 0, tpg_lun=lun)
    acl.chap_userid = "bench-chap-user"
    acl.chap_password = "Bench-Chap-Pw-4kR8q2"
    tpg.set_attribute("authentication", "1")
    tpg.enable = True
root.save_to_file("/etc/rtslib-fb-target/saveconfig.json")
"""


class BenchError(RuntimeError):
    """A step of the benchmark failed; the message is one line."""


def run_calls(vm: VM, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    res = vm.run(
        [vm.flexhub_python, "/tmp/bench-lio-calls.py"],
        input=json.dumps(requests),
        timeout=120 + 120 * len(requests),
        check=False,
    )
    if res.rc != 0:
        raise BenchError(f"guest calls failed: {res.output.strip().splitlines()[-1:]}")
    answers: list[dict[str, Any]] = json.loads(res.stdout.strip().splitlines()[-1])
    for answer in answers:
        if "error" in answer:
            raise BenchError(f"a call failed: {answer['error']}")
    return answers


def around(seconds: list[float], n: int) -> float:
    """The median of call ``n`` (1-based) and its two neighbours."""
    window = seconds[max(0, n - 2) : min(len(seconds), n + 1)]
    return statistics.median(window)


def benchmark(vm: VM, luns: int, at: list[int], batch: int, fill: str) -> list[str]:
    ssh = services.start_sshd(vm)
    services._ensure_lio(vm)
    vm.run(["mkdir", "-p", "-m", "0700", LUNS])
    vm.write_file("/tmp/bench-lio-calls.py", CALLS)
    secrets = {
        "ssh-privatekey": ssh.private_key,
        "ssh-knownhosts": ssh.known_hosts,
        "node.session.auth.username": "bench-chap-user",
        "node.session.auth.password": "Bench-Chap-Pw-4kR8q2",
    }
    parameters = {
        "targetHost": ssh.host,
        "sshPort": str(ssh.port),
        "portals": "127.0.0.1:3260",
        "iqnPrefix": PREFIX,
        "fileioDirectory": LUNS,
        "initiators": services.GUEST_INITIATOR,
        "nodeSecretName": "iscsi-chap",
        "nodeSecretNamespace": "bench",
    }
    if fill == "rtslib":
        return sampled(vm, luns, at, parameters, secrets)
    made: list[dict[str, Any]] = []
    provision_s: list[float] = []
    while len(made) < luns:
        count = min(batch, luns - len(made))
        requests = [provision_request(parameters, secrets) for _ in range(count)]
        for answer in run_calls(vm, requests):
            provision_s.append(answer.pop("seconds"))
            made.append(answer)
        print(f"  provisioned {len(made)}/{luns}", file=sys.stderr, flush=True)
    saved = len(vm.read_file(SAVED))
    walk = rtslib_walk(vm)
    reclaim_s: list[float] = []  # reclaim_s[i]: the call that left luns - i - 1 LUNs
    pending = list(reversed(made))
    while pending:
        chunk, pending = pending[:batch], pending[batch:]
        requests = [reclaim_request(pv, secrets) for pv in chunk]
        for answer in run_calls(vm, requests):
            reclaim_s.append(answer["seconds"])
        print(f"  reclaimed {len(reclaim_s)}/{luns}", file=sys.stderr, flush=True)
    reclaim_by_n = list(reversed(reclaim_s))  # [n - 1]: the reclaim of the n-th LUN
    rows = [(n, around(provision_s, n), around(reclaim_by_n, n)) for n in at if 1 <= n <= luns]
    total = f"total: provision {sum(provision_s):.0f} s, reclaim {sum(reclaim_s):.0f} s; "
    return report(f"{luns} fileio LUNs of 1 MiB (sparse), every one provisioned", rows,
                  total, saved, walk)  # fmt: skip


def provision_request(parameters: dict[str, str], secrets: dict[str, str]) -> dict[str, Any]:
    claim = {"uid": str(uuid.uuid4()), "namespace": "bench", "name": "c", "size": MiB}
    return {"op": "provision", "claim": claim, "parameters": parameters, "secrets": secrets}


def reclaim_request(pv: dict[str, Any], secrets: dict[str, str]) -> dict[str, Any]:
    return {"op": "reclaim", "options": pv["options"], "reclaim": pv["reclaim"], "secrets": secrets}


def rtslib_walk(vm: VM) -> dict[str, Any]:
    vm.write_file("/tmp/bench-lio-walk.py", WALK)
    walk: dict[str, Any] = json.loads(vm.run(["/usr/bin/python3", "/tmp/bench-lio-walk.py"]).stdout)
    return walk


def sampled(
    vm: VM, luns: int, at: list[int], parameters: dict[str, str], secrets: dict[str, str]
) -> list[str]:
    """``--fill rtslib``: the LUNs between the counts of ``at`` made straight through rtslib
    in the guest (as the provisioner makes them, one save at the end); at each count n,
    SAMPLES rounds of a provision call (making the n-th LUN) and the reclaim of that LUN."""
    vm.write_file("/tmp/bench-lio-fill.py", FILL)
    have = 0
    rows = []
    for n in sorted(x for x in at if 1 <= x <= luns):
        if n - 1 > have:
            spec = {"count": n - 1 - have, "directory": LUNS, "prefix": PREFIX,
                    "initiator": services.GUEST_INITIATOR}  # fmt: skip
            vm.run(["/usr/bin/python3", "/tmp/bench-lio-fill.py", json.dumps(spec)], timeout=900)
            have = n - 1
        provision_s, reclaim_s = [], []
        for _ in range(SAMPLES):
            (pv,) = run_calls(vm, [provision_request(parameters, secrets)])
            provision_s.append(pv.pop("seconds"))
            (gone,) = run_calls(vm, [reclaim_request(pv, secrets)])
            reclaim_s.append(gone["seconds"])
        rows.append((n, statistics.median(provision_s), statistics.median(reclaim_s)))
        print(f"  sampled at {n} LUNs", file=sys.stderr, flush=True)
    (pv,) = run_calls(vm, [provision_request(parameters, secrets)])
    saved = len(vm.read_file(SAVED))
    walk = rtslib_walk(vm)
    what = f"{luns} fileio LUNs of 1 MiB (sparse), the others made through rtslib"
    return report(what, rows, "", saved, walk)


def report(
    what: str, rows: list[tuple[int, float, float]], total: str, saved: int, walk: dict[str, Any]
) -> list[str]:
    lines = [f"iscsi provisioning, {what}{LABEL}"]
    lines.append(f"{'LUNs':>6} {'provision s':>12} {'reclaim s':>10}")
    for n, provisioned, reclaimed in rows:
        lines.append(f"{n:>6} {provisioned:>12.2f} {reclaimed:>10.2f}")
    lines.append(f"{total}saved configuration at {walk['objects']} LUNs: {saved // 1024} KiB")
    lines.append(
        f"rtslib at {walk['objects']} LUNs: RTSRoot().dump() {walk['dump']:.2f} s "
        f"({walk['bytes'] // 1024} KiB), every storage object listed {walk['list']:.2f} s" + LABEL
    )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--luns", type=int, default=200, help="claims to provision")
    parser.add_argument("--at", default="1,50,100,200", help="LUN counts to report")
    parser.add_argument("--batch", type=int, default=25, help="calls per guest process")
    parser.add_argument(
        "--fill",
        choices=("provision", "rtslib"),
        default="provision",
        help="make every LUN through the provisioner, or only the sampled ones (quick)",
    )
    args = parser.parse_args()
    try:
        at = [int(x) for x in args.at.split(",") if x.strip()]
    except ValueError:
        parser.error("--at wants a comma-separated list of LUN counts")
    if not 1 <= args.luns <= 400 or args.batch < 1:
        parser.error("want 1 <= --luns <= 400 (the guest's tmpfs holds the files), --batch >= 1")
    if os.geteuid() != 0:
        print("benchmark: needs root (the VM rig)", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        with VM() as vm:
            lines = benchmark(vm, args.luns, at, args.batch, args.fill)
    except (BenchError, RigError) as exc:
        print(f"benchmark: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 1
    for line in lines:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
