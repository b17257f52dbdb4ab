"""A pod's mount of a staged volume through CSI against the same through the FlexVolume driver.

Run as root from a checkout where flexhub (with its ``csi`` extra) and flexhub-loopfile are
installed::

    python3 benchmarks/csi_publish.py [--runs 15] [--runtime DIR]

On one temporary node (``benchmarks/kubelet_node.py``: the driver installed, a kubelet-style
tree, a loopfile root) it starts ``flexhub csi --mode node`` as a process of its own, with
the node's config, and measures, each as a median of ``--runs`` samples:

- a second pod's mount of a volume another pod has mounted: the FlexVolume driver's
  ``mount`` (a process per call, as kubelet makes it) against ``NodePublishVolume`` of a
  staged volume over the plugin's gRPC socket (one long-running process);
- a pod's unmount: the driver's ``unmount`` against ``NodeUnpublishVolume``;
- the first mount of a new volume: the driver's first ``mount`` (attach, format, mount,
  bind) against ``NodeStageVolume`` plus ``NodePublishVolume``;
- the plugin's resident memory at rest (after ``Probe``) and after the calls.

It prints every figure and asserts nothing; it leaves nothing mounted or attached.
``--smoke`` runs every figure with tiny counts (CI runs it to keep the command working).
``--runtime DIR`` runs the driver and the plugin from a relocatable runtime (the full
profile: the node profile has no gRPC).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kubelet_node import Bench, bench_node, median_ms, must

from flexhub.admin.harness import Kubelet

CAPABILITY: dict[str, Any] = {}


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


@contextlib.contextmanager
def plugin(bench: Bench) -> Iterator[tuple[Any, int]]:
    """``flexhub csi --mode node`` on a socket in the bench's tree: (Node stub, its pid)."""
    import grpc

    from flexhub.csi.proto import csi_pb2 as pb
    from flexhub.csi.proto import csi_pb2_grpc as rpc

    sock = bench.root / "csi" / "csi.sock"
    argv = [*bench.start, "-I", "-m", "flexhub", "csi", "--mode", "node", "--node-id", "bench",
            "--endpoint", f"unix://{sock}", "--config", str(bench.root / "flexhub.toml"),
            "--log-level", "warning"]  # fmt: skip
    log = open(bench.root / "csi.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, cwd="/")
    channel = grpc.insecure_channel(f"unix://{sock}")
    try:
        deadline = time.monotonic() + 60
        identity = rpc.IdentityStub(channel)  # type: ignore[no-untyped-call]
        while True:
            try:
                identity.Probe(pb.ProbeRequest(), timeout=2)
                break
            except grpc.RpcError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    said = (bench.root / "csi.log").read_text()[-400:]
                    raise SystemExit(f"benchmark: flexhub csi did not start: {said}") from None
                time.sleep(0.1)
        yield rpc.NodeStub(channel), proc.pid  # type: ignore[no-untyped-call]
    finally:
        channel.close()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


class CsiVolumes:
    """Loopfile volumes staged and published through the plugin, all undone by :meth:`close`."""

    def __init__(self, bench: Bench, node: Any) -> None:
        from flexhub.csi.proto import csi_pb2 as pb

        self.pb = pb
        self.bench = bench
        self.node = node
        self.staged: list[tuple[str, str]] = []  # (volume id, staging path)
        self.published: list[tuple[str, str]] = []  # (volume id, target)
        self.counter = 0
        mode = pb.VolumeCapability.AccessMode.Mode.SINGLE_NODE_MULTI_WRITER
        self.capability = pb.VolumeCapability(
            mount=pb.VolumeCapability.MountVolume(fs_type="ext4"),
            access_mode=pb.VolumeCapability.AccessMode(mode=mode),
        )

    def stage(self, size: str) -> tuple[str, dict[str, str]]:
        self.counter += 1
        volume = f"csi-bench-{self.counter}"
        context = {"backend": "loopfile", "file": f"bench/{volume}.img", "size": size,
                   "flexhub.csi/namespace": "default"}  # fmt: skip
        staging = self.bench.root / "kubelet" / "plugins" / "csi" / volume / "globalmount"
        staging.mkdir(parents=True)
        self.node.NodeStageVolume(
            self.pb.NodeStageVolumeRequest(
                volume_id=volume, staging_target_path=str(staging),
                volume_capability=self.capability, volume_context=context,
            ),
            timeout=120,
        )  # fmt: skip
        self.staged.append((volume, str(staging)))
        return volume, context

    def publish(self, volume: str, context: dict[str, str]) -> str:
        staging = dict(self.staged)[volume]
        uid = Kubelet.new_pod_uid()
        parent = (
            self.bench.root / "kubelet" / "pods" / uid / "volumes" / "kubernetes.io~csi" / volume
        )
        parent.mkdir(parents=True)
        target = str(parent / "mount")
        self.node.NodePublishVolume(
            self.pb.NodePublishVolumeRequest(
                volume_id=volume, staging_target_path=staging, target_path=target,
                volume_capability=self.capability, volume_context=context,
            ),
            timeout=60,
        )  # fmt: skip
        self.published.append((volume, target))
        return target

    def unpublish_last(self) -> None:
        volume, target = self.published.pop()
        self.node.NodeUnpublishVolume(
            self.pb.NodeUnpublishVolumeRequest(volume_id=volume, target_path=target), timeout=60
        )

    def close(self) -> None:
        while self.published:
            self.unpublish_last()
        for volume, staging in reversed(self.staged):
            self.node.NodeUnstageVolume(
                self.pb.NodeUnstageVolumeRequest(volume_id=volume, staging_target_path=staging),
                timeout=120,
            )
        self.staged = []


def _pairs(first: Callable[[], object], then: Callable[[], object], runs: int) -> float:
    """The median of ``first`` over ``runs`` samples, each followed by ``then`` (not timed)."""
    samples = []
    for _ in range(runs):
        started = time.perf_counter()
        first()
        samples.append((time.perf_counter() - started) * 1000)
        then()
    samples.sort()
    return samples[len(samples) // 2]


def line(name: str, flex: float, csi: float) -> str:
    return f"{name:<44} FlexVolume {flex:8.1f} ms | CSI {csi:8.1f} ms | CSI/Flex {csi / flex:5.2f}x"


def run(bench: Bench, runs: int, size: str) -> list[str]:
    out = []
    k = bench.kubelet
    pv, user = bench.new_volume(size)
    must(bench.mount(pv, user), "first pod's mount")

    def flex_unmount_last() -> None:
        uid, name = bench.pods.pop()
        must(k.unmount(uid, name), "unmount")

    flex_second = _pairs(lambda: must(bench.mount(pv, user), "second pod's mount"),
                         flex_unmount_last, runs)  # fmt: skip
    flex_unmount = _pairs(flex_unmount_last, lambda: must(bench.mount(pv, user), "mount"), runs)
    flex_first = median_ms(
        lambda: must(bench.mount(*bench.new_volume(size)), "first mount"), max(1, runs // 3)
    )
    bench.unmount_all()
    with plugin(bench) as (node, pid):
        rest = _rss_mib(pid)
        volumes = CsiVolumes(bench, node)
        try:
            volume, context = volumes.stage(size)
            volumes.publish(volume, context)
            csi_second = _pairs(lambda: volumes.publish(volume, context), volumes.unpublish_last,
                                runs)  # fmt: skip
            csi_unmount = _pairs(volumes.unpublish_last,
                                 lambda: volumes.publish(volume, context), runs)  # fmt: skip

            def first() -> None:
                volumes.publish(*volumes.stage(size))

            csi_first = median_ms(first, max(1, runs // 3))
            after = _rss_mib(pid)
        finally:
            volumes.close()
    out.append(line("second pod's mount of a staged volume", flex_second, csi_second))
    out.append(line("a pod's unmount (volume stays staged)", flex_unmount, csi_unmount))
    out.append(line(f"first mount of a new {size} loopfile", flex_first, csi_first))
    out.append(
        f"{'plugin memory (RSS)':<44} at rest {rest:6.1f} MiB | after the calls {after:6.1f} MiB"
    )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--runtime", type=Path, help="a relocatable runtime (full profile)")
    parser.add_argument("--smoke", action="store_true", help="tiny counts (CI)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("benchmark: run as root (it mounts)")
    runs = 3 if args.smoke else args.runs
    with bench_node(args.runtime) as bench:
        lines = run(bench, runs, "16Mi")
        failures = bench.unmount_failures
    print(f"CSI against FlexVolume, medians of {runs} samples ({len(failures)} unmount failures)")
    for text in lines:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
