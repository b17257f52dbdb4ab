"""The provisioner against hostile claims, edited PVs and a thousand retries, as units.

Each test is one finding of the provisioner's hostile review: the controller and the node
agent run for real against an in-memory API (tests/provisioner/fakeapi.py) and a recording
backend; what matters is which object is read, what reaches a backend and what is written.
The control-plane tier runs the same paths against the real API server
(tests/cluster/test_reclaim_secrets.py, tests/cluster/test_provisioner.py).
"""

from __future__ import annotations

import base64
import copy
import datetime
import json
import uuid
from collections.abc import Mapping
from typing import Any

import pytest
from kubernetes.client.rest import ApiException

from flexhub.errors import FlexhubError
from flexhub.provisioner import pvs
from flexhub.provisioner.controller import MISTAKE_RETRY, Controller, Later
from flexhub.provisioner.events import BURST
from flexhub.provisioner.nodeagent import NodeAgent
from flexhub.provisioner.seal import ANN_SEAL, KEY_SECRET, Sealer, load_key
from flexhub.provisioner.storageclass import ClassSpec
from flexhub.provisioning import Claim, Provisioned, Provisioning
from flexhub.volume import Secrets
from tests.provisioner.fakeapi import FakeApi, reasons

SEALER = Sealer(b"s" * 32)
DRIVER = "k8s/flexhub"


class Recording(Provisioning):
    """A backend that records what reaches it (what a real one would act on)."""

    expands_storage = True

    def __init__(self) -> None:
        self.provisioned: list[Claim] = []
        self.reclaimed: list[tuple[dict[str, str], dict[str, str], dict[str, str]]] = []
        self.expanded: list[int] = []

    def provision(
        self, claim: Claim, parameters: Mapping[str, str], secrets: Secrets
    ) -> Provisioned:
        self.provisioned.append(claim)
        return Provisioned(
            options={"server": "files.example", "path": f"pvc-{claim.uid}"},
            size=claim.size,
            reclaim={"claimUid": claim.uid, "path": f"pvc-{claim.uid}"},
        )

    def reclaim(
        self, options: Mapping[str, str], reclaim: Mapping[str, str], secrets: Secrets
    ) -> None:
        revealed = {key: secrets[key].reveal() for key in secrets}
        self.reclaimed.append((dict(options), dict(reclaim), revealed))

    def expand_storage(
        self, options: Mapping[str, str], reclaim: Mapping[str, str], new_size: int, s: Secrets
    ) -> int:
        self.expanded.append(new_size)
        return new_size


def _spec(secret: tuple[str, str] | None = None) -> ClassSpec:
    return ClassSpec(
        name="files",
        backend="rec",
        parameters={},
        on_delete="delete",
        secret=secret,
        fs_type="",
        reclaim_on="provisioner",
    )


def _setup(
    secret: tuple[str, str] | None = None, allow_expansion: bool = True
) -> tuple[FakeApi, Recording, Controller]:
    api = FakeApi()
    backend = Recording()
    api.add(
        "class",
        {
            "metadata": {"name": "files"},
            "provisioner": "flexhub",
            "reclaimPolicy": "Delete",
            "allowVolumeExpansion": allow_expansion,
            "volumeBindingMode": "Immediate",
            "parameters": {"backend": "rec"},
        },
    )
    api.add("node", {"metadata": {"name": "node-1", "labels": {}}})
    controller = Controller(
        api,
        lambda _name: backend,
        lambda _sc: _spec(secret),
        sealer=SEALER,
        core=api.core,
        storage=api.storage,
    )
    return api, backend, controller


def _claim(
    api: FakeApi, ns: str = "team-a", name: str = "data", size: str = "1Gi", **spec: Any
) -> dict[str, Any]:
    return api.add(
        "claim",
        {
            "metadata": {
                "namespace": ns,
                "name": name,
                "uid": str(uuid.uuid4()),
                "annotations": {pvs.ANN_STORAGE_PROVISIONER: "flexhub"},
            },
            "spec": {
                "storageClassName": "files",
                "accessModes": ["ReadWriteOnce"],
                "resources": {"requests": {"storage": size}},
                **spec,
            },
        },
    )


def _provisioned(api: FakeApi, controller: Controller, claim: dict[str, Any]) -> dict[str, Any]:
    """Provision ``claim`` and bind its PV as the binder would."""
    meta = claim["metadata"]
    controller.sync_claim(meta["namespace"], meta["name"])
    pv = api.volumes[f"pvc-{meta['uid']}"]
    pv["status"] = {"phase": "Bound"}
    claim["spec"]["volumeName"] = pv["metadata"]["name"]
    return pv


# ------------------------------------------------------------------- finding 1: expansion


def test_a_claim_naming_another_tenants_pv_never_grows_it() -> None:
    """Any user may write any PV's name into a new claim's ``spec.volumeName``: the
    provisioner grows storage only for the claim the PV is bound to."""
    api, backend, controller = _setup()
    victim = _claim(api, "team-a", "db")
    pv = _provisioned(api, controller, victim)
    _claim(api, "evil", "grow", size="100Ti", volumeName=pv["metadata"]["name"])
    controller.sync_claim("evil", "grow")
    assert backend.expanded == []
    assert json.loads(pv["metadata"]["annotations"][pvs.ANN_RECLAIM])["size"] == str(1 << 30)
    assert "StorageExpanded" not in reasons(api)


def test_expansion_past_a_class_that_forbids_it_is_refused() -> None:
    api, backend, controller = _setup(allow_expansion=False)
    claim = _claim(api)
    _provisioned(api, controller, claim)
    claim["spec"]["resources"]["requests"]["storage"] = "2Gi"
    with pytest.raises(Later):
        controller.sync_claim("team-a", "data")
    assert backend.expanded == []
    assert "ExpansionRefused" in reasons(api)


class Bounded(Recording):
    """A backend the node grows (loopfile's kind), bounded by the ``maxSize`` its PV carries."""

    expands_storage = False

    def check_expansion(self, options: Mapping[str, str], new_size: int) -> None:
        from pathlib import Path

        from flexhub_loopfile import LoopfileBackend

        from flexhub.config import NodeConfig
        from flexhub.node import Node

        # the provisioner's loopfile: its node services point nowhere, nothing is touched
        nowhere = NodeConfig(state_dir=Path("/nonexistent/flexhub-provisioner"))
        LoopfileBackend(Node(nowhere, backend="loopfile")).check_expansion(options, new_size)


def test_expansion_past_the_pvs_bound_is_refused_early_for_a_node_grown_volume() -> None:
    """loopfile: the node grows the file, and its PV carries the class's maxSize; the
    provisioner says at once, on the claim, that a resize past it will be refused."""
    api, _, controller = _setup()
    backend = Bounded()
    controller.backend_for = lambda _name: backend  # type: ignore[method-assign]
    claim = _claim(api)
    pv = _provisioned(api, controller, claim)
    pv["spec"]["flexVolume"]["options"] = {"file": "f.img", "size": "1Gi", "maxSize": "2Gi"}
    claim["spec"]["resources"]["requests"]["storage"] = "2Gi"
    controller.sync_claim("team-a", "data")  # up to the bound: the node's expandfs grows it
    assert "ExpansionRefused" not in reasons(api)
    claim["spec"]["resources"]["requests"]["storage"] = "3Gi"
    with pytest.raises(Later):
        controller.sync_claim("team-a", "data")
    refused = [e for e in api.events if e["reason"] == "ExpansionRefused"]
    assert refused and "3Gi" in refused[-1]["message"], refused
    assert "maxSize 2Gi" in refused[-1]["message"]
    assert backend.expanded == []


def test_a_node_pv_is_labelled_with_its_node_when_made() -> None:
    made = Provisioned(options={"file": "f"}, size=1, reclaim={}, node="node-1")
    claim = Claim(uid="u", namespace="n", name="c", size=1)
    pv = pvs.build_pv(claim, "c", "Delete", "loopfile", "delete", "node", made, DRIVER, "flexhub")
    assert pv["metadata"]["labels"] == {pvs.NODE_LABEL: "node-1"}
    elsewhere = pvs.build_pv(claim, "c", "Delete", "nfs", "delete", "provisioner",
                             Provisioned(options={}, size=1), DRIVER, "flexhub")  # fmt: skip
    assert "labels" not in elsewhere["metadata"]


def test_the_bound_claim_grows_its_own_storage_and_the_pv_stays_sealed() -> None:
    api, backend, controller = _setup()
    claim = _claim(api)
    pv = _provisioned(api, controller, claim)
    claim["spec"]["resources"]["requests"]["storage"] = "2Gi"
    controller.sync_claim("team-a", "data")
    assert backend.expanded == [2 << 30]
    assert json.loads(pv["metadata"]["annotations"][pvs.ANN_RECLAIM])["size"] == str(2 << 30)
    assert SEALER.sealed(pv)  # re-sealed with the new record: its reclaim still runs


# ----------------------------------------------------------- finding 2: the confused deputy


def _release(pv: dict[str, Any]) -> None:
    pv["status"] = {"phase": "Released"}


def test_an_edited_pv_is_never_reclaimed_with_the_provisioners_rights() -> None:
    """A PV writer points a sealed PV at another namespace's flexhub Secret and their own
    server: no Secret is read, no backend called, the finalizer stays, an Event says why."""
    api, backend, controller = _setup(secret=("team-a", "share"))
    api.add(
        "secret",
        {
            "metadata": {"namespace": "team-a", "name": "share"},
            "type": DRIVER,
            "data": {"password": base64.b64encode(b"team-a-secret").decode()},
        },
    )
    api.add(
        "secret",
        {
            "metadata": {"namespace": "team-b", "name": "smb"},
            "type": DRIVER,
            "data": {"password": base64.b64encode(b"team-b-secret").decode()},
        },
    )
    pv = _provisioned(api, controller, _claim(api))
    _release(pv)
    record = json.loads(pv["metadata"]["annotations"][pvs.ANN_RECLAIM])
    record["classSecret"] = "team-b/smb"
    pv["metadata"]["annotations"][pvs.ANN_RECLAIM] = json.dumps(record)
    pv["spec"]["flexVolume"]["options"]["server"] = "evil.example"
    api.calls.clear()
    with pytest.raises(Later):
        controller.sync_volume(pv["metadata"]["name"])
    assert backend.reclaimed == []
    assert not [c for c in api.calls if c.startswith("get secret")]
    assert pvs.FINALIZER in pv["metadata"]["finalizers"]
    assert "VolumeUnsealed" in reasons(api)


def test_a_sealed_pv_is_reclaimed_and_goes() -> None:
    """The success path: the backend gets the class Secret, then the PV and its finalizer
    go."""
    api, backend, controller = _setup(secret=("team-a", "share"))
    api.add(
        "secret",
        {
            "metadata": {"namespace": "team-a", "name": "share"},
            "type": DRIVER,
            "data": {"password": base64.b64encode(b"pw").decode()},
        },
    )
    pv = _provisioned(api, controller, _claim(api))
    name = pv["metadata"]["name"]
    _release(pv)
    controller.sync_volume(name)
    assert [r[2] for r in backend.reclaimed] == [{"password": "pw"}]
    assert name not in api.volumes


def test_a_pv_written_by_an_unsealing_flexhub_waits_for_an_administrator() -> None:
    api, backend, controller = _setup()
    pv = _provisioned(api, controller, _claim(api))
    del pv["metadata"]["annotations"][ANN_SEAL]
    _release(pv)
    with pytest.raises(Later):
        controller.sync_volume(pv["metadata"]["name"])
    assert backend.reclaimed == []
    message = next(e["message"] for e in api.events if e["reason"] == "VolumeUnsealed")
    assert f"flexhub provisioner-seal {pv['metadata']['name']}" in message


def test_the_seal_covers_what_the_provisioner_acts_on() -> None:
    api, _backend, controller = _setup()
    pv = _provisioned(api, controller, _claim(api))
    assert SEALER.sealed(pv)
    for edit in (
        lambda p: p["spec"]["flexVolume"]["options"].update(server="evil.example"),
        lambda p: p["spec"]["flexVolume"].update(secretRef={"namespace": "x", "name": "y"}),
        lambda p: p["metadata"]["annotations"].update({pvs.ANN_RECLAIM: "{}"}),
        lambda p: p["metadata"].update(name="pvc-other"),
        lambda p: p["metadata"]["annotations"].update({ANN_SEAL: "v1:" + "0" * 64}),
        # a Retain PV flipped to Delete (and its finalizer put back) is not the provisioner's
        # to reclaim until an administrator seals it again
        lambda p: p["spec"].update(persistentVolumeReclaimPolicy="Retain"),
    ):
        edited = copy.deepcopy(pv)
        edit(edited)
        assert not SEALER.sealed(edited)
    assert not Sealer(b"t" * 32).sealed(pv)  # another key's seal is no seal
    odd = copy.deepcopy(pv)
    odd["metadata"]["annotations"][ANN_SEAL] = "v1:\u00e9" * 10
    assert not SEALER.sealed(odd)  # not a TypeError out of compare_digest
    assert "s" * 16 not in repr(SEALER)


def test_the_sealing_key_is_made_once_and_then_read() -> None:
    api = FakeApi()
    first = load_key(api.core, "flexhub")
    assert len(first) == 32
    assert load_key(api.core, "flexhub") == first
    assert ("flexhub", KEY_SECRET) in api.secrets
    api.secrets[("flexhub", KEY_SECRET)]["data"] = {"key": "bm8="}  # too short
    with pytest.raises(FlexhubError, match="holds no sealing key"):
        load_key(api.core, "flexhub")
    # an administrator's provisioner-seal only reads it: never a second key elsewhere
    with pytest.raises(FlexhubError, match="no Secret default/flexhub-provisioner-key"):
        load_key(api.core, "default", create=False)
    assert ("default", KEY_SECRET) not in api.secrets


# ----------------------------------------------- finding 4: the node agent's claim-uid rule


def test_the_node_agent_hands_the_backend_the_uid_from_the_pvs_name() -> None:
    api = FakeApi()
    uid = str(uuid.uuid4())
    record = {"backend": "loopfile", "onDelete": "delete", "reclaimOn": "node", "node": "n1",
              "namespace": "team-a"}  # fmt: skip
    api.add(
        "volume",
        {
            "metadata": {
                "name": f"pvc-{uid}",
                "annotations": {
                    pvs.ANN_PROVISIONED_BY: "flexhub",
                    pvs.ANN_RECLAIM: json.dumps(record),
                },
                "finalizers": [pvs.FINALIZER],
            },
            "spec": {
                "persistentVolumeReclaimPolicy": "Delete",
                "flexVolume": {"driver": DRIVER, "options": {"file": "p/pvc-x.img"}},
            },
            "status": {"phase": "Released"},
        },
    )
    seen: list[Mapping[str, str]] = []
    agent = NodeAgent(api, "n1", lambda _b, _o, r: seen.append(r))
    agent.core = api.core
    agent.events.core = api.core
    agent.sync(f"pvc-{uid}")
    assert [r.get("claimUid") for r in seen] == [uid]


# ------------------------------------------------------- finding 5: clones and restores


@pytest.mark.parametrize(
    "spec",
    [
        {"dataSource": {"kind": "PersistentVolumeClaim", "name": "prod-db"}},
        {
            "dataSourceRef": {
                "kind": "VolumeSnapshot",
                "name": "nightly",
                "apiGroup": "snapshot.storage.k8s.io",
            }
        },
        {"selector": {"matchLabels": {"tier": "gold"}}},
    ],
)
def test_a_clone_restore_or_selector_claim_is_refused_not_made_empty(spec: Any) -> None:
    api, backend, controller = _setup()
    claim = _claim(api, **spec)
    with pytest.raises(Later) as later:
        controller.sync_claim("team-a", "data")
    assert later.value.seconds == MISTAKE_RETRY
    assert backend.provisioned == []
    assert f"pvc-{claim['metadata']['uid']}" not in api.volumes
    assert reasons(api) == ["ProvisioningFailed"]


# ---------------------------------------------------- finding 9: selected-node, 422 answers


@pytest.mark.parametrize("node", ["ghost-node-123", "../../../etc/x", "a\nb", "n" * 300])
def test_a_claim_pinned_to_a_node_that_is_not_there_is_refused(node: str) -> None:
    api, backend, controller = _setup()
    claim = _claim(api)
    claim["metadata"]["annotations"][pvs.ANN_SELECTED_NODE] = node
    with pytest.raises(Later):
        controller.sync_claim("team-a", "data")
    assert backend.provisioned == []
    assert reasons(api) == ["ProvisioningFailed"]
    assert "\n" not in api.events[0]["message"]
    asked = [c.removeprefix("get node ") for c in api.calls if c.startswith("get node ")]
    assert asked in ([], ["ghost-node-123"])  # a name that is no node name is never asked


def test_an_answer_the_api_server_will_give_again_is_a_provisioning_failure() -> None:
    """A 422 (or 400) on the PV's save is the server's own reason in a ProvisioningFailed
    Event, and a slow retry, not a fast loop of Provisioning Events."""
    api, _backend, controller = _setup()
    _claim(api)
    refused = ApiException(status=422, reason="Unprocessable Entity")
    refused.body = json.dumps(
        {"kind": "Status", "code": 422, "message": 'PersistentVolume "x" is invalid: nodeAffinity'}
    )
    refused.headers = {"Audit-Id": "a" * 400}
    api.refuse_pv = refused
    with pytest.raises(Later) as later:
        controller.sync_claim("team-a", "data")
    assert later.value.seconds == MISTAKE_RETRY
    failed = [e["message"] for e in api.events if e["reason"] == "ProvisioningFailed"]
    assert failed == [
        'the API server refused the PV: PersistentVolume "x" is invalid: nodeAffinity'
    ]


# ------------------------------------------------- finding 11: the class Secret's type


def test_a_class_secret_of_another_type_reaches_no_backend() -> None:
    api, backend, controller = _setup(secret=("kube-system", "admin"))
    api.add(
        "secret",
        {
            "metadata": {"namespace": "kube-system", "name": "admin"},
            "type": "Opaque",
            "data": {"password": base64.b64encode(b"root").decode()},
        },
    )
    _claim(api)
    with pytest.raises(Later):
        controller.sync_claim("team-a", "data")
    assert backend.provisioned == []
    assert "has type 'Opaque'" in api.events[-1]["message"]


# --------------------------------------------------------- finding 7: Events aggregated


def test_a_thousand_retries_make_one_counted_event_not_a_thousand() -> None:
    api, _backend, controller = _setup(secret=("team-a", "missing"))
    _claim(api)
    for _ in range(1000):
        with pytest.raises(Later):
            controller.sync_claim("team-a", "data")
    assert len(api.events) == 1
    assert api.events[0]["count"] == BURST  # then one per REFILL seconds


# --------------------------------------------- finding 10: no node agent on an existing node


def _node_pv(api: FakeApi, released_ago: float, labelled: bool = True) -> str:
    uid = str(uuid.uuid4())
    record = {"backend": "rec", "onDelete": "delete", "reclaimOn": "node", "node": "node-1",
              "claimUid": uid}  # fmt: skip
    when = datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=released_ago)
    api.add(
        "volume",
        {
            "metadata": {
                "name": f"pvc-{uid}",
                "annotations": {
                    pvs.ANN_PROVISIONED_BY: "flexhub",
                    pvs.ANN_RECLAIM: json.dumps(record),
                },
                "finalizers": [pvs.FINALIZER],
                "labels": {pvs.NODE_LABEL: "node-1"} if labelled else {},
            },
            "spec": {"persistentVolumeReclaimPolicy": "Delete", "flexVolume": {"options": {}}},
            "status": {"phase": "Released", "lastPhaseTransitionTime": when.isoformat()},
        },
    )
    return f"pvc-{uid}"


def test_a_node_pv_nobody_reclaims_is_said_after_a_grace_period() -> None:
    api, backend, controller = _setup()
    fresh = _node_pv(api, 60)
    with pytest.raises(Later):
        controller.sync_volume(fresh)
    assert reasons(api) == []
    stale = _node_pv(api, 3600)
    with pytest.raises(Later):
        controller.sync_volume(stale)
    assert reasons(api) == ["NodeAgentMissing"]
    assert "node-1" in api.events[0]["message"]
    # one made before PVs were labelled: its agent sees it only once labelled, so it gets
    # its grace from then, not a false alarm on every upgrade
    old = _node_pv(api, 3600, labelled=False)
    with pytest.raises(Later) as later:
        controller.sync_volume(old)
    assert later.value.seconds >= 600 and reasons(api) == ["NodeAgentMissing"]
    assert backend.reclaimed == []


# -------------------------------------- finding 8: node agents watch their own node's PVs


def test_node_pvs_carry_their_nodes_label_and_old_ones_get_it() -> None:
    """A node agent watches with a label selector (its node's), so the provisioner labels
    every node-reclaimed PV it makes, and one made before that once it is Released."""
    from flexhub.provisioner.pvs import NODE_LABEL, node_label

    assert node_label("node-1") == "node-1"
    long = "n." * 100 + "x"
    assert node_label(long).startswith("h-") and len(node_label(long)) <= 63
    assert node_label(long) != node_label(long + "y")
    api, _backend, controller = _setup()
    name = _node_pv(api, 60, labelled=False)
    assert NODE_LABEL not in (api.volumes[name]["metadata"].get("labels") or {})
    with pytest.raises(Later):
        controller.sync_volume(name)
    assert api.volumes[name]["metadata"]["labels"][NODE_LABEL] == "node-1"


def test_the_node_agent_asks_the_api_server_for_its_own_nodes_pvs_only() -> None:
    agent = NodeAgent(FakeApi(), "node-1", lambda _b, _o, _r: None)
    seen: dict[str, Any] = {}

    class Thread:
        def __init__(self, **kwargs: Any) -> None:
            seen.update(kwargs)

        def start(self) -> None:
            pass

    import flexhub.provisioner.nodeagent as nodeagent

    real = nodeagent.threading.Thread
    nodeagent.threading.Thread = Thread  # type: ignore[misc,assignment]
    try:
        agent.feed()
    finally:
        nodeagent.threading.Thread = real  # type: ignore[misc]
    assert seen["kwargs"] == {"label_selector": "flexhub/reclaim-node=node-1"}


def test_a_growth_never_seals_over_a_change_made_meanwhile() -> None:
    """The growth may take long (a LUN zeroed): the record is sealed again only onto the PV
    as it was read before, never over an administrator's fix made (and sealed) meanwhile."""
    api, backend, controller = _setup()
    claim = _claim(api)
    pv = _provisioned(api, controller, claim)
    claim["spec"]["resources"]["requests"]["storage"] = "2Gi"
    fixed = json.loads(pv["metadata"]["annotations"][pvs.ANN_RECLAIM])
    fixed["classSecret"] = "team-a/new"

    def grow(_o: Any, _r: Any, size: int, _s: Any) -> int:
        pv["metadata"]["annotations"][pvs.ANN_RECLAIM] = json.dumps(fixed, sort_keys=True)
        pv["metadata"]["annotations"][ANN_SEAL] = SEALER.seal(pv)
        pv["metadata"]["resourceVersion"] += "0"
        return size

    backend.expand_storage = grow  # type: ignore[method-assign]
    with pytest.raises(FlexhubError, match="changed while its storage grew"):
        controller.sync_claim("team-a", "data")
    assert json.loads(pv["metadata"]["annotations"][pvs.ANN_RECLAIM])["classSecret"] == (
        "team-a/new"
    )
    assert SEALER.sealed(pv)


def test_a_selected_node_outside_the_class_topology_is_refused() -> None:
    api, backend, controller = _setup()
    api.classes["files"]["allowedTopologies"] = [
        {"matchLabelExpressions": [{"key": "kubernetes.io/hostname", "values": ["node-1"]}]}
    ]
    api.nodes["node-1"]["metadata"]["labels"] = {"kubernetes.io/hostname": "node-1"}
    api.add(
        "node", {"metadata": {"name": "infra-9", "labels": {"kubernetes.io/hostname": "infra-9"}}}
    )
    claim = _claim(api)
    claim["metadata"]["annotations"][pvs.ANN_SELECTED_NODE] = "infra-9"
    with pytest.raises(Later):
        controller.sync_claim("team-a", "data")
    assert backend.provisioned == []
    assert "allowedTopologies" in api.events[-1]["message"]
    claim["metadata"]["annotations"][pvs.ANN_SELECTED_NODE] = "node-1"
    controller.sync_claim("team-a", "data")
    assert len(backend.provisioned) == 1


def test_a_pv_refused_by_an_admission_webhook_is_a_provisioning_failure() -> None:
    api, _backend, controller = _setup()
    _claim(api)
    refused = ApiException(status=403, reason="Forbidden")
    refused.body = json.dumps({"kind": "Status", "code": 403, "message": "denied by policy x"})
    api.refuse_pv = refused
    with pytest.raises(Later):
        controller.sync_claim("team-a", "data")
    assert api.events[-1]["message"] == "the API server refused the PV: denied by policy x"


def test_the_node_agent_never_patches_an_event() -> None:
    """Its token may only create Events (in ``default``, every node's and PV's live there):
    a repeat is a new Event under the rate limit, never a patch of someone else's."""
    api = FakeApi()
    agent = NodeAgent(api, "n1", lambda _b, _o, _r: None)
    agent.events.core = api.core
    pv = {"metadata": {"name": "pvc-x", "uid": "u"}}
    for _ in range(3):
        agent.events.volume(pv, "Warning", "VolumeFailedDelete", "busy")
    assert len(api.events) == 3
    assert not [c for c in api.calls if c.startswith("patch event")]


def test_a_growth_reseals_over_a_change_of_what_the_seal_does_not_cover() -> None:
    """The controller-manager raises the PV's capacity while the storage grows: the record
    is still written and sealed (onto the PV read again)."""
    api, backend, controller = _setup()
    claim = _claim(api)
    pv = _provisioned(api, controller, claim)
    claim["spec"]["resources"]["requests"]["storage"] = "2Gi"

    def grow(_o: Any, _r: Any, size: int, _s: Any) -> int:
        pv["spec"]["capacity"] = {"storage": "2Gi"}
        pv["metadata"]["resourceVersion"] += "0"
        return size

    backend.expand_storage = grow  # type: ignore[method-assign]
    controller.sync_claim("team-a", "data")
    assert json.loads(pv["metadata"]["annotations"][pvs.ANN_RECLAIM])["size"] == str(2 << 30)
    assert SEALER.sealed(pv)
