"""flexhub convert against the attacks of its hostile review, with an in-memory API standing in
for tests/cluster's real one (test_convert.py there): a tenant's claim swapped in before a
rollback, a read-only or fsType option, credentials inline in a PV's options. Each failed
before its fix."""

from __future__ import annotations

import copy
import itertools
from typing import Any

import pytest

from flexhub.convert import plan, steps
from flexhub.errors import ConvertError
from flexhub.provisioner.seal import ANN_SEAL, Sealer
from tests.core.test_convert_plan import CLAIM_UID, _provisioned

#: The FlexVolume provisioner's sealing key in flexhub's namespace (FakeKube.sealing_key).
KEY = b"k" * 32


def _sealed() -> tuple[dict[str, Any], dict[str, Any]]:
    """:func:`_provisioned`, under the provisioner's seal (as it writes its PVs)."""
    pv, pvc = _provisioned()
    pv["metadata"]["annotations"][ANN_SEAL] = Sealer(KEY).seal(pv)
    return pv, pvc


_uids = (f"uid-{i}" for i in itertools.count())


class FakeKube:
    """Enough of flexhub.convert.kube.Kube: objects by name, uids on create, a binder that
    binds a claim naming a PV pre-bound to its uid."""

    def __init__(self) -> None:
        self.claims: dict[tuple[str, str], dict[str, Any]] = {}
        self.pvs: dict[str, dict[str, Any]] = {}
        self.cms: dict[tuple[str, str], dict[str, Any]] = {}
        self.log: list[str] = []
        self.key: bytes | None = KEY
        #: the Leases there are, by the seconds since their renewal: csi-provisioner's of a CSI
        #: controller in flexhub's namespace
        self.leases: dict[tuple[str, str], float] = {("flexhub-system", "flexhub-csi-k8s-io"): 5.0}
        self._versions = itertools.count(100)

    def sealing_key(self, ns: str) -> bytes | None:
        return self.key

    def lease_age(self, ns: str, name: str) -> float | None:
        return self.leases.get((ns, name))

    def _bind(self) -> None:
        for c in self.claims.values():
            pv = self.pvs.get(c["spec"].get("volumeName", ""))
            if pv and (pv["spec"].get("claimRef") or {}).get("uid") == c["metadata"]["uid"]:
                c.setdefault("status", {})["phase"] = "Bound"

    def claim(self, ns: str, name: str) -> dict[str, Any] | None:
        self._bind()
        return copy.deepcopy(self.claims.get((ns, name)))

    def pv(self, name: str) -> dict[str, Any] | None:
        return copy.deepcopy(self.pvs.get(name))

    def config_map(self, ns: str, name: str) -> dict[str, Any] | None:
        return copy.deepcopy(self.cms.get((ns, name)))

    def namespace_exists(self, ns: str) -> bool:
        return True

    def pods_using(self, ns: str, name: str) -> list[str]:
        return []

    def nodes_using(self, names: set[str]) -> list[str]:
        return []

    def create_claim(self, body: dict[str, Any]) -> dict[str, Any]:
        body = copy.deepcopy(body)
        body["metadata"]["uid"] = next(_uids)
        self.claims[(body["metadata"]["namespace"], body["metadata"]["name"])] = body
        self.log.append(f"create claim {body['metadata']['name']}")
        return copy.deepcopy(body)

    def create_pv(self, body: dict[str, Any]) -> dict[str, Any]:
        body = copy.deepcopy(body)
        body["metadata"]["uid"] = next(_uids)
        body["metadata"]["resourceVersion"] = str(next(self._versions))
        self.pvs[body["metadata"]["name"]] = body
        self.log.append(f"create pv {body['metadata']['name']}")
        return copy.deepcopy(body)

    def create_config_map(self, ns: str, body: dict[str, Any]) -> dict[str, Any]:
        key = (ns, body["metadata"]["name"])
        if key not in self.cms:  # the real one: 409, then the one there is read
            self.cms[key] = copy.deepcopy(body)
            self.log.append(f"create configmap {body['metadata']['name']}")
        return copy.deepcopy(self.cms[key])

    def patch_config_map(
        self, ns: str, name: str, data: dict[str, str], labels: dict[str, str] | None = None
    ) -> None:
        self.cms[(ns, name)]["data"].update(data)
        if labels:
            self.cms[(ns, name)]["metadata"].setdefault("labels", {}).update(labels)

    def delete_config_map(self, ns: str, name: str) -> None:
        if self.cms.pop((ns, name), None) is not None:
            self.log.append(f"delete configmap {name}")

    def set_pv(
        self,
        pv: dict[str, Any],
        policy: str,
        finalizers: list[str] | None = None,
        unchanged: bool = False,
        annotations: dict[str, str] | None = None,
    ) -> None:
        now = self.pvs[pv["metadata"]["name"]]
        assert now["metadata"]["uid"] == pv["metadata"]["uid"]
        if unchanged and now["metadata"].get("resourceVersion") != pv["metadata"].get(
            "resourceVersion"
        ):
            raise ConvertError(f"PV {pv['metadata']['name']} changed while ...")
        now["metadata"]["resourceVersion"] = str(next(self._versions))
        now["spec"]["persistentVolumeReclaimPolicy"] = policy
        now["metadata"].setdefault("annotations", {}).update(annotations or {})
        if finalizers is not None:
            now["metadata"]["finalizers"] = finalizers
        self.log.append(f"set pv {pv['metadata']['name']} {policy}")

    def delete_claim(self, ns: str, name: str, uid: str) -> None:
        if (self.claims.get((ns, name)) or {}).get("metadata", {}).get("uid") == uid:
            del self.claims[(ns, name)]
            self.log.append(f"delete claim {name}")

    def delete_pv(self, name: str, uid: str) -> None:
        if (self.pvs.get(name) or {}).get("metadata", {}).get("uid") == uid:
            del self.pvs[name]
            self.log.append(f"delete pv {name}")

    @staticmethod
    def wait(what: str, done: Any, timeout: float, hint: str = "") -> None:
        why = done()
        if why is not None:
            raise ConvertError(f"{what}: {why}{hint}")


S = steps.Settings(backup_namespace="flexhub-system", timeout=1)


@pytest.fixture
def converted(monkeypatch: pytest.MonkeyPatch) -> tuple[FakeKube, dict[str, Any]]:
    monkeypatch.setattr(steps, "validate_options", lambda options: None)
    kube = FakeKube()
    pv, pvc = _sealed()
    kube.pvs[pv["metadata"]["name"]] = pv
    kube.claims[("team", "data")] = pvc
    steps.run(kube, "team", ["data"], S, False, lambda line: None)  # type: ignore[arg-type]
    assert kube.pvs[pv["metadata"]["name"]]["spec"].get("csi")
    return kube, pv


def test_rollback_deletes_the_csi_pv_then_refuses(
    converted: tuple[FakeKube, dict[str, Any]],
) -> None:
    """The tenant deleted the CSI claim and made a new one of that name (no annotation).
    Rollback's dry-run pre-pass checks nothing; the real pass deletes the CSI PV and only
    then refuses: a refusal that changed something."""
    kube, pv = converted
    name = pv["metadata"]["name"]
    del kube.claims[("team", "data")]
    kube.claims[("team", "data")] = {
        "metadata": {"name": "data", "namespace": "team", "uid": "tenant-new"},
        "spec": {"volumeName": "pvc-elsewhere", "storageClassName": "other"},
        "status": {"phase": "Bound"},
    }
    before = copy.deepcopy(kube.pvs)
    with pytest.raises(ConvertError, match="not the converted one"):
        steps.run(kube, "team", ["data"], S, True, lambda line: None)  # type: ignore[arg-type]
    print(kube.log)
    assert kube.pvs == before, f"refused, yet PV {name} is gone: {sorted(kube.pvs)}"


def test_rollback_prebinds_the_delete_pv_to_a_forged_claim_bound_elsewhere(
    converted: tuple[FakeKube, dict[str, Any]],
) -> None:
    """The tenant replaces the CSI claim (Retain: data safe) by one bound to another PV and
    carrying flexhub/convert-restored-from=<old claim uid> (they know it). Rollback accepts it
    and writes the FlexVolume PV with reclaim policy Delete, provisioned-by and the
    flexhub/reclaim finalizer, pre-bound to a claim bound elsewhere: the PV controller
    releases such a PV and flexhub's reclaim then removes the storage."""
    kube, pv = converted
    name = pv["metadata"]["name"]
    del kube.claims[("team", "data")]
    kube.claims[("team", "data")] = {
        "metadata": {
            "name": "data",
            "namespace": "team",
            "uid": "tenant-new",
            "annotations": {"flexhub/convert-restored-from": CLAIM_UID},
        },
        "spec": {"volumeName": "pvc-elsewhere", "storageClassName": "other"},
        "status": {"phase": "Bound"},
    }
    with pytest.raises(ConvertError):
        steps.run(kube, "team", ["data"], S, True, lambda line: None)  # type: ignore[arg-type]
    print(kube.log)
    made = kube.pvs[name]
    assert not (
        made["spec"]["persistentVolumeReclaimPolicy"] == "Delete"
        and made["spec"]["claimRef"]["uid"] == "tenant-new"
    ), f"PV {name} written Delete, {made['metadata'].get('finalizers')}, bound to a foreign claim"


def _ro_pv() -> tuple[dict[str, Any], dict[str, Any]]:
    """An admin's static NFS PV published read-only the FlexVolume way: kubelet merges the
    PV's options last, so ``kubernetes.io/readwrite: ro`` there makes every mount ro
    (flexhub.volume.Volume.from_options reads it)."""
    pv, pvc = _provisioned()
    pv["spec"]["flexVolume"] = {
        "driver": "k8s/flexhub",
        "options": {
            "backend": "nfs",
            "server": "10.0.0.1",
            "share": "/export/dataset",
            "kubernetes.io/readwrite": "ro",
        },
    }
    return pv, pvc


def test_a_read_only_flexvolume_pv_stays_read_only_on_csi(tmp_path: Any) -> None:
    from flexhub.config import NodeConfig
    from flexhub.csi.proto import csi_pb2
    from flexhub.csi.volumes import flexhub_volume
    from flexhub.volume import Volume

    pv, pvc = _ro_pv()
    options = pv["spec"]["flexVolume"]["options"]
    assert Volume.from_options(options).read_only  # FlexVolume: mounted ro
    new = plan.csi_pv(pv, pvc, "new-uid")
    source = new["spec"]["csi"]
    cap = csi_pb2.VolumeCapability(
        access_mode=csi_pb2.VolumeCapability.AccessMode(
            mode=csi_pb2.VolumeCapability.AccessMode.MULTI_NODE_MULTI_WRITER
        )
    )
    cap.mount.SetInParent()
    config = NodeConfig(state_dir=tmp_path / "state", log_dir=tmp_path / "log")
    volume, _, _ = flexhub_volume(
        source["volumeAttributes"], cap, {}, config, read_only=bool(source.get("readOnly"))
    )
    assert volume.read_only, f"converted: csi.readOnly={source.get('readOnly')}, mounted rw"


def test_an_inline_secret_in_pv_options_is_refused_and_copied_nowhere() -> None:
    """kubelet passes secrets as ``kubernetes.io/secret/<key>`` options, and a PV's own
    options win, so a PV may carry one inline. Convert refuses it in one line (before, it was
    copied into the backup ConfigMap and the CSI PV's volumeAttributes)."""
    pv, pvc = _ro_pv()
    options = pv["spec"]["flexVolume"]["options"]
    del options["kubernetes.io/readwrite"]
    options["kubernetes.io/secret/password"] = "c2VjcmV0LXB3"
    with pytest.raises(ConvertError, match="carries credentials in its options") as refused:
        plan.csi_pv(pv, pvc, "u")
    assert "c2VjcmV0LXB3" not in str(refused.value)
    kube = FakeKube()
    kube.pvs[pv["metadata"]["name"]] = pv
    kube.claims[("team", "data")] = pvc
    with pytest.raises(ConvertError, match="carries credentials"):
        steps.run(kube, "team", ["data"], S, False, lambda line: None)  # type: ignore[arg-type]
    assert kube.cms == {} and kube.pvs[pv["metadata"]["name"]] == pv


def test_an_fstype_option_survives_the_move() -> None:
    """A PV's ``kubernetes.io/fsType`` option wins over kubelet's (as readwrite does): the
    FlexVolume driver formats and mounts with it. The converted PV's csi.fsType comes only
    from ``flexVolume.fsType``, so the CSI node mounts with another (the default) type."""
    from flexhub.volume import Volume

    pv, pvc = _provisioned()
    flex = pv["spec"]["flexVolume"]
    del flex["fsType"]
    flex["options"]["kubernetes.io/fsType"] = "xfs"
    assert Volume.from_options(flex["options"]).fs_type == "xfs"
    source = plan.csi_pv(pv, pvc, "u")["spec"]["csi"]
    assert source.get("fsType") == "xfs", f"csi.fsType {source.get('fsType')!r}"


def test_a_rerun_refuses_a_forged_claim_that_names_another_pv(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Killed after the CSI claim was created; before the rerun the tenant swaps in a claim
    of that name carrying flexhub/convert-from=<old claim uid> (they know it) but bound to
    another PV. The rerun refuses before it writes the CSI PV (it pre-binds to that claim)."""
    monkeypatch.setattr(steps, "validate_options", lambda options: None)
    kube = FakeKube()
    pv, pvc = _sealed()
    name = pv["metadata"]["name"]
    kube.pvs[name] = pv
    kube.claims[("team", "data")] = pvc
    monkeypatch.setattr(steps, "_killed_after", _stop_after("claim-created"))
    with pytest.raises(_Killed):
        steps.run(kube, "team", ["data"], S, False, lambda line: None)  # type: ignore[arg-type]
    made = kube.claims.pop(("team", "data"))
    forged = copy.deepcopy(made)
    forged["metadata"]["uid"] = "tenant-new"
    forged["spec"]["volumeName"] = "pvc-elsewhere"
    kube.claims[("team", "data")] = forged
    monkeypatch.setattr(steps, "_killed_after", lambda step: None)
    with pytest.raises(ConvertError, match="names another PV"):
        steps.run(kube, "team", ["data"], S, False, lambda line: None)  # type: ignore[arg-type]
    assert name not in kube.pvs, f"a CSI PV {name} was written for a forged claim"


class _Killed(Exception):
    """Stands for the SIGKILL of ``steps._killed_after``."""


def _stop_after(wanted: str) -> Any:
    def killed_after(step: str) -> None:
        if step == wanted:
            raise _Killed(step)

    return killed_after
