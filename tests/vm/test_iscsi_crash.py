"""An iSCSI mount SIGKILLed between the login and its journal record, on a real kernel.

With CHAP the session cannot be re-created by ``unmount`` (kubelet gives it no secret), so
the only way not to leak the session is to release what the attach journalled as it went.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.rig import services
from tests.rig.vm import KUBELET_ENV, VM
from tests.vm.test_iscsi import (
    LOGS,
    PODS,
    SESSION_CHAP,
    Kubelet,
    chap_secrets,
    clean,
    kubelet,
    node_records,
    sessions,
)

__all__ = ["clean", "kubelet"]  # the fixtures

pytest_plugins = ["tests.rig.fixtures"]


class _Crashing:
    """The guest, with ``FLEXHUB_TEST_CRASH_AT`` set for driver calls."""

    def __init__(self, vm: VM, point: str) -> None:
        self.vm = vm
        self.point = point

    def run(self, *args: object, **kwargs: object) -> object:
        return self.vm.run(*args, **kwargs)  # type: ignore[arg-type]

    def call_driver(self, driver: str, argv: list[str], timeout: float = 300) -> tuple[int, str]:
        env = {**KUBELET_ENV, "FLEXHUB_TEST_CRASH_AT": self.point}
        result = self.vm.run([driver, *argv], timeout=timeout, check=False, env=env, cwd="/")
        return result.rc, result.output


def test_sigkill_between_login_and_record_then_unmount_logs_out(
    vm: VM, kubelet: Kubelet, clean: None
) -> None:
    target = services.iscsi_target(
        vm, session_chap=SESSION_CHAP, initiators=[services.GUEST_INITIATOR]
    )
    crashing = Kubelet(_Crashing(vm, "attached"), kubelet.driver)  # type: ignore[arg-type]
    crashing.pods = kubelet.pods + 100
    with pytest.raises(json.JSONDecodeError):  # SIGKILLed: no reply at all
        crashing.mount(target, secrets=chap_secrets(SESSION_CHAP), chapAuthSession="true")
    # the directory that mount was given (Kubelet.pod_dir's naming)
    directory = f"{PODS}/0000-{crashing.pods:04d}-{os.getpid()}/volumes/k8s~flexhub/pv"
    assert len(sessions(vm, target.iqn)) == 1  # logged in, device present, not journalled
    assert node_records(vm, target.iqn) != []

    assert kubelet.unmount(directory) == {"status": "Success"}
    assert sessions(vm, target.iqn) == []
    assert node_records(vm, target.iqn) == []
    assert services.session_disks(vm, target.iqn) == []
    log = vm.read_file(f"{LOGS}/flexhub.log").decode()
    assert "was interrupted during attach: releasing what it reported" in log
    assert "re-attaching" not in log
