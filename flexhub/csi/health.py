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
call probes its paths at once, so it holds a plugin worker for one bound at most, and a path
whose earlier stat still hangs is answered at once. ``NodeGetVolumeStats`` uses the same
probe.

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

_statting: set[str] = set()
#: the volumes whose backend health check is running (guarded by ``_statting_lock``)
_asking: set[str] = set()
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


def probe(path: str, bound: float) -> Probed:
    """One ``stat`` (and ``statvfs`` unless a device) of ``path`` within ``bound`` seconds; a
    path whose stat is still stuck from an earlier call is answered at once."""
    with _statting_lock:
        if path in _statting:
            return Probed(reason="StatTimeout", message=f"{path} did not answer a stat yet")
        _statting.add(path)
    found: list[Probed] = []

    def work() -> None:
        try:
            mode = os.stat(path).st_mode
            found.append(Probed(mode, None if stat.S_ISBLK(mode) else os.statvfs(path)))
        except OSError as exc:
            code = exc.errno or 0
            text = exc.strerror or str(exc)
            if code in CORRUPTED_ERRNOS:
                found.append(
                    Probed(
                        reason="StaleMount",
                        message=f"{path} is a stale or broken mount ({text})",
                        errno=code,
                    )
                )
            else:
                found.append(Probed(reason="StatFailed", message=f"{path}: {text}", errno=code))
        finally:
            with _statting_lock:
                _statting.discard(path)

    thread = threading.Thread(target=work, name="stat", daemon=True)
    thread.start()
    thread.join(bound)
    if found:
        return found[0]
    return Probed(
        reason="StatTimeout",
        message=f"{path} did not answer a stat within {bound:g} s (its server unreachable?)",
    )


def backend_troubles(
    ask: Callable[[], Iterable[Any]], bound: float, what: str, key: str
) -> Callable[[], list[Trouble]]:
    """Start asking the backend's troubles of an attachment (``ask``: its ``health``) in a
    thread of its own, and return what collects them: it waits until ``bound`` seconds after
    the start, so the check runs beside the stats and the call holds one bound in all. An
    exception or a late answer is nothing known, logged in one line (the volume's health must
    still answer); a ``key`` (the volume) whose earlier check still hangs is not asked again:
    nothing known, at once, and no second thread."""
    with _statting_lock:
        if key in _asking:
            LOG.warning("%s: its backend's earlier health check has not answered yet", what)
            return list
        _asking.add(key)
    found: list[list[Trouble]] = []

    def work() -> None:
        try:
            # one line each, whatever the backend wrote (the reply and the log quote them)
            found.append(
                [(_STATUS[t.status], one_line(t.reason, 128), one_line(t.message)) for t in ask()]
            )
        except Exception as exc:  # a backend's fault: logged, never the call's
            LOG.warning("%s: its backend's health check failed: %s", what, one_line(str(exc)))
        finally:
            with _statting_lock:
                _asking.discard(key)

    deadline = time.monotonic() + bound
    thread = threading.Thread(target=work, name="backend-health", daemon=True)
    thread.start()

    def collect() -> list[Trouble]:
        thread.join(max(0.0, deadline - time.monotonic()))
        if not found:
            if thread.is_alive():
                LOG.warning(
                    "%s: its backend's health check did not answer within %g s", what, bound
                )
            return []
        return found[0]

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
