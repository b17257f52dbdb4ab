"""Test the tests: flexhub's CSI processes on the cluster tier with a deliberate defect.

With ``FLEXHUB_CSI_BREAK=<name>[,<name>...]`` in a cluster-tier run's environment, the tier
starts ``flexhub csi`` (the node plugin, tests/cluster/csi_node.py; the controller,
tests/cluster/sidecars.py) through this module, which breaks what each name says and then
runs flexhub's own ``main``; everything else is the real driver. A scenario that still passes
under the break of what it claims to show proves nothing (tests/cluster/test_csi_scenarios.py
names the break of each). The FlexVolume driver's counterpart is ``FLEXHUB_CLUSTER_BREAK``
(:meth:`tests.cluster.cluster.Cluster.break_driver`).

    FLEXHUB_CSI_BREAK=node-expand python -m pytest tests/cluster/test_csi_scenarios.py
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ENV = "FLEXHUB_CSI_BREAK"


def _publish_binds_nothing() -> None:
    """NodePublishVolume makes the target directory and answers OK: no bind of the volume."""
    from flexhub.csi.node import NodeService
    from flexhub.csi.proto import csi_pb2

    def publish(self: Any, request: Any, context: Any) -> Any:
        Path(request.target_path).mkdir(parents=True, exist_ok=True)
        return csi_pb2.NodePublishVolumeResponse()

    NodeService.NodePublishVolume = publish  # type: ignore[method-assign]


def _node_expand_grows_nothing() -> None:
    """NodeExpandVolume answers the new size and grows neither the file nor the filesystem."""
    from flexhub.csi.node import NodeService
    from flexhub.csi.proto import csi_pb2

    def expand(self: Any, request: Any, context: Any) -> Any:
        return csi_pb2.NodeExpandVolumeResponse(
            capacity_bytes=request.capacity_range.required_bytes
        )

    NodeService.NodeExpandVolume = expand  # type: ignore[method-assign]


def _restore_copies_nothing() -> None:
    """A loopfile volume made from a snapshot is a new empty one (nothing copied)."""
    from flexhub_loopfile import LoopfileBackend

    def restore(self: Any, claim: Any, parameters: Any, snapshot: Any, secrets: Any) -> Any:
        return self.provision(claim, parameters, secrets)

    LoopfileBackend.restore = restore  # type: ignore[method-assign]


def _no_topology() -> None:
    """CreateVolume's volume names no accessible topology (no node affinity on the PV)."""
    from flexhub.csi.controller import ControllerService

    real = ControllerService._volume

    def volume(record: Any) -> Any:
        made = real(record)
        del made.accessible_topology[:]
        return made

    ControllerService._volume = staticmethod(volume)  # type: ignore[method-assign,assignment]


def _delete_reclaims_nothing() -> None:
    """DeleteVolume answers OK and leaves the storage (and flexhub's record) where it is."""
    from flexhub.csi.controller import ControllerService
    from flexhub.csi.proto import csi_pb2

    def delete(self: Any, request: Any, context: Any) -> Any:
        return csi_pb2.DeleteVolumeResponse()

    ControllerService.DeleteVolume = delete  # type: ignore[method-assign]


def _no_health_events() -> None:
    """The node plugin's health watcher never starts (no VolumeConditionAbnormal Event)."""
    from flexhub.csi import healthevents

    healthevents.start = lambda *args, **kwargs: None


def _pod_identity_dropped() -> None:
    """NodePublishVolume keeps no pod (as with podInfoOnMount false): no Event names one."""
    from flexhub.csi import node

    node.pod_of_publish = lambda *args, **kwargs: None  # type: ignore[assignment]


BREAKS: dict[str, Callable[[], None]] = {
    "health-events": _no_health_events,
    "pod-identity": _pod_identity_dropped,
    "publish": _publish_binds_nothing,
    "node-expand": _node_expand_grows_nothing,
    "restore": _restore_copies_nothing,
    "topology": _no_topology,
    "reclaim": _delete_reclaims_nothing,
}


def flexhub_argv(*args: str) -> list[str]:
    """The command of ``flexhub ARGS`` on the tier: ``python -m flexhub``, or this module when
    :data:`ENV` names breaks (its environment needs the repository on ``PYTHONPATH``)."""
    module = __name__ if os.environ.get(ENV) else "flexhub"
    return [sys.executable, "-m", module, *args]


def main() -> int:
    for name in filter(None, os.environ.get(ENV, "").split(",")):
        if name not in BREAKS:
            sys.exit(f"{ENV}: unknown break {name!r} (known: {', '.join(BREAKS)})")
        BREAKS[name]()
        print(f"{ENV}: {name}: {BREAKS[name].__doc__}", file=sys.stderr, flush=True)
    from flexhub.__main__ import main as flexhub_main

    return flexhub_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
