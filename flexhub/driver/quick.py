"""The two calls answered before anything is imported: ``init`` and an ``unmount`` with
nothing to do.

kubelet runs ``init`` on every plugin probe and ``unmount`` for every pod volume it tears
down, also after a reboot or a failed ``mount``, when nothing is mounted and flexhub keeps no
record. Both answers are constants, so this module answers them with what the interpreter has
already loaded at start-up (``os``, ``sys``, ``time``) plus :mod:`flexhub.node.fastpath`: no
``json``, ``re``, ``pathlib``, ``typing`` or ``tomllib``. The node config is read by a reader
that understands only the plain form ``flexhub install`` and the examples write (top-level
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

__all__ = ["CAPABILITIES", "serve"]

#: The reply to ``init``. See the README ("Capabilities") for why each is set so.
CAPABILITIES = {
    "attach": False,
    "selinuxRelabel": True,
    "fsGroup": False,
    "supportsMetrics": True,
    "requiresFSResize": True,
}

_DEFAULT_CONFIG = "/etc/flexhub/flexhub.toml"
_STRINGS = ("state_dir", "log_dir", "log_level")
_NUMBERS = (
    "lock_timeout",
    "command_timeout",
    "mount_timeout",
    "unmount_timeout",
    "call_timeout",
    "release_retry_interval",
)
_LEVELS = ("debug", "info", "warning", "error")
_BARE_KEY = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")


def read_plain_config(text: str) -> dict[str, str] | None:
    """``state_dir``, ``log_dir`` and ``log_level`` of a plain config, or ``None`` when the
    text is not plain enough to be sure (the full TOML reader then decides)."""
    found: dict[str, str] = {}
    tables: set[str] = set()
    table_keys: set[str] = set()
    in_table = False
    for raw in text.split("\n"):
        line = raw.strip(" \t\r")
        if not line or line.startswith("#"):
            continue
        if '"""' in line or "'''" in line or "\\" in line:
            return None  # multi-line or escaped strings: only the full reader is exact
        if line.startswith("["):
            name = line[1:].split("]", 1)
            if line.startswith("[[") or len(name) != 2 or not _bare(name[0].strip()):
                return None
            if name[1].strip(" \t") and not name[1].strip(" \t").startswith("#"):
                return None
            table = name[0].strip()
            if table in tables or table in found:
                return None  # a table twice, or a table named like a setting: not TOML
            tables.add(table)
            table_keys = set()
            in_table = True
            continue
        key, eq, rest = line.partition("=")
        key = key.strip(" \t")
        if not eq or not _bare(key):
            return None  # also every continuation line of a value over several lines
        if in_table:
            # a backend's setting: not this reader's business, but it must be TOML
            if key in table_keys or not _one_line_value(rest.strip(" \t")):
                return None
            table_keys.add(key)
            continue
        plain = _without_comment(rest.strip(" \t"))
        if plain is None:
            return None
        value = plain
        if key in found or (key not in _STRINGS and key not in _NUMBERS):
            return None
        if key in _STRINGS:
            if len(value) < 2 or value[0] != value[-1] or value[0] not in "\"'":
                return None
            value = value[1:-1]
            if key == "log_level" and value not in _LEVELS:
                return None
            if key != "log_level" and not _normal_path(value):
                return None
        elif not _positive_number(value):
            return None
        found[key] = value
    return found


def _bare(key: str) -> bool:
    return bool(key) and all(ch in _BARE_KEY for ch in key)


def _without_comment(value: str) -> str | None:
    """The value without a trailing comment; ``None`` for anything but a one-line string,
    number or boolean (arrays, inline tables, dates)."""
    if value[:1] in ("'", '"'):
        end = value.find(value[0], 1)
        if end < 0:
            return None
        rest = value[end + 1 :].strip(" \t")
        if rest and not rest.startswith("#"):
            return None
        body = value[: end + 1]
        if any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in body):
            return None
        return body
    word = value.split("#", 1)[0].strip(" \t")
    if not word or any(ch in word for ch in "[]{}\"' \t"):
        return None
    return word


def _normal_path(value: str) -> bool:
    """An absolute path as :class:`~pathlib.Path` would print it (no ``//``, ``.``, ``..``,
    trailing ``/``), so that comparing strings compares paths."""
    if not value.startswith("/") or (value != "/" and value.endswith("/")):
        return False
    return all(part not in ("", ".", "..") for part in value[1:].split("/")) or value == "/"


def _one_line_value(value: str) -> bool:
    """A one-line TOML value of a kind flexhub's tables hold: a string, a number, a boolean,
    or an array of those (with a trailing comment or none)."""
    if value.startswith("["):
        end = _array_end(value)
        if end < 0:
            return False
        rest = value[end + 1 :].strip(" \t")
        return not rest or rest.startswith("#")
    plain = _without_comment(value)
    return plain is not None and _scalar(plain)


def _array_end(value: str) -> int:
    """The index of the ``]`` closing the one-line array ``value``, or -1."""
    index, items = 1, 0
    while True:
        while index < len(value) and value[index] in " \t":
            index += 1
        if index < len(value) and value[index] == "]":
            return index
        if index >= len(value):
            return -1
        if value[index] in "'\"":
            close = value.find(value[index], index + 1)
            if close < 0:
                return -1
            item, index = value[index : close + 1], close + 1
        else:
            start = index
            while index < len(value) and value[index] not in ", \t]":
                index += 1
            item = value[start:index]
        if not _scalar(item):
            return -1
        items += 1
        while index < len(value) and value[index] in " \t":
            index += 1
        if index < len(value) and value[index] == ",":
            index += 1
        elif index < len(value) and value[index] == "]":
            return index
        else:
            return -1


def _scalar(word: str) -> bool:
    if word[:1] in ("'", '"'):
        return len(word) >= 2 and word[-1] == word[0] and word[0] not in word[1:-1]
    if word in ("true", "false"):
        return True
    digits = word[1:] if word[:1] in "+-" else word
    return _positive_number(digits) or digits == "0"


def _positive_number(word: str) -> bool:
    """A plain decimal the full reader takes as a positive number (``30``, ``2.5``)."""
    whole, dot, fraction = word.partition(".")
    if not _ascii_digits(whole) or (dot and not _ascii_digits(fraction)):
        return False
    if len(whole) > 1 and whole.startswith("0"):
        return False
    return float(word) > 0


def _ascii_digits(word: str) -> bool:
    """``str.isdigit`` without the other scripts' digits (TOML has only these)."""
    return bool(word) and all("0" <= ch <= "9" for ch in word)


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
