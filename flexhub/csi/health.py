"""A volume's health from this node: one bounded stat of each of its paths.

CSI v1.13 removed the alpha ``VOLUME_CONDITION`` (``volume_condition`` of
``NodeGetVolumeStats``) in favour of ``NodeGetVolumeHealth`` (node capability
``GET_VOLUME_HEALTH``): a successful reply whose ``health_statuses`` are empty for a healthy
volume and hold ``INACCESSIBLE`` entries, each with a CamelCase reason and a one-line message,
for a volume this node cannot reach:

* ``NotMounted``: a staging or publish path of the volume holds no mount (it went away).
* ``StaleMount``: its stat failed as a stale or broken mount does (``ESTALE``, ``EIO``,
  ``ENOTCONN``...: an NFS handle gone stale, a filesystem shut down after an I/O error).
* ``StatTimeout``: its stat did not answer within the bound (a hard NFS mount whose server is
  gone), or an earlier stat of it still hangs.
* ``StatFailed``: any other stat error.

Every stat runs in a thread of its own, bounded, one at a time per path (:func:`probe`); a
call probes its paths at once, so it holds a plugin worker for one bound at most, two calls
on one path at once share its stat (the health watcher beside the kubelet's calls), and a
path whose earlier stat still hangs past its bound is answered at once.
``NodeGetVolumeStats`` uses the same probe.

A block backend adds what its attachment lacks (:meth:`flexhub.backend.BlockBackend.health`,
asked beside the stats within the same bound: :func:`backend_troubles`): iSCSI's
``PathDown`` (``DEGRADED``: a multipath path lost) and ``PathsDown`` (``INACCESSIBLE``: no
session or disk serves the LUN), which a stat of a mounted filesystem does not see (its
metadata is cached).
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flexhub.csi.proto import csi_pb2
from flexhub.errors import one_line
from flexhub.node.mounts import CORRUPTED_ERRNOS

__all__ = ["Probed", "backend_troubles", "probe", "volume_health"]

LOG = logging.getLogger(__name__)

_statting: dict[str, _Statting] = {}
#: the volumes whose backend health check is running (guarded by ``_statting_lock``)
_asking: dict[str, _Asking] = {}
_statting_lock = threading.Lock()
_INACCESSIBLE = csi_pb2.VolumeHealthErrorType.INACCESSIBLE
_STATUS = {"degraded": csi_pb2.VolumeHealthErrorType.DEGRADED, "inaccessible": _INACCESSIBLE}
#: (CSI status, reason, message) of one trouble.
Trouble = tuple[Any, str, str]


@dataclass(frozen=True)
class Probed:
    """What one bounded stat of a path found: its mode and statvfs (``None`` for a device),
    or a trouble (``reason`` CamelCase, ``message`` one line, ``errno`` when it failed)."""

    mode: int = 0
    statvfs: os.statvfs_result | None = None
    reason: str = ""
    message: str = ""
    errno: int = 0


class _Statting:
    """One running stat of a path: its thread, when it started, what it found."""

    def __init__(self, path: str) -> None:
        self.found: list[Probed] = []
        self.started = time.monotonic()
        self.thread = threading.Thread(target=self._work, args=(path,), name="stat", daemon=True)

    def _work(self, path: str) -> None:
        try:
            mode = os.stat(path).st_mode
            self.found.append(Probed(mode, None if stat.S_ISBLK(mode) else os.statvfs(path)))
        except OSError as exc:
            code = exc.errno or 0
            text = exc.strerror or str(exc)
            if code in CORRUPTED_ERRNOS:
                self.found.append(
                    Probed(
                        reason="StaleMount",
                        message=f"{path} is a stale or broken mount ({text})",
                        errno=code,
                    )
                )
            else:
                self.found.append(
                    Probed(reason="StatFailed", message=f"{path}: {text}", errno=code)
                )
        finally:
            with _statting_lock:
                _statting.pop(path, None)


def probe(path: str, bound: float) -> Probed:
    """One ``stat`` (and ``statvfs`` unless a device) of ``path`` within ``bound`` seconds. A
    path whose stat is already running is not statted again: the call waits for that stat
    until its bound ends (two calls at once share one answer; one still stuck past its bound
    is answered at once, with no new thread)."""
    with _statting_lock:
        running = _statting.get(path)
        fresh = running is None
        if running is None:
            running = _statting[path] = _Statting(path)
            running.thread.start()
    running.thread.join(max(0.0, running.started + bound - time.monotonic()))
    if running.found:
        return running.found[0]
    if not fresh:
        return Probed(reason="StatTimeout", message=f"{path} did not answer a stat yet")
    return Probed(
        reason="StatTimeout",
        message=f"{path} did not answer a stat within {bound:g} s (its server unreachable?)",
    )


class _Asking:
    """One running check of a backend: its thread, when it started, what it found."""

    def __init__(self, key: str, ask: Callable[[], Iterable[Any]], what: str) -> None:
        self.found: list[list[Trouble]] = []
        self.started = time.monotonic()
        self.thread = threading.Thread(
            target=self._work, args=(key, ask, what), name="backend-health", daemon=True
        )

    def _work(self, key: str, ask: Callable[[], Iterable[Any]], what: str) -> None:
        try:
            # one line each, whatever the backend wrote (the reply and the log quote them)
            self.found.append(
                [(_STATUS[t.status], one_line(t.reason, 128), one_line(t.message)) for t in ask()]
            )
        except Exception as exc:  # a backend's fault: logged, never the call's
            LOG.warning("%s: its backend's health check failed: %s", what, one_line(str(exc)))
        finally:
            with _statting_lock:
                _asking.pop(key, None)


def backend_troubles(
    ask: Callable[[], Iterable[Any]], bound: float, what: str, key: str
) -> Callable[[], list[Trouble]]:
    """Start asking the backend's troubles of an attachment (``ask``: its ``health``) in a
    thread of its own, and return what collects them: it waits until ``bound`` seconds after
    the start, so the check runs beside the stats and the call holds one bound in all. An
    exception or a late answer is nothing known, logged in one line (the volume's health must
    still answer). A ``key`` (the volume) whose check is already running is not asked again:
    the call waits for that check until the check's bound ends (two callers at once share one
    answer; one still hanging past its bound is nothing known, at once, with no new thread)."""
    with _statting_lock:
        asking = _asking.get(key)
        if asking is None:
            asking = _asking[key] = _Asking(key, ask, what)
            asking.thread.start()
    deadline = asking.started + bound

    def collect() -> list[Trouble]:
        asking.thread.join(max(0.0, deadline - time.monotonic()))
        if not asking.found:
            if asking.thread.is_alive():
                LOG.warning(
                    "%s: its backend's health check did not answer within %g s", what, bound
                )
            return []
        return asking.found[0]

    return collect


def volume_health(
    volume_id: str,
    paths: Iterable[Path],
    mounted: Callable[[Path], bool],
    bound: float,
    more: Callable[[], Iterable[Trouble]] = tuple,
) -> Any:
    """The ``VolumeHealth`` of ``volume_id`` from its staging and publish ``paths``, and
    what ``more`` collects once the stats are done (:func:`backend_troubles`): one entry per
    status and reason (the spec allows no two with the same), its messages joined; none when
    every path is mounted and answers and nothing more is wrong."""
    here = {str(path): mounted(path) for path in paths}
    probed: dict[str, Probed] = {}

    def one(where: str) -> None:
        probed[where] = probe(where, bound)

    threads = [
        threading.Thread(target=one, args=(where,), name="probe", daemon=True)
        for where, is_mounted in here.items()
        if is_mounted
    ]
    for thread in threads:  # the paths at once: one bound for the call, not one a path
        thread.start()
    for thread in threads:
        thread.join(bound + 1)
    troubles: dict[tuple[Any, str], list[str]] = {}
    for where, is_mounted in here.items():
        if not is_mounted:
            troubles.setdefault((_INACCESSIBLE, "NotMounted"), []).append(
                f"{where} holds no mount of the volume"
            )
            continue
        found = probed.get(where) or Probed(
            reason="StatTimeout", message=f"{where} did not answer a stat within {bound:g} s"
        )
        if found.reason:
            troubles.setdefault((_INACCESSIBLE, found.reason), []).append(found.message)
    for status, reason, message in more():
        troubles.setdefault((status, reason), []).append(message)
    return csi_pb2.VolumeHealth(
        volume_id=volume_id,
        health_statuses=[
            csi_pb2.VolumeHealth.VolumeHealthEntry(
                status=status, reason=reason, message="; ".join(messages)
            )
            for (status, reason), messages in troubles.items()
        ],
    )
