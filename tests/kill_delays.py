"""When a crash test kills a volume's first mount inside its mkfs window (the host's loopfile
test and the VM's iSCSI one): one random point in each slice of the window, then, only while
no kill has landed in mkfs yet, as many more in the window's first half. Under load, or on a
machine faster than when the window was measured, finding mkfs in the process tree lags and
a late kill misses it."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator


def kill_delays(
    rng: random.Random, window: float, rounds: int, landed: Callable[[], bool]
) -> Iterator[tuple[int, float]]:
    """``(round, seconds)`` for each kill; ``landed`` says whether one has hit mkfs yet."""
    for n in range(2 * rounds):
        if n >= rounds and landed():
            return
        if n < rounds:
            yield n, (n + rng.random()) * window / rounds
        else:
            yield n, rng.random() * window / 2
