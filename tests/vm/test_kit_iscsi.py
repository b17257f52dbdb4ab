"""The conformance kit (``flexhub.testing``) against iscsi, in the VM rig: a LIO target with
CHAP for discovery and session (so the kit's secret scan looks for real secrets), the
installed driver called as kubelet calls it. "Unreachable" takes the target's portal down.
Beyond the kit's default, an iSCSI session of the target left logged in, or its node record
left in open-iscsi's database, counts as attached."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import pytest

from flexhub.testing import KitEnv, ProvisionSample, Sample
from flexhub.testing.conformance import default_attached
from tests.rig import services
from tests.rig.services import Chap, IscsiTarget
from tests.vm.kithost import VM_OVERHEAD, VMConformance, vm_kit_host

flexhub_host = vm_kit_host("iscsi")

SESSION = Chap("kit-sess-user", "Kit-Sess-Pw-9d2Lq7")
DISCOVERY = Chap("kit-disc-user", "Kit-Disc-Pw-4hT8x1")
TARGET: list[IscsiTarget] = []


@pytest.fixture(scope="module", autouse=True)
def target(vm: Any) -> Iterator[IscsiTarget]:
    services.reset_iscsi(vm)
    made = services.iscsi_target(
        vm,
        lun_sizes=[128 * 1024 * 1024],
        session_chap=SESSION,
        discovery_chap=DISCOVERY,
        initiators=[services.GUEST_INITIATOR],
    )
    TARGET.append(made)
    yield made
    TARGET.clear()
    services.reset_iscsi(vm)


class TestIscsiConformance(VMConformance):
    backend = "iscsi"
    # With the target gone, an unmount runs its umount steps to their bounds (umount, forced
    # umount: unmount_timeout each), then the release waits for the target (ReleaseDeferred):
    # the kit's unmount calls after the portal is back release the LUN and log out.
    call_timeout = 150
    node_settings: ClassVar[Mapping[str, Any]] = {
        "unmount_timeout": 10,
        "release_retry_interval": 5,
    }
    overhead = VM_OVERHEAD
    # With the portal down, a mount runs into the session listing and discovery
    # (command_timeout), the login (login_timeout) and the wait for the disk (device_timeout);
    # an unmount into the staging umount, forced and lazy (unmount_timeout each) and the flush
    # whose release is then deferred (command_timeout).
    mount_bound = 20 + 15 + 20
    unmount_bound = 3 * 10 + 20

    def settings(self, base: str) -> Mapping[str, Any]:
        return {"device_timeout": 20, "login_timeout": 15, "command_timeout": 20}

    def provision_sample(self) -> ProvisionSample:
        """The class of tests/vm/test_iscsi_provision.py (which runs provision and reclaim
        in the guest); here only the kit's static check reads it."""
        return ProvisionSample(
            parameters={
                "targetHost": "127.0.0.1",
                "portals": "127.0.0.1:3260",
                "iqnPrefix": "iqn.2026-01.io.flexhub.rig:kit",
                "fileioDirectory": f"{services.LUN_DIR}/kit",
                "initiators": services.GUEST_INITIATOR,
                "nodeSecretName": "iscsi-chap",
                "nodeSecretNamespace": "flexhub",
            }
        )

    def sample(self) -> Sample:
        (target,) = TARGET
        return Sample(
            options={
                "targetPortal": target.portal,
                "iqn": target.iqn,
                "lun": "0",
                "chapAuthDiscovery": "true",
                "chapAuthSession": "true",
                "kubernetes.io/fsType": "ext4",
            },
            secrets={
                "node.session.auth.username": SESSION.userid,
                "node.session.auth.password": SESSION.password,
                "discovery.sendtargets.auth.username": DISCOVERY.userid,
                "discovery.sendtargets.auth.password": DISCOVERY.password,
            },
            fs_group=3000,
        )

    def attached(self, env: KitEnv) -> list[str]:
        (target,) = TARGET
        out = env.host.run(
            ["iscsiadm", "-m", "session"], env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}, timeout=60
        )
        sessions = [
            f"session {line}"
            for line in out.output.decode().splitlines()
            if target.iqn in line.split()
        ]
        nodes = env.host.run(
            ["iscsiadm", "-m", "node", "-T", target.iqn],
            env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
            timeout=60,
        )
        records = [] if nodes.rc == 21 else [f"node record of {target.iqn}"]  # 21: none
        return default_attached(env) + sessions + records

    @contextlib.contextmanager
    def unreachable(self, sample: Sample) -> Iterator[None]:
        (target,) = TARGET
        vm = self.env.host.vm  # type: ignore[attr-defined]
        services.portal_down(vm, target, target.portal)
        try:
            yield
        finally:
            services.portal_up(vm, target, target.portal)
