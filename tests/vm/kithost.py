"""The conformance kit's :class:`~flexhub.testing.host.Host` inside the VM rig: the kit
installs and calls the driver in the guest (as tests/vm/test_nfs.py and test_iscsi.py do:
``vm.install_flexhub``, the driver run with kubelet's bare environment, stderr merged).

Use it from a kit test module (any backend, e.g. cifs)::

    from tests.vm.kithost import VMHost, vm_kit_host

    flexhub_host = vm_kit_host("cifs")   # a class-scoped fixture over the session's ``vm``

    class TestCifsConformance(Conformance): ...
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence

import pytest

from flexhub.testing import Conformance
from flexhub.testing.host import MountPoint, RunResult, parse_proc_mounts
from tests.rig.vm import VM, RigError

__all__ = ["VMConformance", "VMHost", "vm_kit_host"]

#: What a driver call costs in the guest besides its own work: python start-up under TCG on a
#: loaded host (tests/vm/test_nfs.py measures it).
VM_OVERHEAD = 20.0


class VMHost:
    """A :class:`~flexhub.testing.host.Host` that runs everything in the guest ``vm``: only
    the driver makes block devices there (``isolated``), so a new one is the backend's."""

    isolated = True

    def __init__(self, vm: VM, backend: str) -> None:
        self.vm = vm
        self.backend = backend

    def run(
        self, argv: Sequence[str], *, env: Mapping[str, str], timeout: float, cwd: str = "/"
    ) -> RunResult:
        result = self.vm.run(
            list(argv), timeout=timeout, check=False, env=dict(env), cwd=cwd, merge=True
        )
        return RunResult(result.rc, result.output.encode(), result.timed_out, result.duration)

    def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        self.vm.write_file(path, data, mode)

    def read_file(self, path: str) -> bytes | None:
        try:
            return self.vm.read_file(path)
        except RigError:
            return None

    def list_files(self, directories: Iterable[str]) -> list[str]:
        dirs = list(directories)
        out = self.vm.run(["find", *dirs, "-xdev", "-type", "f"], check=False).stdout
        return sorted(line for line in out.splitlines() if line.startswith(tuple(dirs)))

    def make_dirs(self, path: str, mode: int = 0o750) -> None:
        self.vm.run(["mkdir", "-p", "-m", f"{mode:o}", path])

    def remove_dir(self, path: str) -> bool:
        self.vm.run(["rmdir", path], check=False)
        return not self.exists(path)

    def exists(self, path: str) -> bool:
        # as kubelet's PathExists: only "no such file" is absent; a dead mount (EHOSTDOWN,
        # EIO, ...) is there
        result = self.vm.run(["stat", "--", path], check=False)
        return result.rc == 0 or "No such file or directory" not in result.stderr

    def mounts(self) -> list[MountPoint]:
        return parse_proc_mounts(self.vm.read_file("/proc/self/mounts").decode())

    def install_driver(self, plugin_dir: str, config: str, python: str | None) -> str:
        return self.vm.install_flexhub(plugin_dir, config=config)

    def temp_dir(self) -> str:
        path = f"/run/flexhub-kit/{self.backend}-{uuid.uuid4().hex[:8]}"
        self.vm.run(["mkdir", "-p", "-m", "0700", path])
        return path

    def remove_tree(self, path: str) -> None:
        self.vm.run(["rm", "-rf", "--one-file-system", path], check=False)


class VMConformance(Conformance):
    """The kit in the guest, without its checks that do not depend on the backend: ``init``,
    ``unmount`` of a missing and of a never-mounted directory are answered by the core before
    any backend is loaded (flexhub/fastpath.py), with the same code in the guest as on the
    host, where tests/loopfile/test_kit.py runs them once."""

    test_init = None  # type: ignore[assignment]
    test_unmount_missing_dir = None  # type: ignore[assignment]
    test_unmount_never_mounted = None  # type: ignore[assignment]
    # The kit calls provision and reclaim in its own process, the host's, which has no NFS,
    # SMB or iSCSI client. The same properties (provision twice gives the same and makes
    # nothing else, the PV mounts through the driver, reclaim removes it and again is
    # success, a second provision after a crash leaks nothing) are checked in the guest,
    # against the same servers, by tests/vm/test_nfs_provision.py, test_cifs_provision.py and
    # test_iscsi_provision.py; the kit's static check of the parameters runs here.
    test_provision_is_idempotent = None  # type: ignore[assignment]
    test_reclaim_of_nothing_is_success = None  # type: ignore[assignment]
    test_provision_retried_after_a_crash = None  # type: ignore[assignment]


def vm_kit_host(backend: str) -> Callable[..., VMHost]:
    """A class-scoped ``flexhub_host`` fixture: the kit runs in the session's guest."""

    @pytest.fixture(scope="class")
    def flexhub_host(vm: VM) -> VMHost:
        return VMHost(vm, backend)

    return flexhub_host
