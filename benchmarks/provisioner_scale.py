"""The provisioner at scale on the control-plane tier: N loopfile claims made at once.

    python3 benchmarks/provisioner_scale.py [--claims 1000] [--workers 4]

As root, from a clone with flexhub and its loopfile backend installed and the control-plane
tier's binaries built (tests/cluster/build.py; Go builds them into the CI cache the first
time). It starts that tier (a real etcd, kube-apiserver, controller-manager, scheduler and a
kubelet on this host), a StorageClass of loopfile, ``flexhub provisioner`` and ``flexhub
node-agent`` as processes, then makes N claims pinned to the node (``selected-node``, as the
scheduler writes it for a pod: this measures the provisioner, not the scheduling of N pods;
loopfile makes its file at the first mount, so no storage is written), and prints:

- the seconds until every claim is Bound, and until every PV is reclaimed and gone after the
  claims are deleted;
- the API server's requests during each phase per claim, by resource and verb (every
  client's: the provisioner's, the node agent's and the controller-manager's binding);
- the Events written per claim (objects, and the sum of their counts);
- the provisioner's and the node agent's peak resident memory (VmHWM).

Figures are printed, never asserted (tests/cluster/test_scale.py runs a small N and checks
that each figure is printed and every claim got its PV).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
NAMESPACE = "scale"
CLASS = "scale-loop"
_REQUEST = re.compile(r"^apiserver_request_total\{([^}]*)\} ([0-9.e+]+)$")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def requests_by_kind(api: Any) -> Counter[str]:
    """The API server's ``apiserver_request_total`` summed by ``resource verb``."""
    method, url, headers, body, post = api.param_serialize(
        "GET", "/metrics", auth_settings=["BearerToken"]
    )
    response = api.call_api(method, url, header_params=headers, body=body, post_params=post)
    response.read()
    text = response.data.decode()
    found: Counter[str] = Counter()
    for line in text.splitlines():
        match = _REQUEST.match(line)
        if not match:
            continue
        labels = dict(_LABEL.findall(match.group(1)))
        if labels.get("resource"):
            found[f"{labels['resource']} {labels.get('verb', '?').lower()}"] += int(
                float(match.group(2))
            )
    return found


def _tier(module: str) -> Any:
    """A module of the control-plane tier (tests/cluster), imported from this clone."""
    import importlib

    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    return importlib.import_module(f"tests.cluster.{module}")


def peak_memory(pid: int) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            kib = int(line.split()[1])
            return f"{kib / 1024:.0f} MiB"
    return "?"


def _wait(what: str, done: Callable[[], bool], timeout: float) -> float:
    start = time.monotonic()
    while not done():
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"{what}: not within {timeout:.0f} s")
        time.sleep(0.5)
    return time.monotonic() - start


def _per_claim(before: Counter[str], after: Counter[str], claims: int, out: list[str]) -> None:
    diff = Counter({k: after[k] - before[k] for k in after if after[k] - before[k] > 0})
    total = sum(diff.values())
    out.append(f"  API requests per claim: {total / claims:.1f} in all")
    for kind, count in diff.most_common(8):
        out.append(f"    {kind}: {count / claims:.2f}")


def run(cluster: Any, claims: int, workers: int, node: str) -> list[str]:
    """Run the benchmark on a started cluster; return the printed lines."""
    Process = _tier("cluster").Process

    core, storage = cluster.core, cluster.storage
    out = [f"# provisioner scale: {claims} loopfile claims, {workers} workers"]
    core.create_namespace({"metadata": {"name": NAMESPACE}})
    storage.create_storage_class(
        {
            "apiVersion": "storage.k8s.io/v1",
            "kind": "StorageClass",
            "metadata": {"name": CLASS},
            "provisioner": "flexhub",
            "parameters": {"backend": "loopfile"},
            "reclaimPolicy": "Delete",
            "volumeBindingMode": "WaitForFirstConsumer",
        }
    )
    common = ["--kubeconfig", str(cluster.kubeconfig), "--config", str(cluster.config)]
    flexhub = [sys.executable, "-m", "flexhub"]
    serve = [*flexhub, "provisioner", *common, "--lease-namespace", "default"]
    prov = Process("scale-provisioner", [*serve, "--workers", str(workers)],
                   cluster.logs / "scale-provisioner.log")  # fmt: skip
    agent = Process("scale-node-agent", [*flexhub, "node-agent", *common, "--node", node],
                    cluster.logs / "scale-node-agent.log")  # fmt: skip
    try:
        before = requests_by_kind(cluster.api)
        made = time.monotonic()
        for i in range(claims):
            core.create_namespaced_persistent_volume_claim(
                NAMESPACE,
                {
                    "metadata": {
                        "name": f"c{i:05d}",
                        "annotations": {"volume.kubernetes.io/selected-node": node},
                    },
                    "spec": {
                        "accessModes": ["ReadWriteOnce"],
                        "storageClassName": CLASS,
                        "resources": {"requests": {"storage": "16Mi"}},
                    },
                },
            )
        created = time.monotonic() - made

        def bound() -> bool:
            listed = core.list_namespaced_persistent_volume_claim(NAMESPACE).items
            return sum(1 for c in listed if c.status.phase == "Bound") == claims

        took = _wait("every claim Bound", bound, timeout=60 + claims * 2.0)
        out.append(f"claims created in {created:.1f} s; all Bound {took + created:.1f} s after "
                   f"the first ({claims / (took + created):.1f} claims/s)")  # fmt: skip
        middle = requests_by_kind(cluster.api)
        _per_claim(before, middle, claims, out)
        events = core.list_namespaced_event(NAMESPACE).items
        out.append(
            f"  Events per claim: {len(events) / claims:.2f} objects, "
            f"{sum(e.count or 1 for e in events) / claims:.2f} counted"
        )
        out.append(f"  provisioner peak memory: {peak_memory(prov.popen.pid)}")
        core.delete_collection_namespaced_persistent_volume_claim(NAMESPACE)

        def reclaimed() -> bool:
            return not [
                pv
                for pv in core.list_persistent_volume().items
                if pv.spec.claim_ref and pv.spec.claim_ref.namespace == NAMESPACE
            ]

        took = _wait("every PV reclaimed", reclaimed, timeout=60 + claims * 2.0)
        out.append(f"every PV reclaimed and gone {took:.1f} s after the claims were deleted "
                   f"({claims / took:.1f} PVs/s)")  # fmt: skip
        _per_claim(middle, requests_by_kind(cluster.api), claims, out)
        out.append(f"  node agent peak memory: {peak_memory(agent.popen.pid)}")
        out.append(f"  provisioner peak memory: {peak_memory(prov.popen.pid)}")
    finally:
        prov.stop()
        agent.stop()
        core.delete_namespace(NAMESPACE)
        storage.delete_storage_class(CLASS)
    return out


@contextmanager
def _cluster() -> Iterator[Any]:
    with tempfile.TemporaryDirectory() as scratch:
        bin_dir = _tier("build").build(Path(scratch) / "go-build.log")
    with _tier("cluster").running(bin_dir) as cluster:
        cluster.wait_node_ready()
        yield cluster


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--claims", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=4)
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("run as root: the control-plane tier's kubelet mounts for real", file=sys.stderr)
        return 2
    with _cluster() as cluster:
        for line in run(cluster, args.claims, args.workers, _tier("cluster").NODE):
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
