"""The conformance kit (``flexhub.testing``) against cifs, in the VM rig: Samba's smbd in the
guest, the installed driver called as kubelet calls it. "Unreachable" stops smbd (the client's
mounts hang until forced; a new mount is refused at once)."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

import pytest

from flexhub.testing import ProvisionSample, Sample
from tests.rig import services
from tests.vm.kithost import VM_OVERHEAD, VMConformance, vm_kit_host

flexhub_host = vm_kit_host("cifs")

PASSWORD = "Kit-" + uuid.uuid4().hex


@pytest.fixture(scope="module", autouse=True)
def smb_server(vm: Any) -> None:
    services.start_smb_server(vm, PASSWORD, shares=("kit",))


class TestCifsConformance(VMConformance):
    backend = "cifs"
    call_timeout = 40
    overhead = VM_OVERHEAD
    # with smbd stopped: a mount is refused or runs into mount_timeout, then the clean-up of
    # its directory (stat, forced umount); an unmount of the dead mount: stat, then the plain,
    # forced and lazy umount
    # with an fsGroup, the share is mounted with gid=<fsGroup> and dir_mode 0770: group rwx,
    # no setgid bit (the modes are the mount's, not the server's)
    fs_group_mode = 0o070
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
        return Sample(
            options={"server": "127.0.0.1", "share": "kit", "vers": "3.1.1"},
            secrets={"username": "flexsmb", "password": PASSWORD},
            fs_group=2000,
        )

    def provision_sample(self) -> ProvisionSample:
        return ProvisionSample(
            parameters={"server": "127.0.0.1", "share": "kit", "vers": "3.1.1"},
            secrets={"username": "flexsmb", "password": PASSWORD},
        )

    @contextlib.contextmanager
    def unreachable(self, sample: Sample) -> Iterator[None]:
        vm = self.env.host.vm  # type: ignore[attr-defined]
        services.stop_smbd(vm)
        try:
            yield
        finally:
            services.start_smbd(vm)
