"""flexhub convert and the reclaim policy (flexhub/convert/adopt.py), with the in-memory API of
test_convert_attacks: a PV the FlexVolume provisioner reclaimed on delete gets its ``Delete``
back under CSI, only after the CSI controller's record of it is written and the CSI PV is
bound, and only when the provisioner's seal still covers it; any other stays ``Retain``. A
kill after any step and a rerun ends the same; a rollback removes the record."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from flexhub.convert import adopt, plan, steps
from flexhub.csi.adopted import check_record
from flexhub.csi.records import adoption_name
from flexhub.errors import ConvertError
from flexhub.provisioner.seal import ANN_SEAL, Sealer
from tests.core.test_convert_attacks import KEY, FakeKube, S, _Killed, _sealed, _stop_after
from tests.core.test_convert_plan import CLAIM_UID

NAME = f"pvc-{CLAIM_UID}"
HANDLE = f"loopfile:{CLAIM_UID}"
RECORD = ("flexhub-system", adoption_name(CLAIM_UID))


@pytest.fixture(autouse=True)
def _no_schema(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(steps, "validate_options", lambda options: None)


def _kube(pv: dict[str, Any], pvc: dict[str, Any]) -> FakeKube:
    kube = FakeKube()
    kube.pvs[pv["metadata"]["name"]] = pv
    kube.claims[("team", "data")] = pvc
    return kube


def _run(kube: FakeKube, rollback: bool = False, dry_run: bool = False) -> list[dict[str, Any]]:
    settings = steps.Settings(backup_namespace="flexhub-system", timeout=1, dry_run=dry_run)
    return steps.run(kube, "team", ["data"], settings, rollback, lambda line: None)  # type: ignore[arg-type]


def _killed(
    monkeypatch: pytest.MonkeyPatch, kube: FakeKube, step: str, rollback: bool = False
) -> None:
    """Convert (or roll back) on ``kube`` until it is killed after ``step``; later runs of
    the test are not killed."""
    monkeypatch.setattr(steps, "_killed_after", _stop_after(step))
    with pytest.raises(_Killed):
        _run(kube, rollback=rollback)
    monkeypatch.setattr(steps, "_killed_after", lambda step: None)


def _reseal(pv: dict[str, Any]) -> None:
    pv["metadata"]["annotations"][ANN_SEAL] = Sealer(KEY).seal(pv)


def _with_record(**keys: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """:func:`_sealed` with ``keys`` set in its reclaim record, sealed again."""
    pv, pvc = _sealed()
    record = json.loads(pv["metadata"]["annotations"]["flexhub/reclaim"])
    pv["metadata"]["annotations"]["flexhub/reclaim"] = json.dumps({**record, **keys})
    _reseal(pv)
    return pv, pvc


def test_a_reclaimed_pv_gets_delete_back_after_its_record_and_its_binding() -> None:
    pv, pvc = _sealed()
    kube = _kube(pv, pvc)
    _run(kube)
    csi = kube.pvs[NAME]
    assert csi["spec"]["persistentVolumeReclaimPolicy"] == "Delete"
    assert csi["metadata"]["annotations"][plan.ANN_PROVISIONED_BY] == plan.CSI_DRIVER
    # the record first, the PV made Retain, Delete only at the end
    assert kube.log.index(f"create configmap {RECORD[1]}") < kube.log.index(f"create pv {NAME}")
    assert kube.log[-1] == f"set pv {NAME} Delete"
    record = check_record(json.loads(kube.cms[RECORD]["data"]["record.json"]), HANDLE)
    assert record.options == pv["spec"]["flexVolume"]["options"]
    assert record.node == "n1" and record.namespace == "team"
    assert record.reclaim == {"onDelete": "delete"} | {
        "claimUid": CLAIM_UID
    }  # the backend's own keys, the claim's uid from the PV's name
    assert record.size == 320 << 20 and record.fs_type == "xfs"
    assert kube.cms[("flexhub-system", plan.backup_name("team", "data"))]["data"]["step"] == "done"


def test_the_class_secret_becomes_the_deletion_and_expansion_secret() -> None:
    pv, pvc = _with_record(classSecret="storage/iscsi-host")
    kube = _kube(pv, pvc)
    _run(kube)
    csi = kube.pvs[NAME]
    annotations = csi["metadata"]["annotations"]
    assert annotations[adopt.ANN_DELETION_SECRET_NAMESPACE] == "storage"
    assert annotations[adopt.ANN_DELETION_SECRET_NAME] == "iscsi-host"
    assert csi["spec"]["csi"]["controllerExpandSecretRef"] == {
        "namespace": "storage",
        "name": "iscsi-host",
    }
    stored = json.loads(kube.cms[RECORD]["data"]["record.json"])
    assert "classSecret" not in stored["reclaim"]


@pytest.mark.parametrize("edit", ["options", "record", "unsealed", "no-key", "other-key"])
def test_a_reclaimed_pv_not_under_the_seal_is_refused_and_nothing_changes(edit: str) -> None:
    """Whoever may edit PVs (every node agent's token) pointed the PV at another claim's
    file: written as a CSI record, the CSI controller would remove that file with its own
    rights. Refused before anything is written, as the provisioner itself refuses it."""
    pv, pvc = _sealed()
    kube = _kube(pv, pvc)
    if edit == "options":
        pv["spec"]["flexVolume"]["options"]["file"] = "provisioned/pvc-other.img"
    elif edit == "record":
        pv["metadata"]["annotations"]["flexhub/reclaim"] = json.dumps(
            {"backend": "loopfile", "node": "n1", "onDelete": "delete", "namespace": "other"}
        )
    elif edit == "unsealed":
        del pv["metadata"]["annotations"][ANN_SEAL]
    elif edit == "no-key":
        kube.key = None
    else:
        kube.key = b"x" * 32
    before = copy.deepcopy((kube.pvs, kube.claims))
    with pytest.raises(ConvertError, match="PV pvc-") as refused:
        _run(kube)
    assert "\n" not in str(refused.value)
    assert "provisioner-seal" in str(refused.value)
    assert (kube.pvs, kube.claims) == before and kube.cms == {}


@pytest.mark.parametrize("kind", ["retain", "hand-written"])
def test_a_pv_without_a_reclaim_stays_retain_with_no_record(kind: str) -> None:
    pv, pvc = _sealed()
    if kind == "retain":
        pv["spec"]["persistentVolumeReclaimPolicy"] = "Retain"
    else:  # written by hand: no reclaim record, no seal (no FlexVolume reclaimer either)
        del pv["metadata"]["annotations"]["flexhub/reclaim"]
        del pv["metadata"]["annotations"][ANN_SEAL]
    kube = _kube(pv, pvc)
    kube.key = None
    _run(kube)
    assert kube.pvs[NAME]["spec"]["persistentVolumeReclaimPolicy"] == "Retain"
    assert RECORD not in kube.cms


#: Every step convert may be killed after (tests/cluster/test_convert.py kills the real
#: process after each).
STEPS = [
    "saved",
    "retained",
    "claim-deleted",
    "pv-deleted",
    "claim-created",
    "record-written",
    "pv-created",
    "policy-restored",
]


@pytest.mark.parametrize("step", STEPS)
def test_a_kill_after_any_step_and_a_rerun_ends_delete_with_its_record(
    monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    pv, pvc = _sealed()
    kube = _kube(pv, pvc)
    _killed(monkeypatch, kube, step)
    if step in ("record-written", "pv-created"):  # not yet Delete: nothing can reclaim it
        assert NAME not in kube.pvs or (
            kube.pvs[NAME]["spec"]["persistentVolumeReclaimPolicy"] == "Retain"
        )
    _run(kube)
    assert kube.pvs[NAME]["spec"]["persistentVolumeReclaimPolicy"] == "Delete"
    assert RECORD in kube.cms
    check_record(json.loads(kube.cms[RECORD]["data"]["record.json"]), HANDLE)


def test_a_record_edited_before_the_rerun_is_written_again() -> None:
    pv, pvc = _sealed()
    kube = _kube(pv, pvc)
    body = adopt.record_body(pv, pvc, HANDLE)
    forged = copy.deepcopy(body)
    forged["data"]["record.json"] = json.dumps({"forged": True})
    kube.cms[RECORD] = forged
    _run(kube)
    assert kube.cms[RECORD]["data"] == body["data"]


def test_the_dry_run_shows_the_record_and_writes_nothing() -> None:
    pv, pvc = _sealed()
    kube = _kube(pv, pvc)
    shown = _run(kube, dry_run=True)
    kinds = [(o["kind"], o["metadata"]["name"]) for o in shown]
    assert ("ConfigMap", RECORD[1]) in kinds
    (csi,) = [o for o in shown if o["kind"] == "PersistentVolume"]
    assert csi["spec"]["persistentVolumeReclaimPolicy"] == "Retain"  # as it is created
    assert kube.cms == {} and kube.log == []


def test_a_rollback_makes_the_csi_pv_retain_first_and_drops_the_record() -> None:
    pv, pvc = _sealed()
    kube = _kube(pv, pvc)
    _run(kube)
    kube.log.clear()
    _run(kube, rollback=True)
    assert kube.log[0] == f"set pv {NAME} Retain"
    assert RECORD not in kube.cms
    back = kube.pvs[NAME]
    assert back["spec"].get("flexVolume")
    assert back["spec"]["persistentVolumeReclaimPolicy"] == "Delete"
    assert Sealer(KEY).sealed(back), "the FlexVolume PV comes back under its seal"


def test_a_rollback_of_a_convert_killed_before_the_pv_drops_the_record(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pv, pvc = _sealed()
    kube = _kube(pv, pvc)
    _killed(monkeypatch, kube, "record-written")
    assert RECORD in kube.cms
    _run(kube, rollback=True)
    assert RECORD not in kube.cms
    assert kube.pvs[NAME]["spec"].get("flexVolume")


def test_a_record_deleted_before_the_rerun_is_written_before_delete_comes_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Killed once the CSI PV exists (Retain); the record is deleted meanwhile. The rerun
    writes it again before the policy is Delete: without it DeleteVolume would answer that
    the volume is gone and leave its storage behind."""
    pv, pvc = _sealed()
    kube = _kube(pv, pvc)
    _killed(monkeypatch, kube, "pv-created")
    del kube.cms[RECORD]
    kube.log.clear()
    _run(kube)
    assert kube.log.index(f"create configmap {RECORD[1]}") < kube.log.index(f"set pv {NAME} Delete")


def test_without_a_class_secret_the_pvs_secret_ref_is_the_deletion_secret() -> None:
    """As the FlexVolume provisioner reclaims: the class Secret, else the PV's secretRef
    (its namespace, else ``default``)."""
    pv, pvc = _sealed()
    assert pv["spec"]["flexVolume"]["secretRef"] == {"name": "creds"}
    kube = _kube(pv, pvc)
    _run(kube)
    annotations = kube.pvs[NAME]["metadata"]["annotations"]
    assert annotations[adopt.ANN_DELETION_SECRET_NAMESPACE] == "default"
    assert annotations[adopt.ANN_DELETION_SECRET_NAME] == "creds"


def test_the_steps_killed_after_are_every_step_of_convert() -> None:
    """The kill tests (here and on the tier) cover each point convert may stop at."""
    import inspect
    import re

    found = re.findall(r'_killed_after\("([a-z-]+)"\)', inspect.getsource(steps))
    assert sorted(s for s in found if not s.startswith("rollback-")) == sorted(STEPS)


# -- from the hostile review of the first version (each failed before its fix) -------------


def _reclaimed_by_csi(kube: FakeKube) -> None:
    """The tenant deletes the CSI claim; the PV is Delete: external-provisioner's DeleteVolume
    reclaims the storage and deletes the record, then the PV goes."""
    del kube.claims[("team", "data")]
    assert kube.pvs[NAME]["spec"]["persistentVolumeReclaimPolicy"] == "Delete"
    del kube.pvs[NAME]
    kube.cms.pop(RECORD)


def test_removing_the_saved_copies_by_their_label_leaves_the_records() -> None:
    """The documented clean-up of the saved copies (``-l
    app.kubernetes.io/managed-by=flexhub-convert``) once matched the records too: every
    converted PV left Delete with no record, its storage leaked at its deletion."""
    pv, pvc = _sealed()
    kube = _kube(pv, pvc)
    _run(kube)
    labels = kube.cms[RECORD]["metadata"]["labels"]
    assert labels.get("app.kubernetes.io/managed-by") != "flexhub-convert"


def test_a_record_lost_after_done_is_written_again_by_a_rerun() -> None:
    pv, pvc = _sealed()
    kube = _kube(pv, pvc)
    _run(kube)
    del kube.cms[RECORD]
    _run(kube)  # "converted already", and the record is back
    assert RECORD in kube.cms
    kube.cms[RECORD]["metadata"]["labels"] = {}  # there, without its labels: refused by CSI
    _run(kube)
    assert kube.cms[RECORD]["metadata"]["labels"] == adopt_labels()


def adopt_labels() -> dict[str, str]:
    from flexhub.csi.records import ADOPTION_LABELS

    return dict(ADOPTION_LABELS)


def test_no_csi_controller_in_the_namespace_is_refused_before_anything_changes() -> None:
    """An older chart, CSI mode installed in another namespace, or none: the record would be
    read by no controller, and Delete would leave the storage behind."""
    pv, pvc = _sealed()
    kube = _kube(pv, pvc)
    kube.leases.clear()
    before = copy.deepcopy((kube.pvs, kube.claims))
    with pytest.raises(ConvertError, match="no CSI controller of flexhub runs in namespace"):
        _run(kube)
    assert (kube.pvs, kube.claims) == before and kube.cms == {}


def _beside_the_bound_mark(
    kube: FakeKube, monkeypatch: pytest.MonkeyPatch, beside: Any
) -> list[int]:
    """Run ``beside()`` once, as convert marks its copy bound (between its read of the PV
    and its Delete)."""
    real, ran = kube.patch_config_map, []

    def patch(ns: str, name: str, data: dict[str, str], labels: Any = None) -> None:
        if data.get("step") == steps.BOUND and not ran:
            ran.append(1)
            beside()
        real(ns, name, data, labels)

    monkeypatch.setattr(kube, "patch_config_map", patch)
    return ran


def test_a_rollback_racing_the_policy_restore_never_leaves_a_released_delete_pv(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Convert has read the bound CSI PV; a rollback beside it sets the PV Retain and deletes
    its claim; convert's Delete (tested on the uid only) used to land on the Released PV,
    whose record was still there: DeleteVolume reclaimed the storage the rollback then wrote
    a FlexVolume PV for."""
    pv, pvc = _sealed()
    kube = _kube(pv, pvc)
    _killed(monkeypatch, kube, "pv-created")

    def rollback() -> None:
        monkeypatch.setattr(steps, "_killed_after", _stop_after("rollback-claim-deleted"))
        with pytest.raises(_Killed):
            steps.rollback_claim(kube, "team", "data", S, lambda line: None)  # type: ignore[arg-type]
        monkeypatch.setattr(steps, "_killed_after", lambda step: None)

    ran = _beside_the_bound_mark(kube, monkeypatch, rollback)
    with pytest.raises(ConvertError):
        steps.convert_claim(kube, "team", "data", S, lambda line: None)  # type: ignore[arg-type]
    assert ran
    csi = kube.pvs.get(NAME)
    assert csi is None or csi["spec"]["persistentVolumeReclaimPolicy"] == "Retain"


def test_delete_lands_only_on_the_pv_as_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """The PV written by someone else after convert read it (its claim still bound): the
    Delete is not set (the resourceVersion test), in one line, and the PV keeps Retain."""
    pv, pvc = _sealed()
    kube = _kube(pv, pvc)
    _killed(monkeypatch, kube, "pv-created")

    def written() -> None:
        kube.pvs[NAME]["metadata"]["resourceVersion"] = "written-meanwhile"

    _beside_the_bound_mark(kube, monkeypatch, written)
    with pytest.raises(ConvertError, match="changed while"):
        _run(kube)
    assert kube.pvs[NAME]["spec"]["persistentVolumeReclaimPolicy"] == "Retain"


def test_a_rerun_after_the_volume_was_reclaimed_makes_nothing_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Killed once Delete was back (before done); the claim deleted, the storage reclaimed.
    The rerun used to make the claim, the record and a Delete CSI PV again, for storage
    that is no more."""
    pv, pvc = _sealed()
    kube = _kube(pv, pvc)
    _killed(monkeypatch, kube, "policy-restored")
    _reclaimed_by_csi(kube)
    with pytest.raises(ConvertError, match="is gone") as refused:
        _run(kube)
    assert "\n" not in str(refused.value)
    assert ("team", "data") not in kube.claims and RECORD not in kube.cms and NAME not in kube.pvs


def test_a_rollback_after_the_volume_was_reclaimed_writes_nothing_back() -> None:
    pv, pvc = _sealed()
    kube = _kube(pv, pvc)
    _run(kube)
    _reclaimed_by_csi(kube)
    with pytest.raises(ConvertError, match="nothing to roll back"):
        _run(kube, rollback=True)
    assert NAME not in kube.pvs and ("team", "data") not in kube.claims


def test_a_killed_rollback_finishes_though_it_deleted_the_csi_pv(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Not refused as "reclaimed": the rollback marked the copy before it deleted anything."""
    pv, pvc = _sealed()
    kube = _kube(pv, pvc)
    _run(kube)
    _killed(monkeypatch, kube, "rollback-pv-deleted", rollback=True)
    assert NAME not in kube.pvs
    _run(kube, rollback=True)
    assert kube.pvs[NAME]["spec"].get("flexVolume")


def test_a_record_whose_reclaim_on_is_unknown_is_not_handed_to_csi() -> None:
    """The FlexVolume provisioner refuses a record whose reclaimOn it does not know."""
    pv, pvc = _with_record(reclaimOn="archive-host")
    kube = _kube(pv, pvc)
    with pytest.raises(ConvertError, match="reclaimOn 'archive-host'"):
        _run(kube)
    assert kube.cms == {}


# -- from the second hostile review (each failed before its fix) ---------------------------


def test_a_convert_rerun_beside_a_rollback_never_leaves_its_claim_deleted_under_delete(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Convert killed once its CSI PV existed (Retain). A rollback begins; while it checks the
    pods, a rerun of convert runs to its end (Delete back). The rollback used to delete the
    CSI claim of that Delete PV, its record still there: the storage reclaimed under it."""
    pv, pvc = _sealed()
    kube = _kube(pv, pvc)
    _killed(monkeypatch, kube, "pv-created")
    seen: list[str] = []
    real_pods, real_delete = kube.pods_using, kube.delete_claim

    def pods_using(ns: str, name: str) -> list[str]:
        if not seen:  # the rollback's in-use check: the whole rerun of convert runs here
            seen.append("convert")
            steps.convert_claim(kube, "team", "data", S, lambda line: None)  # type: ignore[arg-type]
        return real_pods(ns, name)

    def delete_claim(ns: str, name: str, uid: str) -> None:
        seen.append(kube.pvs[NAME]["spec"]["persistentVolumeReclaimPolicy"])
        real_delete(ns, name, uid)

    monkeypatch.setattr(kube, "pods_using", pods_using)
    monkeypatch.setattr(kube, "delete_claim", delete_claim)
    steps.rollback_claim(kube, "team", "data", S, lambda line: None)  # type: ignore[arg-type]
    assert seen[0] == "convert" and seen[1] == "Retain"
    assert kube.pvs[NAME]["spec"].get("flexVolume")


def test_a_rollback_refused_for_a_pod_changes_nothing() -> None:
    pv, pvc = _sealed()
    kube = _kube(pv, pvc)
    _run(kube)
    before = copy.deepcopy((kube.pvs, kube.claims, kube.cms))
    kube.pods_using = lambda ns, name: ["app-0"]  # type: ignore[method-assign]
    with pytest.raises(ConvertError, match="used by pod"):
        _run(kube, rollback=True)
    assert (kube.pvs, kube.claims, kube.cms) == before


def _as_before_this_release(kube: FakeKube) -> None:
    """What a convert of the release before left: the copy done (no Delete given), the CSI
    PV Retain, no record."""
    backup = kube.cms[("flexhub-system", plan.backup_name("team", "data"))]
    del backup["data"][steps.DELETE_GIVEN]
    kube.pvs[NAME]["spec"]["persistentVolumeReclaimPolicy"] = "Retain"
    kube.cms.pop(RECORD)


def test_an_older_releases_copy_of_a_deleted_retain_pv_still_rolls_back() -> None:
    """Its PV was Retain: deleting it left the storage, and the copy is the way back."""
    pv, pvc = _sealed()
    kube = _kube(pv, pvc)
    _run(kube)
    _as_before_this_release(kube)
    del kube.claims[("team", "data")]
    del kube.pvs[NAME]
    _run(kube, rollback=True)
    assert kube.pvs[NAME]["spec"].get("flexVolume")


def test_an_older_releases_copy_is_never_made_a_record_by_a_rerun() -> None:
    """Its copy was never checked against the seal: a rerun wrote the CSI record from it
    (a file of another claim here), which the CSI controller acts on with its own rights."""
    pv, pvc = _sealed()
    kube = _kube(pv, pvc)
    _run(kube)
    _as_before_this_release(kube)
    backup = kube.cms[("flexhub-system", plan.backup_name("team", "data"))]
    saved = json.loads(backup["data"]["pv.json"])
    saved["spec"]["flexVolume"]["options"]["file"] = "provisioned/pvc-other.img"
    saved["metadata"]["annotations"].pop(ANN_SEAL, None)
    backup["data"]["pv.json"] = plan.saved_text(saved)
    kube.leases.clear()
    _run(kube)  # converted already
    assert RECORD not in kube.cms


def test_a_lease_not_renewed_for_long_is_no_controller() -> None:
    """A Lease outlives an uninstalled CSI controller."""
    pv, pvc = _sealed()
    kube = _kube(pv, pvc)
    kube.leases[("flexhub-system", "flexhub-csi-k8s-io")] = 3600.0
    with pytest.raises(ConvertError, match="no CSI controller"):
        _run(kube)
    assert kube.cms == {}


def test_the_api_servers_refusal_of_a_changed_pv_is_one_line() -> None:
    from kubernetes.client.rest import ApiException

    from flexhub.convert.kube import Kube

    class Core:
        def patch_persistent_volume(self, name: str, patch: Any, **_: Any) -> None:
            assert {"op": "test", "path": "/metadata/resourceVersion", "value": "7"} in patch
            raise ApiException(status=422, reason="Unprocessable Entity")

    kube = Kube.__new__(Kube)
    kube.core = Core()
    pv = {"metadata": {"name": NAME, "uid": "u", "resourceVersion": "7"}}
    with pytest.raises(ConvertError, match="changed while") as refused:
        kube.set_pv(pv, "Delete", unchanged=True)
    assert "\n" not in str(refused.value)
