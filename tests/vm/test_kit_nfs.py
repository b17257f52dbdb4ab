"""The conformance kit (``flexhub.testing``) against nfs, in the VM rig: the guest's kernel NFS
server, the installed driver called as kubelet calls it. "Unreachable" stops nfsd's threads
(the server stops answering; the client's mounts hang until forced)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import pytest

from flexhub.testing import ProvisionSample, Sample
from tests.rig import services
from tests.vm.kithost import VM_OVERHEAD, VMConformance, vm_kit_host
from tests.vm.test_nfs import short_nfs_grace

flexhub_host = vm_kit_host("nfs")


@pytest.fixture(scope="module", autouse=True)
def nfs_server(vm: Any) -> None:
    short_nfs_grace(vm)
    services.start_nfs_server(vm)


class TestNfsConformance(VMConformance):
    backend = "nfs"
    call_timeout = 40
    overhead = VM_OVERHEAD
    # with nfsd stopped: a mount runs into mount_timeout, then the clean-up of its directory
    # (stat, forced umount); an unmount of the dead mount: stat, then forced and lazy umount
    mount_bound = 8 + 3 + 5
    unmount_bound = 3 + 8 + 5

    def settings(self, base: str) -> Mapping[str, Any]:
        return {
            "mount_timeout": 8,
            "unmount_timeout": 8,
            "stat_timeout": 3,
            "force_unmount_timeout": 5,
        }

    def sample(self) -> Sample:
        # NFS reads no Secret, but kubelet hands a PV's secretRef to any backend's mount: the
        # secret scan follows calls that carry this one (without it, it scanned nothing)
        return Sample(
            options={"server": "127.0.0.1", "share": "/export", "nfsVersion": "4.2"},
            secrets={"token": "nfs-kit-Secret-3b7c"},
        )

    def provision_sample(self) -> ProvisionSample:
        return ProvisionSample(
            parameters={"server": "127.0.0.1", "share": "/export", "nfsVersion": "4.2"}
        )

    @contextlib.contextmanager
    def unreachable(self, sample: Sample) -> Iterator[None]:
        vm = self.env.host.vm  # type: ignore[attr-defined]
        vm.run(["rpc.nfsd", "0"])
        try:
            yield
        finally:
            vm.run(["rpc.nfsd", "8"])
