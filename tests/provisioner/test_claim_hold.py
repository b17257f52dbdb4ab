"""A claim deleted while its storage exists without a PV: the provisioner killed (or the PV
refused) between the backend's provision and the PV's save, then the claim deleted before
any retry. The claim holds ``flexhub/provisioning`` over that window, so it waits for the
provisioner, which finds what the backend made and reclaims it; nothing else is touched.

Units against the in-memory API; the same on the real API server and the rig's NFS server:
tests/cluster/test_provisioner.py, tests/vm/.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from kubernetes.client.rest import ApiException

from flexhub.errors import FlexhubError, InvalidOptions, NoRoom
from flexhub.provisioner.controller import Controller, Later
from flexhub.provisioner.pvapi import CLAIM_FINALIZER
from flexhub.provisioning import Claim, Provisioned
from flexhub.volume import Secrets
from tests.provisioner.fakeapi import FakeApi, reasons
from tests.provisioner.test_controller_attacks import Recording, _claim, _setup


def _crashed(api: FakeApi, controller: Controller, claim: dict[str, Any]) -> None:
    """Provision ``claim`` up to the PV's save, which never happens (as a kill would)."""
    api.refuse_pv = ApiException(status=503, reason="the provisioner died here")
    meta = claim["metadata"]
    with pytest.raises(ApiException):
        controller.sync_claim(meta["namespace"], meta["name"])
    api.refuse_pv = None


def _delete(api: FakeApi, claim: dict[str, Any]) -> None:
    meta = claim["metadata"]
    api.core.delete_namespaced_persistent_volume_claim(meta["name"], meta["namespace"])


def test_the_claim_holds_its_finalizer_exactly_while_storage_may_lack_a_pv() -> None:
    api, _, controller = _setup()
    claim = _claim(api)
    seen: list[list[str]] = []

    class Watching(Recording):
        def provision(self, c: Claim, parameters: Any, secrets: Secrets) -> Provisioned:
            seen.append(list(api.claims[("team-a", "data")]["metadata"].get("finalizers", [])))
            return super().provision(c, parameters, secrets)

    controller.backend_for = lambda _name: Watching()
    controller.sync_claim("team-a", "data")
    assert seen == [[CLAIM_FINALIZER]]
    assert f"pvc-{claim['metadata']['uid']}" in api.volumes
    assert claim["metadata"]["finalizers"] == []


def test_a_claim_deleted_between_storage_and_pv_gets_its_storage_reclaimed() -> None:
    """Before the fix: the delete removed the claim at once and its storage was left with
    nothing to reclaim it (``reclaimed == []``)."""
    api, backend, controller = _setup()
    claim = _claim(api)
    other = _claim(api, ns="team-b", name="other")
    _crashed(api, controller, claim)
    _delete(api, claim)
    assert ("team-a", "data") in api.claims  # waits for the provisioner
    controller.sync_claim("team-a", "data")
    uid = claim["metadata"]["uid"]
    assert [(o["path"], r["claimUid"]) for o, r, _ in backend.reclaimed] == [(f"pvc-{uid}", uid)]
    assert ("team-a", "data") not in api.claims
    assert not api.volumes
    assert reasons(api)[-1] == "ProvisioningUndone"
    assert [c.uid for c in backend.provisioned] == [uid, uid]  # found again, never another's
    assert other["metadata"].get("finalizers") is None


def test_a_claim_whose_pv_was_saved_just_goes() -> None:
    """Killed after the PV's save and before the finalizer's removal: the PV's own reclaim
    takes care of the storage; the claim goes with nothing reclaimed for it."""
    api, backend, controller = _setup()
    claim = _claim(api)
    controller.sync_claim("team-a", "data")
    claim["metadata"]["finalizers"] = [CLAIM_FINALIZER]  # as if the removal never happened
    _delete(api, claim)
    controller.sync_claim("team-a", "data")
    assert ("team-a", "data") not in api.claims
    assert backend.reclaimed == []
    assert f"pvc-{claim['metadata']['uid']}" in api.volumes


def test_a_held_claim_bound_to_its_pv_is_let_go() -> None:
    api, _, controller = _setup()
    claim = _claim(api)
    controller.sync_claim("team-a", "data")
    claim["metadata"]["finalizers"] = [CLAIM_FINALIZER]
    claim["spec"]["volumeName"] = f"pvc-{claim['metadata']['uid']}"
    controller.sync_claim("team-a", "data")
    assert claim["metadata"]["finalizers"] == []


@pytest.mark.parametrize(
    "change, why",
    [
        (lambda api: api.classes.pop("files"), "class gone"),
        (lambda api: api.classes["files"].update(provisioner="someone-else"), "not ours"),
    ],
    ids=["class-gone", "another-provisioners-class"],
)
def test_without_its_class_the_claim_goes_and_the_event_names_its_uid(
    change: Any, why: str
) -> None:
    """Nothing says any more what was made: an Event says what to look for, the claim goes,
    and no backend is called (a tenant who puts the finalizer on any claim reaches none)."""
    api, backend, controller = _setup()
    claim = _claim(api)
    _crashed(api, controller, claim)
    change(api)
    _delete(api, claim)
    controller.sync_claim("team-a", "data")
    assert ("team-a", "data") not in api.claims, why
    assert len(backend.provisioned) == 1 and backend.reclaimed == []
    assert api.events[-1]["reason"] == "ProvisioningLeftover"
    assert claim["metadata"]["uid"] in api.events[-1]["message"]


def test_storage_no_pv_ever_named_is_deleted_whatever_the_class_keeps() -> None:
    """No PV named it, so no pod wrote to it: deleted even for a Retain/archive class (an
    archive of it, interrupted, would collide with itself on every retry)."""
    api, backend, controller = _setup()
    claim = _claim(api)
    _crashed(api, controller, claim)
    api.classes["files"]["reclaimPolicy"] = "Retain"
    _delete(api, claim)
    controller.sync_claim("team-a", "data")
    assert ("team-a", "data") not in api.claims
    assert [r["onDelete"] for _, r, _ in backend.reclaimed] == ["delete"]


def test_an_annotation_edited_after_the_hold_does_not_move_what_is_reclaimed() -> None:
    """A pathPattern may use an annotation: a retry and the undo derive the storage from the
    annotations as frozen at the hold, not as edited since (the edit would otherwise make
    the undo delete a new directory and leave the made one)."""
    api, _, controller = _setup()
    claim = _claim(api)
    claim["metadata"]["annotations"]["team"] = "blue"
    paths: list[str] = []

    class ByTeam(Recording):
        def provision(self, c: Claim, parameters: Any, secrets: Secrets) -> Provisioned:
            made = super().provision(c, parameters, secrets)
            path = f"{c.annotations.get('team')}/pvc-{c.uid}"
            paths.append(path)
            return made.replace(options={"path": path}, reclaim={"claimUid": c.uid, "path": path})

    by_team = ByTeam()
    controller.backend_for = lambda _name: by_team
    _crashed(api, controller, claim)
    claim["metadata"]["annotations"]["team"] = "red"
    _delete(api, claim)
    controller.sync_claim("team-a", "data")
    uid = claim["metadata"]["uid"]
    assert paths == [f"blue/pvc-{uid}"] * 2
    assert [r["path"] for _, r, _ in by_team.reclaimed] == [f"blue/pvc-{uid}"]
    assert ("team-a", "data") not in api.claims


def test_a_claim_that_named_a_pv_never_has_storage_deleted_by_the_undo() -> None:
    api, backend, controller = _setup()
    claim = _claim(api)
    _crashed(api, controller, claim)
    claim["spec"]["volumeName"] = "pvc-gone-since"
    _delete(api, claim)
    controller.sync_claim("team-a", "data")
    assert ("team-a", "data") not in api.claims
    assert backend.reclaimed == [] and len(backend.provisioned) == 1
    assert api.events[-1]["reason"] == "ProvisioningLeftover"


@pytest.mark.parametrize(
    "spec",
    [
        {"dataSource": {"kind": "VolumeSnapshot", "name": "s"}},
        {"selector": {"matchLabels": {"a": "b"}}},
        {"volumeMode": "Block"},
    ],
    ids=["dataSource", "selector", "block"],
)
def test_a_finalizer_a_tenant_put_on_a_refused_claim_makes_no_storage(spec: Any) -> None:
    """Provisioning refuses these before any hold: an author who adds the finalizer by hand
    and deletes the claim gets no storage made (and zeroed) for it."""
    api, backend, controller = _setup()
    claim = _claim(api, **spec)
    claim["metadata"]["finalizers"] = [CLAIM_FINALIZER]
    _delete(api, claim)
    controller.sync_claim("team-a", "data")
    assert ("team-a", "data") not in api.claims
    assert backend.provisioned == [] and backend.reclaimed == []


def test_a_hold_the_rbac_refuses_is_said_on_the_claim() -> None:
    api, backend, controller = _setup()
    _claim(api)
    api.refuse_claim_patch = ApiException(status=403, reason="Forbidden")
    with pytest.raises(ApiException):
        controller.sync_claim("team-a", "data")
    assert backend.provisioned == []
    assert api.events[-1]["reason"] == "ProvisioningFailed"
    assert "may not patch claims" in api.events[-1]["message"]


def test_a_backend_that_cannot_load_keeps_the_claim_and_says_why() -> None:
    api, _, controller = _setup()
    claim = _claim(api)
    _crashed(api, controller, claim)
    _delete(api, claim)

    def broken(_name: str) -> Any:
        raise FlexhubError("backend 'rec' failed to import: ModuleNotFoundError")

    controller.backend_for = broken
    with pytest.raises(FlexhubError):
        controller.sync_claim("team-a", "data")
    assert ("team-a", "data") in api.claims
    assert api.events[-1]["reason"] == "ProvisioningLeftover"
    assert "failed to import" in api.events[-1]["message"]


def test_a_node_reclaimed_class_made_nothing_to_undo() -> None:
    api, backend, controller = _setup()
    claim = _claim(api)
    _crashed(api, controller, claim)
    spec = controller.read_class(api.classes["files"])
    controller.read_class = lambda _sc: spec.__class__(**{**spec.__dict__, "reclaim_on": "node"})
    _delete(api, claim)
    controller.sync_claim("team-a", "data")
    assert ("team-a", "data") not in api.claims
    assert len(backend.provisioned) == 1 and backend.reclaimed == []


def test_a_failing_reclaim_keeps_the_claim_and_says_why() -> None:
    api, backend, controller = _setup()
    claim = _claim(api)
    _crashed(api, controller, claim)
    _delete(api, claim)

    def refuse(*_: Any) -> None:
        raise FlexhubError("files.example: connection refused")

    backend.reclaim = refuse  # type: ignore[method-assign]
    with pytest.raises(FlexhubError):
        controller.sync_claim("team-a", "data")
    assert ("team-a", "data") in api.claims
    assert api.events[-1]["reason"] == "ProvisioningLeftover"
    assert "connection refused" in api.events[-1]["message"]


def test_no_finalizer_is_added_to_a_claim_deleted_after_it_was_read() -> None:
    """Deleted between the controller's read and its hold: the API server refuses the new
    finalizer (422), nothing is provisioned, and the next sync sees the deletion."""
    api, backend, controller = _setup()
    claim = _claim(api)
    claim["metadata"]["finalizers"] = ["kubernetes.io/pvc-protection"]
    read = api.core.read_namespaced_persistent_volume_claim

    def read_then_deleted(name: str, namespace: str, **kw: Any) -> Any:
        found = copy.deepcopy(read(name, namespace, **kw))
        _delete(api, claim)
        return found

    api.core.read_namespaced_persistent_volume_claim = read_then_deleted  # type: ignore[method-assign]
    with pytest.raises(ApiException) as raised:
        controller.sync_claim("team-a", "data")
    assert raised.value.status == 422
    assert backend.provisioned == [] and not api.volumes
    assert claim["metadata"]["finalizers"] == ["kubernetes.io/pvc-protection"]


@pytest.mark.parametrize(
    "refusal",
    [
        InvalidOptions("parameters.pathPattern: annotation team is refused"),
        NoRoom("pathPattern: 100Ti asked, the target holds 2Ti"),
    ],
    ids=["invalid", "no-room"],
)
def test_a_claim_its_backend_refuses_can_still_be_deleted(refusal: Exception) -> None:
    """A claim the backend refused (a parameter, an annotation its pattern refuses, a size
    the target has no room for) holds the finalizer too; deleted, it must not wait forever
    for a reclaim that cannot be derived."""
    api, _, controller = _setup()
    claim = _claim(api)

    class Refusing(Recording):
        def provision(self, c: Claim, parameters: Any, secrets: Secrets) -> Provisioned:
            raise refusal

    refusing = Refusing()
    controller.backend_for = lambda _name: refusing
    with pytest.raises((Later, FlexhubError)):
        controller.sync_claim("team-a", "data")
    assert claim["metadata"]["finalizers"] == [CLAIM_FINALIZER]
    _delete(api, claim)
    controller.sync_claim("team-a", "data")
    assert ("team-a", "data") not in api.claims
    assert refusing.reclaimed == []
    assert api.events[-1]["reason"] == "ProvisioningLeftover"
    assert claim["metadata"]["uid"] in api.events[-1]["message"]
