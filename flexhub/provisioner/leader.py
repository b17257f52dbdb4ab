"""Leader election on a coordination.k8s.io Lease, as client-go's leaderelection does it.

Only the holder of the Lease provisions; the others wait. The holder renews every
``retry`` seconds; a candidate takes the Lease over once its renewTime is ``duration``
seconds old by the candidate's clock. Every write carries the resourceVersion read just
before, so two candidates can never both win one round. A holder that cannot renew within
``renew_deadline`` of starting to (at most one attempt per ``retry`` seconds, a request
still pending then not waited for) has lost, and so has one that finds another holder in
the Lease: it exits at once (``on_lost``), as client-go's provisioners do, so that two
instances never both act for long. flexhub's correctness does not rest on this (PV names
and storage are derived from the claim's uid); the election only keeps the work in one place.
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


class _Conflict(Exception):
    """The Lease changed between our read and our write (HTTP 409): another candidate's
    write, or our own request sent again by the HTTP client after its answer was lost."""


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

    def _try(self) -> bool:
        """One round: create, renew or take over the Lease; True when we hold it now, False
        when another live holder does.

        :raises _Conflict: the Lease changed between the read and the write.
        """
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
                    raise _Conflict("created meanwhile") from None
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
                raise _Conflict("changed since it was read") from None
            raise
        return True

    def acquire(self, stop: threading.Event) -> bool:
        """Block until we lead (True) or ``stop`` is set (False)."""
        LOG.info("waiting for the lease %s/%s as %s", self.namespace, self.name, self.identity)
        while not stop.is_set():
            try:
                if self._try():
                    LOG.info("leading (lease %s/%s)", self.namespace, self.name)
                    self.leading.set()
                    return True
            except _Conflict:
                pass  # another candidate was quicker: read again after a retry
            except Exception as exc:
                LOG.warning("lease %s/%s: %s", self.namespace, self.name, exc)
            stop.wait(self.retry)
        return False

    def _round(self, budget: float) -> bool | None:
        """One :meth:`_try` given ``budget`` seconds: its answer, or None when it has not
        answered by then. A request the API server holds on to (each attempt may take 10 s
        and the HTTP client sends a request up to four times) is not waited for: left
        running, it ends with the process, which is giving up the Lease."""
        answer: list[bool | Exception] = []

        def run() -> None:
            try:
                answer.append(self._try())
            except Exception as exc:
                answer.append(exc)

        worker = threading.Thread(target=run, name="lease-renewal", daemon=True)
        worker.start()
        worker.join(max(budget, 0.0))
        if not answer:
            return None
        if isinstance(answer[0], Exception):
            raise answer[0]
        return answer[0]

    def _renew(self, stop: threading.Event) -> str:
        """Renew once: at most one attempt per ``retry`` seconds, from one's start to the
        next's (at once after a renewal's first 409, so that another holder is seen without
        delay), for up to ``renew_deadline`` from the first. "" when renewed or ``stop`` is
        set, else why the Lease is lost."""
        deadline = self.clock() + self.renew_deadline
        reread = False
        while True:
            attempt = self.clock()
            if deadline - attempt <= 0:
                return "not renewed within the renew deadline"
            pause = self.retry
            try:
                held = self._round(deadline - attempt)
                if held is None:
                    if stop.is_set():
                        return ""  # shutting down: not a lost Lease
                    return "a renewal still pending at the renew deadline"
                if not held:
                    return "taken by another instance"
                return ""
            except _Conflict:
                LOG.info("lease %s/%s changed since it was read: reading again",
                         self.namespace, self.name)  # fmt: skip
                pause = self.retry if reread else 0.0
                reread = True
            except Exception as exc:
                LOG.warning("renewing lease %s/%s: %s", self.namespace, self.name, exc)
            if stop.wait(max(min(attempt + pause, deadline) - self.clock(), 0.0)):
                return ""

    def keep(self, stop: threading.Event) -> None:
        """Renew every ``retry`` seconds until ``stop``. Call ``on_lost`` (`flexhub
        provisioner` passes an exit) when a renewal has not succeeded within
        ``renew_deadline`` of its first attempt, or another instance holds the Lease."""
        while not stop.wait(self.retry):
            reason = self._renew(stop)
            if reason:
                self.leading.clear()
                LOG.error("lost the lease %s/%s (%s): exiting", self.namespace, self.name,
                          reason)  # fmt: skip
                if self.on_lost is not None:
                    self.on_lost()
                return
