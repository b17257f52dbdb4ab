"""The iscsi backend against a real kernel LIO target, driven exactly like kubelet drives it.

The guest runs the installed driver (``vm.call_driver``: ``env -i``, stdin /dev/null, stderr
merged into stdout) with Go-style JSON options, including the pod keys and base64
``kubernetes.io/secret/*`` values; every reply must be one strict JSON object. The last test
scans every file flexhub wrote (state, log, plugin directory) and every reply for every CHAP
value used, raw and base64.

Call latencies are written to ``$FLEXHUB_ISCSI_TIMINGS`` (default
``/tmp/flexhub-iscsi-timings.json``) on the host.
"""

from __future__ import annotations

import base64
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.rig import services
from tests.rig.services import Chap, IscsiTarget
from tests.rig.vm import VM

pytest_plugins = ["tests.rig.fixtures"]

MiB = 1024 * 1024
ROOT = "/var/lib/flexhub-iscsi-test"
STATE = f"{ROOT}/state"
LOGS = f"{ROOT}/log"
PLUGINS = f"{ROOT}/plugins"
CONFIG = f"{ROOT}/flexhub.toml"
PODS = "/var/lib/kubelet/pods"

#: Every CHAP value used by a test, and every reply, for the scans after each CHAP test.
USED_SECRETS: set[str] = set()
REPLIES: list[str] = []
TIMINGS: dict[str, list[float]] = {}


def go_json(options: dict[str, str]) -> str:
    """``json.Marshal`` of a ``map[string]string``, as kubelet writes it."""
    text = json.dumps(options, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    for char, escape in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026")):
        text = text.replace(char, escape)
    return text


class Kubelet:
    """Calls the installed driver the way kubelet does."""

    def __init__(self, vm: VM, driver: str) -> None:
        self.vm = vm
        self.driver = driver
        self.pods = 0

    def call(self, kind: str, argv: list[str]) -> dict[str, object]:
        started = time.monotonic()
        rc, output = self.vm.call_driver(self.driver, argv, timeout=240)
        TIMINGS.setdefault(kind, []).append(round(time.monotonic() - started, 2))
        REPLIES.append(output)
        reply = json.loads(output)  # strict: nothing but the one JSON object
        assert isinstance(reply, dict)
        assert (rc == 0) == (reply["status"] == "Success"), (rc, output)
        return reply

    def pod_dir(self, pv: str) -> str:
        self.pods += 1
        uid = f"0000-{self.pods:04d}-{os.getpid()}"
        path = f"{PODS}/{uid}/volumes/k8s~flexhub/{pv}"
        self.vm.run(["mkdir", "-p", "-m", "0750", path])
        return path

    def mount(
        self,
        target: IscsiTarget,
        lun: int = 0,
        *,
        secrets: dict[str, str] | None = None,
        fs_type: str = "ext4",
        pv: str = "pv",
        **extra: str,
    ) -> tuple[str, dict[str, object]]:
        directory = self.pod_dir(pv)
        options = {
            "backend": "iscsi",
            "targetPortal": target.portal,
            "iqn": target.iqn,
            "lun": str(lun),
            "kubernetes.io/fsType": fs_type,
            "kubernetes.io/readwrite": "rw",
            "kubernetes.io/pvOrVolumeName": pv,
            "kubernetes.io/pod.name": "web-0",
            "kubernetes.io/pod.namespace": "default",
            "kubernetes.io/pod.uid": directory.split("/")[-4],  # .../pods/<uid>/volumes/...
            "kubernetes.io/serviceAccount.name": "default",
            **extra,
        }
        for key, value in (secrets or {}).items():
            USED_SECRETS.add(value)
            options[f"kubernetes.io/secret/{key}"] = base64.b64encode(value.encode()).decode()
        return directory, self.call("mount", ["mount", directory, go_json(options)])

    def unmount(self, directory: str) -> dict[str, object]:
        return self.call("unmount", ["unmount", directory])


@pytest.fixture(scope="module")
def kubelet(vm: VM) -> Iterator[Kubelet]:
    vm.run(["mkdir", "-p", ROOT])
    vm.write_file(
        CONFIG,
        f'state_dir = "{STATE}"\nlog_dir = "{LOGS}"\nlog_level = "debug"\n'
        # Short bounds where the tests are about the behaviour, not the default: the
        # target-down unmount waits one unmount_timeout and retries the release every
        # release_retry_interval (30 s each by default); the dead and hung portals of these
        # modules wait out login_timeout (60 s by default), which stays long enough for the
        # other volume's calls that must finish while a mount hangs there.
        "unmount_timeout = 10\nrelease_retry_interval = 5\n"
        "[iscsi]\ndevice_timeout = 30\nmultipath_timeout = 20\nlogin_timeout = 30\n",
    )
    driver = vm.install_flexhub(PLUGINS, config=CONFIG)
    yield Kubelet(vm, driver)
    path = Path(os.environ.get("FLEXHUB_ISCSI_TIMINGS", "/tmp/flexhub-iscsi-timings.json"))
    failures = [r.strip() for r in REPLIES if '"Failure"' in r]
    path.write_text(json.dumps({"seconds": TIMINGS, "failures": failures}, indent=1) + "\n")


@pytest.fixture
def clean(vm: VM) -> Iterator[None]:
    yield
    services.reset_iscsi(vm)


def sessions(vm: VM, iqn: str) -> list[str]:
    out = vm.run(["iscsiadm", "-m", "session"], check=False).stdout
    return [line for line in out.splitlines() if iqn in line.split()]


def node_records(vm: VM, iqn: str) -> list[str]:
    res = vm.run(["iscsiadm", "-m", "node", "-T", iqn], check=False)
    return [] if res.rc == 21 else [res.stdout or res.stderr]


def source_of(vm: VM, directory: str) -> str:
    return vm.run(["findmnt", "-n", "-o", "SOURCE", "--target", directory]).stdout.strip()


def write(vm: VM, directory: str, name: str, text: str) -> None:
    vm.run(["/bin/sh", "-c", f"printf %s '{text}' > {directory}/{name} && sync"])


def read(vm: VM, directory: str, name: str) -> str:
    return vm.run(["cat", f"{directory}/{name}"]).stdout


def needles() -> set[str]:
    found = set()
    for value in USED_SECRETS:
        found.add(value)
        found.add(base64.b64encode(value.encode()).decode())
    return found


def scan_files(vm: VM) -> list[str]:
    """Assert that no file under flexhub's state, log and plugin directories holds a CHAP
    value (raw or base64); returns the files scanned."""
    # -xdev: flexhub's own files, not the filesystems of volumes staged below state_dir
    files = vm.run(["find", STATE, LOGS, PLUGINS, "-xdev", "-type", "f"]).stdout.split()
    for path in files:
        data = vm.read_file(path).decode("utf-8", "replace")
        for needle in needles():
            assert needle not in data, f"a CHAP value is in {path}"
    return files


def assert_no_chap_shown(vm: VM, since: int) -> None:
    """After a test's calls with CHAP: no reply since ``REPLIES[since]`` and no file under
    flexhub's state, log and plugin directories holds a CHAP value used so far (raw or
    base64). Fails when the test made no call to judge."""
    replies = REPLIES[since:]
    assert replies and USED_SECRETS, "no driver call with CHAP to scan after"
    files = scan_files(vm)
    assert any(f.endswith("flexhub.log") for f in files), files
    for reply in replies:
        for needle in needles():
            assert needle not in reply, "a CHAP value is in a reply"


# --------------------------------------------------------------------------------------------


def test_two_luns_refcount_and_remount(vm: VM, kubelet: Kubelet, clean: None) -> None:
    """LUN 0 written, LUN 1 mounted; unmounting LUN 0 keeps the session for LUN 1; the last
    unmount logs out and deletes the node records; a remount finds LUN 0's data intact."""
    target = services.iscsi_target(vm, lun_sizes=[64 * MiB, 48 * MiB])
    zero, reply = kubelet.mount(target, 0, pv="pv-lun0")
    assert reply == {"status": "Success"}
    write(vm, zero, "data", "lun zero survives")
    one, reply = kubelet.mount(target, 1, pv="pv-lun1")
    assert reply == {"status": "Success"}
    assert len(sessions(vm, target.iqn)) == 1  # one session shared by both LUNs

    assert kubelet.unmount(zero) == {"status": "Success"}
    assert len(sessions(vm, target.iqn)) == 1, "the other LUN's session was logged out"
    write(vm, one, "after", "lun one still works")
    vm.run(["sync"])
    assert read(vm, one, "after") == "lun one still works"
    assert vm.run(["mountpoint", "-q", zero], check=False).rc != 0

    assert kubelet.unmount(one) == {"status": "Success"}
    assert sessions(vm, target.iqn) == []
    assert node_records(vm, target.iqn) == []
    assert services.session_disks(vm, target.iqn) == []

    again, reply = kubelet.mount(target, 0, pv="pv-lun0")
    assert reply == {"status": "Success"}
    assert read(vm, again, "data") == "lun zero survives"
    # idempotent: a second pod of the same LUN shares the session and staging
    second, reply = kubelet.mount(target, 0, pv="pv-lun0")
    assert reply == {"status": "Success"} and len(sessions(vm, target.iqn)) == 1
    assert read(vm, second, "data") == "lun zero survives"
    assert kubelet.unmount(second) == {"status": "Success"}
    assert len(sessions(vm, target.iqn)) == 1
    assert kubelet.unmount(again) == {"status": "Success"}
    assert sessions(vm, target.iqn) == [] and node_records(vm, target.iqn) == []


SESSION_CHAP = Chap("flexhub-sess-user", "Sess-Pw-7f3kq9Xz")
DISCOVERY_CHAP = Chap("flexhub-disc-user", "Disc-Pw-2b8mL4vR")


def chap_secrets(session: Chap, discovery: Chap | None = None) -> dict[str, str]:
    secrets = {
        "node.session.auth.username": session.userid,
        "node.session.auth.password": session.password,
    }
    if discovery is not None:
        secrets["discovery.sendtargets.auth.username"] = discovery.userid
        secrets["discovery.sendtargets.auth.password"] = discovery.password
    return secrets


def test_chap_discovery_and_session(vm: VM, kubelet: Kubelet, clean: None) -> None:
    since = len(REPLIES)
    target = services.iscsi_target(
        vm,
        session_chap=SESSION_CHAP,
        discovery_chap=DISCOVERY_CHAP,
        initiators=[services.GUEST_INITIATOR],
    )
    directory, reply = kubelet.mount(
        target,
        secrets=chap_secrets(SESSION_CHAP, DISCOVERY_CHAP),
        chapAuthDiscovery="true",
        chapAuthSession="true",
    )
    assert reply == {"status": "Success"}
    write(vm, directory, "chap", "ok")
    files = scan_files(vm)  # while mounted: journal records exist
    assert any("/volumes/" in f for f in files) and any("/pods/" in f for f in files)
    # open-iscsi's discovery record does not keep the discovery credentials
    found = vm.run(["grep", "-rlF", DISCOVERY_CHAP.password, "/etc/iscsi"], check=False)
    assert found.rc == 1, found.stdout
    assert kubelet.unmount(directory) == {"status": "Success"}
    assert sessions(vm, target.iqn) == [] and node_records(vm, target.iqn) == []
    # and once logged out, nothing under /etc/iscsi holds any CHAP value
    found = vm.run(
        ["grep", "-rlF", "-e", DISCOVERY_CHAP.password, "-e", SESSION_CHAP.password, "/etc/iscsi"],
        check=False,
    )
    assert found.rc == 1, found.stdout
    assert_no_chap_shown(vm, since)


@pytest.mark.parametrize("which", ["session", "discovery"])
def test_chap_wrong_password_fails_clearly(
    vm: VM, kubelet: Kubelet, clean: None, which: str
) -> None:
    target = services.iscsi_target(
        vm,
        session_chap=SESSION_CHAP,
        discovery_chap=DISCOVERY_CHAP,
        initiators=[services.GUEST_INITIATOR],
    )
    since = len(REPLIES)
    wrong = f"Wrong-{which}-Pw-55xq"
    session = Chap(SESSION_CHAP.userid, wrong if which == "session" else SESSION_CHAP.password)
    discovery = Chap(
        DISCOVERY_CHAP.userid, wrong if which == "discovery" else DISCOVERY_CHAP.password
    )
    directory, reply = kubelet.mount(
        target,
        secrets=chap_secrets(session, discovery),
        chapAuthDiscovery="true",
        chapAuthSession="true",
    )
    assert reply["status"] == "Failure"
    message = str(reply["message"])
    assert "authentication failed" in message or "authenticate" in message, message
    assert "CHAP" in message, message
    for value in (wrong, SESSION_CHAP.password, DISCOVERY_CHAP.password):
        assert value not in message
        assert base64.b64encode(value.encode()).decode() not in message
    assert sessions(vm, target.iqn) == []
    assert vm.run(["mountpoint", "-q", directory], check=False).rc != 0
    assert_no_chap_shown(vm, since)


def test_foreign_filesystem_is_refused_and_kept(vm: VM, kubelet: Kubelet, clean: None) -> None:
    target = services.iscsi_target(vm, lun_sizes=[320 * MiB])  # mkfs.xfs needs 300 MB
    services.lun_mkfs(vm, target, 0, "xfs")
    before = vm.run(["sha256sum", target.lun_paths[0]]).stdout.split()[0]
    directory, reply = kubelet.mount(target, fs_type="ext4")
    assert reply["status"] == "Failure"
    assert "xfs" in str(reply["message"])
    after = vm.run(["sha256sum", target.lun_paths[0]]).stdout.split()[0]
    assert after == before, "the LUN was modified"
    assert vm.run(["mountpoint", "-q", directory], check=False).rc != 0
    assert sessions(vm, target.iqn) == []


def test_expandfs_after_the_lun_grew(vm: VM, kubelet: Kubelet, clean: None) -> None:
    target = services.iscsi_target(vm, lun_sizes=[64 * MiB])
    directory, reply = kubelet.mount(target, pv="pv-grow")
    assert reply == {"status": "Success"}

    def size() -> int:
        out = vm.run(["df", "-B1", "--output=size", directory]).stdout.split()
        return int(out[-1])

    old = size()
    services.grow_lun(vm, target, 0, 160 * MiB)
    options = {
        "backend": "iscsi",
        "targetPortal": target.portal,
        "iqn": target.iqn,
        "lun": "0",
        "kubernetes.io/fsType": "ext4",
        "kubernetes.io/readwrite": "rw",
        "kubernetes.io/pvOrVolumeName": "pv-grow",
    }
    reply = kubelet.call(
        "expandfs",
        ["expandfs", go_json(options), "", directory, str(160 * MiB), str(64 * MiB)],
    )
    assert reply["status"] == "Success", reply
    assert size() > old + 64 * MiB
    # asking for more than the LUN has is a Failure, never a pretend success
    reply = kubelet.call(
        "expandfs",
        ["expandfs", go_json(options), "", directory, str(512 * MiB), str(160 * MiB)],
    )
    assert reply["status"] == "Failure" and "grow the LUN" in str(reply["message"])
    assert kubelet.unmount(directory) == {"status": "Success"}


def test_two_portals_one_down(vm: VM, kubelet: Kubelet, clean: None) -> None:
    target = services.iscsi_target(vm, portals=["127.0.0.1:3260", "127.0.0.2:3260"])
    services.portal_down(vm, target, "127.0.0.2:3260")
    directory, reply = kubelet.mount(
        target, targetPortal="127.0.0.2:3260", portals="127.0.0.1:3260"
    )
    assert reply == {"status": "Success"}
    write(vm, directory, "one-path", "fine")
    assert [s for s in sessions(vm, target.iqn) if "127.0.0.1:3260" in s]
    assert kubelet.unmount(directory) == {"status": "Success"}
    assert sessions(vm, target.iqn) == [] and node_records(vm, target.iqn) == []


def flexhub_log(vm: VM, word: str) -> str:
    """The last lines of flexhub's log that mention ``word`` (for a failure message)."""
    text = vm.run(["cat", f"{LOGS}/flexhub.log"], check=False).stdout
    return "\n".join([line for line in text.splitlines() if word in line][-40:])


def path_states(vm: VM) -> list[str]:
    """The dm state of each path of the one multipath map (``multipath -ll``)."""
    out = vm.run(["multipath", "-ll"], check=False).stdout
    return [
        w
        for line in out.splitlines()
        if "sd" in line
        for w in line.split()
        if w in ("active", "failed")
    ][:2]


def test_multipath_over_two_portals(vm: VM, kubelet: Kubelet, clean: None) -> None:
    vm.run(["modprobe", "dm_multipath"])
    vm.write_file(
        "/etc/multipath.conf", "defaults {\n  find_multipaths no\n  user_friendly_names yes\n}\n"
    )
    pid = vm.spawn(["multipathd", "-d", "-s"], log="/tmp/flexhub-test-multipathd.log")
    try:
        for _ in range(150):  # up and done configuring ("pid N idle|running"), as on a node
            shown = vm.run(["multipathd", "show", "daemon"], check=False)
            if shown.rc == 0 and shown.stdout.split()[-1:] in (["idle"], ["running"]):
                break
            time.sleep(0.2)
        else:
            pytest.fail("multipathd does not start in this guest", pytrace=False)
        target = services.iscsi_target(vm, portals=["127.0.0.1:3260", "127.0.0.2:3260"])
        directory, reply = kubelet.mount(target, portals="127.0.0.2:3260")
        assert reply == {"status": "Success"}
        assert len(sessions(vm, target.iqn)) == 2, flexhub_log(vm, "iscsi")
        staging = vm.run(["findmnt", "-n", "-o", "SOURCE", "--target", directory]).stdout.strip()
        assert "mapper/" in staging or "dm-" in staging, staging
        write(vm, directory, "mp", "two paths")
        assert read(vm, directory, "mp") == "two paths"
        assert path_states(vm) == ["active", "active"], vm.run(["multipath", "-ll"]).stdout
        # one path dies under I/O: multipath fails over; the unmount still cleans up both
        services.portal_down(vm, target, "127.0.0.2:3260")
        started = time.monotonic()
        vm.run(["timeout", "90", "/bin/sh", "-c", f"echo failover > {directory}/f && sync"])
        TIMINGS.setdefault("failover-write", []).append(round(time.monotonic() - started, 2))
        assert read(vm, directory, "f") == "failover\n"
        # O_DIRECT, past the page cache: the blocks really go through the surviving path
        vm.run(["dd", "if=/dev/urandom", "of=/tmp/mp-src", "bs=4096", "count=64"])
        vm.run(
            ["dd", "if=/tmp/mp-src", f"of={directory}/direct", "bs=4096", "oflag=direct,sync"],
            timeout=90,
        )
        vm.run(["sh", "-c", "echo 3 > /proc/sys/vm/drop_caches"])
        copied = vm.run(
            ["sh", "-c", f"dd if={directory}/direct bs=4096 iflag=direct | sha256sum"], timeout=90
        ).stdout.split()[0]
        assert copied == vm.run(["sha256sum", "/tmp/mp-src"]).stdout.split()[0]
        for _ in range(60):  # multipathd's checker marks the dead path (bounded wait)
            if sorted(path_states(vm)) == ["active", "failed"]:
                break
            time.sleep(0.5)
        assert sorted(path_states(vm)) == ["active", "failed"], vm.run(["multipath", "-ll"]).stdout
        assert kubelet.unmount(directory) == {"status": "Success"}
        assert sessions(vm, target.iqn) == [] and node_records(vm, target.iqn) == []
        maps = vm.run(["dmsetup", "ls", "--target", "multipath"], check=False).stdout
        assert "No devices found" in maps or not maps.strip(), maps
    finally:
        vm.run(["kill", str(pid)], check=False)


def test_unmount_with_the_target_unreachable_waits_then_releases(
    vm: VM, kubelet: Kubelet, clean: None
) -> None:
    """The target dies under a mounted volume: the unmount answers Success once the pod's
    mounts are gone, keeping the LUN's disk and session (writes still queued would be lost
    with them); once the target is back, the node's next unmount calls (any pod's) flush,
    log out and delete the records; the data written before the outage is there."""
    target = services.iscsi_target(vm)
    directory, reply = kubelet.mount(target)
    assert reply == {"status": "Success"}
    write(vm, directory, "kept", "written before the outage")
    services.portal_down(vm, target, target.portal)
    try:
        started = time.monotonic()
        reply = kubelet.unmount(directory)
        TIMINGS.setdefault("unmount-target-down", []).append(round(time.monotonic() - started, 2))
        assert reply["status"] == "Success", reply
        assert "unreachable" in str(reply.get("message", "")), reply
        assert vm.run(["mountpoint", "-q", directory], check=False).rc != 0
        assert len(sessions(vm, target.iqn)) == 1, "the session was dropped with the target down"
        assert services.session_disks(vm, target.iqn), "the disk was deleted with the target down"
        # another pod's unmount while the target is still down: the release keeps waiting
        assert kubelet.unmount(kubelet.pod_dir("pv-idle")) == {"status": "Success"}
        assert len(sessions(vm, target.iqn)) == 1
    finally:
        services.portal_up(vm, target, target.portal)
    for _ in range(45):  # open-iscsi reconnects on its own; kubelet's unmounts go on
        if not sessions(vm, target.iqn):
            break
        assert kubelet.unmount(kubelet.pod_dir("pv-idle")) == {"status": "Success"}
        time.sleep(2)
    assert sessions(vm, target.iqn) == [], flexhub_log(vm, "release")
    assert node_records(vm, target.iqn) == []
    assert services.session_disks(vm, target.iqn) == []
    again, reply = kubelet.mount(target)
    assert reply == {"status": "Success"}
    assert read(vm, again, "kept") == "written before the outage"
    assert kubelet.unmount(again) == {"status": "Success"}
    assert sessions(vm, target.iqn) == []
