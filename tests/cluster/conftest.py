"""The ``cluster`` fixture: one real control plane and node for the tests of tests/cluster."""

from __future__ import annotations

import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster import accounts as chart_accounts
from tests.cluster import build
from tests.cluster.cluster import Cluster
from tests.cluster.manifests import apply_file
from tests.conftest import REPO


def _on_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


# Package scope: the cluster runs while tests/cluster runs, and is gone before the rest of the
# session (its processes would otherwise take CPU from the VM sessions beside it in CI).
@pytest.fixture(scope="package")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    reason = None
    if os.geteuid() != 0:
        reason = "needs root (the kubelet mounts for real)"
    elif not build.complete(build.bin_dir()) and shutil.which("go") is None:
        reason = "needs Go to build the control plane (`go` not on PATH)"
    if reason:
        if _on_ci():
            pytest.fail(f"CI=true but the cluster tier {reason}", pytrace=False)
        pytest.skip(reason)
    log = Path(tmp_path_factory.mktemp("cluster-build")) / "go-build.log"
    try:
        bin_dir = build.build(log)
    except Exception as exc:
        tail = log.read_text(errors="replace")[-4000:] if log.exists() else ""
        pytest.fail(f"building the control plane failed: {exc}\n{tail}", pytrace=False)
    # A SIGTERM (a CI run ended early) tears the cluster down too, as Ctrl-C does.
    signal.signal(signal.SIGTERM, _interrupt)
    running = Cluster(bin_dir)
    try:
        running.start()
    except Exception:
        for proc in running.processes.values():
            print(f"----- {proc.name} (tail)\n{proc.tail(40)}")
        running.stop()
        raise
    try:
        # As an operator installs flexhub: its admission policies are in force for every test.
        apply_file(running, REPO / "deploy" / "admission-policy.yaml")
        _wait_for_policies(running)
        yield running
    finally:
        running.stop()
        if os.environ.get("FLEXHUB_CLUSTER_KEEP"):  # for a post-mortem: logs, state, files
            print(f"cluster root kept: {running.root}")
        else:
            running.remove()


@pytest.fixture(scope="package")
def accounts(cluster: Cluster) -> chart_accounts.Accounts:
    """The Helm chart's accounts and RBAC on the cluster, a kubeconfig with a token of each
    (tests/cluster/accounts.py): flexhub's processes run with these, never as admin."""
    return chart_accounts.install(cluster)


def _interrupt(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def _wait_for_policies(cluster: Cluster) -> None:
    """The API server enforces a new policy once it has compiled it and its binding (about
    a second): wait until an inline flexhub volume in an unlabelled namespace is refused."""
    from kubernetes.client.rest import ApiException

    from tests.cluster.kube import eventually, flex, loopfile, namespace, pod

    ns = namespace(cluster, "policy-probe", inline_allowed=False)
    probe = pod("probe", [{"name": "v", "flexVolume": flex(loopfile("p.img"))}])

    def refused() -> bool:
        try:
            cluster.core.create_namespaced_pod(ns, probe, dry_run="All")
        except ApiException as exc:
            return exc.status == 403
        return False

    eventually("the admission policies in force", refused, timeout=60)
