"""The flexhub conformance kit: checks a backend package runs from its own test suite.

.. code-block:: python

    from flexhub.testing import Conformance, Sample

    class TestMyStore(Conformance):
        backend = "mystore"

        def sample(self) -> Sample:
            return Sample(options={"path": "/srv/one"}, secrets={"password": "s3cret"})

        @contextlib.contextmanager
        def unreachable(self, sample): ...

A backend that mixes in :class:`~flexhub.provisioning.Provisioning` also gives
``provision_sample()`` (a :class:`ProvisionSample`) and ``assets(claim)``: the provisioning
checks (:mod:`flexhub.testing.provisioning`) then provision, mount and reclaim for real.

``pytest -m flexhub_static`` runs the checks that need no storage. Each failure is one line
``flexhub-kit <check>: <what is wrong>; <what to fix>``. :data:`KIT_VERSION` is the version
of this API (the classes, their hooks, the markers and fixtures); it changes when a change
could break a backend's conformance test.
"""

from __future__ import annotations

from flexhub.testing.conformance import Conformance, Sample
from flexhub.testing.env import Call, KitEnv, KitFailure
from flexhub.testing.host import Host, LocalHost, MountPoint, RunResult
from flexhub.testing.provisioning import ProvisionSample

__all__ = [
    "KIT_VERSION",
    "Call",
    "Conformance",
    "Host",
    "KitEnv",
    "KitFailure",
    "LocalHost",
    "MountPoint",
    "ProvisionSample",
    "RunResult",
    "Sample",
]

#: The version of the kit's API (see the module).
KIT_VERSION = "4"
