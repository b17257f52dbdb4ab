"""``flexhub provisioner`` and the node agent on the real control plane, with loopfile claims
mounted by the real kubelet: claim → PV → pod → data → resize → claim deleted → file gone.

The provisioner and the node agent run as processes (``python -m flexhub ...``), each with
a token of its account in the Helm chart and the chart's RBAC (tests/cluster/accounts.py),
as deployed; every test fails when the API server refused any of their calls (its audit log).
Each test starts the instances it needs, so that crashes and a second instance are real
processes too.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes.client.rest import ApiException

from tests.cluster.accounts import Accounts, audited, forbidden
from tests.cluster.cluster import NODE, Cluster, Process
from tests.cluster.kube import (
    claim_pod,
    delete_pod,
    events,
    eventually,
    mount_of,
    namespace,
    run_pod,
    volume_dir,
)
from tests.cluster.processes import provisioner, start

pytestmark = [pytest.mark.cluster, pytest.mark.root]
MiB = 1024 * 1024


@pytest.fixture(autouse=True)
def nothing_refused(cluster: Cluster, accounts: Accounts) -> Iterator[None]:
    """No call of the provisioner or node agent was refused by the chart's RBAC (the API
    server's audit log), whatever the process did with the 403 (an Event's is only logged)."""
    before = len(audited(cluster))
    yield
    calls = audited(cluster)[before:]
    assert calls, "no call of the chart's accounts in the audit log: who called the API?"
    refused = forbidden(calls)
    assert not refused, f"calls the chart's RBAC or policy refused: {refused}"


@pytest.fixture(scope="module")
def node_agent(cluster: Cluster, accounts: Accounts) -> Iterator[Process]:
    agent = start(cluster, "node-agent", "node-agent", "node-agent", "--node", NODE)
    yield agent
    agent.stop()


@pytest.fixture
def leader(cluster: Cluster, accounts: Accounts) -> Iterator[Process]:
    proc = provisioner(cluster, "provisioner")
    yield proc
    proc.stop()


def _class(
    cluster: Cluster, name: str, parameters: dict[str, str], binding: str = "WaitForFirstConsumer"
) -> None:
    with contextlib.suppress(ApiException):
        cluster.storage.delete_storage_class(name)
    cluster.storage.create_storage_class(
        {
            "apiVersion": "storage.k8s.io/v1",
            "kind": "StorageClass",
            "metadata": {"name": name},
            "provisioner": "flexhub",
            "parameters": parameters,
            "reclaimPolicy": "Delete",
            "allowVolumeExpansion": True,
            "volumeBindingMode": binding,
        }
    )


def _claim(cluster: Cluster, ns: str, name: str, sc: str, size: str = "64Mi") -> Any:
    return cluster.core.create_namespaced_persistent_volume_claim(
        ns,
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": name},
            "spec": {
                "accessModes": ["ReadWriteOnce"],
                "storageClassName": sc,
                "resources": {"requests": {"storage": size}},
            },
        },
    )


def _pv(cluster: Cluster, uid: str) -> Any:
    try:
        return cluster.core.read_persistent_volume(f"pvc-{uid}")
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


def _file(cluster: Cluster, ns: str, uid: str) -> Path:
    return cluster.loopfile_root / "namespaces" / ns / "provisioned" / f"pvc-{uid}.img"


def test_loopfile_claim_lifecycle(cluster: Cluster, leader: Process, node_agent: Process) -> None:
    """Claim → PV (named from the claim's uid, node affinity, finalizer, record) → bound by the
    controller → a pod mounts it through the kubelet and writes → the claim is resized: the
    file and filesystem grow → pod and claim deleted → the node agent removes the file, then
    the PV goes."""
    ns = namespace(cluster, "prov")
    _class(cluster, "loop-xfs", {"backend": "loopfile", "fsType": "xfs"})
    claim = _claim(cluster, ns, "data", "loop-xfs", "320Mi")
    uid = claim.metadata.uid
    time.sleep(2)
    assert _pv(cluster, uid) is None, "provisioned before a pod chose the node (WFFC)"
    running = run_pod(cluster, ns, claim_pod("app", "data"), timeout=180)
    pv = _pv(cluster, uid)
    assert pv.metadata.annotations["pv.kubernetes.io/provisioned-by"] == "flexhub"
    assert "flexhub/reclaim" in pv.metadata.finalizers
    record = json.loads(pv.metadata.annotations["flexhub/reclaim"])
    assert record["backend"] == "loopfile" and record["node"] == NODE
    assert record["reclaimOn"] == "node" and record["onDelete"] == "delete"
    assert pv.spec.flex_volume.options == {
        "backend": "loopfile",
        "file": f"provisioned/pvc-{uid}.img",
        "size": str(320 * MiB),
        "maxSize": "1Ti",  # the class's bound (its default), enforced by the node's expandfs
    }
    assert pv.spec.flex_volume.fs_type == "xfs"
    term = pv.spec.node_affinity.required.node_selector_terms[0].match_expressions[0]
    assert (term.key, term.values) == ("kubernetes.io/hostname", [NODE])
    assert pv.spec.claim_ref.uid == uid and pv.spec.capacity["storage"] == "320Mi"
    shown = events(cluster, ns, "data")
    assert any(e.startswith("ProvisioningSucceeded") for e in shown), shown
    target = volume_dir(cluster, running.metadata.uid, f"pvc-{uid}")
    assert mount_of(target)["fstype"] == "xfs"
    (target / "kept").write_text("provisioned")
    backing = _file(cluster, ns, uid)
    assert backing.stat().st_size == 320 * MiB

    cluster.core.patch_namespaced_persistent_volume_claim(
        "data", ns, {"spec": {"resources": {"requests": {"storage": "400Mi"}}}}
    )
    eventually(
        "claim grown to 400Mi",
        lambda: (
            cluster.core.read_namespaced_persistent_volume_claim("data", ns).status.capacity.get(
                "storage"
            )
            == "400Mi"
        ),
        timeout=120,
    )
    assert backing.stat().st_size == 400 * MiB
    assert (target / "kept").read_text() == "provisioned"

    delete_pod(cluster, ns, "app")
    cluster.core.delete_namespaced_persistent_volume_claim("data", ns)
    eventually("the PV reclaimed and gone", lambda: _pv(cluster, uid) is None, timeout=120)
    assert not backing.exists()


def test_a_bad_parameter_is_an_event_naming_it(cluster: Cluster, leader: Process) -> None:
    ns = namespace(cluster, "badsc")
    _class(cluster, "loop-typo", {"backend": "loopfile", "directroy": "x"})
    _claim(cluster, ns, "typo", "loop-typo")
    # WaitForFirstConsumer: the claim is the provisioner's once a pod made the scheduler pick.
    cluster.core.create_namespaced_pod(ns, claim_pod("typo", "typo"))
    message = eventually(
        "ProvisioningFailed",
        lambda: next(
            (e for e in events(cluster, ns, "typo") if e.startswith("ProvisioningFailed")), None
        ),
    )
    assert "directroy" in message and "directory" in message, message  # named, with a hint
    assert len(message.splitlines()) == 1
    _class(cluster, "loop-now", {"backend": "loopfile"}, binding="Immediate")
    _claim(cluster, ns, "now", "loop-now")
    message = eventually(
        "ProvisioningFailed",
        lambda: next(
            (e for e in events(cluster, ns, "now") if e.startswith("ProvisioningFailed")), None
        ),
    )
    assert "WaitForFirstConsumer" in message, message


def test_two_instances_make_one_pv_per_claim(cluster: Cluster) -> None:
    """Three instances at once, two of them without leader election: every claim still gets
    exactly one PV (its name is the claim's uid; AlreadyExists counts as done). And the
    leader-elected ones hand over: the leader SIGKILLed, the other takes the Lease and serves
    a new claim."""
    ns = namespace(cluster, "twice")
    _class(cluster, "loop-twice", {"backend": "loopfile"})
    procs = [provisioner(cluster, f"prov-free-{i}", "--no-leader-elect") for i in range(2)]
    try:
        uids = [_claim(cluster, ns, f"c{i}", "loop-twice").metadata.uid for i in range(3)]
        for i in range(3):
            run_pod(cluster, ns, claim_pod(f"p{i}", f"c{i}"), timeout=180)
        ours = [
            pv
            for pv in cluster.core.list_persistent_volume().items
            if pv.spec.claim_ref and pv.spec.claim_ref.namespace == ns
        ]
        assert sorted(pv.spec.claim_ref.uid for pv in ours) == sorted(uids)
    finally:
        for proc in procs:
            proc.stop()
    first = provisioner(cluster, "prov-a")
    eventually("a leader", lambda: "leading" in first.log.read_text())
    second = provisioner(cluster, "prov-b")
    try:
        time.sleep(3)
        assert "leading" not in second.log.read_text()
        first.kill()
        claim = _claim(cluster, ns, "after", "loop-twice")
        run_pod(cluster, ns, claim_pod("after", "after"), timeout=180)
        assert "leading" in second.log.read_text()
        assert _pv(cluster, claim.metadata.uid) is not None
    finally:
        first.stop()
        second.stop()


def _provisioners_running() -> list[str]:
    """Every ``flexhub provisioner`` process on this machine, with its state (T: stopped)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            state = (proc / "stat").read_bytes().rpartition(b")")[2].split()[0].decode()
        except OSError:
            continue
        if any(b"flexhub" in word for word in argv) and b"provisioner" in argv:
            found.append(f"{proc.name} ({state}): {b' '.join(argv).decode(errors='replace')[:200]}")
    return found


def _killed_after_storage(cluster: Cluster, ns: str, name: str, trace: Path) -> Any:
    """A loopfile claim ``c`` (and pod ``p``) of a class ``loop-<name>``, its provisioner
    SIGKILLed after the storage was made and before the PV was saved; the claim."""
    _class(cluster, f"loop-{name}", {"backend": "loopfile"})
    paused = provisioner(
        cluster,
        f"prov-{name}",
        FLEXHUB_TEST_PAUSE_AT="provisioner-made",
        FLEXHUB_TEST_TRACE=str(trace),
    )
    try:
        claim = _claim(cluster, ns, "c", f"loop-{name}")
        cluster.core.create_namespaced_pod(ns, claim_pod("p", "c"))
        eventually(
            "paused after the storage was made",
            lambda: trace.exists() and "provisioner-made" in trace.read_text(),
            timeout=120,
        )
        made = _pv(cluster, claim.metadata.uid)
        assert made is None, (
            f"a PV for the claim before the paused provisioner went on: {made.metadata}\n"
            f"provisioners running: {_provisioners_running()}\n"
            f"{paused.name}'s log:\n{paused.tail(60)}"
        )
    finally:  # never left stopped (SIGSTOP) behind, whatever failed
        paused.kill()
    return claim


def test_killed_between_storage_and_pv(cluster: Cluster, tmp_path: Path) -> None:
    """SIGKILL after the backend made the storage and before the PV was saved, then a restart:
    exactly one PV, and the volume mounts."""
    ns = namespace(cluster, "crash")
    claim = _killed_after_storage(cluster, ns, "crash", tmp_path / "trace")
    again = provisioner(cluster, "prov-again")
    try:
        eventually(
            "pod running",
            lambda: cluster.core.read_namespaced_pod("p", ns).status.phase == "Running",
            timeout=180,
        )
        ours = [
            pv
            for pv in cluster.core.list_persistent_volume().items
            if pv.spec.claim_ref and pv.spec.claim_ref.uid == claim.metadata.uid
        ]
        assert len(ours) == 1
    finally:
        again.stop()


def test_a_claim_deleted_while_the_provisioner_is_dead_waits_for_it(
    cluster: Cluster, tmp_path: Path
) -> None:
    """SIGKILL between the storage and the PV, then the claim deleted while no provisioner
    runs: the claim waits (Terminating, held by ``flexhub/provisioning``) instead of leaving
    its storage behind, and goes once a provisioner runs again, with no PV made for it. With
    the chart's RBAC (the finalizer is a claim patch). The storage itself reclaimed: the VM
    tier's NFS test; loopfile makes its file at the first mount, so here there is none."""
    ns = namespace(cluster, "undo")
    claim = _killed_after_storage(cluster, ns, "undo", tmp_path / "trace")
    cluster.core.delete_namespaced_pod("p", ns, grace_period_seconds=0)
    cluster.core.delete_namespaced_persistent_volume_claim("c", ns)
    eventually(
        "the pod gone",
        lambda: not cluster.core.list_namespaced_pod(ns).items,
        timeout=120,
    )
    # the controller-manager's pvc-protection lets go once no pod uses it; flexhub's stays
    eventually(
        "only flexhub's finalizer holding the claim",
        lambda: (
            cluster.core.read_namespaced_persistent_volume_claim("c", ns).metadata.finalizers
            == ["flexhub/provisioning"]
        ),
        timeout=60,
    )
    assert cluster.core.read_namespaced_persistent_volume_claim("c", ns).metadata.deletion_timestamp
    again = provisioner(cluster, "prov-undo-again")
    try:

        def gone() -> bool:
            try:
                cluster.core.read_namespaced_persistent_volume_claim("c", ns)
            except ApiException as exc:
                return exc.status == 404
            return False

        eventually("the claim gone", gone, timeout=120)
        assert _pv(cluster, claim.metadata.uid) is None
    finally:
        again.stop()


def test_a_node_that_is_gone_leaves_the_pv_released_with_an_event(
    cluster: Cluster, leader: Process
) -> None:
    ns = namespace(cluster, "ghost")
    _class(cluster, "loop-ghost", {"backend": "loopfile"})
    claim = _claim(cluster, ns, "g", "loop-ghost")
    # A node the scheduler chose (a Node object, no kubelet) that then goes away.
    cluster.core.create_node(
        {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "ghost-node"}}
    )
    try:
        cluster.core.patch_namespaced_persistent_volume_claim(
            "g",
            ns,
            {"metadata": {"annotations": {"volume.kubernetes.io/selected-node": "ghost-node"}}},
        )
        uid = claim.metadata.uid
        eventually(
            "bound",
            lambda: (
                cluster.core.read_namespaced_persistent_volume_claim("g", ns).status.phase
                == "Bound"
            ),
            timeout=90,
        )
    finally:
        cluster.core.delete_node("ghost-node")
    cluster.core.delete_namespaced_persistent_volume_claim("g", ns)
    eventually("released", lambda: _pv(cluster, uid).status.phase == "Released", timeout=60)

    def node_gone() -> str | None:
        found = cluster.core.list_namespaced_event(
            "default", field_selector=f"involvedObject.name=pvc-{uid}"
        ).items
        return next((e.message for e in found if e.reason == "NodeGone"), None)

    message = eventually("NodeGone event", node_gone, timeout=60)
    assert "ghost-node" in message
    pv = _pv(cluster, uid)
    assert pv.status.phase == "Released" and "flexhub/reclaim" in pv.metadata.finalizers
    # Cleaned up as the message says (the finalizer first: nothing will reclaim it).
    cluster.core.patch_persistent_volume(f"pvc-{uid}", {"metadata": {"finalizers": None}})
    cluster.core.delete_persistent_volume(f"pvc-{uid}")


@pytest.mark.parametrize("node", ["no-such-node", "../../../etc/x", "a\nb", "n" * 300])
def test_a_claim_pinned_to_a_node_that_does_not_exist_is_refused(
    cluster: Cluster, leader: Process, node: str
) -> None:
    """A claim author may write ``selected-node`` themselves: a node that is not there (or a
    value the API server would refuse in the PV's node affinity) is a ProvisioningFailed
    Event naming the annotation, and no PV."""
    ns = namespace(cluster, "pinned")
    _class(cluster, "loop-pinned", {"backend": "loopfile"})
    claim = _claim(cluster, ns, "p", "loop-pinned")
    cluster.core.patch_namespaced_persistent_volume_claim(
        "p", ns, {"metadata": {"annotations": {"volume.kubernetes.io/selected-node": node}}}
    )
    message = eventually(
        "ProvisioningFailed",
        lambda: next(
            (e for e in events(cluster, ns, "p") if e.startswith("ProvisioningFailed")), None
        ),
    )
    assert "selected-node" in message and len(message.splitlines()) == 1, message
    assert _pv(cluster, claim.metadata.uid) is None
