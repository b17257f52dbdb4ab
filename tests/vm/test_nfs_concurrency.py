"""A dead NFS server does not hold up other calls: several driver calls at once, real kernel.

Two pods mount an export whose server never answers while, at the same time, a third pod
mounts the live server's export and a fourth unmounts it. The two dead mounts run their
mount commands at the same moment (filesystem backends take only the pod directory's lock,
so they do not queue behind each other), and every call answers.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

from flexhub.admin.harness import Kubelet, go_json
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


def test_create_sub_path_mounts_at_once(rig: Rig) -> None:
    """Four pods mount at once with ``createSubPath`` (v4.2 and v3): two ask for the same new
    sub-directory, two for new siblings, all under one new parent. Every call answers Success,
    each pod sees exactly its directory on the server, each directory has ``subPathMode``, and
    no temporary mount or directory of any call is left behind; the unmounts, also all at
    once, leave nothing mounted."""
    tag = uuid.uuid4().hex[:6]
    subs = [f"conc-{tag}/a", f"conc-{tag}/shared", f"conc-{tag}/b", f"conc-{tag}/shared"]
    versions = ["4.2", "3", "3", "4.2"]
    calls = []
    for sub, version in zip(subs, versions, strict=True):
        user = {
            **share(rig, version),
            "nfsVersion": version,
            "subPath": sub,
            "createSubPath": "true",
            "subPathMode": "0770",
        }
        calls.append(("mount", rig.pod_dir(), user))
    at_once(rig, calls, "mount")
    # how many calls had their temporary mount up at one instant (a figure: the guest's one
    # emulated CPU decides how much they overlap)
    LOG.warning(
        "createSubPath mounts at once: %s temporary mounts seen together",
        rig.sh(f"cat {BASE}/overlap 2>/dev/null || echo 0").strip(),
    )
    for index, (_, target, _) in enumerate(calls):
        rig.vm.write_file(f"{target}/pod{index}", str(index))
    assert rig.sh(f"ls {rig.server_path(subs[0])}") == "pod0\n"
    assert rig.sh(f"ls {rig.server_path(subs[2])}") == "pod2\n"
    assert rig.sh(f"ls {rig.server_path(subs[1])}") == "pod1\npod3\n"
    assert rig.sh(f"ls {rig.server_path(f'conc-{tag}')}") == "a\nb\nshared\n"
    modes = rig.sh(f"cd {rig.server_path()} && stat -c %a {subs[0]} {subs[1]} {subs[2]}")
    assert modes == "770\n770\n770\n"
    assert rig.sh(f"ls -A {BASE}/state/nfs-tmp") == ""
    assert rig.sh(f"grep -c ' {BASE}/state/nfs-tmp' /proc/mounts", check=False) == "0\n"
    at_once(rig, [("unmount", target, {}) for _, target, _ in calls], "unmount")
    for _, target, _ in calls:
        assert rig.mounts(target) == []
    assert rig.mount_commands() == []


def at_once(rig: Rig, calls: list[tuple[str, str, dict[str, str]]], name: str) -> None:
    """Run the driver calls all at once in the guest; assert each answers Success. While
    they run, the most ``nfs-tmp`` entries seen at one instant is written to ``BASE/overlap``."""
    script = []
    env = " ".join(f"{k}={v}" for k, v in KUBELET_ENV.items())
    for index, (op, target, user) in enumerate(calls):
        argv = f'{op} {target} "$(cat {BASE}/{name}-arg{index})"' if user else f"{op} {target}"
        if user:
            rig.vm.write_file(f"{BASE}/{name}-arg{index}", _options(target, user))
        script.append(f"env -i {env} {rig.driver} {argv} > {BASE}/{name}-out{index} 2>&1 &")
    rig.vm.write_file(f"{BASE}/{name}.sh", "\n".join([*script, "wait", f"touch {BASE}/done"]))
    rig.vm.run(["rm", "-f", f"{BASE}/done", f"{BASE}/overlap"])
    rig.vm.spawn(["/bin/sh", f"{BASE}/{name}.sh"])
    rig.sh(
        f"max=0; while [ ! -e {BASE}/done ]; do"
        f" n=$(ls {BASE}/state/nfs-tmp 2>/dev/null | wc -l);"
        ' [ "$n" -gt "$max" ] && max=$n; sleep 0.05; done;'
        f" echo $max > {BASE}/overlap",
        timeout=300,
    )
    replies = [json.loads(rig.vm.read_file(f"{BASE}/{name}-out{i}")) for i in range(len(calls))]
    assert replies == [{"status": "Success"}] * len(calls), replies
