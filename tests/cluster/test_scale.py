"""The provisioner's scale benchmark (benchmarks/provisioner_scale.py) at a small N on the
control-plane tier: it runs, every claim is Bound and reclaimed, and every figure is printed
(the figures are reported, never asserted; the README has a 1,000-claim run's)."""

from __future__ import annotations

import sys

import pytest

from tests.cluster.cluster import NODE, Cluster
from tests.conftest import REPO

pytestmark = [pytest.mark.cluster, pytest.mark.root]


def test_the_scale_benchmark_prints_every_figure(cluster: Cluster) -> None:
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import provisioner_scale
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    lines = provisioner_scale.run(cluster, claims=20, workers=4, node=NODE)
    text = "\n".join(lines)
    print(text)
    for figure in (
        "all Bound",
        "API requests per claim",
        "Events per claim",
        "provisioner peak memory",
        "every PV reclaimed and gone",
        "node agent peak memory",
    ):
        assert figure in text, (figure, text)
