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


#: ``python -c`` of a provisioner whose clock runs ``SKEW`` seconds ahead: only the clock the
#: leader election reads (leader.py's ``_now``) is moved; everything else is the real process.
SKEWED = """import datetime, os, sys
import flexhub.provisioner.leader as leader
skew = datetime.timedelta(seconds=float(os.environ["FLEXHUB_TEST_CLOCK_SKEW"]))
leader._now = lambda: datetime.datetime.now(datetime.UTC) + skew
from flexhub.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


def skewed_provisioner(cluster: Cluster, name: str, seconds: float) -> Process:
    """``flexhub provisioner`` as :func:`provisioner`, its clock ``seconds`` ahead."""
    kubeconfig = cluster.service_kubeconfigs["provisioner"]
    argv = [sys.executable, "-c", SKEWED, "provisioner", "--lease-namespace", NAMESPACE,
            "--kubeconfig", str(kubeconfig), "--config", str(cluster.config)]  # fmt: skip
    env = {**os.environ, "FLEXHUB_TEST_CLOCK_SKEW": str(seconds)}
    return Process(name, argv, cluster.logs / f"{name}.log", env=env)
