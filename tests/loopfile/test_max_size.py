"""A loopfile claim's size is bounded where the provisioner decides (issue #32): the class's
``maxSize`` (default 1Ti) refuses a larger claim at provisioning, in one line naming it, and
the PV carries the bound, so the node's ``expandfs`` refuses growing past it (real loop devices
and the installed driver) and its mount refuses a PV whose ``size`` is already past it."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from flexhub.admin.harness import Kubelet
from flexhub.driver.loader import load_backend
from flexhub.driver.validation import validate_options
from flexhub.errors import InvalidOptions
from flexhub.provisioner.storageclass import read_class
from flexhub.provisioning import Claim
from tests.conftest import needs_root
from tests.loopfile.test_driver_e2e import MiB, mount
from tests.loopfile.test_provision import CLASS

TiB = 1 << 40


def _claim(size: int) -> Claim:
    return Claim(uid=str(uuid.uuid4()), namespace="ns", name="c", size=size, selected_node="n")


def _provision(size: int, **parameters: str) -> object:
    from flexhub_loopfile import _provision

    return _provision.provision(_claim(size), {"directory": "claims", **parameters})


def test_a_claim_past_the_default_bound_is_refused_in_one_line() -> None:
    with pytest.raises(InvalidOptions) as caught:
        _provision(100 * TiB)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("resources.requests.storage: 100Ti"), message
    assert "maxSize" in message and "1Ti" in message, message


def test_the_bound_is_the_classs_and_the_pv_carries_it() -> None:
    from flexhub_loopfile import _provision

    made = _provision.provision(_claim(TiB), {})
    assert made.options["maxSize"] == "1Ti"  # the default, exactly at the bound
    made = _provision.provision(_claim(2 * TiB), {"maxSize": "4Ti"})
    assert made.options == {"file": made.options["file"], "size": str(2 * TiB), "maxSize": "4Ti"}
    with pytest.raises(InvalidOptions, match=r"resources\.requests\.storage: 600Mi .*512Mi"):
        _provision.provision(_claim(600 * MiB), {"maxSize": "512Mi"})
    # what the node driver accepts
    options = Kubelet.base_options({"backend": "loopfile", **made.options}, pv="pvc-x")
    validate_options(load_backend("loopfile"), options)


def test_the_class_parameter_is_checked_by_schema_and_rule() -> None:
    good = {**CLASS, "parameters": {**CLASS["parameters"], "maxSize": "2Ti"}}  # type: ignore[dict-item]
    assert read_class(good, load_backend).parameters["maxSize"] == "2Ti"
    for bad in ("lots", "0", "2Ei"):
        sc = {**CLASS, "parameters": {**CLASS["parameters"], "maxSize": bad}}  # type: ignore[dict-item]
        with pytest.raises(InvalidOptions, match=r"parameters\.maxSize"):
            read_class(sc, load_backend)


GROW = {"backend": "loopfile", "file": "grow.img", "size": "400Mi", "maxSize": "600Mi"}


@needs_root
@pytest.mark.root
def test_expandfs_past_the_pvs_bound_is_refused_and_changes_nothing(
    kube: Kubelet,
    node_tree: dict[str, Path],
) -> None:
    uid = kube.new_pod_uid()
    assert mount(kube, uid, GROW, fs_type="xfs").ok
    target = kube.pod_dir(uid, "pv-1")
    before = os.statvfs(target).f_blocks
    options = Kubelet.base_options(GROW, pv="pv-1", fs_type="xfs")
    reply = kube.expandfs(uid, "pv-1", options, 800 * MiB, 400 * MiB)
    assert reply.status == "Failure", reply.reply
    assert "800Mi" in reply.message and "maxSize 600Mi" in reply.message, reply.message
    image = node_tree["loopfiles"] / "namespaces" / "default" / "grow.img"
    assert image.stat().st_size == 400 * MiB
    assert os.statvfs(target).f_blocks == before
    reply = kube.expandfs(uid, "pv-1", options, 600 * MiB, 400 * MiB)  # up to the bound: grown
    assert reply.ok, reply.reply
    assert image.stat().st_size == 600 * MiB
    assert kube.unmount(uid, "pv-1").ok  # type: ignore[union-attr]


@needs_root
@pytest.mark.root
def test_a_pv_whose_size_is_past_its_bound_is_refused_and_makes_nothing(
    kube: Kubelet,
    node_tree: dict[str, Path],
) -> None:
    uid = kube.new_pod_uid()
    reply = mount(kube, uid, {**GROW, "size": "700Mi"}, fs_type="xfs")
    assert reply is not None and reply.status == "Failure", reply
    assert "maxSize 600Mi" in reply.message, reply.message
    assert not (node_tree["loopfiles"] / "namespaces" / "default" / "grow.img").exists()
