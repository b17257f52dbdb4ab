"""The conformance kit (``flexhub.testing``) against loopfile: real loop devices and mounts on
this host, through the installed driver."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from flexhub.provisioning import Claim
from flexhub.testing import Conformance, ProvisionSample, Sample
from tests.conftest import needs_root

pytestmark = [needs_root, pytest.mark.root]

MiB = 1024 * 1024


class TestLoopfileConformance(Conformance):
    backend = "loopfile"

    def settings(self, base: str) -> Mapping[str, Any]:
        return {"root": f"{base}/loopfiles", "isolation": "namespace"}

    def sample(self) -> Sample:
        # xfs: online growth needs CAP_SYS_RESOURCE for ext4, which this host lacks
        return Sample(
            options={"file": "kit/volume.img", "size": "300Mi", "kubernetes.io/fsType": "xfs"},
            # loopfile reads no Secret; one on the PV reaches the driver all the same, and the
            # secret scan follows the calls that carry it
            secrets={"token": "loopfile-kit-Secret-9a4e"},
            fs_group=2000,
            expand_to=600 * MiB,
        )

    def provision_sample(self) -> ProvisionSample:
        return ProvisionSample(
            parameters={"directory": "kit-claims", "fsType": "xfs"}, size=300 * MiB
        )

    def assets(self, claim: Claim) -> list[str]:
        """Every file of the claim under the root (with a creation's leftovers), any area."""
        return [str(p) for p in Path(self.root()).rglob(f"*{claim.volume_name}*")]

    def root(self) -> str:
        return f"{self.env.base}/loopfiles"

    @contextlib.contextmanager
    def unreachable(self, sample: Sample) -> Iterator[None]:
        """A local file has no server to lose: the loopfile root becomes an empty read-only
        filesystem (as if the disk holding it were gone), so no file can be found or made."""
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "kit-gone", self.root()], check=True
        )
        try:
            yield
        finally:
            subprocess.run(["umount", self.root()], check=True)
