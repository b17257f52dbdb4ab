"""The reservation of a fenced LUN is given up only after the LUN's writes are flushed: a
release that waits (a flush that does not finish) keeps it held, so no other node writes
before this node's queued writes are in or failed.

Against the fake persistent-reservation target of ``test_reservation`` (the order of a flush
and a PR OUT command is logic no real system here shows on demand: a flush that hangs needs a
target that takes writes and never completes them).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from flexhub_iscsi import IscsiBackend

from flexhub.backend import CommandTimeout, ReleaseDeferred
from flexhub.node.runner import Result

from .conftest import FakePR
from .test_reservation import key, make_node, runner, volume


@pytest.fixture
def a(tmp_path: Path, pr: FakePR) -> IscsiBackend:
    return make_node(tmp_path / "a", pr)


@pytest.fixture
def pr() -> FakePR:
    return FakePR()


def test_a_flush_that_waits_keeps_the_reservation(a: IscsiBackend, pr: FakePR) -> None:
    attachment = a.attach(volume())
    assert pr.holder is not None and set(pr.registered.values()) == {key(a)}

    def hang(args: tuple[str, ...]) -> Result:
        raise CommandTimeout(f"{' '.join(args)} timed out after 60s and was killed")

    runner(a).answers.append((("blockdev",), hang))  # type: ignore[arg-type]
    with pytest.raises(ReleaseDeferred):
        a.detach(attachment)
    assert pr.holder is not None and pr.holder[1] == key(a)  # still fenced
    assert set(pr.registered.values()) == {key(a)}
    assert len(a.sysfs.sessions()) == 1

    runner(a).answers.pop()  # the target answers again: the retry releases everything
    a.detach(attachment)
    assert pr.holder is None and pr.registered == {}
    assert a.sysfs.sessions() == []


def test_the_key_is_unregistered_after_the_flush_before_the_disks_go(
    a: IscsiBackend, pr: FakePR
) -> None:
    attachment = a.attach(volume())
    calls = runner(a).calls
    start = len(calls)
    a.detach(attachment)
    done = [" ".join(c[:2]) for c in calls[start:]]
    flush = done.index("blockdev --flushbufs")
    unregister = next(
        i for i, c in enumerate(calls[start:]) if c[0] == "sg_persist" and "--out" in c
    )
    assert flush < unregister, done
    assert a.sysfs.deleted == [attachment.device.rsplit("/", 1)[-1]]  # type: ignore[attr-defined]
    assert pr.holder is None and pr.registered == {}
