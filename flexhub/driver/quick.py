"""The two calls answered before anything is imported: ``init`` and an ``unmount`` with
nothing to do.

kubelet runs ``init`` on every plugin probe and ``unmount`` for every pod volume it tears
down, also after a reboot or a failed ``mount``, when nothing is mounted and flexhub keeps no
record. Both answers are constants, so this module answers them with what the interpreter has
already loaded at start-up (``os``, ``sys``, ``time``) plus :mod:`flexhub.node.fastpath`: no
``json``, ``re``, ``pathlib``, ``typing`` or ``tomllib``. The node config is read by a reader
(:mod:`flexhub.node.plainconfig`, which the full config reader uses too) that understands only
the plain form ``flexhub install`` and the examples write (top-level
``key = "string"`` or ``key = number`` lines before the first table); any other text, any
unknown or repeated key or a value the full reader would refuse makes :func:`serve` return
``None``, and the call goes the full way (:mod:`flexhub.driver.kubelet`), which reports it.

Backend tables (``[loopfile]``) are skipped line by line, never interpreted: an ``unmount``
with nothing to unmount uses no backend, so a mistake in one is reported by the calls that
use it. The call is logged exactly as the full path logs it.
"""

# (no ``from __future__ import annotations``: importing __future__ costs init 0.1 ms)
import os
import time

# The reader of the plain form, shared with the full config reader (flexhub.config).
from flexhub.node.plainconfig import _LEVELS, _NUMBERS, _STRINGS, read_plain_config  # noqa: F401

__all__ = ["CAPABILITIES", "serve"]

#: The reply to ``init``. See docs/backends/protocol.md ("Capabilities") for why each is set so.
CAPABILITIES = {
    "attach": False,
    "selinuxRelabel": True,
    "fsGroup": False,
    "supportsMetrics": True,
    "requiresFSResize": True,
}

_DEFAULT_CONFIG = "/etc/flexhub/flexhub.toml"
#: The largest config the quick path reads; a longer one goes the full way.
MAX_CONFIG_BYTES = 1 << 20


def _config() -> dict[str, str] | None:
    path = os.environ.get("FLEXHUB_CONFIG") or _DEFAULT_CONFIG
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        return {}
    except OSError:
        return None
    if len(data) > MAX_CONFIG_BYTES:
        return None  # never a decision on part of the file
    try:
        return read_plain_config(data.decode("utf-8"))
    except UnicodeDecodeError:
        return None


def _directory(value: str) -> str | None:
    """``value`` if it is a directory argument the full path accepts, else ``None``."""
    if not value.startswith("/") or "\x00" in value:
        return None
    if any("\udc80" <= ch <= "\udcff" for ch in value):
        return None
    parts = value.split("/")
    if ".." in parts:
        return None
    # pathlib's normalisation: no empty or "." components, no trailing slash
    return "/" + "/".join(p for p in parts if p and p != ".")


def json_string(text: str) -> str:
    """``text`` as a JSON string, as ``json.dumps(text, ensure_ascii=False)`` writes it."""
    out = ['"']
    for ch in text:
        code = ord(ch)
        if ch == '"':
            out.append('\\"')
        elif ch == "\\":
            out.append("\\\\")
        elif code < 0x20:
            out.append(_ESCAPES.get(ch) or f"\\u{code:04x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\b": "\\b", "\f": "\\f"}


def _log(config: dict[str, str], operation: str, target: str, started: float) -> None:
    """The call's summary line, in the format :mod:`flexhub.driver.logs` writes; logging
    never breaks a call (the reply is out already)."""
    try:
        _write_log(config, operation, target, started)
    except Exception:
        return


def _write_log(config: dict[str, str], operation: str, target: str, started: float) -> None:
    if _LEVELS.index(config.get("log_level", "info")) > 1:
        return
    log_dir = config.get("log_dir", "/var/log/flexhub")
    try:
        _make_log_dir(config.get("state_dir", "/var/lib/flexhub"), log_dir)
        fd = os.open(
            log_dir + "/flexhub.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600
        )
    except OSError:
        return
    now = time.time()
    fields = (
        f'"op": {json_string(operation)}, "backend": "", "volume": "", "pod": "", '
        f'"dir": {json_string(target)}, "status": "Success", '
        f'"ms": {round((time.monotonic() - started) * 1000, 1)!r}, "message": "", '
        f'"time": {json_string(time.strftime("%Y-%m-%dT%H:%M:%S%z"))}'
    )
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now))
    prefix = f"{stamp},{int(now * 1000) % 1000:03d} {os.getpid()} INFO flexhub.calls"
    line = f"{prefix}: call {{{fields}}}\n"
    try:
        os.write(fd, line.encode("utf-8", "replace"))
    except OSError:
        pass
    finally:
        os.close(fd)


def _make_log_dir(state_dir: str, log_dir: str) -> None:
    """The log directory, made as the full path makes it: inside ``state_dir`` every missing
    directory from ``state_dir`` down is 0700 (and the parents of ``state_dir`` 0755), as
    :func:`flexhub.node.statedir.private_dir` makes them (:mod:`flexhub.node.dirs`)."""
    if log_dir != state_dir and not log_dir.startswith(state_dir.rstrip("/") + "/"):
        os.makedirs(log_dir, mode=0o700, exist_ok=True)
        return
    if not os.path.isdir(log_dir):
        from flexhub.node.dirs import make_private

        make_private(state_dir, *(n for n in log_dir[len(state_dir) :].split("/") if n))


def _reply(text: str) -> None:
    data = (text + "\n").encode()
    while data:
        data = data[os.write(1, data) :]


def serve(argv: list[str]) -> int | None:
    """Answer ``init`` or an ``unmount`` with nothing to unmount and return the exit code;
    ``None`` for every other call, and whenever in doubt (nothing is written then)."""
    started = time.monotonic()
    try:
        if argv == ["init"]:
            operation, target = "init", ""
            caps = ",".join(f'"{k}":{"true" if v else "false"}' for k, v in CAPABILITIES.items())
            reply = f'{{"status":"Success","capabilities":{{{caps}}}}}'
        elif len(argv) == 2 and argv[0] == "unmount" and _directory(argv[1]) is not None:
            operation, target, reply = "unmount", _directory(argv[1]) or "", '{"status":"Success"}'
        else:
            return None
        config = _config()
        if config is None:
            return None
        if operation == "unmount":
            from flexhub.node.fastpath import nothing_to_unmount

            # kubelet serialises the operations on one pod volume directory, so no mount of
            # this directory can be in flight while it asks to unmount it.
            if not nothing_to_unmount(config.get("state_dir", "/var/lib/flexhub"), target):
                return None
    except Exception:
        return None  # the full path answers, and says what is wrong
    _reply(reply)
    _log(config, operation, target, started)
    return 0
