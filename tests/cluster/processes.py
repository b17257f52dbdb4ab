"""flexhub's long-running API clients as processes on the test cluster, each with the token
of its account in the Helm chart (tests/cluster/accounts.py), never the admin's."""

from __future__ import annotations

import os
import sys

from tests.cluster.accounts import NAMESPACE
from tests.cluster.cluster import Cluster, Process


def start(
    cluster: Cluster,
    name: str,
    component: str,
    *args: str,
    env: dict[str, str] | None = None,
) -> Process:
    """``python -m flexhub ARGS`` with the kubeconfig of ``component``'s chart account (the
    ``accounts`` fixture made them) and the cluster's node config; its log is ``name``'s."""
    kubeconfig = cluster.service_kubeconfigs[component]
    argv = [sys.executable, "-m", "flexhub", *args, "--kubeconfig", str(kubeconfig),
            "--config", str(cluster.config)]  # fmt: skip
    return Process(name, argv, cluster.logs / f"{name}.log", env={**os.environ, **(env or {})})


def provisioner(cluster: Cluster, name: str, *extra: str, **env: str) -> Process:
    """``flexhub provisioner`` with the provisioner's token; its Lease in the chart's
    namespace, as the chart's Deployment passes ``--lease-namespace``."""
    return start(cluster, name, "provisioner", "provisioner", "--lease-namespace", NAMESPACE,
                 *extra, env=env)  # fmt: skip
