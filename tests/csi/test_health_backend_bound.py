"""A block backend's ``health`` that hangs (sysfs of a dying HBA, a third-party backend's bug)
costs ``NodeGetVolumeHealth`` and the health watcher what a hanging stat does: the call holds a
plugin worker one bound in all (the backend is asked beside the stats, not before them), and a
volume whose earlier backend check still hangs is answered at once, with no second thread.
Units: ``NodeService.health_of`` on a stand-in node, ``os.stat`` held for the stat side."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from flexhub.csi import node as csi_node
from flexhub.csi.node import NodeService


def _node(ask: Any) -> Any:
    """What ``health_of`` uses of a ``NodeService``: its node, its backend check and its
    mount check (every path mounted)."""
    return SimpleNamespace(
        _node=lambda: None,
        _attachment_health=ask,
        _staged_here=lambda node, path: True,
    )


def _backend_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "backend-health" and t.is_alive()}


def test_a_hanging_backend_and_a_hanging_stat_cost_one_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    release = threading.Event()
    real = os.stat

    def stuck(path: Any, *args: Any, **kwargs: Any) -> Any:
        if str(path).startswith("/dead-backend/"):
            release.wait(30)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", stuck)
    monkeypatch.setattr(csi_node, "STAT_BOUND", 1.0)
    node = _node(lambda volume_id: release.wait(30) and [])
    try:
        started = time.monotonic()
        paths = [Path("/dead-backend/stage"), Path("/dead-backend/target")]
        reply = NodeService.health_of(node, "iscsi:hung-1", paths)
        took = time.monotonic() - started
        assert [e.reason for e in reply.health_statuses] == ["StatTimeout"]
        assert took < 1.8, f"health_of held its worker {took:.1f} s for a bound of 1 s"
    finally:
        release.set()


def test_a_backend_check_still_hanging_is_answered_at_once_without_a_second_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    release = threading.Event()
    asked: list[str] = []

    def hangs(volume_id: str) -> list[Any]:
        asked.append(volume_id)
        release.wait(30)
        return []

    # a second call that asked again (or waited a bound of its own) would take 2 s: a stat of
    # "/" is well inside the rest on a loaded machine, where 0.1 s of a 0.5 s bound was not
    monkeypatch.setattr(csi_node, "STAT_BOUND", 2.0)
    node = _node(hangs)
    before = _backend_threads()
    try:
        assert list(NodeService.health_of(node, "iscsi:hung-2", [Path("/")]).health_statuses) == []
        started = time.monotonic()
        again = NodeService.health_of(node, "iscsi:hung-2", [Path("/")])
        took = time.monotonic() - started
        assert list(again.health_statuses) == []
        assert asked == ["iscsi:hung-2"], "the hung check was asked again"
        # this test's own threads (another test's, released, may end meanwhile)
        assert len(_backend_threads() - before) == 1
        assert took < 1.5, f"the second call waited {took:.1f} s on a check known to hang"
    finally:
        release.set()


def test_a_backend_s_trouble_is_one_line_in_the_reply_and_the_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A third-party backend's ``VolumeTrouble`` is only documented as one line: the core folds
    it, or its newline forges a log line of NodeGetVolumeHealth's warning and the gRPC reply."""
    from flexhub.backend import VolumeTrouble
    from flexhub.csi import health

    trouble = VolumeTrouble("degraded", "Path\nDown", "lost\nERROR flexhub: forged line\r")
    collect = health.backend_troubles(lambda: [trouble], 1.0, "volume v", "one-line-v")
    ((_, reason, message),) = collect()
    assert (reason, message) == ("Path Down", "lost ERROR flexhub: forged line")

    def broken() -> list[Any]:
        raise RuntimeError("sysfs\nERROR flexhub: forged too")

    caplog.set_level("WARNING")
    assert health.backend_troubles(broken, 1.0, "volume v", "one-line-w")() == []
    assert all("\n" not in r.getMessage() for r in caplog.records)


def test_two_callers_at_once_both_get_the_backend_s_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The kubelet's NodeGetVolumeHealth and the health watcher's round on one volume at once:
    one check of the backend, and both calls get its answer (not 'nothing known')."""
    from flexhub.backend import VolumeTrouble

    asked: list[str] = []

    def slow(volume_id: str) -> list[Any]:
        asked.append(volume_id)
        time.sleep(0.3)
        return [VolumeTrouble("degraded", "PathDown", "one path down")]

    monkeypatch.setattr(csi_node, "STAT_BOUND", 2.0)
    node = _node(slow)
    replies: list[Any] = []
    callers = [
        threading.Thread(
            target=lambda: replies.append(NodeService.health_of(node, "iscsi:both", []))
        )
        for _ in range(2)
    ]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join(10)
    assert [[e.reason for e in r.health_statuses] for r in replies] == [["PathDown"]] * 2
    assert asked == ["iscsi:both"]
