"""The kubelet path: parse one FlexVolume call, run it, write exactly one JSON reply.

kubelet merges the driver's stdout and stderr and parses the result as one JSON value, so
before anything else :func:`serve` points file descriptors 1 and 2 at ``/dev/null`` (stray
prints, warnings and child processes cannot corrupt the reply) and keeps a private copy of the
real stdout for the reply alone. Only the standard library and flexhub's own lean modules are
imported here; the schema validator and the backends load only for operations that need them.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flexhub.driver.call import Call, Reply
from flexhub.driver.quick import CAPABILITIES
from flexhub.errors import (
    MIN_SECRET_CHARS,
    FlexhubError,
    InvalidOptions,
    NotSupported,
    UsageError,
    one_line,
    redact,
    remember_secrets,
)

if TYPE_CHECKING:
    from flexhub.config import NodeConfig

__all__ = ["CAPABILITIES", "MIN_SECRET_CHARS", "OPERATIONS", "Reply", "serve"]

#: Largest options argument accepted (kubelet's are a few hundred bytes; secrets add some).
MAX_OPTIONS_BYTES = 256 * 1024
#: Largest single option value.
MAX_VALUE_CHARS = 64 * 1024
#: Each operation's arguments, as kubelet passes them (its usage line).
USAGE: Mapping[str, str] = {
    "init": "init",
    "getvolumename": "getvolumename <json>",
    "attach": "attach <json> <nodeName>",
    "isattached": "isattached <json> <nodeName>",
    "detach": "detach <pvOrVolumeName> <nodeName>",
    "waitforattach": "waitforattach <devicePath> <json>",
    "mountdevice": "mountdevice <deviceMountPath> <devicePath> <json>",
    "unmountdevice": "unmountdevice <deviceMountPath>",
    "mount": "mount <podVolumeDir> <json>",
    "unmount": "unmount <podVolumeDir>",
    "expandvolume": "expandvolume <json> <deviceMountPath> <newSize> <oldSize>",
    "expandfs": "expandfs <json> <devicePath> <podVolumeDir> <newSize> <oldSize>",
}


Handler = Callable[[list[str], Call], Reply]


# --- argument handling ------------------------------------------------------------------


def _expect(args: list[str], count: int, usage: str) -> None:
    if len(args) != count:
        raise UsageError(f"expected {count} argument(s) after the operation: {usage}")


def _directory(value: str, what: str) -> Path:
    if not value:
        raise UsageError(f"{what} is empty")
    if "\x00" in value or _has_surrogates(value):
        raise UsageError(f"{what} is not a valid path")
    path = Path(value)
    if not path.is_absolute() or ".." in path.parts:
        raise UsageError(f"{what} must be an absolute path without '..'")
    return path


def _size(value: str, what: str) -> int:
    if not value.isdigit() or len(value) > 19:
        raise UsageError(f"{what} must be a whole number of bytes")
    return int(value)


def _has_surrogates(text: str) -> bool:
    # argv bytes that are not UTF-8 arrive as lone surrogates (surrogateescape)
    return any("\udc80" <= ch <= "\udcff" for ch in text)


def parse_options(raw: str, call: Call) -> dict[str, str]:
    """Parse the options argument: one JSON object whose values are all strings.

    Secret values are remembered on ``call`` at once so that nothing after this point can
    log or echo them.
    """
    if _has_surrogates(raw):
        raise InvalidOptions("options are not valid UTF-8")
    if len(raw.encode("utf-8", "surrogatepass")) > MAX_OPTIONS_BYTES:
        raise InvalidOptions(f"options are larger than {MAX_OPTIONS_BYTES} bytes")
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise InvalidOptions(
            f"options are not valid JSON: {exc.msg} at character {exc.pos}"
        ) from None
    except ValueError:
        raise InvalidOptions("options are not valid JSON") from None
    if not isinstance(data, dict):
        raise InvalidOptions(f"options must be a JSON object, not {type(data).__name__}")
    from flexhub.volume import SECRET_PREFIX, has_control_character

    for key, value in data.items():
        if key.startswith(SECRET_PREFIX) and isinstance(value, str):
            call.secrets.append(value)
            call.secrets.extend(_decoded(value))
            call.secret_keys.append(key[len(SECRET_PREFIX) :])
    remember_secrets(call.secrets)
    for key, value in data.items():
        shown = key if len(key) <= 80 else key[:77] + "..."
        if not isinstance(value, str):
            raise InvalidOptions(f"option {shown!r} must be a string, not {_json_type(value)}")
        if _has_surrogates(key) or _has_surrogates(value) or "\x00" in key + value:
            raise InvalidOptions(f"option {shown!r} is not valid text")
        if has_control_character(key) or has_control_character(value):
            raise InvalidOptions(
                f"option {shown!r} contains a control character (a newline, tab, ...): "
                "no option key or value may"
            )
        if len(value) > MAX_VALUE_CHARS:
            raise InvalidOptions(f"option {shown!r} is longer than {MAX_VALUE_CHARS} characters")
    call.backend = data.get("backend", "")
    call.volume = data.get("kubernetes.io/pvOrVolumeName", "")
    call.pod_uid = data.get("kubernetes.io/pod.uid", "")
    return data


def _decoded(value: str) -> list[str]:
    """The decoded text of a base64 secret value, so that it is scrubbed too."""
    import base64
    import binascii

    try:
        return [base64.b64decode(value, validate=True).decode("utf-8")]
    except (binascii.Error, ValueError):
        return []


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, list):
        return "an array"
    return "an object"


# --- operations -------------------------------------------------------------------------


_CONFIG: list[NodeConfig] = []


def _config() -> NodeConfig:
    """The node config, read once per call (a broken file is a Failure of the call)."""
    if not _CONFIG:
        from flexhub.config import load_config

        _CONFIG.append(load_config())
    return _CONFIG[0]


def check_node_sections(config: NodeConfig) -> None:
    """Refuse a table of the node config that names no installed backend (a typo)."""
    if config.backends:
        from flexhub.driver.memo import known_backend_names
        from flexhub.settings import check_sections

        check_sections(config, known_backend_names(config))


def op_init(args: list[str], call: Call) -> Reply:
    _expect(args, 0, USAGE["init"])
    return Reply(extra={"capabilities": dict(CAPABILITIES)})


def op_getvolumename(args: list[str], call: Call) -> Reply:
    # kubelet ignores the name and uses spec.Name(); after a kubelet restart the options hold
    # no user keys at all, so they are parsed but not validated against a backend schema.
    _expect(args, 1, USAGE["getvolumename"])
    options = parse_options(args[0], call)
    return Reply(extra={"volumeName": options.get("kubernetes.io/pvOrVolumeName", "")})


def check_pod_uid(target: Path, options: Mapping[str, str]) -> None:
    """Refuse a ``kubernetes.io/pod.uid`` that contradicts the pod directory.

    kubelet mounts on ``<root>/pods/<uid>/volumes/<vendor~driver>/<name>`` (any root) and
    merges the user's options last, so a ``pod.uid`` option can claim another pod. A directory
    of another shape (a test, a replayer) is not checked.
    """
    parts = target.parts
    if len(parts) < 6 or parts[-5] != "pods" or parts[-3] != "volumes" or "~" not in parts[-2]:
        return
    uid = options.get("kubernetes.io/pod.uid", "")
    if uid != parts[-4]:
        shown = uid if len(uid) <= 80 else uid[:77] + "..."
        raise InvalidOptions(
            f"kubernetes.io/pod.uid {shown!r} contradicts the pod directory (pod {parts[-4]!r}): "
            "a volume's options must not set kubernetes.io/ keys"
        )


def _validated(
    raw: str, call: Call, *, with_pod: bool, target: Path | None = None
) -> tuple[Any, Any, Any]:
    """Parse, validate and load: returns (volume, backend instance, node)."""
    from flexhub.driver.loader import load_backend
    from flexhub.driver.memo import Memo
    from flexhub.driver.validation import validate_options
    from flexhub.volume import Volume

    options = parse_options(raw, call)
    if target is not None:
        check_pod_uid(target, options)
    config = _config()
    check_node_sections(config)
    backend_cls = load_backend(options.get("backend"), config)
    from flexhub.settings import check_backend_table

    check_backend_table(config, call.backend, backend_cls)
    validate_options(backend_cls, options, Memo(config.state_dir))
    volume = Volume.from_options(options, with_pod=with_pod)
    from flexhub.node import Node

    node = Node(config, backend=volume.backend)
    backend = backend_cls(node)
    backend_cls.check_options(volume)
    backend.check(volume)
    return volume, backend, node


def op_attach(args: list[str], call: Call) -> Reply:
    # attach: false — kubelet and the controller never send this; node work happens in mount.
    _expect(args, 2, USAGE["attach"])
    _validated(args[0], call, with_pod=False)
    return Reply(extra={"device": ""})


def op_isattached(args: list[str], call: Call) -> Reply:
    _expect(args, 2, USAGE["isattached"])
    parse_options(args[0], call)
    return Reply(extra={"attached": True})


def op_detach(args: list[str], call: Call) -> Reply:
    # Receives only the PV name; devices are released by the last unmount on the node.
    _expect(args, 2, USAGE["detach"])
    call.volume = args[0]
    return Reply()


def op_waitforattach(args: list[str], call: Call) -> Reply:
    _expect(args, 2, USAGE["waitforattach"])
    parse_options(args[1], call)
    return Reply(extra={"device": args[0]})


def op_mountdevice(args: list[str], call: Call) -> Reply:
    # With attach: false there is no device stage; mount does everything, so this is a no-op
    # that never lets kubelet's default format a device.
    _expect(args, 3, USAGE["mountdevice"])
    _directory(args[0], "deviceMountPath")
    _validated(args[2], call, with_pod=False)
    return Reply()


def op_unmountdevice(args: list[str], call: Call) -> Reply:
    _expect(args, 1, USAGE["unmountdevice"])
    call.target = str(_directory(args[0], "deviceMountPath"))
    return Reply()


def op_mount(args: list[str], call: Call) -> Reply:
    _expect(args, 2, USAGE["mount"])
    target = _directory(args[0], "mount directory")
    call.target = str(target)
    volume, backend, node = _validated(args[1], call, with_pod=True, target=target)
    from flexhub.node.mounts import is_corrupted
    from flexhub.node.volumes import mount_volume, pod_dir

    target = pod_dir(target)  # kubelet's root may be a symlink; mountinfo shows real paths
    # A stale mount (a restarted NFS server) fails or hangs a plain stat: probe it with a
    # bound, and let mount_volume clean it up before mounting again.
    stale = node.mounts.is_mount_point(target) and is_corrupted(target)
    if not stale and not target.is_dir():
        raise UsageError(f"mount directory {target} does not exist or is not a directory")

    mount_volume(node, backend, target, volume)
    return Reply()


def op_unmount(args: list[str], call: Call) -> Reply:
    _expect(args, 1, USAGE["unmount"])
    target = _directory(args[0], "mount directory")
    call.target = str(target)
    config = _config()
    from flexhub.node.fastpath import nothing_to_unmount

    # kubelet serialises the operations on one pod volume directory, so no mount of this
    # directory can be in flight while it asks to unmount it.
    if nothing_to_unmount(config.state_dir, target):
        return Reply()
    from flexhub.driver.loader import backend_factory
    from flexhub.driver.logs import configure_logging
    from flexhub.node import Node
    from flexhub.node.volumes import unmount_volume

    configure_logging()
    # An unmount never fails on a table naming no installed backend: it takes its backend from
    # the journal, and a volume mounted before the table went wrong (an upgrade, a backend
    # dropped from the image) must still come off. The table is named in the reply and log.
    warning = ""
    try:
        check_node_sections(config)
    except FlexhubError as exc:
        warning = f"warning: {exc.message}"
        _log_warning(warning)
    # Success once nothing is mounted on target, even if something could not be released:
    # a Failure would make kubelet retry forever and keep the pod Terminating.
    message = unmount_volume(Node(config), target, backend_factory(config, call))
    return Reply(message="; ".join(m for m in (message, warning) if m))


def _log_warning(message: str) -> None:
    """Through the module logger (logging is imported only on this path)."""
    import logging

    logging.getLogger(__name__).warning("%s", message)


def op_expandvolume(args: list[str], call: Call) -> Reply:
    # Controller side; upstream never runs it. The node grows the filesystem in expandfs.
    _expect(args, 4, USAGE["expandvolume"])
    parse_options(args[0], call)
    _size(args[2], "newSize")
    _size(args[3], "oldSize")
    return Reply()


def op_expandfs(args: list[str], call: Call) -> Reply:
    _expect(args, 5, USAGE["expandfs"])
    target = _directory(args[2], "mount directory")
    call.target = str(target)
    new_size = _size(args[3], "newSize")
    old_size = _size(args[4], "oldSize")
    if new_size < old_size:
        raise UsageError(f"newSize {new_size} is below oldSize {old_size}: shrinking is refused")
    volume, backend, node = _validated(args[0], call, with_pod=False)
    from flexhub.node.volumes import expand_volume

    expand_volume(node, backend, target, volume, new_size)
    return Reply()


OPERATIONS: Mapping[str, Handler] = {
    "init": op_init,
    "getvolumename": op_getvolumename,
    "attach": op_attach,
    "isattached": op_isattached,
    "detach": op_detach,
    "waitforattach": op_waitforattach,
    "mountdevice": op_mountdevice,
    "unmountdevice": op_unmountdevice,
    "mount": op_mount,
    "unmount": op_unmount,
    "expandvolume": op_expandvolume,
    "expandfs": op_expandfs,
}


# --- serving ----------------------------------------------------------------------------

#: Operations that import no node service or backend (``unmount`` only when there is nothing
#: to unmount): they log their summary line without setting up :mod:`logging`.
_LEAN = frozenset(
    {
        "init",
        "getvolumename",
        "isattached",
        "detach",
        "waitforattach",
        "unmountdevice",
        "expandvolume",
        "unmount",
    }
)


def _protect_streams() -> int:
    """Send fds 1 and 2 to /dev/null and return a private duplicate of the real stdout."""
    reply_fd = os.dup(1)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    os.close(devnull)
    os.set_inheritable(reply_fd, False)
    return reply_fd


def handle(args: list[str], call: Call) -> Reply:
    """Run one call and turn every outcome into a :class:`Reply`."""
    handler = OPERATIONS.get(call.operation)
    if handler is None:
        return Reply(status=NotSupported.status)
    try:
        if call.operation not in _LEAN:
            from flexhub.driver.logs import configure_logging

            configure_logging()
        return handler(args, call)
    except FlexhubError as exc:
        return Reply(status=exc.status, message=exc.message)
    except Exception as exc:  # the reply must be JSON, whatever broke
        from flexhub.driver.logs import log_exception

        log_exception(call)
        return Reply(
            status="Failure", message=one_line(f"internal error: {type(exc).__name__}: {exc}")
        )


#: Operations bounded by the node's ``call_timeout`` (the others touch nothing that can hang).
BOUNDED = ("mount", "unmount", "expandfs")
#: Seconds a call past its ``call_timeout`` gets to unwind before the process exits.
UNWIND_GRACE = 15.0


def _handle_bounded(args: list[str], call: Call, reply_fd: int, started: float) -> Reply:
    """:func:`handle` under the call's deadline (see :mod:`flexhub.driver.deadline`)."""
    try:
        seconds = _config().call_timeout
    except FlexhubError:
        return handle(args, call)  # the call fails on the config at once
    from flexhub.driver.deadline import call_deadline
    from flexhub.errors import CallTimeout

    def expire() -> None:
        message = (
            f"{call.operation} ran past call_timeout ({seconds:g}s) and did not unwind within "
            f"{UNWIND_GRACE:g}s: exiting, which releases its locks; the next call finishes "
            "or undoes the rest"
        )
        _answer(call, Reply(status="Failure", message=message), reply_fd, started)
        os._exit(1)

    try:
        with call_deadline(seconds, UNWIND_GRACE, call.operation, expire):
            return handle(args, call)
    except CallTimeout as exc:
        return Reply(status=exc.status, message=exc.message)


def _answer(call: Call, reply: Reply, reply_fd: int, started: float) -> None:
    from flexhub.driver.logs import log_call

    reply.message = redact(reply.message, call.secrets, MIN_SECRET_CHARS)
    log_call(call, reply.status, reply.message, time.monotonic() - started)
    data = (reply.to_json() + "\n").encode()
    while data:
        written = os.write(reply_fd, data)
        data = data[written:]
    os.close(reply_fd)


def serve(argv: list[str]) -> int:
    """Serve one kubelet call; returns the exit code."""
    started = time.monotonic()
    reply_fd = _protect_streams()
    call = Call(operation=argv[0] if argv else "")
    args = argv[1:]
    from flexhub.driver.logs import start_logging

    if not argv:
        reply = Reply(status="Failure", message="no operation given")
    else:
        start_logging(call, _config)
        if call.operation in BOUNDED:
            reply = _handle_bounded(args, call, reply_fd, started)
        else:
            reply = handle(args, call)
    _answer(call, reply, reply_fd, started)
    return reply.exit_code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(serve(sys.argv[1:]))
