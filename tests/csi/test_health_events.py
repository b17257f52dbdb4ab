"""The node plugin's health watcher (flexhub/csi/healthevents.py): a published volume turned
abnormal is one Warning Event VolumeConditionAbnormal on the pod the kubelet published it for.

Units with a fake API (its create and patch calls recorded): transitions, the dedupe, a pod
uid that is not the target path's, API errors, a check that hangs, no option or secret in
an Event. Then real: a loopfile volume staged and published by ``flexhub csi`` on a kubelet
shaped target path with the kubelet's pod keys in the volume context, its staging mount
unmounted behind the plugin's back, the watcher's round on the plugin's own records and mounts.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from flexhub.csi import health
from flexhub.csi.healthevents import COMPONENT, REASON, REPEAT, HealthWatcher, events_api
from flexhub.csi.proto import csi_pb2 as pb
from flexhub.csi.published import (
    POD_KEYS,
    PodRef,
    Published,
    PublishedTargets,
    pod_of_publish,
    target_parts,
)
from flexhub.csi.status import InFlight
from flexhub.provisioner.events import CountingRecorder
from tests.conftest import needs_root
from tests.csi.sanity import LoopfilePlugin

UID = "0f4c2a51-3b7e-4c1d-9a6e-5d2f8b1c7e90"
KUBELET = "/var/lib/kubelet"
TARGET = f"{KUBELET}/pods/{UID}/volumes/kubernetes.io~csi/pv-data/mount"
STAGING = f"{KUBELET}/plugins/kubernetes.io/csi/flexhub.csi.k8s.io/abc/globalmount"
POD = {
    "csi.storage.k8s.io/pod.name": "app",
    "csi.storage.k8s.io/pod.namespace": "team-a",
    "csi.storage.k8s.io/pod.uid": UID,
    "csi.storage.k8s.io/serviceAccount.name": "default",
    "csi.storage.k8s.io/ephemeral": "false",
}
INACCESSIBLE = pb.VolumeHealthErrorType.INACCESSIBLE


class ApiError(Exception):
    """What the client raises: a status, a reason, headers and a body."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(f"({status})\nReason: {reason}\nHTTP response body: Bearer sekrit")
        self.status, self.reason = status, reason


class FakeCore:
    def __init__(self) -> None:
        self.created: list[tuple[str, dict[str, Any]]] = []
        self.patched: list[tuple[str, str, dict[str, Any]]] = []
        self.fail: Exception | None = None

    def create_namespaced_event(self, namespace: str, body: dict[str, Any], **_: Any) -> None:
        if self.fail is not None:
            raise self.fail
        self.created.append((namespace, body))

    def patch_namespaced_event(self, name: str, namespace: str, body: Any, **_: Any) -> None:
        if self.fail is not None:
            raise self.fail
        self.patched.append((namespace, name, body))


class FakeNode:
    """A node service: real publish records under ``state``, a health set by the test."""

    def __init__(self, state: Path) -> None:
        self.published = PublishedTargets(state)
        self.in_flight = InFlight()
        self.troubles: dict[str, list[tuple[str, str]]] = {}
        self.checked: list[str] = []

    def unpublished(self, target: Path) -> bool:
        return False  # every recorded target is still there (the real one: the last test)

    def health_of(self, volume_id: str, paths: list[Path]) -> Any:
        self.checked.append(volume_id)
        return pb.VolumeHealth(
            volume_id=volume_id,
            health_statuses=[
                pb.VolumeHealth.VolumeHealthEntry(status=INACCESSIBLE, reason=r, message=m)
                for r, m in self.troubles.get(volume_id, [])
            ],
        )


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _watcher(tmp_path: Path) -> tuple[HealthWatcher, FakeNode, FakeCore, Clock]:
    node, core, clock = FakeNode(tmp_path), FakeCore(), Clock()
    recorder = CountingRecorder(core, COMPONENT, "node-1", host="node-1", clock=clock)
    return HealthWatcher(node, recorder, 60, clock=clock), node, core, clock


def _publish(node: FakeNode, target: str = TARGET, pod: PodRef | None = None) -> Published:
    entry = Published(
        target, "loopfile:v1", STAGING, "pv-data", pod or PodRef("app", "team-a", UID)
    )
    node.published.put(entry)
    return entry


NOT_MOUNTED = [("NotMounted", f"{STAGING} holds no mount of the volume")]


def test_a_volume_turned_abnormal_is_one_warning_event_on_its_pod(tmp_path: Path) -> None:
    watcher, node, core, clock = _watcher(tmp_path)
    _publish(node)
    watcher.check()
    assert core.created == [] and node.checked == ["loopfile:v1"]  # healthy: nothing
    node.troubles["loopfile:v1"] = NOT_MOUNTED
    watcher.check()
    ((namespace, event),) = core.created
    assert namespace == "team-a"
    assert event["type"] == "Warning" and event["reason"] == REASON == "VolumeConditionAbnormal"
    assert event["involvedObject"] == {
        "apiVersion": "v1",
        "kind": "Pod",
        "name": "app",
        "namespace": "team-a",
        "uid": UID,
        "resourceVersion": None,
    }
    assert event["metadata"]["namespace"] == "team-a"
    assert event["message"] == f"Volume pv-data: NotMounted: {STAGING} holds no mount of the volume"
    assert event["source"] == {"component": "flexhub-csi-node", "host": "node-1"}
    assert event["count"] == 1 and event["firstTimestamp"] == event["lastTimestamp"]
    # still abnormal: no new Event at each check, one count per REPEAT seconds
    for _ in range(5):
        clock.now += 60
        watcher.check()
    assert len(core.created) == 1 and core.patched == []
    clock.now += REPEAT
    watcher.check()
    assert len(core.created) == 1
    ((_, name, body),) = core.patched
    assert name == event["metadata"]["name"] and body["count"] == 2
    # healthy again resets: the next trouble is a transition at once
    node.troubles.clear()
    watcher.check()
    node.troubles["loopfile:v1"] = NOT_MOUNTED
    clock.now += 1
    watcher.check()
    assert len(core.created) + len(core.patched) == 3


def test_other_conditions_are_a_new_event_at_once(tmp_path: Path) -> None:
    watcher, node, core, _ = _watcher(tmp_path)
    _publish(node)
    node.troubles["loopfile:v1"] = NOT_MOUNTED
    watcher.check()
    node.troubles["loopfile:v1"] = [("StatTimeout", f"{TARGET} did not answer a stat within 5 s")]
    watcher.check()
    assert [e["message"].split(": ")[1] for _, e in core.created] == ["NotMounted", "StatTimeout"]


def test_an_api_error_is_one_line_without_the_token_and_retried_next_round(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    watcher, node, core, _ = _watcher(tmp_path)
    _publish(node)
    node.troubles["loopfile:v1"] = NOT_MOUNTED
    core.fail = ApiError(403, "Forbidden")
    with caplog.at_level(logging.DEBUG):
        watcher.check()
        core.fail = ConnectionRefusedError(111, "Connection refused")
        watcher.check()  # still failing: no crash, tried again
    failures = [r.getMessage() for r in caplog.records if "could not record" in r.getMessage()]
    assert len(failures) == 2, failures
    assert failures[0].endswith(": 403 Forbidden")
    assert "ConnectionRefusedError" in failures[1]
    assert all("\n" not in f and "sekrit" not in f for f in failures)
    core.fail = None
    watcher.check()
    assert len(core.created) == 1  # written once the API answers


def test_no_pod_no_event_and_a_target_unpublished_while_checked_is_forgotten(
    tmp_path: Path,
) -> None:
    watcher, node, core, _ = _watcher(tmp_path)
    entry = Published(TARGET, "loopfile:v1", STAGING, "pv-data", None)
    node.published.put(entry)
    node.troubles["loopfile:v1"] = NOT_MOUNTED
    watcher.check()
    assert core.created == [] and node.checked == []  # no pod: not even checked

    entry = _publish(node)
    real = node.health_of

    def unpublished_meanwhile(volume_id: str, paths: list[Path]) -> Any:
        node.published.delete(entry.target)  # NodeUnpublishVolume drops the record first
        return real(volume_id, paths)

    node.health_of = unpublished_meanwhile  # type: ignore[method-assign]
    watcher.check()
    assert core.created == []

    node.health_of = real  # type: ignore[method-assign]
    _publish(node)
    with node.in_flight.hold("loopfile:v1"):  # a call on the volume runs: skipped this round
        watcher.check()
    assert core.created == []
    watcher.check()
    assert len(core.created) == 1


def test_a_hanging_check_takes_its_bound_and_the_next_round_answers_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The watcher checks through the health module's bounded probe: a stat that never
    answers (a hard NFS mount whose server is gone) costs one bound, then nothing."""
    release = threading.Event()
    real = os.stat

    def stuck(path: Any, *args: Any, **kwargs: Any) -> Any:
        if str(path).startswith("/hung/"):
            release.wait(30)
        return real(path, *args, **kwargs)

    watcher, node, core, clock = _watcher(tmp_path)
    node.health_of = lambda volume_id, paths: health.volume_health(  # type: ignore[method-assign]
        volume_id, paths, lambda _: True, 0.5
    )
    node.published.put(
        Published(
            f"/hung/pods/{UID}/volumes/kubernetes.io~csi/pv-data/mount",
            "nfs:v2",
            "/hung/stage",
            "pv-data",
            PodRef("app", "team-a", UID),
        )
    )
    monkeypatch.setattr(os, "stat", stuck)
    try:
        started = time.monotonic()
        watcher.check()
        assert time.monotonic() - started < 2.5
        ((_, event),) = core.created
        assert event["message"].startswith("Volume pv-data: StatTimeout: /hung/stage did not")
        started = time.monotonic()
        clock.now += 60
        watcher.check()
        assert time.monotonic() - started < 0.4  # the hung stats answer at once now
        assert len(core.created) == 1
    finally:
        release.set()


def test_a_round_survives_a_broken_check(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    watcher, node, core, _ = _watcher(tmp_path)
    _publish(node)
    other = f"{KUBELET}/pods/{UID}/volumes/kubernetes.io~csi/pv-other/mount"
    node.published.put(
        Published(other, "loopfile:v3", STAGING, "pv-other", PodRef("app", "team-a", UID))
    )
    node.troubles["loopfile:v3"] = NOT_MOUNTED

    def broken(volume_id: str, paths: list[Path]) -> Any:
        if volume_id == "loopfile:v1":
            raise RuntimeError("boom")
        return FakeNode.health_of(node, volume_id, paths)

    node.health_of = broken  # type: ignore[method-assign]
    watcher.check()
    assert [e["message"].split(":")[0] for _, e in core.created] == ["Volume pv-other"]
    assert any("boom" in r.getMessage() for r in caplog.records)


# ----------------------------------------------------------------------- who the pod is


def test_the_pod_is_believed_only_when_the_target_path_and_the_stage_agree(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert pod_of_publish("v", TARGET, POD, {}) == PodRef("app", "team-a", UID)
    block = f"{KUBELET}/plugins/kubernetes.io/csi/volumeDevices/publish/pv-raw/{UID}"
    assert target_parts(block) == ("pv-raw", UID)
    assert pod_of_publish("v", block, POD, {}) == PodRef("app", "team-a", UID)
    assert pod_of_publish("v", TARGET, {"backend": "loopfile"}, {}) is None  # podInfoOnMount off
    assert caplog.records == []
    other_uid = TARGET.replace(UID, "11111111-2222-3333-4444-555555555555")
    not_believed = [
        (other_uid, POD, {}),  # another pod's path: the uid disagrees
        ("/mnt/somewhere", POD, {}),  # no kubelet path
        (TARGET, {**POD, "csi.storage.k8s.io/pod.namespace": "Team A"}, {}),
        (TARGET, POD, {"csi.storage.k8s.io/pod.namespace": "kube-system"}),  # PV's attributes
        (f"{TARGET}/../../../../{UID}/volumes/kubernetes.io~csi/pv-data/mount/x", POD, {}),
    ]
    for target, context, staged in not_believed:
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            assert pod_of_publish("v", target, context, staged) is None, target
        (record,) = caplog.records  # one line, once per publish
        assert "pod identity not believed" in record.getMessage()
        assert "\n" not in record.getMessage()


def test_the_node_keeps_the_pod_of_a_publish_only_when_its_stage_named_none(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """NodeService's record of a publish (what the watcher reads): the kubelet's pod when the
    stage's context named none; none when it did (the PV's attributes); and a record that
    cannot be written is a warning, never a failed publish (it serves the Events alone)."""
    from flexhub.csi.node import NodeService
    from tests.csi.sanity import plugin_config

    service = NodeService(plugin_config(tmp_path), "node-1")
    stage, target = Path(STAGING), Path(TARGET)
    service.staged.put(stage, "loopfile:v1", {"backend": "loopfile"})
    service._record_publish("loopfile:v1", stage, target, {"backend": "loopfile", **POD})
    assert service.published.get(TARGET) == Published(
        TARGET, "loopfile:v1", STAGING, "pv-data", PodRef("app", "team-a", UID)
    )
    forged = {"backend": "loopfile", "csi.storage.k8s.io/pod.namespace": "kube-system"}
    service.staged.put(stage, "loopfile:v1", forged)
    service._record_publish("loopfile:v1", stage, target, {"backend": "loopfile", **POD})
    found = service.published.get(TARGET)
    assert found is not None and found.pod is None
    records = tmp_path / "state" / "csi" / "published"
    for record in records.iterdir():
        record.unlink()
    records.rmdir()
    records.write_text("")  # the directory cannot be made: nothing can be written
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        service._record_publish("loopfile:v1", stage, target, {"backend": "loopfile", **POD})
    assert [r.getMessage() for r in caplog.records if "kept no record" in r.getMessage()]


CONTEXTS = {
    "loopfile": (
        {"backend": "loopfile", "file": "a.img", "size": "64Mi", "flexhub.csi/namespace": "t"},
        {},
    ),
    "nfs": ({"backend": "nfs", "server": "nfs1.example.com", "share": "/exports/a"}, {}),
    "cifs": (
        {"backend": "cifs", "server": "files.example.com", "share": "team"},
        {"username": "u", "password": "p"},
    ),
    "iscsi": (
        {
            "backend": "iscsi",
            "targetPortal": "127.0.0.1:3260",
            "lun": "0",
            "iqn": "iqn.2026-01.io.flexhub.test:pvc-a",
        },
        {},
    ),
}


@pytest.mark.parametrize("backend", sorted(CONTEXTS))
def test_the_kubelet_s_pod_keys_never_reach_a_backend_s_options(
    backend: str, tmp_path: Path
) -> None:
    """Every shipped backend: a volume context with the kubelet's five pod keys (what a
    publish carries with podInfoOnMount) validates, and its options are the context's
    without them; an unknown key of the same shape outside csi.storage.k8s.io/ is refused."""
    from flexhub.config import NodeConfig
    from flexhub.csi.volumes import flexhub_volume
    from flexhub.errors import InvalidOptions

    config = NodeConfig(
        state_dir=tmp_path / "state",
        log_dir=tmp_path / "log",
        backends={"loopfile": {"root": str(tmp_path / "loopfiles")}},
    )
    (tmp_path / "loopfiles").mkdir(mode=0o700)
    capability = pb.VolumeCapability(
        mount=pb.VolumeCapability.MountVolume(),
        access_mode=pb.VolumeCapability.AccessMode(
            mode=pb.VolumeCapability.AccessMode.Mode.SINGLE_NODE_WRITER
        ),
    )
    context, secrets = CONTEXTS[backend]
    volume, _, _ = flexhub_volume({**context, **POD}, capability, secrets, config)
    assert dict(volume.options) == {k: v for k, v in context.items() if "/" not in k}
    assert set(POD) == set(POD_KEYS)
    with pytest.raises(InvalidOptions):
        flexhub_volume({**context, "pod.name": "app"}, capability, secrets, config)


def test_events_api_without_credentials_is_off_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with caplog.at_level(logging.WARNING):
        assert events_api(None) is None
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("health events off: no service account token and no --kubeconfig")
    broken = tmp_path / "kubeconfig"
    broken.write_text("users:\n- name: x\n  user: {token: sekrit-token-123\n")  # bad YAML
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert events_api(broken) is None
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith(f"health events off: cannot load --kubeconfig {broken} (")
    assert "sekrit" not in line and "\n" not in line


# ----------------------------------------------------------------------- real, on the host


@needs_root
@pytest.mark.root
def test_a_published_loopfile_volume_unstaged_behind_the_plugin_s_back_is_an_event(
    loopfile_plugin: LoopfilePlugin,
) -> None:
    from flexhub.config import load_config
    from flexhub.csi.node import NodeService

    top = loopfile_plugin.top
    controller, node = loopfile_plugin.controller, loopfile_plugin.node
    stage = top / "plugins" / "stage"
    target = top / "pods" / UID / "volumes" / "kubernetes.io~csi" / "pv-data" / "mount"
    stage.mkdir(parents=True)
    target.parent.mkdir(parents=True)
    capability = pb.VolumeCapability(
        mount=pb.VolumeCapability.MountVolume(),
        access_mode=pb.VolumeCapability.AccessMode(
            mode=pb.VolumeCapability.AccessMode.Mode.SINGLE_NODE_WRITER
        ),
    )
    volume = controller.CreateVolume(
        pb.CreateVolumeRequest(
            name="health-events",
            capacity_range=pb.CapacityRange(required_bytes=320 << 20),
            volume_capabilities=[capability],
            parameters={"backend": "loopfile", "fsType": "xfs"},
        )
    ).volume
    vid = volume.volume_id
    try:
        node.NodeStageVolume(
            pb.NodeStageVolumeRequest(
                volume_id=vid,
                staging_target_path=str(stage),
                volume_capability=capability,
                volume_context=volume.volume_context,
            )
        )
        # the kubelet's publish: the PV's attributes plus its five pod keys (validated as
        # options they would fail loopfile's schema: additional properties)
        node.NodePublishVolume(
            pb.NodePublishVolumeRequest(
                volume_id=vid,
                staging_target_path=str(stage),
                target_path=str(target),
                volume_capability=capability,
                volume_context={**volume.volume_context, **POD},
                secrets={"unused": "sekrit-value-42"},
            )
        )
        (record,) = (top / "state" / "csi" / "published").glob("*.json")
        assert record.stat().st_mode & 0o777 == 0o600
        kept = json.loads(record.read_text())
        assert kept == {
            "target": str(target),
            "volume_id": vid,
            "staging": str(stage),
            "pv": "pv-data",
            "pod": ["app", "team-a", UID],
        }
        service = NodeService(load_config(top / "flexhub.toml"), "node-1")
        core = FakeCore()
        watcher = HealthWatcher(
            service, CountingRecorder(core, COMPONENT, "node-1", host="node-1"), 60
        )
        watcher.check()
        assert core.created == []  # healthy
        subprocess.run(["umount", str(stage)], check=True, timeout=60)
        watcher.check()
        ((namespace, event),) = core.created
        assert namespace == "team-a" and event["involvedObject"]["uid"] == UID
        assert event["message"] == (
            f"Volume pv-data: NotMounted: {stage} holds no mount of the volume"
        )
        text = json.dumps(event)
        for value in (*volume.volume_context.values(), "sekrit-value-42"):
            if value not in ("loopfile", "xfs"):  # the backend's and the fs's names
                assert value not in text, value
        assert "health events off: no service account token" in (top / "plugin.log").read_text()
    finally:
        node.NodeUnpublishVolume(
            pb.NodeUnpublishVolumeRequest(volume_id=vid, target_path=str(target))
        )
        node.NodeUnstageVolume(
            pb.NodeUnstageVolumeRequest(volume_id=vid, staging_target_path=str(stage))
        )
        controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=vid))
    assert not list((top / "state" / "csi" / "published").glob("*.json"))


def test_bad_watcher_options_are_one_line_before_anything_is_served(tmp_path: Path) -> None:
    from flexhub.csi.server import serve
    from flexhub.errors import UsageError
    from tests.csi.sanity import plugin_config

    config = plugin_config(tmp_path)
    socket = f"unix://{tmp_path / 'csi.sock'}"
    for options, wanted in (
        ({"health_interval": -1}, "--health-interval -1: expected 0 (off) or 1 to 86400"),
        # a round every millisecond: two stat threads a target, a thousand times a second
        ({"health_interval": 0.001}, "--health-interval 0.001: expected 0 (off) or 1 to 86400"),
        ({"kubeconfig": tmp_path / "nope"}, f"--kubeconfig {tmp_path / 'nope'}: no such file"),
    ):
        with pytest.raises(UsageError) as refused:
            serve(config, socket, "node", "node-1", **options)  # type: ignore[arg-type]
        assert refused.value.message == wanted
    assert not (tmp_path / "csi.sock").exists() and not (tmp_path / "state").exists()


@needs_root
def test_a_record_left_of_a_target_gone_is_dropped_and_names_no_pod(trusted_dir: Path) -> None:
    """A publish record whose removal failed at NodeUnpublishVolume (the state disk read-only
    then: logged, the unmount went on) outlives its target: the pod and its directory are
    gone. The watcher found it NotMounted at every start and wrote a Warning Event on a pod
    that no longer exists, and kept the record for ever. A target with no mount and no path
    is published no more: its record goes, no Event."""
    from flexhub.config import load_config
    from flexhub.csi.node import NodeService
    from tests.csi.sanity import node_config

    service = NodeService(load_config(node_config(trusted_dir)), "node-1")
    gone = trusted_dir / "pods" / UID / "volumes" / "kubernetes.io~csi" / "pv-data" / "mount"
    entry = Published(
        str(gone),
        "loopfile:v1",
        str(trusted_dir / "stage"),
        "pv-data",
        PodRef("app", "team-a", UID),
    )
    service.published.put(entry)
    core = FakeCore()
    watcher = HealthWatcher(service, CountingRecorder(core, COMPONENT, "node-1", host="node-1"), 60)
    watcher.check()
    assert core.created == []
    assert service.published.all() == []
    # a target still there (its pod's directory kept) with no mount is abnormal, as before
    gone.mkdir(parents=True)
    service.published.put(entry)
    watcher.check()
    assert [event["reason"] for _, event in core.created] == [REASON]
    assert service.published.all() == [entry]
