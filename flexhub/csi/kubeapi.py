"""The CSI plugin's own API client: ``--kubeconfig``, else the pod's service account.

The node plugin writes its health Events with it (:mod:`flexhub.csi.healthevents`), the
controller reads the records of converted volumes (:mod:`flexhub.csi.adopted`). ``kubernetes``
is imported here only, when a client is made.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

__all__ = ["SERVICE_ACCOUNT", "core_api", "in_cluster", "own_namespace"]

LOG = logging.getLogger(__name__)

#: Where a pod's service account token, CA and namespace are mounted.
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


def in_cluster() -> bool:
    """Whether this runs in a pod: the API server's address in the environment."""
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST"))


def core_api(kubeconfig: Path | None, off: str) -> Any:
    """A ``CoreV1Api`` from ``kubeconfig``, else the pod's service account; ``None`` (and one
    line logged: ``off``, what is off without it; never the file's content) when there is
    neither or it cannot be loaded."""
    token = SERVICE_ACCOUNT / "token"
    if kubeconfig is None and not (os.environ.get("KUBERNETES_SERVICE_HOST") and token.is_file()):
        LOG.warning("%s: no service account token and no --kubeconfig", off)
        return None
    try:
        from kubernetes import client, config

        configuration = client.Configuration()
        if kubeconfig is not None:
            config.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)
        else:
            config.load_incluster_config(client_configuration=configuration)
    except Exception as exc:  # the message may quote the file: its type alone
        where = f"--kubeconfig {kubeconfig}" if kubeconfig else "the service account"
        LOG.warning("%s: cannot load %s (%s)", off, where, type(exc).__name__)
        return None
    return client.CoreV1Api(client.ApiClient(configuration))


def own_namespace(default: str) -> str:
    """``$POD_NAMESPACE``, else the service account's namespace file, else ``default``."""
    found = os.environ.get("POD_NAMESPACE", "")
    if not found:
        try:
            found = (SERVICE_ACCOUNT / "namespace").read_text().strip()
        except OSError:
            found = ""
    return found or default
