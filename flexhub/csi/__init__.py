"""The CSI front end (``flexhub csi``): Identity, Controller and Node services over gRPC.

It serves the same backends as the FlexVolume driver through the public backend and
provisioning API and the node services (:mod:`flexhub.node`), with the same journal, locks and
safe format. gRPC and protobuf are imported only here (and by ``flexhub csi``), never on the
FlexVolume path (``tests/core/test_protocol.py``).

* :mod:`flexhub.csi.status`: flexhub's exception tree onto CSI status codes; in-flight calls.
* :mod:`flexhub.csi.volumes`: a CSI request's volume as flexhub's (context, capability).
* :mod:`flexhub.csi.identity`, :mod:`flexhub.csi.node`, :mod:`flexhub.csi.controller`: the services.
* :mod:`flexhub.csi.records`: the controller's records of the volumes it created.
* :mod:`flexhub.csi.published`: the node's record of each publish and the pod it is for.
* :mod:`flexhub.csi.healthevents`: the node plugin's health watcher (Events on pods).
* :mod:`flexhub.csi.server`: the gRPC server on a unix socket.
"""

from __future__ import annotations

import os

# gRPC core's fork support (on by default in grpcio) runs its handlers in every child forked
# with Python code before exec (a ``preexec_fn``: run_in_host's chroot, a umask): with a server
# live, about one such child in four died of SIGABRT or SIGSEGV before exec, or wrote gRPC's
# "Epoll1Poller ... epoll_wait error" into its output (measured 2026-12-06, grpcio 1.85). The
# plugin never uses gRPC in a forked child, so fork support is off, set before any flexhub
# module imports grpc (each does so through this package). tests/deploy/test_run_in_host.py.
os.environ["GRPC_ENABLE_FORK_SUPPORT"] = "false"

#: The one CSI driver name for every backend: the ``backend`` key of the volume context (the
#: StorageClass parameters) picks the backend, as ``backend`` does in FlexVolume options.
DRIVER_NAME = "flexhub.csi.k8s.io"
#: The topology key of a node-local volume (loopfile): the node's id.
TOPOLOGY_NODE_KEY = "topology.flexhub.csi.k8s.io/node"
