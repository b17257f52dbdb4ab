"""The leader's renew deadline, as units over a recorded Lease API and a fake clock.

A real API server cannot be made to answer a renewal late on demand; the control-plane tier
runs the same elector against the real server (tests/cluster/test_leader.py). What these
pin: a holder trusts a renewal only from the moment it stamped it, so a renewal that lands
but answers after the renew deadline counts as lost (another candidate may have taken the
Lease over on the stamp's age meanwhile), and failures are counted from the last renewal's
stamp, not from when its answer came.
"""

from __future__ import annotations

import copy
import datetime
import threading
from typing import Any

import pytest

pytest.importorskip("kubernetes")

from kubernetes import client

from flexhub.provisioner.leader import LeaseElector


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Leases:
    """One Lease held by ``identity``. Each call takes the next queued answer: the seconds
    the API took (the clock moves on by them), then the exception it raised, if any. Past
    the queue every call fails after ``then`` seconds."""

    def __init__(self, clock: Clock, identity: str, answers: list[tuple[float, bool]]) -> None:
        self.clock = clock
        now = datetime.datetime.now(datetime.UTC)
        self.lease = client.V1Lease(
            metadata=client.V1ObjectMeta(name="l", namespace="ns", resource_version="1"),
            spec=client.V1LeaseSpec(
                holder_identity=identity,
                lease_duration_seconds=15,
                acquire_time=now,
                renew_time=now,
                lease_transitions=0,
            ),
        )
        self.answers = list(answers)
        self.then = 1.0
        self.replaced = 0

    def _answer(self) -> None:
        seconds, fails = self.answers.pop(0) if self.answers else (self.then, True)
        self.clock.now += seconds
        if fails:
            raise client.ApiException(status=500, reason="Internal Server Error")

    def read_namespaced_lease(self, name: str, namespace: str, **_: Any) -> Any:
        self._answer()
        return copy.deepcopy(self.lease)

    def replace_namespaced_lease(self, name: str, namespace: str, body: Any, **_: Any) -> Any:
        self._answer()
        self.replaced += 1
        self.lease = copy.deepcopy(body)
        return body


def _keep(
    answers: list[tuple[float, bool]], rounds: int | None
) -> tuple[LeaseElector, Leases, list[float]]:
    """Run ``keep`` over ``answers`` until it gives up or ``rounds`` renewals have landed;
    returns the elector, the API and the clock's readings when ``on_lost`` was called."""
    clock = Clock()
    lost: list[float] = []
    elector = LeaseElector(
        client.ApiClient(), "ns", "l", "me", renew_deadline=10, retry=0,
        on_lost=lambda: lost.append(clock.now), clock=clock,
    )  # fmt: skip
    leases = Leases(clock, "me", answers)
    elector.leases = leases
    elector.leading.set()
    stop = threading.Event()
    real = leases.replace_namespaced_lease

    def counted(*args: Any, **kwargs: Any) -> Any:
        try:
            return real(*args, **kwargs)
        finally:
            if (rounds is not None and leases.replaced >= rounds) or clock.now > 1000:
                stop.set()

    leases.replace_namespaced_lease = counted  # type: ignore[method-assign]
    worker = threading.Thread(target=elector.keep, args=(stop,), daemon=True)
    worker.start()
    worker.join(10)
    assert not worker.is_alive(), "keep() did not return"
    return elector, leases, lost


def test_renewals_answered_in_time_keep_the_lead() -> None:
    """Five rounds of 9 s each (read 4 s, replace 5 s): each within the deadline."""
    elector, leases, lost = _keep([(4.0, False), (5.0, False)] * 5, rounds=5)
    assert leases.replaced == 5
    assert lost == [] and elector.leading.is_set()


def test_a_renewal_answered_after_the_deadline_loses_the_lead() -> None:
    """The read answers at once, the replace after 11 s: the write landed with the round's
    stamp, so by the time the answer comes the stamp is older than the renew deadline and
    another candidate may already hold the Lease. The holder stops at once."""
    elector, leases, lost = _keep([(0.0, False), (11.0, False)], rounds=None)
    assert leases.replaced == 1
    assert lost == [111.0]
    assert not elector.leading.is_set()


def test_failures_count_from_the_last_stamp_not_from_its_late_answer() -> None:
    """A renewal stamped at 100 answers at 109 (in time); then every read fails after 1 s.
    The deadline runs out 10 s after the stamp (at 110), not 10 s after the answer (119):
    the holder gives up at the first failure that reaches it."""
    elector, leases, lost = _keep([(0.0, False), (9.0, False)], rounds=None)
    assert leases.replaced == 1
    assert lost == [110.0]
    assert not elector.leading.is_set()


def test_a_lease_taken_with_an_answer_past_the_deadline_is_taken_again_before_leading() -> None:
    """The same rule when acquiring: a take-over that answers 11 s after its stamp is not
    trusted (the provisioner would start work on a Lease others may judge expired); the next
    round, answered in time, leads, and its stamp is where ``keep`` counts from."""
    clock = Clock()
    elector = LeaseElector(
        client.ApiClient(), "ns", "l", "me", renew_deadline=10, retry=0, clock=clock
    )
    leases = Leases(clock, "someone-expired", [(0.0, False), (11.0, False), (1.0, False),
                                               (1.0, False)])  # fmt: skip
    leases.lease.spec.renew_time -= datetime.timedelta(seconds=60)
    elector.leases = leases
    assert elector.acquire(threading.Event())
    assert leases.replaced == 2
    assert elector.leading.is_set()
    assert elector.stamped == 111.0
    assert leases.lease.spec.holder_identity == "me"
