"""Several loopfile volumes attached at once through the installed driver (real loop devices):
each gets its own loop device and filesystem, and all of them are released afterwards."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from flexhub.admin.harness import DriverReply, Kubelet
from tests.conftest import needs_root
from tests.loopfile.conftest import loops_of, mounts_under

pytestmark = [needs_root, pytest.mark.root]

N = 4


def in_parallel(jobs: list[object]) -> list[DriverReply]:
    replies: list[DriverReply | None] = [None] * len(jobs)
    start = threading.Barrier(len(jobs))

    def run(i: int) -> None:
        start.wait()
        replies[i] = jobs[i]()  # type: ignore[operator]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r is not None for r in replies)
    return replies  # type: ignore[return-value]


def test_volumes_attach_and_release_at_once(kube: Kubelet, node_tree: dict[str, Path]) -> None:
    uids = [kube.new_pod_uid() for _ in range(N)]
    vols = [{"backend": "loopfile", "file": f"c/v{i}.img", "size": "64Mi"} for i in range(N)]
    replies = in_parallel(
        [
            lambda i=i: kube.mount(
                uids[i], f"pv-{i}", Kubelet.mount_options(vols[i], pv=f"pv-{i}", pod_uid=uids[i])
            )
            for i in range(N)
        ]
    )
    assert [r.reply for r in replies] == [{"status": "Success"}] * N
    images = [node_tree["loopfiles"] / "namespaces" / "default" / v["file"] for v in vols]
    loops = [loops_of(image) for image in images]
    assert all(len(found) == 1 for found in loops), loops
    assert len({found[0] for found in loops}) == N  # one loop device each
    targets = [kube.pod_dir(uids[i], f"pv-{i}") for i in range(N)]
    assert len({os.stat(t).st_dev for t in targets}) == N  # N distinct filesystems
    for i, target in enumerate(targets):
        (target / "who").write_text(str(i))
    assert [(t / "who").read_text() for t in targets] == [str(i) for i in range(N)]
    replies = in_parallel([lambda i=i: kube.unmount(uids[i], f"pv-{i}") for i in range(N)])
    assert [r.reply for r in replies] == [{"status": "Success"}] * N
    assert loops_of(node_tree["loopfiles"]) == []
    assert mounts_under(node_tree["kubelet"]) == [] and mounts_under(node_tree["state"]) == []
