"""Running the provisioner and the node agent as processes: API access, backends, signals."""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from flexhub.errors import FlexhubError
from flexhub.provisioning import Provisioning
from flexhub.volume import Secrets

LOG = logging.getLogger(__name__)

__all__ = ["api_client", "run_node_agent", "run_provisioner", "seal_volumes"]


def api_client(kubeconfig: Path | None) -> Any:
    """An ApiClient from ``kubeconfig``, or the pod's service account when none is given."""
    from kubernetes import client, config

    if kubeconfig is not None:
        configuration = client.Configuration()
        config.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)
    else:
        config.load_incluster_config()
        configuration = client.Configuration.get_default_copy()
    return client.ApiClient(configuration)


def _log_to_stderr(level: str) -> None:
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel(level.upper())
    for noisy in ("urllib3", "kubernetes"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


class _Backends:
    """Backend instances by name, made once, with the node services of ``config``."""

    def __init__(self, config_path: Path | None) -> None:
        from flexhub.config import load_config

        self.config = load_config(config_path)
        self._made: dict[str, Any] = {}
        self._lock = threading.Lock()  # the provisioner's workers share one instance each

    def __call__(self, name: str) -> Provisioning:
        with self._lock:
            return self._backend(name)

    def _backend(self, name: str) -> Provisioning:
        if name not in self._made:
            from flexhub.driver.loader import load_backend
            from flexhub.node import Node

            cls = load_backend(name, self.config)
            if not issubclass(cls, Provisioning):
                raise FlexhubError(f"backend {name!r} cannot provision")
            cls.check_settings(name, self.config.backends.get(name, {}), self.config)
            self._made[name] = cls(Node(self.config, backend=name))
        backend: Provisioning = self._made[name]
        return backend

    def class_of(self, name: str) -> type:
        from flexhub.driver.loader import load_backend

        return load_backend(name, self.config)


def _stop_on_signals(*stops: threading.Event) -> None:
    def handler(signum: int, _frame: object) -> None:
        LOG.info("signal %d: stopping", signum)
        for stop in stops:
            stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def run_provisioner(
    kubeconfig: Path | None,
    config: Path | None,
    leader_elect: bool = True,
    lease_namespace: str = "",
    name: str = "flexhub",
    log_level: str = "info",
    workers: int = 4,
) -> int:
    """``flexhub provisioner``: runs until SIGTERM; exits 1 when it loses its lease.

    The Lease and the sealing key (:mod:`flexhub.provisioner.seal`) live in
    ``lease_namespace`` (default: the pod's namespace)."""
    from kubernetes import client

    from flexhub.provisioner.controller import Controller
    from flexhub.provisioner.leader import LeaseElector
    from flexhub.provisioner.seal import Sealer, load_key
    from flexhub.provisioner.storageclass import read_class

    _log_to_stderr(log_level)
    api = api_client(kubeconfig)
    backends = _Backends(config)
    identity = f"{socket.gethostname()}_{uuid.uuid4().hex[:8]}"
    namespace = lease_namespace or _pod_namespace()
    sealer = Sealer(load_key(client.CoreV1Api(api), namespace))
    controller = Controller(
        api,
        backends,
        lambda sc: read_class(sc, backends.class_of),
        name=name,
        identity=identity,
        sealer=sealer,
        workers=workers,
    )
    _stop_on_signals(controller.stop)
    leading = None
    if leader_elect:
        elector = LeaseElector(api, namespace, f"{name}-provisioner", identity,
                               on_lost=lambda: os._exit(1))  # fmt: skip
        if not elector.acquire(controller.stop):
            return 0
        threading.Thread(target=elector.keep, args=(controller.stop,), daemon=True).start()
        leading = elector.leading
    LOG.info("provisioning for StorageClasses of provisioner %r as %s", name, identity)
    controller.feed()
    controller.run(leading)
    return 0


def seal_volumes(
    kubeconfig: Path | None, names: list[str], namespace: str, name: str = "flexhub"
) -> list[str]:
    """``flexhub provisioner-seal``: seal PVs an administrator has checked (made by a flexhub
    that did not seal, or edited on purpose) with the provisioner's key; returns one line per
    PV. Run with rights to read the key Secret (an administrator's kubeconfig)."""
    from kubernetes import client

    from flexhub.provisioner.pvapi import get
    from flexhub.provisioner.pvs import ANN_PROVISIONED_BY, ANN_RECLAIM
    from flexhub.provisioner.seal import ANN_SEAL, Sealer, load_key

    api = api_client(kubeconfig)
    core = client.CoreV1Api(api)
    sealer = Sealer(load_key(core, namespace, create=False))
    lines = []
    for volume in names:
        pv = get(api, core.read_persistent_volume, volume)
        annotations = (pv or {}).get("metadata", {}).get("annotations") or {}
        if pv is None:
            raise FlexhubError(f"PV {volume} not found")
        if annotations.get(ANN_PROVISIONED_BY) != name or ANN_RECLAIM not in annotations:
            raise FlexhubError(f"PV {volume} was not provisioned by {name!r}: nothing to seal")
        if sealer.sealed(pv):
            lines.append(f"{volume}: sealed already")
            continue
        patch = [
            {"op": "test", "path": "/metadata/resourceVersion",
             "value": pv["metadata"]["resourceVersion"]},
            {"op": "add", "path": "/metadata/annotations/" + ANN_SEAL.replace("/", "~1"),
             "value": sealer.seal(pv)},
        ]  # fmt: skip
        core.patch_persistent_volume(volume, patch, _request_timeout=30)
        lines.append(f"{volume}: sealed")
    return lines


def _pod_namespace() -> str:
    path = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
    try:
        return path.read_text().strip() or "default"
    except OSError:
        return "default"


def run_node_agent(
    kubeconfig: Path | None,
    config: Path | None,
    node: str,
    name: str = "flexhub",
    log_level: str = "info",
    reclaim: Callable[[str, Mapping[str, str], Mapping[str, str]], None] | None = None,
) -> int:
    """``flexhub node-agent``: reclaim the storage of this node's released PVs.

    :param reclaim: how (default: in this process, with ``config``); the DaemonSet's pod
        reclaims in the host (:func:`flexhub.admin.reclaim.host_reclaimer`).
    """
    from flexhub.provisioner.nodeagent import NodeAgent

    if not node:
        raise FlexhubError("node-agent needs the node's name (--node, or NODE_NAME)")
    _log_to_stderr(log_level)
    api = api_client(kubeconfig)
    if reclaim is None:
        backends = _Backends(config)

        def reclaim(backend: str, options: Mapping[str, str], record: Mapping[str, str]) -> None:
            backends(backend).reclaim(options, record, Secrets())

    agent = NodeAgent(api, node, reclaim, name=name)
    _stop_on_signals(agent.stop)
    LOG.info("reclaiming node storage of released PVs on %s", node)
    agent.feed()
    agent.run()
    return 0
