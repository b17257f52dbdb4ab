"""The deadline of one kubelet call: no call, and so no lock, outlives ``call_timeout``.

kubelet gives ``mount`` and ``unmount`` no timeout: a call that never returns blocks that
volume for ever. Each step of flexhub is bounded (locks, commands, the reap of a killed
command), but their sum can be long; the call as a whole gets ``call_timeout``:

1. At ``call_timeout`` a ``SIGALRM`` raises :class:`~flexhub.errors.CallTimeout` in the main
   thread. It interrupts a wait for a lock or a command (the command's group is killed); the
   call unwinds like any failure: rollback, locks released, a Failure reply.
2. If the call has not finished ``grace`` seconds later (its main thread is stuck where no
   signal handler runs), a watchdog thread calls ``expire``, which answers and exits the
   process: the kernel then drops every lock the call held.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

from flexhub.errors import CallTimeout

__all__ = ["call_deadline"]


@contextmanager
def call_deadline(
    seconds: float, grace: float, what: str, expire: Callable[[], None]
) -> Iterator[None]:
    """Bound the ``with`` block (run in the main thread) to ``seconds``; see the module.

    :param what: the call, for the message (``"mount"``).
    :param expire: called from a watchdog thread ``grace`` seconds after the deadline if the
        block is still running; it must end the process (``os._exit``).
    """
    done = threading.Event()

    def alarm(signum: int, frame: FrameType | None) -> None:
        if not done.is_set():
            raise CallTimeout(
                f"{what} ran past call_timeout ({seconds:g}s): stopped, undone where it "
                "could be and its locks released; the next call finishes or undoes the rest"
            )

    def watchdog() -> None:
        if not done.wait(seconds + grace):
            expire()

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    guard = threading.Thread(target=watchdog, name="flexhub-deadline", daemon=True)
    guard.start()
    try:
        yield
    finally:
        done.set()
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
