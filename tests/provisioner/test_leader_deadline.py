"""The leader's renew deadline, as units over a recorded Lease API (fake clock, and real time
scaled down where a request must hang).

A real API server cannot be made to fail or hang a renewal on demand; the control-plane tier
runs the same elector against the real server (tests/cluster/test_leader.py). What these
pin, as client-go's leaderelection does it: a renewal is retried every ``retry`` seconds
for up to ``renew_deadline`` from its first attempt, so one failed request is not fatal and
slow but successful rounds keep the lead; a request still pending at that deadline is not
waited for; another holder in the Lease ends the lead at once; a write that meets a changed
Lease (HTTP 409, also our own request sent again by the HTTP client) is read again, not
taken for another holder.
"""

from __future__ import annotations

import copy
import datetime
import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("kubernetes")

from kubernetes import client

from flexhub.provisioner.leader import LeaseElector

#: Fake seconds after which a test's API stops answering (a run gone wrong ends, not spins).
BUDGET = 1000.0


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Leases:
    """One Lease held by ``holder``. Each call takes the next queued answer: the seconds
    the API took (the fake clock moves on by them) and the HTTP status it then failed with
    (0: it succeeded). Past the queue every call fails (500) after 1 s; past :data:`BUDGET`
    every call sets ``stop`` and fails."""

    def __init__(self, clock: Clock, holder: str, answers: list[tuple[float, int]]) -> None:
        self.clock = clock
        now = datetime.datetime.now(datetime.UTC)
        self.lease = client.V1Lease(
            metadata=client.V1ObjectMeta(name="l", namespace="ns", resource_version="1"),
            spec=client.V1LeaseSpec(
                holder_identity=holder,
                lease_duration_seconds=15,
                acquire_time=now,
                renew_time=now,
                lease_transitions=0,
            ),
        )
        self.answers = list(answers)
        self.replaced = 0
        self.stop = threading.Event()
        self.rounds: int | None = None  # set stop once this many replaces have landed

    def _answer(self) -> None:
        seconds, status = self.answers.pop(0) if self.answers else (1.0, 500)
        self.clock.now += seconds
        if self.clock.now > BUDGET:
            self.stop.set()
            status = 500
        if status:
            raise client.ApiException(status=status, reason="refused")

    def read_namespaced_lease(self, name: str, namespace: str, **_: Any) -> Any:
        self._answer()
        return copy.deepcopy(self.lease)

    def replace_namespaced_lease(self, name: str, namespace: str, body: Any, **_: Any) -> Any:
        self._answer()
        self.replaced += 1
        self.lease = copy.deepcopy(body)
        if self.rounds is not None and self.replaced >= self.rounds:
            self.stop.set()
        return body


def _elector(clock: Callable[[], float]) -> tuple[LeaseElector, list[float]]:
    lost: list[float] = []
    elector = LeaseElector(
        client.ApiClient(), "ns", "l", "me", renew_deadline=10, retry=0,
        on_lost=lambda: lost.append(clock()), clock=clock,
    )  # fmt: skip
    return elector, lost


def _bounded(target: Callable[[], Any], stop: threading.Event, seconds: float = 10) -> list[Any]:
    """Run ``target`` in a thread for at most ``seconds``; its return value (or exception)
    in a list. A run that goes on is stopped (``stop`` set) before the test fails."""
    result: list[Any] = []

    def run() -> None:
        try:
            result.append(target())
        except Exception as exc:
            result.append(exc)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        stop.set()
        worker.join(5)
        pytest.fail("did not return in time")
    return result


def _keep(
    answers: list[tuple[float, int]], rounds: int | None, holder: str = "me"
) -> tuple[LeaseElector, Leases, list[float]]:
    """Run ``keep`` over ``answers`` (fake clock, ``retry`` 0) until it gives up or
    ``rounds`` renewals have landed; returns the elector, the API and the clock's readings
    when ``on_lost`` was called."""
    clock = Clock()
    elector, lost = _elector(clock)
    leases = Leases(clock, holder, answers)
    leases.rounds = rounds
    elector.leases = leases
    elector.leading.set()
    _bounded(lambda: elector.keep(leases.stop), leases.stop)
    return elector, leases, lost


def test_renewals_answered_within_the_deadline_keep_the_lead() -> None:
    """Five rounds of 9 s each (read 4 s, replace 5 s): each within the deadline."""
    elector, leases, lost = _keep([(4.0, 0), (5.0, 0)] * 5, rounds=5)
    assert leases.replaced == 5
    assert lost == [] and elector.leading.is_set()


def test_a_failed_request_is_retried_within_the_deadline() -> None:
    """A read refused (500) and one that found the Lease changed under our write (409: our
    own PUT sent again after its answer was lost, as the HTTP client does) are tried again;
    the renewals then succeed and the lead goes on."""
    answers = [(1.0, 500), (1.0, 0), (1.0, 409), (1.0, 0), (1.0, 0), (1.0, 0), (1.0, 0)]
    elector, leases, lost = _keep(answers, rounds=2)
    assert leases.replaced == 2
    assert lost == [] and elector.leading.is_set()


def test_a_renewal_failing_for_the_renew_deadline_loses_the_lead() -> None:
    """A renewal at 100 answers at 109; the next starts then and every request fails after
    1 s: the holder gives up at 119, the deadline of that renewal's first attempt."""
    elector, leases, lost = _keep([(0.0, 0), (9.0, 0)], rounds=None)
    assert leases.replaced == 1
    assert lost == [119.0]
    assert not elector.leading.is_set()


def test_another_holder_ends_the_lead_at_once() -> None:
    """The Lease names another, live holder: no write, and the lead ends at the first
    read that sees it, not at the deadline."""
    elector, leases, lost = _keep([(1.0, 0)], rounds=None, holder="another")
    assert leases.replaced == 0
    assert lost == [101.0]
    assert not elector.leading.is_set()


def test_an_error_from_on_lost_ends_keep() -> None:
    """``on_lost`` is called once; what it raises leaves ``keep``, not taken for a failed
    renewal and retried."""
    clock = Clock()
    calls: list[float] = []

    def on_lost() -> None:
        calls.append(clock())
        raise RuntimeError("on_lost failed")

    elector = LeaseElector(
        client.ApiClient(), "ns", "l", "me", renew_deadline=10, retry=0, on_lost=on_lost,
        clock=clock,
    )  # fmt: skip
    leases = Leases(clock, "another", [(1.0, 0)])
    elector.leases = leases
    (result,) = _bounded(lambda: elector.keep(leases.stop), leases.stop)
    assert isinstance(result, RuntimeError)
    assert calls == [101.0]


def _acquire(answers: list[tuple[float, int]], holder: str) -> tuple[LeaseElector, Leases, Any]:
    clock = Clock()
    elector, _ = _elector(clock)
    leases = Leases(clock, holder, answers)
    leases.lease.spec.renew_time -= datetime.timedelta(seconds=60)  # expired
    elector.leases = leases
    (result,) = _bounded(lambda: elector.acquire(leases.stop), leases.stop)
    return elector, leases, result


def test_acquire_takes_an_expired_lease_after_a_failed_round_and_a_conflict() -> None:
    """A failed read (500) is retried, and so is a write another candidate beat (409); the
    next round takes the expired Lease."""
    answers = [(1.0, 500), (1.0, 0), (1.0, 409), (1.0, 0), (1.0, 0)]
    elector, leases, result = _acquire(answers, "gone")
    assert result is True
    assert elector.leading.is_set()
    assert leases.replaced == 1
    assert leases.lease.spec.holder_identity == "me"
    assert leases.lease.spec.lease_transitions == 1


class Timed(Leases):
    """Calls in real time: each takes the next of ``steps`` (seconds, then the HTTP status
    it fails with, 0: it succeeds), past them ``then``. ``sent`` holds when each began,
    from ``begun``."""

    def __init__(self, steps: list[tuple[float, int]], then: tuple[float, int]) -> None:
        super().__init__(Clock(), "me", [])
        self.steps, self.then, self.sent = list(steps), then, []
        self.begun = time.monotonic()

    def _answer(self) -> None:
        self.sent.append(time.monotonic() - self.begun)
        seconds, status = self.steps.pop(0) if self.steps else self.then
        time.sleep(seconds)
        if status:
            raise client.ApiException(status=status, reason="refused")


def _scaled(leases: Timed, deadline: float) -> tuple[LeaseElector, list[float]]:
    """An elector over ``leases`` in real time, scaled by ``deadline / 10`` (retry
    ``deadline / 5``), and the times its ``on_lost`` was called."""
    elector, lost = _elector(time.monotonic)
    elector.renew_deadline, elector.retry = deadline, deadline / 5
    elector.leases = leases
    return elector, lost


def _real(
    steps: list[tuple[float, int]], then: tuple[float, int], run_for: float
) -> tuple[Timed, list[float], float]:
    """``keep`` in real time, scaled by a fifth (deadline 2 s, retry 0.4 s), for ``run_for``
    seconds or until it gives up; returns the API, the times ``on_lost`` was called and when
    ``keep`` began."""
    leases = Timed(steps, then)
    elector, lost = _scaled(leases, 2.0)
    elector.leading.set()
    stopper = threading.Timer(run_for, leases.stop.set)
    stopper.start()
    begun = time.monotonic()
    try:
        _bounded(lambda: elector.keep(leases.stop), leases.stop, seconds=run_for + 5)
    finally:
        stopper.cancel()
        leases.stop.set()
    return leases, lost, begun


def test_a_leader_whose_renewals_take_6_s_keeps_leading() -> None:
    """Every request takes 0.6 s (a round of 6 s unscaled, on a loaded machine): each
    renewal succeeds within the deadline, so the leader goes on."""
    leases, lost, _ = _real([], (0.6, 0), run_for=5.0)
    assert lost == []
    assert leases.replaced >= 2


def test_a_request_still_pending_at_the_deadline_is_not_waited_for() -> None:
    """The API server holds the read (each attempt may take 10 s, and the HTTP client tries
    a request up to four times): the holder gives up at the renewal's deadline, 2 s after
    its first attempt (itself a retry, 0.4 s, after ``keep`` began), the request still
    pending."""
    leases, lost, begun = _real([(30.0, 0)], (0.01, 0), run_for=6.0)
    assert len(lost) == 1
    assert 2.4 - 0.05 <= lost[0] - begun < 2.4 + 0.5, lost[0] - begun
    assert leases.replaced == 0


def _scripted(
    script: list[tuple[float, int]], stop_at: float | None = None, deadline: float = 4.0
) -> tuple[Timed, str]:
    """``_renew`` once in real time, scaled by ``deadline / 10`` (retry ``deadline / 5``;
    scaled less than the others: a loaded machine's thread switches would blur the attempts'
    spacing); returns the API and the reason given ("" renewed or stopped)."""
    leases = Timed(script, then=(30.0, 0))  # past the script, a request hangs
    elector, lost = _scaled(leases, deadline)
    if stop_at is not None:
        threading.Timer(stop_at, leases.stop.set).start()
    leases.begun = time.monotonic()
    (reason,) = _bounded(lambda: elector._renew(leases.stop), leases.stop, seconds=8)
    assert lost == []  # _renew only says why; keep() calls on_lost
    return leases, reason


def _a_retry_apart(sent: list[float], count: int) -> None:
    """``count`` attempts, each a retry (0.8 s) after the last one's start (0.1 s early and
    0.3 s late of slack: each is recorded by its own thread, started on a loaded machine),
    the first at once."""
    gaps = [later - earlier for earlier, later in itertools.pairwise(sent)]
    assert len(sent) == count and sent[0] < 0.3, sent
    assert all(0.8 - 0.1 <= gap < 0.8 + 0.3 for gap in gaps), sent


def test_a_retry_still_pending_at_the_deadline_is_not_waited_for() -> None:
    """Three requests refused at once, a retry apart, then one that hangs: the renewal gives
    up at its deadline, 4 s after its first attempt, not a whole attempt's bound later."""
    leases, reason = _scripted([(0.0, 500)] * 3)
    assert reason == "a renewal still pending at the renew deadline"
    _a_retry_apart(leases.sent, 4)
    assert 4.0 - 0.01 <= time.monotonic() - leases.begun < 4.0 + 0.5


def test_refused_renewals_say_so_and_send_nothing_at_the_deadline() -> None:
    """Every request refused (403, the RoleBinding gone), the first four after 0.5 s:
    attempts a retry apart from one's start to the next's (a slow refusal does not push the
    next one back), none sent at the deadline itself, and the reason says refused, not
    pending (the last refusal quick, so a late fifth attempt still answers in time)."""
    leases, reason = _scripted([(0.5, 403)] * 4 + [(0.0, 403)] * 6)
    assert reason == "not renewed within the renew deadline"
    _a_retry_apart(leases.sent, 5)
    assert 4.0 - 0.01 <= time.monotonic() - leases.begun < 4.0 + 0.5


def test_a_409_is_read_again_at_once() -> None:
    """The write meets a changed Lease (409): the next read follows at once, not a retry
    later, so another holder is seen as soon as it is there; here the Lease is still ours
    (our own request sent again) and the renewal succeeds."""
    leases, reason = _scripted([(0.0, 0), (0.0, 409), (0.0, 0), (0.0, 0)])
    assert reason == ""
    assert len(leases.sent) == 4 and leases.sent[2] - leases.sent[1] < 0.5, leases.sent
    assert leases.replaced == 1


def test_stop_while_a_request_is_pending_is_not_a_lost_lease() -> None:
    """A shutdown (``stop``) while a request hangs: the renewal ends at its deadline
    without calling the Lease lost (``flexhub provisioner`` would exit 1 mid-shutdown)."""
    leases, reason = _scripted([], stop_at=0.5, deadline=2.0)
    assert reason == ""
    assert len(leases.sent) == 1


def test_repeated_409s_wait_a_retry_after_the_first() -> None:
    """Every write meets a changed Lease (409; a webhook answering 409 would do this): the
    first is read again at once, later ones a retry apart, not as fast as the server
    answers, until the deadline."""
    leases, reason = _scripted([(0.0, 0), (0.0, 409)] * 20)
    assert reason == "not renewed within the renew deadline"
    starts = leases.sent[0::2]  # each attempt's read
    assert 5 <= len(starts) <= 6, leases.sent
    assert starts[1] - starts[0] < 0.5, leases.sent
    assert all(later - earlier >= 0.7 for earlier, later in itertools.pairwise(starts[1:]))
