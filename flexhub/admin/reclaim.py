"""The node agent's reclaim, run with the host's flexhub and the host's node config.

The DaemonSet pod (``flexhub daemonset --node-agent``) sees the host at ``--host-root``; a
loop file's reclaim must act on the host's files, under the host's node config (its loopfile
root, its journal and locks in its state directory). So the pod does not reclaim itself: for
each PV it runs the installed driver (the shim kubelet runs, which exports the host's config)
inside the host's root, as kubelet would, with the hidden admin command
``reclaim-volume``, and hands it the request on stdin, one JSON object
``{"backend", "options", "record"}`` (the PV's options and reclaim record: nothing secret, and
nothing on a command line). The command answers one JSON line, ``{"status": "Success"}`` or
``{"status": "Failure", "message": one line}``.

With the host at ``/`` and no driver (flexhub run on the host itself) it reclaims in-process.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from flexhub.errors import FlexhubError

__all__ = ["MAX_REQUEST", "Reclaim", "host_reclaimer", "parse_request", "reclaim_volume"]

#: The most bytes a request may have (a PV's options and record are far smaller).
MAX_REQUEST = 256 * 1024
#: Seconds one reclaim in the host may take (it waits for the volume's lock) before it is
#: killed, reported and retried.
TIMEOUT = 600.0

Reclaim = Callable[[str, Mapping[str, str], Mapping[str, str]], None]


def _strings(value: object, what: str) -> dict[str, str]:
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise FlexhubError(f"reclaim request: {what} must be an object of strings")
    return dict(value)


def parse_request(raw: bytes) -> tuple[str, dict[str, str], dict[str, str]]:
    """``(backend, options, record)`` from a request.

    :raises FlexhubError: one line, when it is not exactly such an object.
    """
    if len(raw) > MAX_REQUEST:
        raise FlexhubError(f"reclaim request: more than {MAX_REQUEST} bytes")
    try:
        request: Any = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise FlexhubError("reclaim request: not one JSON object") from None
    if not isinstance(request, dict) or set(request) != {"backend", "options", "record"}:
        raise FlexhubError("reclaim request: must be an object of backend, options and record")
    backend = request["backend"]
    if not isinstance(backend, str) or not backend:
        raise FlexhubError("reclaim request: backend must be a backend's name")
    return backend, _strings(request["options"], "options"), _strings(request["record"], "record")


def reclaim_volume(
    backend: str,
    options: Mapping[str, str],
    record: Mapping[str, str],
    config: Path | None = None,
) -> None:
    """Reclaim in this process, with the node config ``config`` (default: FLEXHUB_CONFIG)."""
    from flexhub.provisioner.service import _Backends
    from flexhub.volume import Secrets

    _Backends(config)(backend).reclaim(options, record, Secrets())


def _one_line(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= 400 else line[:397] + "..."


def host_reclaimer(host_root: Path, driver: str | None, timeout: float = TIMEOUT) -> Reclaim:
    """The node agent's ``reclaim(backend, options, record)`` for the host at ``host_root``.

    :param driver: the installed driver (a host path); ``None`` only with the host at ``/``
        (in-process, with FLEXHUB_CONFIG).
    """
    if driver is None:
        if host_root != Path("/"):
            raise FlexhubError("reclaiming in a container needs the installed driver")
        return lambda backend, options, record: reclaim_volume(backend, options, record)

    def reclaim(backend: str, options: Mapping[str, str], record: Mapping[str, str]) -> None:
        from flexhub.admin.deploy import run_in_host
        from flexhub.admin.harness import ReplyError, parse_reply
        from flexhub.admin.install import check_runnable

        check_runnable(driver, host_root)  # root's alone, checked before each run
        request = json.dumps(
            {"backend": backend, "options": dict(options), "record": dict(record)}
        ).encode()
        try:
            code, output = run_in_host(
                host_root, [driver, "reclaim-volume"], timeout=timeout, stdin_data=request
            )
        except subprocess.TimeoutExpired:
            raise FlexhubError(f"reclaim on the host took more than {timeout:.0f} s") from None
        except OSError as exc:
            raise FlexhubError(f"cannot run {driver} on the host: {exc.strerror}") from None
        try:
            reply = parse_reply(output)
        except ReplyError as exc:
            raise FlexhubError(f"the host's reclaim answered no reply: {exc}") from None
        if reply.get("status") != "Success" or code != 0:
            raise FlexhubError(_one_line(str(reply.get("message") or reply)))

    return reclaim
