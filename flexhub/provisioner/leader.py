"""Leader election on a coordination.k8s.io Lease, after client-go's leaderelection.

Only the holder of the Lease provisions; the others wait. The holder renews every
``retry`` seconds; a candidate takes the Lease over once its renewTime is ``duration``
seconds old by the candidate's clock. Every write carries the resourceVersion read just
before, so two candidates can never both win one round.

Stricter than client-go about late answers: a renewal counts from its stamp (taken before
its read), not from when the API server answered it. Once the last renewal confirmed in
time was stamped ``renew_deadline`` seconds ago, a candidate whose clock runs
``duration - renew_deadline`` ahead may take the Lease; from then on the holder pauses its
work (``leading`` cleared) while a renewal is pending, resumes when that renewal is
confirmed within ``renew_deadline`` of its own stamp, and otherwise exits at once
(``on_lost``), as client-go's provisioners do when they lose the lead. flexhub's
correctness does not rest on this (PV names and storage are derived from the claim's uid);
the election only keeps the work in one place.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

LOG = logging.getLogger(__name__)

__all__ = ["LeaseElector"]


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


class LeaseElector:
    def __init__(
        self,
        api: Any,
        namespace: str,
        name: str,
        identity: str,
        duration: float = 15,
        renew_deadline: float = 10,
        retry: float = 2,
        on_lost: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        from kubernetes import client

        self.leases = client.CoordinationV1Api(api)
        self.namespace, self.name, self.identity = namespace, name, identity
        self.duration, self.renew_deadline, self.retry = duration, renew_deadline, retry
        self.on_lost, self.clock = on_lost, clock
        self.leading = threading.Event()
        self.stamped = clock()  # the stamp (start) of the last round confirmed in time

    def _try(self) -> bool:
        """One round: create, renew or take over the Lease; True when we hold it now."""
        from kubernetes import client
        from kubernetes.client.rest import ApiException

        now = _now()
        try:
            lease = self.leases.read_namespaced_lease(
                self.name, self.namespace, _request_timeout=10
            )
        except ApiException as exc:
            if exc.status != 404:
                raise
            body = client.V1Lease(
                metadata=client.V1ObjectMeta(name=self.name, namespace=self.namespace),
                spec=client.V1LeaseSpec(
                    holder_identity=self.identity,
                    lease_duration_seconds=int(self.duration),
                    acquire_time=now,
                    renew_time=now,
                    lease_transitions=0,
                ),
            )
            try:
                self.leases.create_namespaced_lease(self.namespace, body, _request_timeout=10)
            except ApiException as created:
                if created.status == 409:
                    return False
                raise
            return True
        spec = lease.spec
        holder = spec.holder_identity or ""
        renewed = spec.renew_time or spec.acquire_time
        duration = spec.lease_duration_seconds or self.duration
        expired = renewed is None or (now - renewed).total_seconds() > duration
        if holder != self.identity and holder and not expired:
            return False
        if holder != self.identity:
            spec.holder_identity = self.identity
            spec.acquire_time = now
            spec.lease_transitions = (spec.lease_transitions or 0) + 1
        spec.renew_time = now
        spec.lease_duration_seconds = int(self.duration)
        try:  # the read's resourceVersion makes this a compare-and-swap
            self.leases.replace_namespaced_lease(
                self.name, self.namespace, lease, _request_timeout=10
            )
        except ApiException as exc:
            if exc.status == 409:
                return False
            raise
        return True

    def _round(self, last: float) -> bool | None:
        """One :meth:`_try` while leading, on a Lease last confirmed with the stamp ``last``:
        its answer, or None when it has not answered within ``renew_deadline`` of its own
        start. Past ``last + renew_deadline`` with no answer yet, the lead pauses (``leading``
        cleared: the controller defers its work) until the answer comes. A request the API
        server holds on to (each call may take 10 s) is not waited for past the round's own
        deadline; left running, it ends with the process, which is giving up anyway."""
        started = self.clock()
        answer: list[bool | Exception] = []

        def run() -> None:
            try:
                answer.append(self._try())
            except Exception as exc:
                answer.append(exc)

        worker = threading.Thread(target=run, name="lease-renewal", daemon=True)
        worker.start()
        worker.join(max(last + self.renew_deadline - self.clock(), 0.0))
        if not answer and self.leading.is_set():
            LOG.warning("lease %s/%s: renewal pending at the renew deadline: pausing until "
                        "it answers", self.namespace, self.name)  # fmt: skip
            self.leading.clear()
            worker.join(max(started + self.renew_deadline - self.clock(), 0.0))
        if not answer:
            return None
        if isinstance(answer[0], Exception):
            raise answer[0]
        return answer[0]

    def acquire(self, stop: threading.Event) -> bool:
        """Block until we lead (True) or ``stop`` is set (False).

        A take-over or renewal answered past the renew deadline is not trusted: the Lease is
        left alone for a lease duration (so another candidate can take it) before trying
        again, instead of leading on a Lease others may judge expired."""
        LOG.info("waiting for the lease %s/%s as %s", self.namespace, self.name, self.identity)
        while not stop.is_set():
            started = self.clock()
            wait = self.retry
            try:
                if self._try():
                    if self.clock() - started < self.renew_deadline:
                        LOG.info("leading (lease %s/%s)", self.namespace, self.name)
                        self.stamped = started
                        self.leading.set()
                        return True
                    LOG.warning("lease %s/%s: held, but the answer came past the renew "
                                "deadline; leaving it for %.0f s", self.namespace, self.name,
                                self.duration)  # fmt: skip
                    wait = self.duration
            except Exception as exc:
                LOG.warning("lease %s/%s: %s", self.namespace, self.name, exc)
            stop.wait(wait)
        return False

    def keep(self, stop: threading.Event) -> None:
        """Renew until ``stop``. A renewal counts from its stamp, taken before its read, not
        from its answer: once the last confirmed stamp is ``renew_deadline`` seconds old, a
        candidate whose clock runs ahead may judge the Lease expired. So the lead pauses then
        while a renewal is pending, and resumes when it is confirmed within ``renew_deadline``
        of its own stamp. ``on_lost`` (`flexhub provisioner` passes an exit) is called when
        another instance holds the Lease, when a renewal has no answer within that time or
        answers later, and when a renewal fails with the last confirmed stamp past it."""
        # a round starts a retry after the last, or when the last stamp's deadline comes
        # (the round pauses the lead then), whichever is first
        while not stop.wait(
            min(self.retry, max(self.stamped + self.renew_deadline - self.clock(), 0.0))
        ):
            started = self.clock()
            reason = ""
            try:
                held = self._round(self.stamped)
                if held is None:
                    reason = "no answer to a renewal within the renew deadline"
                elif not held:
                    reason = "taken by another instance"
                elif self.clock() - started >= self.renew_deadline:
                    reason = "a renewal answered past the renew deadline"
                else:
                    self.stamped = started
                    if not self.leading.is_set():
                        LOG.info("lease %s/%s renewed: leading again", self.namespace, self.name)
                        self.leading.set()
            except Exception as exc:
                LOG.warning("renewing lease %s/%s: %s", self.namespace, self.name, exc)
                late = self.clock() - self.stamped
                if late >= self.renew_deadline:
                    reason = f"no renewal confirmed since the stamp {late:.1f} s ago"
            if reason:
                LOG.error("lease %s/%s: %s (renew deadline %.0f s)", self.namespace, self.name,
                          reason, self.renew_deadline)  # fmt: skip
                self._lose()
                return

    def _lose(self) -> None:
        self.leading.clear()
        LOG.error("lost the lease %s/%s: exiting", self.namespace, self.name)
        if self.on_lost is not None:
            self.on_lost()
