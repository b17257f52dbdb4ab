"""The leader's renew deadline, as units over a recorded Lease API and a fake clock.

A real API server cannot be made to answer a renewal late on demand; the control-plane tier
runs the same elector against the real server (tests/cluster/test_leader.py). What these
pin: a holder trusts a renewal only from the moment it stamped it, so a renewal that lands
but answers after the renew deadline counts as lost (another candidate may have taken the
Lease over on the stamp's age meanwhile); failures are counted from the last renewal's
stamp, not from when its answer came; a round still waiting for its answer at the deadline
is not waited for; another holder ends the lead at once.
"""

from __future__ import annotations

import copy
import datetime
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
    the API took (the clock moves on by them) and whether it then failed (HTTP 500). Past
    the queue every call fails after 1 s; past :data:`BUDGET` every call sets ``stop`` and
    fails."""

    def __init__(self, clock: Clock, holder: str, answers: list[tuple[float, bool]]) -> None:
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
        seconds, fails = self.answers.pop(0) if self.answers else (1.0, True)
        self.clock.now += seconds
        if self.clock.now > BUDGET:
            self.stop.set()
            fails = True
        if fails:
            raise client.ApiException(status=500, reason="Internal Server Error")

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


def _elector(clock: Callable[[], float], **kwargs: Any) -> tuple[LeaseElector, list[float]]:
    lost: list[float] = []
    elector = LeaseElector(
        client.ApiClient(), "ns", "l", "me", renew_deadline=10, retry=0,
        on_lost=lambda: lost.append(clock()), clock=clock, **kwargs,
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
    answers: list[tuple[float, bool]], rounds: int | None, holder: str = "me"
) -> tuple[LeaseElector, Leases, list[float]]:
    """Run ``keep`` over ``answers`` until it gives up or ``rounds`` renewals have landed;
    returns the elector, the API and the clock's readings when ``on_lost`` was called."""
    clock = Clock()
    elector, lost = _elector(clock)
    leases = Leases(clock, holder, answers)
    leases.rounds = rounds
    elector.leases = leases
    elector.leading.set()
    _bounded(lambda: elector.keep(leases.stop), leases.stop)
    return elector, leases, lost


def test_renewals_answered_in_time_keep_the_lead() -> None:
    """Five rounds of 9 s each (read 4 s, replace 5 s), each answered within the deadline
    of its own stamp (no wait between rounds here: ``retry`` is 0)."""
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


def test_another_holder_ends_the_lead_at_the_next_round() -> None:
    """The Lease names another, live holder: no write, and the lead ends at once, not at
    the deadline."""
    elector, leases, lost = _keep([(1.0, False)], rounds=None, holder="another")
    assert leases.replaced == 0
    assert lost == [101.0]
    assert not elector.leading.is_set()


class Slow(Leases):
    """Calls in real time: each takes the next of ``script`` (seconds, then whether it fails
    with HTTP 500), past it ``seconds`` and success. ``held`` records the lead's state at
    each answer."""

    def __init__(
        self, elector: LeaseElector, seconds: float, script: list[tuple[float, bool]]
    ) -> None:
        super().__init__(Clock(), "me", [])
        self.elector, self.seconds, self.script = elector, seconds, list(script)
        self.held: list[bool] = []

    def _answer(self) -> None:
        seconds, fails = self.script.pop(0) if self.script else (self.seconds, False)
        time.sleep(seconds)
        self.held.append(self.elector.leading.is_set())
        if fails:
            raise client.ApiException(status=500, reason="Internal Server Error")


def _real(
    seconds: float, script: list[tuple[float, bool]], run_for: float
) -> tuple[LeaseElector, Slow, list[float]]:
    """``keep`` in real time, scaled by a fifth (deadline 2 s, retry 0.4 s), for ``run_for``
    seconds or until it gives up; the Lease's last stamp 1 s old when it starts, so the
    first round starts after a retry, at 1.4 s, and the stamp's deadline comes at 2 s.
    Throughout, a watcher checks leader.py's promise: never leading on a confirmed stamp
    older than the deadline (within 0.15 s, its sampling and a thread switch)."""
    elector, lost = _elector(time.monotonic)
    elector.renew_deadline, elector.retry = 2.0, 0.4
    leases = Slow(elector, seconds, script)
    elector.leases = leases
    elector.leading.set()
    elector.stamped = time.monotonic() - 1.0
    stopper = threading.Timer(run_for, leases.stop.set)
    stopper.start()
    broken: list[float] = []

    def watch() -> None:
        while not leases.stop.wait(0.01):
            stamped = elector.stamped
            if elector.leading.is_set() and time.monotonic() - stamped >= 2.0 + 0.15:
                broken.append(time.monotonic() - stamped)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        _bounded(lambda: elector.keep(leases.stop), leases.stop, seconds=run_for + 5)
    finally:
        stopper.cancel()
        leases.stop.set()
        watcher.join(5)
    assert broken == [], f"leading on a stamp this old (s): {broken[:5]}"
    return elector, leases, lost


def test_a_renewal_pending_past_the_deadline_pauses_the_lead_until_it_answers() -> None:
    """The first read takes 1.2 s (6 s unscaled): it is pending when the last stamp turns
    2 s old (a candidate whose clock runs ahead may take the Lease from then on), so the
    lead pauses; the renewal answers within the deadline of its own stamp (0.8 s before
    it), so the lead resumes, with no exit."""
    elector, leases, lost = _real(0.01, [(1.2, False)], run_for=3.0)
    assert lost == []
    assert leases.replaced >= 3
    # the first round's read and replace answered paused, later ones leading
    assert leases.held[:2] == [False, False], leases.held
    assert True in leases.held[2:], leases.held
    assert elector.leading.is_set()


def test_a_leader_whose_renewals_take_4_s_keeps_leading() -> None:
    """Every call takes 0.42 s (a round of 4.2 s unscaled, as seen on a loaded CI machine):
    each renewal is confirmed within the deadline of its own stamp, so the leader goes on,
    pausing at most while one is pending past the last stamp's deadline."""
    elector, leases, lost = _real(0.42, [], run_for=5.0)
    assert lost == []
    assert leases.replaced >= 3
    assert elector.leading.is_set()  # the last round, confirmed, resumed the lead if paused


def test_a_failure_just_before_the_deadline_pauses_the_lead_at_it() -> None:
    """The first read fails after 0.5 s, its stamp then 1.9 s old: not yet past the
    deadline, so no exit; the next round starts when the deadline comes (not a whole retry
    later, leading past it) and pauses the lead until its renewal, quick, is confirmed."""
    elector, leases, lost = _real(0.01, [(0.5, True), (0.3, False)], run_for=3.0)
    assert lost == []
    assert leases.held[:2] == [True, False], leases.held
    assert True in leases.held[2:], leases.held
    assert elector.leading.is_set()


def test_a_round_without_an_answer_is_not_waited_for_past_its_deadline() -> None:
    """The API server holds the read (each call may take 10 s, read and write 20 s): the
    lead pauses at the last stamp's deadline and the holder gives up at the round's own
    deadline (it starts after a retry), the call still pending."""
    elector, leases, lost = _real(0.01, [(30.0, False)], run_for=6.0)
    begun = elector.stamped + 1.0
    assert len(lost) == 1
    assert 2.4 - 0.05 <= lost[0] - begun < 2.4 + 0.5, lost[0] - begun
    assert leases.replaced == 0
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
    leases = Leases(clock, "another", [(1.0, False)])
    elector.leases = leases
    (result,) = _bounded(lambda: elector.keep(leases.stop), leases.stop)
    assert isinstance(result, RuntimeError)
    assert calls == [101.0]


def _acquire(
    answers: list[tuple[float, bool]], holder: str, **kwargs: Any
) -> tuple[LeaseElector, Leases, bool]:
    clock = Clock()
    elector, _ = _elector(clock, **kwargs)
    leases = Leases(clock, holder, answers)
    leases.lease.spec.renew_time -= datetime.timedelta(seconds=60)  # expired
    elector.leases = leases
    (result,) = _bounded(lambda: elector.acquire(leases.stop), leases.stop)
    return elector, leases, result


def test_a_lease_taken_with_an_answer_past_the_deadline_is_left_alone_before_leading() -> None:
    """The same rule when acquiring: a take-over that answers 11 s after its stamp is not
    trusted (the provisioner would start work on a Lease others may judge expired). The
    candidate leaves the Lease for a lease duration, so that a quicker one can take it, then
    takes it again, answered in time, and leads; that round's stamp is where ``keep`` counts
    from."""
    waited: list[float] = []
    stop_wait = threading.Event.wait

    class Stop(threading.Event):
        def wait(self, timeout: float | None = None) -> bool:
            waited.append(timeout or 0.0)
            return stop_wait(self, 0)

    clock = Clock()
    elector, _ = _elector(clock, duration=15)
    leases = Leases(clock, "someone-expired", [(0.0, False), (11.0, False), (1.0, False),
                                               (1.0, False)])  # fmt: skip
    leases.lease.spec.renew_time -= datetime.timedelta(seconds=60)
    elector.leases = leases
    stop = Stop()
    leases.stop = stop
    (result,) = _bounded(lambda: elector.acquire(stop), stop)
    assert result is True
    assert waited == [15]
    assert leases.replaced == 2
    assert elector.leading.is_set()
    assert elector.stamped == 111.0
    assert leases.lease.spec.holder_identity == "me"


def test_acquire_takes_an_expired_lease_after_a_failed_round() -> None:
    """A failed read (HTTP 500) is retried; the next round takes the expired Lease."""
    elector, leases, result = _acquire([(1.0, True), (1.0, False), (1.0, False)], "gone")
    assert result is True
    assert leases.lease.spec.holder_identity == "me"
    assert leases.lease.spec.lease_transitions == 1
    assert elector.stamped == 101.0
