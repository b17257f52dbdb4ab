"""The kit's provisioning checks, for backends that mix in
:class:`~flexhub.provisioning.Provisioning` (a backend that does not passes them with nothing
to check). :class:`~flexhub.testing.Conformance` inherits them.

The backend's test class provides :meth:`ProvisioningChecks.provision_sample` (the class
parameters and Secret of a StorageClass that works on this machine) and
:meth:`ProvisioningChecks.assets` (what the backend's storage holds for one claim: one name
per volume made). ``provision`` and ``reclaim`` run in the kit's process, as the provisioner
(or, for ``reclaim_on = "node"``, the node's DaemonSet pod) runs them, on a backend instance
whose node services are the kit run's (:meth:`ProvisioningChecks.provisioning_backend`); each
provisioned volume is mounted through the installed driver as kubelet mounts a PV.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, NoReturn

import pytest

from flexhub.admin.harness import Kubelet
from flexhub.testing.env import KitEnv, fail_line

__all__ = ["ProvisionSample", "ProvisioningChecks"]

static = pytest.mark.flexhub_static
storage = pytest.mark.flexhub_storage


@dataclass(frozen=True)
class ProvisionSample:
    """A StorageClass that works on this machine: the backend's ``parameters`` (without
    ``backend`` and the provisioner's keys, with ``fsType`` if any), the decoded data of the
    Secret it names, the size of the claims the kit makes, and ``onDelete``."""

    parameters: Mapping[str, str] = field(default_factory=dict)
    secrets: Mapping[str, str] = field(default_factory=dict)
    size: int = 256 * 1024 * 1024
    on_delete: str = "delete"


def _fail(check: str, what: str, fix: str) -> NoReturn:
    __tracebackhide__ = True
    pytest.fail(fail_line(check, what, fix), pytrace=False)


class ProvisioningChecks:
    """The provisioning checks; see the module."""

    backend: ClassVar[str] = ""
    env: KitEnv
    #: The node name the kit's claims are scheduled on (``Claim.selected_node``).
    kit_node: ClassVar[str] = "kit-node"

    # -- what the backend author provides ---------------------------------------------------

    def provision_sample(self) -> ProvisionSample:
        """The StorageClass of the checks (required when the backend mixes in Provisioning)."""
        raise NotImplementedError

    def assets(self, claim: Any) -> list[str]:
        """What the backend's storage holds for ``claim`` (a
        :class:`~flexhub.provisioning.Claim`), one name per volume made: files, directories,
        LUNs whose name holds ``claim.uid``. The kit needs it to see leaks."""
        raise NotImplementedError

    # -- helpers ------------------------------------------------------------------------

    def _provisioning_class(self) -> type | None:
        from flexhub.driver.loader import load_backend
        from flexhub.provisioning import Provisioning

        cls = load_backend(self.backend)
        return cls if issubclass(cls, Provisioning) else None

    def _provision_sample(self, check: str) -> ProvisionSample:
        __tracebackhide__ = True
        try:
            return self.provision_sample()
        except NotImplementedError:
            _fail(
                check,
                f"backend {self.backend} mixes in Provisioning but the test class has no "
                "provision_sample()",
                "implement provision_sample() (and assets()) in the backend's Conformance class",
            )

    def _assets(self, check: str, claim: Any) -> list[str]:
        __tracebackhide__ = True
        try:
            return sorted(self.assets(claim))
        except NotImplementedError:
            _fail(
                check,
                "the test class has no assets(claim)",
                "implement assets(): what the storage holds for a claim (the kit looks for leaks)",
            )

    def provisioning_backend(self) -> Any:
        """The backend instance ``provision`` and ``reclaim`` are called on: by default, in the
        kit's process, with the kit run's node config (so on this machine: override it when
        the host is another, e.g. to call them where the storage is)."""
        from flexhub.config import parse_config
        from flexhub.driver.loader import load_backend
        from flexhub.node import Node

        config = parse_config(self.env.config_text().encode(), Path(self.env.config_path))
        return load_backend(self.backend)(Node(config, backend=self.backend))

    def _claim(self, sample: ProvisionSample) -> Any:
        from flexhub.provisioning import Claim

        return Claim(
            uid=str(uuid.uuid4()),
            namespace="default",
            name=f"kit-{uuid.uuid4().hex[:8]}",
            size=sample.size,
            selected_node=self.kit_node,
        )

    def _secrets(self, sample: ProvisionSample) -> Any:
        from flexhub.volume import Secret, Secrets

        return Secrets({k: Secret(v) for k, v in sample.secrets.items()})

    def _provision(self, check: str, sample: ProvisionSample, claim: Any) -> Any:
        __tracebackhide__ = True
        from flexhub.errors import FlexhubError

        try:
            made = self.provisioning_backend().provision(
                claim, dict(sample.parameters), self._secrets(sample)
            )
        except FlexhubError as exc:
            _fail(check, f"provision failed: {exc}", "provision the sample's claim")
        text = repr(made)
        shown = [k for k, v in sample.secrets.items() if len(v) >= 3 and v in text]
        if shown:
            _fail(
                check,
                f"what provision returned holds secret {shown[0]!r}",
                "never put a secret in the PV's options or reclaim record",
            )
        return made

    def _reclaim(self, check: str, sample: ProvisionSample, made: Any, what: str) -> None:
        __tracebackhide__ = True
        from flexhub.errors import FlexhubError

        record = {**made.reclaim, "onDelete": sample.on_delete}
        try:
            self.provisioning_backend().reclaim(made.options, record, self._secrets(sample))
        except FlexhubError as exc:
            _fail(check, f"{what} failed: {exc}", "reclaim must be idempotent: gone is success")

    def _mount_cycle(self, check: str, sample: ProvisionSample, claim: Any, made: Any) -> None:
        """Mount the PV through the driver as kubelet would, write, unmount."""
        __tracebackhide__ = True
        env = self.env
        target = env.new_pod(pv=claim.volume_name)
        user = dict(made.options)
        if made.fs_type:
            user["kubernetes.io/fsType"] = made.fs_type
        call = env.mount(target, env.options(target, user, sample.secrets))
        if call is None or not call.ok:
            env.cleanup()
            _fail(
                check,
                f"the provisioned PV does not mount: {call and call.describe()}",
                "return options the node driver accepts and mounts",
            )
        env.host.write_file(f"{target}/kit-provisioned", b"kit\n", 0o644)
        unmount = env.unmount(target)
        if unmount is None or not unmount.ok:
            env.cleanup()
            _fail(check, f"unmount failed: {unmount and unmount.describe()}", "see above")

    # -- the checks -----------------------------------------------------------------------

    @static
    def test_provision_parameters(self) -> None:
        """The parameters schema lints clean and the sample's class reads as the provisioner
        reads it (``flexhub.provisioner.storageclass.read_class``)."""
        from flexhub.driver.loader import load_backend
        from flexhub.errors import FlexhubError
        from flexhub.provisioner.storageclass import read_class
        from flexhub.testing.lint import lint_schema

        cls = self._provisioning_class()
        if cls is None:
            return  # nothing to provision
        check = "provision-parameters"
        sample = self._provision_sample(check)
        problems = lint_schema(cls.parameters_schema())  # type: ignore[attr-defined]
        if problems:
            _fail(check, "; ".join(problems), "fix the backend's provision-schema.json")
        parameters = {**sample.parameters, "backend": self.backend, "onDelete": sample.on_delete}
        if sample.secrets:
            parameters.update(secretName="kit-secret", secretNamespace="default")
        sc = {
            "kind": "StorageClass",
            "metadata": {"name": "kit"},
            "provisioner": "flexhub",
            "volumeBindingMode": "WaitForFirstConsumer",
            "parameters": parameters,
        }
        try:
            read_class(sc, load_backend)
        except FlexhubError as exc:
            _fail(check, f"the sample's StorageClass is refused: {exc}", "fix provision_sample()")

    @storage
    def test_provision_is_idempotent(self) -> None:
        """The same claim provisioned twice gives the same answer, whose options the driver
        validates and mounts; reclaim removes every asset, and a second reclaim succeeds."""
        if self._provisioning_class() is None:
            return
        from flexhub.driver.loader import load_backend
        from flexhub.driver.validation import validate_options
        from flexhub.errors import FlexhubError

        check = "provision-idempotent"
        sample = self._provision_sample(check)
        claim = self._claim(sample)
        first = self._provision(check, sample, claim)
        again = self._provision(check, sample, claim)
        if again != first:
            _fail(
                check,
                f"the same claim provisioned twice gave {first!r} then {again!r}",
                "find and return what the first call made (name assets from Claim.uid)",
            )
        if first.size < claim.size:
            _fail(check, f"size {first.size} < the claim's {claim.size}", "give at least it")
        options = Kubelet.base_options(
            {"backend": self.backend, **first.options}, pv=claim.volume_name, fs_type=first.fs_type
        )
        try:
            validate_options(load_backend(self.backend), options)
        except FlexhubError as exc:
            _fail(check, f"the PV's options are refused: {exc}", "return the driver's options")
        self._mount_cycle(check, sample, claim, first)
        self._reclaim(check, sample, first, "reclaim")
        left = self._assets(check, claim)
        if left:
            _fail(check, f"after reclaim, left: {', '.join(left)}", "remove the claim's storage")
        self._reclaim(check, sample, first, "a second reclaim")

    @storage
    def test_reclaim_of_nothing_is_success(self) -> None:
        """Reclaim of a provisioned volume whose storage is already gone (never mounted, or
        removed by hand) succeeds, twice."""
        if self._provisioning_class() is None:
            return
        check = "reclaim-gone"
        sample = self._provision_sample(check)
        claim = self._claim(sample)
        made = self._provision(check, sample, claim)
        self._mount_cycle(check, sample, claim, made)
        self._reclaim(check, sample, made, "reclaim")
        self._reclaim(check, sample, made, "reclaim of storage already gone")
        fresh = self._claim(sample)
        unmounted = self._provision(check, sample, fresh)
        self._reclaim(check, sample, unmounted, "reclaim of a volume never mounted")
        left = self._assets(check, claim) + self._assets(check, fresh)
        if left:
            _fail(check, f"after reclaim, left: {', '.join(left)}", "remove the claim's storage")

    @storage
    def test_provision_retried_after_a_crash(self) -> None:
        """A provisioner that made the storage and died before saving the PV, restarted:
        provision again (a new backend instance) adds nothing, the volume is exactly one
        asset once used, and one reclaim leaves nothing."""
        if self._provisioning_class() is None:
            return
        check = "provision-crash"
        sample = self._provision_sample(check)
        claim = self._claim(sample)
        self._provision(check, sample, claim)  # its answer is lost with the provisioner
        before = self._assets(check, claim)
        retried = self._provision(check, sample, claim)
        after = self._assets(check, claim)
        if after != before:
            _fail(
                check,
                f"provisioning the claim again made {', '.join(sorted(set(after) - set(before)))}",
                "find what an earlier call made for the claim instead of making more",
            )
        self._mount_cycle(check, sample, claim, retried)
        used = self._assets(check, claim)
        if len(used) != 1:
            _fail(
                check,
                f"the claim's volume is {len(used)} assets once used: {', '.join(used) or '-'}",
                "make one volume per claim (and assets() must name it)",
            )
        self._reclaim(check, sample, retried, "reclaim")
        left = self._assets(check, claim)
        if left:
            _fail(check, f"after one reclaim, left: {', '.join(left)}", "leak nothing")
