"""The CSI controller and the records ``flexhub convert`` leaves of converted volumes
(flexhub/csi/adopted.py), in-process, with loopfile on the host and an in-memory ConfigMap
API: a converted loopfile volume is reclaimed (its file removed, its record deleted) by
``DeleteVolume``, grown by ``ControllerExpandVolume``; a forged, foreign or malformed record
is refused in one line and nothing is removed; an API that does not answer is
``UNAVAILABLE`` (never "gone already", which would leave the storage behind for good)."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from kubernetes.client.rest import ApiException

from flexhub.config import load_config
from flexhub.convert import adopt
from flexhub.csi.adopted import Adoptions
from flexhub.csi.controller import ControllerService
from flexhub.csi.proto import csi_pb2 as pb
from flexhub.csi.records import adoption_name
from tests.conftest import needs_root
from tests.csi.sanity import node_config
from tests.csi.test_create_retries import Aborted, Context

pytestmark = [needs_root]

NODE = "node-a"
NS = "flexhub-system"
UID = "0b7c7a55-1f0e-4a2b-9c1d-5e6f7a8b9c0d"
OTHER = "6a1e2f3b-4c5d-4e6f-8a9b-0c1d2e3f4a5b"
HANDLE = f"loopfile:{UID}"
MiB = 1 << 20


class FakeCore:
    """ConfigMaps by (namespace, name); ``fail`` makes every call raise it."""

    def __init__(self) -> None:
        self.cms: dict[tuple[str, str], dict[str, Any]] = {}
        self.fail: BaseException | None = None
        self.calls: list[str] = []

    def read_namespaced_config_map(self, name: str, ns: str, **_: Any) -> dict[str, Any]:
        self.calls.append(f"get {ns}/{name}")
        if self.fail is not None:
            raise self.fail
        if (ns, name) not in self.cms:
            raise ApiException(status=404, reason="Not Found")
        return copy.deepcopy(self.cms[(ns, name)])

    def delete_namespaced_config_map(self, name: str, ns: str, **_: Any) -> None:
        self.calls.append(f"delete {ns}/{name}")
        if self.fail is not None:
            raise self.fail
        if self.cms.pop((ns, name), None) is None:
            raise ApiException(status=404, reason="Not Found")


def flex_pv(uid: str = UID, file_uid: str | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """A loopfile PV as flexhub's FlexVolume provisioner writes it, and its claim."""
    record = {"backend": "loopfile", "node": NODE, "onDelete": "delete", "reclaimOn": "node",
              "size": str(16 * MiB), "namespace": "team", "claimUid": uid}  # fmt: skip
    pv = {
        "metadata": {
            "name": f"pvc-{uid}",
            "annotations": {"flexhub/reclaim": json.dumps(record, sort_keys=True)},
        },
        "spec": {
            "capacity": {"storage": "16Mi"},
            "persistentVolumeReclaimPolicy": "Delete",
            "flexVolume": {
                "driver": "k8s/flexhub",
                "fsType": "ext4",
                "options": {
                    "backend": "loopfile",
                    "file": f"provisioned/pvc-{file_uid or uid}.img",
                    "size": str(16 * MiB),
                },
            },
        },
    }
    pvc = {"metadata": {"name": "data", "namespace": "team", "uid": uid}}
    return pv, pvc


def backing(top: Path, uid: str = UID) -> Path:
    return top / "loopfiles" / "namespaces" / "team" / "provisioned" / f"pvc-{uid}.img"


@pytest.fixture
def top(trusted_dir: Path) -> Path:
    node_config(trusted_dir)
    for uid in (UID, OTHER):
        path = backing(trusted_dir, uid)
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        path.write_bytes(b"\0" * MiB)
    return trusted_dir


@pytest.fixture
def core() -> FakeCore:
    return FakeCore()


@pytest.fixture
def controller(top: Path, core: FakeCore) -> Iterator[ControllerService]:
    config = load_config(top / "flexhub.toml")
    yield ControllerService(config, NODE, Adoptions(core, NS))


def put(core: FakeCore, body: dict[str, Any]) -> None:
    core.cms[(NS, body["metadata"]["name"])] = body


def delete(service: ControllerService, volume_id: str = HANDLE) -> Any:
    return service.DeleteVolume(pb.DeleteVolumeRequest(volume_id=volume_id), Context())


def refused(service: ControllerService, volume_id: str = HANDLE) -> Aborted:
    with pytest.raises(Aborted) as caught:
        delete(service, volume_id)
    assert "\n" not in str(caught.value)
    return caught.value


def test_a_converted_volume_is_reclaimed_and_its_record_deleted(
    top: Path, core: FakeCore, controller: ControllerService
) -> None:
    put(core, adopt.record_body(*flex_pv(), HANDLE))
    delete(controller)
    assert not backing(top).exists()
    assert backing(top, OTHER).exists()
    assert core.cms == {}
    delete(controller)  # the sidecar's retry: gone already
    assert not list((top / "state").rglob("volumes/*.json"))


def test_a_converted_volume_grows_and_is_then_reclaimed_with_both_records(
    top: Path, core: FakeCore, controller: ControllerService
) -> None:
    put(core, adopt.record_body(*flex_pv(), HANDLE))
    request = pb.ControllerExpandVolumeRequest(
        volume_id=HANDLE, capacity_range=pb.CapacityRange(required_bytes=32 * MiB)
    )
    assert controller.ControllerExpandVolume(request, Context()).capacity_bytes == 32 * MiB
    assert controller.records.get(UID).size == 32 * MiB  # type: ignore[union-attr]
    delete(controller)
    assert not backing(top).exists()
    assert core.cms == {} and controller.records.get(UID) is None


def test_a_record_of_another_volume_is_refused_and_nothing_removed(
    top: Path, core: FakeCore, controller: ControllerService
) -> None:
    """Named for this volume, holding another's record (whose file it would remove)."""
    body = adopt.record_body(*flex_pv(OTHER), f"loopfile:{OTHER}")
    body["metadata"]["name"] = adoption_name(UID)
    put(core, body)
    error = refused(controller)
    assert error.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "is the record of volume" in str(error)
    assert backing(top).exists() and backing(top, OTHER).exists()
    assert (NS, adoption_name(UID)) in core.cms


@pytest.mark.parametrize(
    "forge",
    [
        "label",
        "not-json",
        "backend",
        "size",
        "source",
        "options-not-strings",
        "schema",
        "file-of-another-claim",
    ],
)
def test_a_forged_or_malformed_record_is_refused_in_one_line(
    top: Path, core: FakeCore, controller: ControllerService, forge: str
) -> None:
    body = adopt.record_body(*flex_pv(), HANDLE)
    record = json.loads(body["data"]["record.json"])
    if forge == "label":
        body["metadata"]["labels"] = {"app": "mine"}
    elif forge == "not-json":
        body["data"]["record.json"] = "{not json"
    elif forge == "backend":
        record["backend"] = record["options"]["backend"] = "nfs"
    elif forge == "size":
        record["size"] = "16Mi"
    elif forge == "source":
        record["source"] = f"volume:loopfile:{OTHER}"
    elif forge == "options-not-strings":
        record["options"]["size"] = 16 * MiB
    elif forge == "schema":
        record["options"]["file"] = "../../etc/passwd"
    elif forge == "file-of-another-claim":  # the backend's own check: not this claim's file
        record["options"]["file"] = f"provisioned/pvc-{OTHER}.img"
    if forge != "not-json":
        body["data"]["record.json"] = json.dumps(record)
    put(core, body)
    error = refused(controller)
    expected = (
        grpc.StatusCode.INVALID_ARGUMENT
        if forge == "file-of-another-claim"
        else grpc.StatusCode.FAILED_PRECONDITION
    )
    assert error.code == expected, error
    assert backing(top).exists() and backing(top, OTHER).exists()


@pytest.mark.parametrize(
    "failure",
    [
        ApiException(status=500, reason="Internal"),
        ApiException(status=403, reason="Forbidden"),
        ConnectionRefusedError(111, "refused"),
    ],
    ids=["500", "403", "unreachable"],
)
def test_an_api_that_does_not_answer_is_unavailable_never_gone(
    top: Path, core: FakeCore, controller: ControllerService, failure: BaseException
) -> None:
    put(core, adopt.record_body(*flex_pv(), HANDLE))
    core.fail = failure
    error = refused(controller)
    assert error.code == grpc.StatusCode.UNAVAILABLE
    assert backing(top).exists()
    core.fail = None
    delete(controller)  # the sidecar's next call
    assert not backing(top).exists() and core.cms == {}


def test_a_record_delete_that_fails_after_the_reclaim_is_finished_by_the_retry(
    top: Path, core: FakeCore, controller: ControllerService, monkeypatch: pytest.MonkeyPatch
) -> None:
    put(core, adopt.record_body(*flex_pv(), HANDLE))
    real = core.delete_namespaced_config_map

    def broken(name: str, ns: str, **kw: Any) -> None:
        raise ApiException(status=503, reason="Unavailable")

    monkeypatch.setattr(core, "delete_namespaced_config_map", broken)
    assert refused(controller).code == grpc.StatusCode.UNAVAILABLE
    assert not backing(top).exists()
    monkeypatch.setattr(core, "delete_namespaced_config_map", real)
    delete(controller)
    assert core.cms == {}


def test_a_volume_of_another_node_is_left_to_that_node(
    top: Path, core: FakeCore, monkeypatch: pytest.MonkeyPatch
) -> None:
    put(core, adopt.record_body(*flex_pv(), HANDLE))
    service = ControllerService(load_config(top / "flexhub.toml"), "node-b", Adoptions(core, NS))
    assert refused(service).code == grpc.StatusCode.FAILED_PRECONDITION
    assert backing(top).exists() and core.cms


def test_without_an_api_client_nothing_is_adopted(top: Path, core: FakeCore) -> None:
    put(core, adopt.record_body(*flex_pv(), HANDLE))
    service = ControllerService(load_config(top / "flexhub.toml"), NODE)
    delete(service)
    assert backing(top).exists()


def test_a_volume_id_this_controller_never_made_asks_nothing(
    core: FakeCore, controller: ControllerService
) -> None:
    delete(controller, "not-a-flexhub-id")
    delete(controller, f"loopfile:{OTHER}")  # none recorded: gone
    assert core.calls == [f"get {NS}/{adoption_name(OTHER)}"]


def test_a_converted_volume_grown_then_rolled_back_is_no_longer_the_controllers(
    top: Path, core: FakeCore, controller: ControllerService
) -> None:
    """Grown under CSI (a local record), then rolled back (its ConfigMap removed): the local
    record used to win, so the controller listed the volume and would reclaim storage that
    is the FlexVolume PV's again."""
    put(core, adopt.record_body(*flex_pv(), HANDLE))
    request = pb.ControllerExpandVolumeRequest(
        volume_id=HANDLE, capacity_range=pb.CapacityRange(required_bytes=32 * MiB)
    )
    controller.ControllerExpandVolume(request, Context())
    listed = controller.ListVolumes(pb.ListVolumesRequest(), Context())
    assert [e.volume.volume_id for e in listed.entries] == [HANDLE]
    core.cms.clear()  # the rollback's
    listed = controller.ListVolumes(pb.ListVolumesRequest(), Context())
    assert [e.volume.volume_id for e in listed.entries] == []
    delete(controller)
    assert backing(top).exists()


def test_a_converted_volume_is_snapshotted_and_cloned(
    top: Path, core: FakeCore, controller: ControllerService
) -> None:
    from tests.csi.test_create_retries import MOUNT, of_volume, snap

    backing(top).write_bytes(b"converted data\n" + b"\0" * (MiB - 15))
    put(core, adopt.record_body(*flex_pv(), HANDLE))
    snapshot = snap(controller, "snapshot-of-converted", HANDLE)
    assert snapshot.source_volume_id == HANDLE and snapshot.ready_to_use
    request = pb.CreateVolumeRequest(
        name="clone-of-converted",
        capacity_range=pb.CapacityRange(required_bytes=16 * MiB),
        volume_capabilities=[MOUNT],
        parameters={"backend": "loopfile", "csi.storage.k8s.io/pvc/namespace": "team"},
    )
    request.volume_content_source.CopyFrom(of_volume(HANDLE))
    clone = controller.CreateVolume(request, Context()).volume
    copies = [
        p for p in (top / "loopfiles").rglob("*.img") if p.read_bytes()[:15] == b"converted data\n"
    ]
    assert len(copies) == 3, copies  # the volume, its snapshot, its clone
    controller.DeleteSnapshot(pb.DeleteSnapshotRequest(snapshot_id=snapshot.snapshot_id), Context())
    delete(controller, clone.volume_id)
    delete(controller)
    assert not backing(top).exists()


def test_a_controller_in_a_pod_without_its_api_client_does_not_start(
    top: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a pod, a controller that cannot read the records would answer a converted
    volume's DeleteVolume "gone" and leave its storage: it refuses to start, in one line."""
    from flexhub.csi import kubeapi
    from flexhub.csi.server import serve
    from flexhub.errors import UsageError

    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    monkeypatch.setattr(kubeapi, "SERVICE_ACCOUNT", top / "no-such-account")
    config = load_config(top / "flexhub.toml")
    with pytest.raises(UsageError, match="cannot load its API client") as refused:
        serve(config, f"unix://{top}/csi.sock", "controller", NODE)
    assert "\n" not in str(refused.value)
    assert not (top / "csi.sock").exists()
