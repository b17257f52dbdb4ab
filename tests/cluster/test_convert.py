"""``flexhub convert`` against the tier's real API server and controller-manager: a FlexVolume
PV of flexhub (as its provisioner writes one: Delete, its finalizer, reclaim record and seal)
and its bound claim are moved onto the CSI driver (Delete again, with the CSI controller's
record of it) and back, refused while a pod uses the claim, and a kill after every step
followed by a rerun ends converted (or rolled back). End to end, a claim the real FlexVolume
provisioner made is converted and then deleted: the CSI sidecars and flexhub's CSI controller
reclaim its storage."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import subprocess
import sys
import time
from typing import Any

import pytest
import yaml
from kubernetes.client.rest import ApiException

from flexhub.convert.plan import backup_name
from flexhub.csi.records import adoption_name
from flexhub.provisioner.seal import ANN_SEAL, KEY_SECRET, Sealer
from tests.cluster.cluster import Cluster
from tests.cluster.kube import delete_pod, eventually, flex, loopfile, namespace, pod, run_pod
from tests.core.test_convert_reclaim import STEPS

pytestmark = [pytest.mark.cluster, pytest.mark.root]

CLAIM = "data"
#: The sealing key the tests' PVs are sealed with, in each test's namespace (the backup
#: namespace the tests pass convert: where it looks for the provisioner's key).
KEY = os.urandom(32)


def _seal_key(cluster: Cluster, ns: str) -> None:
    """The provisioner's sealing key, and the Lease a CSI controller's csi-provisioner holds,
    in ``ns``: what convert checks before it gives a converted PV its Delete back (the
    sidecars of tests/cluster/sidecars.py hold theirs in flexhub's namespace)."""
    from kubernetes import client

    body = {"metadata": {"name": KEY_SECRET}, "data": {"key": base64.b64encode(KEY).decode()}}
    with contextlib.suppress(ApiException):  # made for an earlier claim of the namespace
        cluster.core.create_namespaced_secret(ns, body)
    import datetime

    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    lease = {
        "metadata": {"name": "flexhub-csi-k8s-io"},
        "spec": {"holderIdentity": "test", "renewTime": now, "leaseDurationSeconds": 137},
    }
    with contextlib.suppress(ApiException):
        client.CoordinationV1Api(cluster.api).create_namespaced_lease(ns, lease)


def _flexhub(
    cluster: Cluster, *args: str, kill_after: str = ""
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "FLEXHUB_TEST_CONVERT_KILL_AFTER"}
    # the tier's own node config (never the host's paths); the tier's API server certificate
    # is not verified by its admin kubeconfig: urllib3's warning is not convert's output
    env.update(FLEXHUB_CONFIG=str(cluster.config), PYTHONWARNINGS="ignore::Warning")
    if kill_after:
        env["FLEXHUB_TEST_CONVERT_KILL_AFTER"] = kill_after
    return subprocess.run(
        [sys.executable, "-m", "flexhub", "convert", *args, "--kubeconfig", str(cluster.kubeconfig),
         "--timeout", "60"],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )  # fmt: skip


def _pair(
    cluster: Cluster, ns: str, claim: str = CLAIM, options: dict[str, str] | None = None
) -> tuple[Any, Any]:
    """A PV as flexhub's provisioner writes it for claim ``ns/claim``, and the claim, bound."""
    name = f"pvc-conv-{ns}" if claim == CLAIM else f"pvc-conv-{ns}-{claim}"
    if options is None:
        options = loopfile(f"conv-{ns}.img", mountOptions="noatime")
    record = {"backend": "loopfile", "node": "flexhub-node", "onDelete": "delete",
              "reclaimOn": "node", "size": str(64 << 20)}  # fmt: skip
    _seal_key(cluster, ns)
    body = {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {
            "name": name,
            "labels": {"team": "a"},
            "annotations": {
                "pv.kubernetes.io/provisioned-by": "flexhub",
                "flexhub/reclaim": json.dumps(record, sort_keys=True),
            },
            "finalizers": ["flexhub/reclaim"],
        },
        "spec": {
            "capacity": {"storage": "64Mi"},
            "accessModes": ["ReadWriteOnce"],
            "persistentVolumeReclaimPolicy": "Delete",
            "storageClassName": "",
            "claimRef": {"namespace": ns, "name": claim},
            "flexVolume": flex(options, fs_type="ext4"),
        },
    }
    body["metadata"]["annotations"][ANN_SEAL] = Sealer(KEY).seal(body)
    cluster.core.create_persistent_volume(body)
    cluster.core.create_namespaced_persistent_volume_claim(
        ns,
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": claim, "labels": {"app": "db"}, "annotations": {"a/b": "c"}},
            "spec": {
                "accessModes": ["ReadWriteOnce"],
                "storageClassName": "",
                "volumeName": name,
                "resources": {"requests": {"storage": "64Mi"}},
            },
        },
    )
    return _bound(cluster, ns, claim)


def _bound(cluster: Cluster, ns: str, name: str = CLAIM) -> tuple[Any, Any]:
    """The claim and its PV, both Bound and settled: the binder writes both again after it
    marks them Bound, so the pair is taken once two reads 0.5 s apart find the same versions
    (the tests compare versions later to prove convert wrote nothing)."""

    def read() -> tuple[Any, Any] | None:
        claim = cluster.core.read_namespaced_persistent_volume_claim(name, ns)
        if claim.status.phase != "Bound":
            return None
        pv = cluster.core.read_persistent_volume(claim.spec.volume_name)
        return (claim, pv) if pv.status.phase == "Bound" else None

    def settled() -> Any:
        first = read()
        time.sleep(0.5)
        second = read()
        if first is None or second is None:
            return None
        versions = [(c.metadata.resource_version, p.metadata.resource_version)
                    for c, p in (first, second)]  # fmt: skip
        return second if versions[0] == versions[1] else None

    claim, pv = eventually(f"claim {ns}/{name} and its PV Bound and settled", settled)
    return claim, pv


def _backups(cluster: Cluster, ns: str) -> list[str]:
    found = cluster.core.list_namespaced_config_map(ns)
    return [c.metadata.name for c in found.items if c.metadata.name.startswith("flexhub-convert")]


def _assert_converted(cluster: Cluster, ns: str, old_claim: Any, old_pv: Any) -> None:
    claim, pv = _bound(cluster, ns)
    assert claim.metadata.uid != old_claim.metadata.uid
    assert pv.metadata.name == old_pv.metadata.name and pv.metadata.uid != old_pv.metadata.uid
    assert pv.spec.flex_volume is None
    csi = pv.spec.csi
    assert csi.driver == "flexhub.csi.k8s.io"
    assert csi.volume_handle == f"loopfile:{old_claim.metadata.uid}"
    assert csi.fs_type == "ext4"
    assert csi.volume_attributes == {
        "backend": "loopfile",
        "file": f"conv-{ns}.img",
        "size": "64Mi",
        "flexhub.csi/namespace": ns,
    }
    assert pv.spec.mount_options == ["noatime"]
    assert pv.spec.capacity == old_pv.spec.capacity
    assert pv.spec.access_modes == old_pv.spec.access_modes
    assert pv.spec.persistent_volume_reclaim_policy == "Delete"  # its record written first
    record = cluster.core.read_namespaced_config_map(adoption_name(old_claim.metadata.uid), ns)
    assert json.loads(record.data["record.json"])["volume_id"] == csi.volume_handle
    assert pv.spec.claim_ref.uid == claim.metadata.uid
    assert pv.metadata.labels == {"team": "a"}
    assert pv.metadata.annotations["pv.kubernetes.io/provisioned-by"] == "flexhub.csi.k8s.io"
    assert (
        pv.metadata.annotations["flexhub/reclaim"] == old_pv.metadata.annotations["flexhub/reclaim"]
    )
    assert "flexhub/reclaim" not in (pv.metadata.finalizers or [])
    assert claim.metadata.labels == {"app": "db"}
    assert claim.metadata.annotations["a/b"] == "c"
    assert claim.spec.volume_name == pv.metadata.name
    assert claim.spec.resources.requests == old_claim.spec.resources.requests


def _assert_rolled_back(cluster: Cluster, ns: str, old_claim: Any, old_pv: Any) -> None:
    claim, pv = _bound(cluster, ns)
    assert pv.metadata.name == old_pv.metadata.name and pv.spec.csi is None
    assert pv.spec.flex_volume.to_dict() == old_pv.spec.flex_volume.to_dict()
    assert pv.spec.persistent_volume_reclaim_policy == "Delete"
    assert "flexhub/reclaim" in pv.metadata.finalizers
    assert pv.spec.claim_ref.uid == claim.metadata.uid
    assert pv.metadata.annotations["pv.kubernetes.io/provisioned-by"] == "flexhub"
    assert claim.metadata.labels == {"app": "db"}
    assert _backups(cluster, ns) == []
    names = [c.metadata.name for c in cluster.core.list_namespaced_config_map(ns).items]
    assert adoption_name(old_claim.metadata.uid) not in names, "the CSI record stays"


def _cleanup(cluster: Cluster, ns: str, pv: str, claim: str = CLAIM) -> None:
    """The test's PV goes (its Delete policy would wait for a provisioner that is not there)."""
    with contextlib.suppress(ApiException):
        cluster.core.delete_namespaced_persistent_volume_claim(claim, ns)
    try:
        cluster.core.patch_persistent_volume(
            pv,
            {"metadata": {"finalizers": None}, "spec": {"persistentVolumeReclaimPolicy": "Retain"}},
        )
        cluster.core.delete_persistent_volume(pv)
    except ApiException:
        pass


def test_dry_run_writes_nothing_and_prints_the_objects(cluster: Cluster) -> None:
    ns = namespace(cluster, "conv")
    claim, pv = _pair(cluster, ns)
    try:
        done = _flexhub(cluster, CLAIM, "-n", ns, "--backup-namespace", ns, "--dry-run")
        assert done.returncode == 0, done.stderr
        docs = list(yaml.safe_load_all(done.stdout))
        kinds = [d["kind"] for d in docs]
        assert kinds == ["ConfigMap", "PersistentVolumeClaim", "ConfigMap", "PersistentVolume"], (
            kinds
        )
        assert docs[2]["metadata"]["name"] == adoption_name(claim.metadata.uid)
        assert docs[3]["spec"]["csi"]["volumeHandle"] == f"loopfile:{claim.metadata.uid}"
        assert docs[1]["spec"]["volumeName"] == pv.metadata.name
        assert _backups(cluster, ns) == []
        after = cluster.core.read_persistent_volume(pv.metadata.name)
        assert after.metadata.resource_version == pv.metadata.resource_version
        again = cluster.core.read_namespaced_persistent_volume_claim(CLAIM, ns)
        assert again.metadata.resource_version == claim.metadata.resource_version
    finally:
        _cleanup(cluster, ns, pv.metadata.name)


def test_convert_then_rollback(cluster: Cluster) -> None:
    ns = namespace(cluster, "conv")
    claim, pv = _pair(cluster, ns)
    try:
        done = _flexhub(cluster, CLAIM, "-n", ns, "--backup-namespace", ns)
        assert done.returncode == 0, done.stderr
        assert "converted" in done.stdout
        _assert_converted(cluster, ns, claim, pv)
        again = _flexhub(cluster, CLAIM, "-n", ns, "--backup-namespace", ns)
        assert again.returncode == 0 and "converted already" in again.stdout, again.stderr
        csi_claim, csi_pv = _bound(cluster, ns)
        dry = _flexhub(
            cluster, CLAIM, "-n", ns, "--backup-namespace", ns, "--rollback", "--dry-run"
        )
        assert dry.returncode == 0, dry.stderr
        docs = list(yaml.safe_load_all(dry.stdout))
        assert [d["kind"] for d in docs] == ["PersistentVolumeClaim", "PersistentVolume"]
        source = docs[1]["spec"]["flexVolume"]
        assert source["driver"] == "k8s/flexhub"
        assert source["options"] == pv.spec.flex_volume.options
        assert docs[1]["spec"]["persistentVolumeReclaimPolicy"] == "Delete"
        assert _bound(cluster, ns)[1].metadata.resource_version == csi_pv.metadata.resource_version
        assert _bound(cluster, ns)[0].metadata.uid == csi_claim.metadata.uid
        back = _flexhub(cluster, CLAIM, "-n", ns, "--backup-namespace", ns, "--rollback")
        assert back.returncode == 0, back.stderr
        _assert_rolled_back(cluster, ns, claim, pv)
    finally:
        _cleanup(cluster, ns, pv.metadata.name)


def test_refused_while_a_pod_uses_the_claim(cluster: Cluster) -> None:
    ns = namespace(cluster, "conv")
    claim, pv = _pair(cluster, ns)
    volume = [{"name": "data", "persistentVolumeClaim": {"claimName": CLAIM}}]
    try:
        run_pod(cluster, ns, pod("app", volume), timeout=180)
        done = _flexhub(cluster, CLAIM, "-n", ns, "--backup-namespace", ns)
        assert done.returncode == 1
        assert "used by pod(s) app" in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1
        assert _backups(cluster, ns) == []
        after = cluster.core.read_persistent_volume(pv.metadata.name)
        assert after.metadata.resource_version == pv.metadata.resource_version
        delete_pod(cluster, ns, "app")
        done = _flexhub(cluster, CLAIM, "-n", ns, "--backup-namespace", ns)
        assert done.returncode == 0, done.stderr
        _assert_converted(cluster, ns, claim, pv)
    finally:
        _cleanup(cluster, ns, pv.metadata.name)


def test_bad_input_is_one_line_and_changes_nothing(cluster: Cluster) -> None:
    ns = namespace(cluster, "conv")
    done = _flexhub(cluster, "nope", "-n", ns, "--backup-namespace", ns)
    assert done.returncode == 1 and done.stderr == f"error: claim {ns}/nope not found\n"
    back = _flexhub(cluster, "nope", "-n", ns, "--backup-namespace", ns, "--rollback")
    assert back.returncode == 1 and "no saved copy" in back.stderr


@pytest.mark.parametrize("step", STEPS)
def test_a_kill_after_a_step_and_a_rerun_ends_converted(cluster: Cluster, step: str) -> None:
    ns = namespace(cluster, "conv")
    claim, pv = _pair(cluster, ns)
    try:
        killed = _flexhub(cluster, CLAIM, "-n", ns, "--backup-namespace", ns, kill_after=step)
        assert killed.returncode == -9, (killed.returncode, killed.stderr)
        done = _flexhub(cluster, CLAIM, "-n", ns, "--backup-namespace", ns)
        assert done.returncode == 0, done.stderr
        _assert_converted(cluster, ns, claim, pv)
    finally:
        _cleanup(cluster, ns, pv.metadata.name)


@pytest.mark.parametrize(
    "step",
    [
        "rollback-retained",
        "rollback-claim-deleted",
        "rollback-pv-deleted",
        "rollback-claim-created",
        "rollback-pv-created",
    ],
)
def test_a_kill_during_rollback_and_a_rerun_ends_rolled_back(cluster: Cluster, step: str) -> None:
    ns = namespace(cluster, "conv")
    claim, pv = _pair(cluster, ns)
    try:
        done = _flexhub(cluster, CLAIM, "-n", ns, "--backup-namespace", ns)
        assert done.returncode == 0, done.stderr
        args = (CLAIM, "-n", ns, "--backup-namespace", ns, "--rollback")
        killed = _flexhub(cluster, *args, kill_after=step)
        assert killed.returncode == -9, (killed.returncode, killed.stderr)
        back = _flexhub(cluster, *args)
        assert back.returncode == 0, back.stderr
        _assert_rolled_back(cluster, ns, claim, pv)
    finally:
        _cleanup(cluster, ns, pv.metadata.name)


def test_a_rollback_of_a_half_done_convert_restores_the_policy(cluster: Cluster) -> None:
    ns = namespace(cluster, "conv")
    _claim, pv = _pair(cluster, ns)
    try:
        killed = _flexhub(cluster, CLAIM, "-n", ns, "--backup-namespace", ns, kill_after="retained")
        assert killed.returncode == -9
        assert (
            cluster.core.read_persistent_volume(
                pv.metadata.name
            ).spec.persistent_volume_reclaim_policy
            == "Retain"
        )
        back = _flexhub(cluster, CLAIM, "-n", ns, "--backup-namespace", ns, "--rollback")
        assert back.returncode == 0, back.stderr
        now = cluster.core.read_persistent_volume(pv.metadata.name)
        assert now.metadata.uid == pv.metadata.uid
        assert now.spec.persistent_volume_reclaim_policy == "Delete"
        assert "flexhub/reclaim" in now.metadata.finalizers
        assert _backups(cluster, ns) == []
    finally:
        _cleanup(cluster, ns, pv.metadata.name)


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"backend": "loopfile", "file": "x.img", "size": "64Mi", "colour": "red"}, "colour"),
        ({"backend": "nosuchbackend", "file": "x.img"}, "nosuchbackend"),
    ],
)
def test_options_the_backend_refuses_are_one_line_and_change_nothing(
    cluster: Cluster, options: dict[str, str], error: str
) -> None:
    ns = namespace(cluster, "conv")
    claim, pv = _pair(cluster, ns, options=options)
    try:
        done = _flexhub(cluster, CLAIM, "-n", ns, "--backup-namespace", ns)
        assert done.returncode == 1
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and error in lines[0], lines
        assert _backups(cluster, ns) == []
        after = cluster.core.read_persistent_volume(pv.metadata.name)
        assert after.metadata.resource_version == pv.metadata.resource_version
        again = cluster.core.read_namespaced_persistent_volume_claim(CLAIM, ns)
        assert again.metadata.resource_version == claim.metadata.resource_version
    finally:
        _cleanup(cluster, ns, pv.metadata.name)


def test_all_converts_the_flexhub_claims_of_the_namespace_only(cluster: Cluster) -> None:
    ns = namespace(cluster, "conv")
    first, first_pv = _pair(cluster, ns)
    second, second_pv = _pair(
        cluster, ns, "logs", options=loopfile(f"conv-{ns}-logs.img", mountOptions="noatime")
    )
    cluster.core.create_namespaced_persistent_volume_claim(
        ns,
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": "pending"},
            "spec": {
                "accessModes": ["ReadWriteOnce"],
                "storageClassName": "",
                "resources": {"requests": {"storage": "1Mi"}},
            },
        },
    )
    pending = cluster.core.read_namespaced_persistent_volume_claim("pending", ns)
    try:
        done = _flexhub(cluster, "-n", ns, "--backup-namespace", ns, "--all")
        assert done.returncode == 0, done.stderr
        _assert_converted(cluster, ns, first, first_pv)
        claim, pv = _bound(cluster, ns, "logs")
        assert pv.spec.csi.volume_handle == f"loopfile:{second.metadata.uid}"
        assert claim.metadata.uid != second.metadata.uid
        assert len(_backups(cluster, ns)) == 2
        untouched = cluster.core.read_namespaced_persistent_volume_claim("pending", ns)
        assert untouched.metadata.resource_version == pending.metadata.resource_version
        back = _flexhub(cluster, "-n", ns, "--backup-namespace", ns, "--all", "--rollback")
        assert back.returncode == 0, back.stderr
        _assert_rolled_back(cluster, ns, first, first_pv)
        claim, pv = _bound(cluster, ns, "logs")
        assert pv.spec.flex_volume.options["file"] == f"conv-{ns}-logs.img"
    finally:
        _cleanup(cluster, ns, first_pv.metadata.name)
        _cleanup(cluster, ns, second_pv.metadata.name, "logs")


def test_a_converted_claim_keeps_its_data_under_csi(cluster: Cluster) -> None:
    """The issue's end to end: a loopfile claim written through the FlexVolume driver by a pod,
    the pod stopped, the claim converted, and a new pod on the same claim reads the data
    through flexhub's CSI node plugin (registered with the stock kubelet): same storage, same
    bytes. The plugin's NodeUnstageVolume undoes the stage afterwards (the kubelet does not
    unstage a flexhub file system volume: tests/cluster/test_csi_node.py, test (b))."""
    from tests.cluster import csi_node

    created = csi_node.apply_csi_driver(cluster)
    plugin = csi_node.node_plugin(cluster)
    ns = namespace(cluster, "conv")
    _, pv = _pair(cluster, ns)
    volume = [{"name": "data", "persistentVolumeClaim": {"claimName": CLAIM}}]
    handle = ""
    try:
        csi_node.wait_registered(cluster, plugin, timeout=90)
        writer = run_pod(cluster, ns, pod("writer", volume), timeout=180)
        flex_dir = cluster.kubelet_root / "pods" / writer.metadata.uid / "volumes"
        written = flex_dir / "k8s~flexhub" / pv.metadata.name / "payload"
        written.write_bytes(b"flexhub convert keeps this\n" * 1000)
        os.sync()
        delete_pod(cluster, ns, "writer")
        done = _flexhub(cluster, CLAIM, "-n", ns, "--backup-namespace", ns)
        assert done.returncode == 0, done.stderr
        _, csi_pv = _bound(cluster, ns)
        handle = csi_pv.spec.csi.volume_handle
        reader = run_pod(cluster, ns, pod("reader", volume), timeout=180)
        mount = csi_node.publish_path(cluster, reader.metadata.uid, pv.metadata.name)
        assert (mount / "payload").read_bytes() == b"flexhub convert keeps this\n" * 1000
        delete_pod(cluster, ns, "reader")
    finally:
        try:
            if handle:
                csi_node.unstage(cluster, handle)
        finally:
            plugin.stop()
            if created:
                cluster.storage.delete_csi_driver(csi_node.DRIVER)
            _cleanup(cluster, ns, pv.metadata.name)


def test_a_provisioned_claim_converted_is_reclaimed_by_the_csi_driver(
    cluster: Cluster, accounts: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The reclaim policy across the move, end to end: the real FlexVolume provisioner makes a
    loopfile claim (Delete, sealed), a pod writes it through the FlexVolume driver and stops,
    convert moves it (its record to flexhub's namespace, the CSI PV Delete again), and when
    the claim is deleted the CSI sidecars and flexhub's CSI controller, with the chart's
    account, reclaim it: the loop file goes, then the PV, then the record. Before convert
    wrote the record (and the policy stayed Retain), the PV stayed Released and the file
    stayed."""
    from tests.cluster import sidecars
    from tests.cluster.accounts import NAMESPACE
    from tests.cluster.kube import claim_pod
    from tests.cluster.processes import provisioner
    from tests.cluster.test_provisioner import _claim, _class

    ns = namespace(cluster, "conv")
    _class(cluster, "conv-loop", {"backend": "loopfile", "fsType": "ext4"})
    names = [s.metadata.name for s in cluster.core.list_namespaced_secret(NAMESPACE).items]
    key_made = KEY_SECRET not in names  # by the provisioner below: gone again at the end
    leader = provisioner(cluster, "provisioner-convert")
    try:
        uid = _claim(cluster, ns, CLAIM, "conv-loop").metadata.uid
        run_pod(cluster, ns, claim_pod("writer", CLAIM), timeout=180)
        delete_pod(cluster, ns, "writer")
    finally:
        leader.stop()
    name = f"pvc-{uid}"
    backing = cluster.loopfile_root / "namespaces" / ns / "provisioned" / f"{name}.img"
    record = adoption_name(uid)
    try:
        assert backing.is_file()
        controller = accounts.kubeconfig("csi-controller")
        with sidecars.running(cluster, controller, tmp_path_factory, on_node=True):
            eventually("csi-provisioner's Lease", lambda: _has_lease(cluster, NAMESPACE), 60)
            done = _flexhub(cluster, CLAIM, "-n", ns, "--backup-namespace", NAMESPACE)
            assert done.returncode == 0, done.stderr
            assert f"ConfigMap {NAMESPACE}/{record}" in done.stdout
            pv = cluster.core.read_persistent_volume(name)
            assert pv.spec.csi.volume_handle == f"loopfile:{uid}"
            assert pv.spec.persistent_volume_reclaim_policy == "Delete"
            assert pv.metadata.annotations["pv.kubernetes.io/provisioned-by"] == sidecars.DRIVER
            cluster.core.read_namespaced_config_map(record, NAMESPACE)
            cluster.core.delete_namespaced_persistent_volume_claim(CLAIM, ns)

            def gone() -> bool:
                try:
                    cluster.core.read_persistent_volume(name)
                except ApiException as exc:
                    return exc.status == 404
                return False

            eventually(f"PV {name} reclaimed by the CSI driver and gone", gone, timeout=120)
            assert not backing.exists()
            with pytest.raises(ApiException) as missing:
                cluster.core.read_namespaced_config_map(record, NAMESPACE)
            assert missing.value.status == 404
    finally:
        for cm in (record, backup_name(ns, CLAIM)):
            with contextlib.suppress(ApiException):
                cluster.core.delete_namespaced_config_map(cm, NAMESPACE)
        if key_made:
            with contextlib.suppress(ApiException):
                cluster.core.delete_namespaced_secret(KEY_SECRET, NAMESPACE)
        _cleanup(cluster, ns, name)


def _has_lease(cluster: Cluster, ns: str) -> bool:
    from kubernetes import client

    try:
        client.CoordinationV1Api(cluster.api).read_namespaced_lease("flexhub-csi-k8s-io", ns)
    except ApiException:
        return False
    return True
