"""The provisioner's work queue and list/watch loop, as units.

The list/watch tests feed ``watch_forever`` a recorded list function and event stream (a
fake: a real API server cannot be made to answer 410 on demand); the control-plane tier runs
the same loop against the real server (tests/cluster/test_provisioner.py).
"""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

from flexhub.provisioner.queue import MAX_RETRY, WorkQueue, watch_forever


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_key_is_queued_once_and_comes_when_due() -> None:
    clock = Clock()
    queue = WorkQueue(clock)
    queue.add("a", 5)
    queue.add("a", 10)  # later: the earlier due time stands
    queue.add("b")
    assert len(queue) == 2
    assert queue.get(timeout=0) == "b"
    assert queue.get(timeout=0) is None
    clock.now = 5
    assert queue.get(timeout=0) == "a"
    assert len(queue) == 0


def test_failures_back_off_exponentially_up_to_a_cap_and_forget_resets() -> None:
    queue = WorkQueue(Clock())
    delays = [queue.retry("k") for _ in range(12)]
    assert delays[:4] == [1.0, 2.0, 4.0, 8.0]
    assert delays[-1] == MAX_RETRY
    queue.forget("k")
    assert queue.retry("k") == 1.0


def _listed(names: list[str], version: str) -> Any:
    items = [SimpleNamespace(metadata=SimpleNamespace(name=n)) for n in names]
    return SimpleNamespace(items=items, metadata=SimpleNamespace(resource_version=version))


def test_a_watch_answering_410_relists_and_one_that_ends_is_renewed_from_its_version() -> None:
    """Nothing is dropped: after a 410 (resourceVersion too old) the loop lists again and
    queues every object it lists, then watches from the new list's resourceVersion. A watch
    that just ends (the server's timeout, every few minutes) is renewed from the last
    resourceVersion it saw, bookmarks included, without a list: a quiet cluster costs one
    request per watch period, not a relist of every object."""
    stop = threading.Event()
    lists = [_listed(["a"], "1"), _listed(["a", "b"], "7")]
    watched_from: list[str] = []
    seen: list[str] = []
    listed = 0

    def list_fn(**_: Any) -> Any:
        nonlocal listed
        listed += 1
        return lists.pop(0)

    def stream(_fn: Any, resource_version: str, **_: Any) -> Any:
        watched_from.append(resource_version)
        if resource_version == "1":
            yield {"type": "ADDED", "object": {"metadata": {"name": "b", "resourceVersion": "5"}}}
            yield {"type": "ERROR", "raw_object": {"code": 410, "message": "too old"}}
        elif resource_version == "7":
            yield {
                "type": "MODIFIED",
                "object": {"metadata": {"name": "x", "resourceVersion": "8"}},
            }
            return  # the server closed the watch
        elif resource_version == "8":
            yield {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "9"}}}
            return
        else:
            stop.set()
            yield {"type": "MODIFIED", "object": {"metadata": {"name": "c"}}}

    def key_of(obj: Any) -> str:
        return obj["metadata"]["name"] if isinstance(obj, dict) else obj.metadata.name

    watch_forever(list_fn, lambda key, _e: seen.append(key), key_of, stop, "test", stream=stream)
    assert watched_from == ["1", "7", "8", "9"]
    assert listed == 2
    assert seen == ["a", "b", "a", "b", "x"]  # "c" came after the stop


def test_a_relist_never_pulls_a_key_out_of_its_backoff() -> None:
    """What a list queues (``add_listed``) leaves a key that waits out its backoff where it
    is; a key not queued is queued now."""
    clock = Clock()
    queue = WorkQueue(clock)
    queue.add("k")
    assert queue.get(timeout=0) == "k"
    queue.retry("k")
    queue.retry("k")  # a second failure meanwhile: 2 s
    queue.done("k")
    queue.add_listed("k")
    queue.add_listed("fresh")
    assert queue.get(timeout=0) == "fresh"
    assert queue.get(timeout=0) is None  # "k" still waits
    clock.now = 2
    assert queue.get(timeout=0) == "k"


def test_a_key_is_never_handed_to_two_workers_at_once() -> None:
    """Added again while a worker holds it, a key waits for that worker's ``done``."""
    clock = Clock()
    queue = WorkQueue(clock)
    queue.add("k")
    queue.add("other")
    assert queue.get(timeout=0) == "k"
    queue.add("k")  # a watch event while it is being synced
    assert queue.get(timeout=0) == "other"
    assert queue.get(timeout=0) is None
    queue.done("k")
    assert queue.get(timeout=0) == "k"


def test_the_node_agent_queues_only_this_nodes_pvs() -> None:
    """Every node watches every PV: only flexhub's node-reclaimed PVs of this node become
    work (no request is made for the others)."""
    import json as _json

    from flexhub.provisioner.nodeagent import NodeAgent

    agent = NodeAgent.__new__(NodeAgent)
    agent.node, agent.name = "n1", "flexhub"

    def pv(node: str, by: str = "flexhub", where: str = "node") -> dict[str, Any]:
        record = _json.dumps({"backend": "loopfile", "node": node, "reclaimOn": where})
        return {
            "metadata": {
                "name": f"pv-{node}-{by}-{where}",
                "annotations": {"pv.kubernetes.io/provisioned-by": by, "flexhub/reclaim": record},
            }
        }

    assert agent._key_if_mine(pv("n1")) == "pv-n1-flexhub-node"
    assert agent._key_if_mine(pv("n2")) == ""
    assert agent._key_if_mine(pv("n1", by="other")) == ""
    assert agent._key_if_mine(pv("n1", where="provisioner")) == ""
    assert agent._key_if_mine({"metadata": {"name": "plain", "annotations": None}}) == ""
    broken = pv("n1")
    broken["metadata"]["annotations"]["flexhub/reclaim"] = "{not json"
    assert agent._key_if_mine(broken) == ""
