"""A dead NFS server does not hold up other calls: several driver calls at once, real kernel.

Two pods mount an export whose server never answers while, at the same time, a third pod
mounts the live server's export and a fourth unmounts it. The two dead mounts run their
mount commands at the same moment (filesystem backends take only the pod directory's lock,
so they do not queue behind each other), and every call answers.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from flexhub.harness import Kubelet, go_json
from tests.rig.vm import GUEST_PYTHON, KUBELET_ENV
from tests.vm.test_nfs import (
    BASE,
    MOUNT_TIMEOUT,
    SILENT_HOST,
    SILENT_PORT,
    SILENT_SERVER,
    Rig,
    rig,
    share,
)

__all__ = ["rig"]  # the fixture

pytest_plugins = ["tests.rig.fixtures"]

LOG = logging.getLogger(__name__)


def _options(target: str, user: dict[str, str]) -> str:
    return go_json(
        Kubelet.mount_options(
            {"backend": "nfs", **user}, pv=target.rsplit("/", 1)[-1], pod_uid=target.split("/")[-4]
        )
    )


def _calls_in_log(rig: Rig) -> dict[str, dict[str, Any]]:
    log = rig.vm.read_file(f"{BASE}/log/flexhub.log").decode(errors="replace")
    records = [
        json.loads(line.split(" flexhub.calls: call ", 1)[1])
        for line in log.splitlines()
        if " flexhub.calls: call {" in line
    ]
    return {f"{r['op']} {r['dir']}": r for r in records}


def test_dead_server_mounts_do_not_hold_up_each_other_or_other_calls(rig: Rig) -> None:
    silent = rig.vm.spawn([GUEST_PYTHON, "-c", SILENT_SERVER])
    try:
        rig.sh(
            f"for i in $(seq 50); do ss -ltn | grep -q '{SILENT_HOST}:{SILENT_PORT} ' && exit 0;"
            " sleep 0.1; done; exit 1"
        )
        dead = {
            "server": SILENT_HOST,
            "share": "/export",
            "nfsVersion": "4.2",
            "mountOptions": f"port={SILENT_PORT}",
        }
        live = {**share(rig, "4.2"), "nfsVersion": "4.2"}
        leaving = rig.pod_dir()
        reply, _ = rig.mount(leaving, live)
        assert reply["status"] == "Success", reply
        calls = [("mount", rig.pod_dir(), dead), ("mount", rig.pod_dir(), dead)]
        calls += [("mount", rig.pod_dir(), live), ("unmount", leaving, {})]
        script = []
        for index, (op, target, user) in enumerate(calls):
            argv = f'{op} {target} "$(cat {BASE}/arg{index})"' if user else f"{op} {target}"
            if user:
                rig.vm.write_file(f"{BASE}/arg{index}", _options(target, user))
            env = " ".join(f"{k}={v}" for k, v in KUBELET_ENV.items())
            script.append(f"env -i {env} {rig.driver} {argv} > {BASE}/out{index} 2>&1 &")
        rig.vm.write_file(f"{BASE}/calls.sh", "\n".join([*script, "wait", f"touch {BASE}/done"]))
        rig.vm.run(["rm", "-f", f"{BASE}/done"])
        rig.vm.spawn(["/bin/sh", f"{BASE}/calls.sh"])
        # Both dead mounts have their mount command running at the same moment: neither
        # queued behind the other (each would otherwise wait for the other's lock).
        both = rig.sh(
            f"while [ ! -e {BASE}/done ]; do"  # sampled until every call has answered
            f" n=$(ps -eo args= | grep -c 'mount\\.nfs4* {SILENT_HOST}:');"
            ' [ "$n" -ge 2 ] && echo both && exit 0; sleep 0.1; done; echo never',
            timeout=300,
        )
        assert both.strip() == "both"
        rig.sh(f"for i in $(seq 1200); do [ -e {BASE}/done ] && exit 0; sleep 0.1; done; exit 1")

        replies = [json.loads(rig.vm.read_file(f"{BASE}/out{i}")) for i in range(len(calls))]
        assert [r["status"] for r in replies] == ["Failure", "Failure", "Success", "Success"]
        for reply in replies[:2]:
            assert f"did not answer within {MOUNT_TIMEOUT}s" in reply["message"], reply
        logged = _calls_in_log(rig)
        seconds = [logged[f"{op} {target}"]["ms"] / 1000 for op, target, _ in calls]
        # Figures only: 4 calls (and their imports) share the guest's one emulated CPU, so
        # their durations say little; the overlap above is what shows nothing queued.
        LOG.warning("4 concurrent calls, seconds inside flexhub: %s", seconds)
        assert rig.mount_commands() == []
        assert rig.mounts(calls[0][1]) == [] and rig.mounts(calls[1][1]) == []
        assert len(rig.mounts(calls[2][1])) == 1 and rig.mounts(leaving) == []
        reply, _ = rig.unmount(calls[2][1])
        assert reply["status"] == "Success", reply
    finally:
        rig.vm.run(["kill", str(silent)], check=False)
