"""The node config in its plain form, read without ``tomllib``.

``flexhub install`` and the examples write the node config as top-level ``key = "string"`` or
``key = number`` lines, then one table per backend whose values are one-line strings, numbers,
booleans or arrays of those. This module reads exactly that form and gives what
:func:`tomllib.loads` gives for it; any other text (an escape, a multi-line value, a dotted or
quoted key, a date, an unknown or repeated top-level key, a control character anywhere) is
``None``, and the caller reads it with ``tomllib``, which reports what is wrong
(``tests/core/test_quick.py`` compares both readers on every text this one accepts).

Two readers use it: :mod:`flexhub.driver.quick` (``init`` and an ``unmount`` with nothing to
unmount: only the top-level settings, before anything else is imported) and
:func:`flexhub.config.parse_config` (every other call, which then needs no ``tomllib``,
``datetime`` or their regular expressions). It imports nothing.
"""

# (no ``from __future__ import annotations``: importing __future__ costs init 0.1 ms)
__all__ = ["plain_document", "read_plain_config"]

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
#: What TOML allows nowhere (tab aside; a newline only as a line end, CR only before it).
_CONTROL = frozenset([chr(i) for i in range(0x20) if chr(i) not in "\t\n\r"] + ["\x7f"])


def read_plain_config(text: str) -> "dict[str, str] | None":
    """``state_dir``, ``log_dir`` and ``log_level`` of a plain config (and the numbers, as
    written), or ``None`` when the text is not plain enough to be sure (the full TOML reader
    then decides)."""
    read = _read(text)
    return None if read is None else read[0]


def plain_document(text: str) -> "dict[str, object] | None":
    """What ``tomllib.loads(text)`` returns, for a plain config; ``None`` for any other text."""
    read = _read(text)
    return None if read is None else read[1]


def _read(text: str) -> "tuple[dict[str, str], dict[str, object]] | None":
    found: dict[str, str] = {}
    document: dict[str, object] = {}
    tables: set[str] = set()
    table: dict[str, object] = {}
    in_table = False
    if any(ch in _CONTROL for ch in text) or "\r" in text.replace("\r\n", ""):
        return None  # not TOML (also in a comment, where this reader does not look)
    for raw in text.split("\n"):
        line = raw.strip(" \t\r")
        if not line or line.startswith("#"):
            continue
        if '"""' in line or "'''" in line or "\\" in line:
            return None  # multi-line or escaped strings: only the full reader is exact
        if line.startswith("["):
            name = line[1:].split("]", 1)
            if line.startswith("[[") or len(name) != 2 or not _bare(name[0].strip(" \t")):
                return None
            if name[1].strip(" \t") and not name[1].strip(" \t").startswith("#"):
                return None
            table_name = name[0].strip(" \t")
            if table_name in tables or table_name in found:
                return None  # a table twice, or a table named like a setting: not TOML
            tables.add(table_name)
            table = {}
            document[table_name] = table
            in_table = True
            continue
        key, eq, rest = line.partition("=")
        key = key.strip(" \t")
        if not eq or not _bare(key):
            return None  # also every continuation line of a value over several lines
        if in_table:
            # a backend's setting: it must be TOML, of a kind this reader reads exactly
            value = _one_line_value(rest.strip(" \t"))
            if key in table or value is _NOT_PLAIN:
                return None
            table[key] = value
            continue
        plain = _without_comment(rest.strip(" \t"))
        if plain is None:
            return None
        word = plain
        if key in found or (key not in _STRINGS and key not in _NUMBERS):
            return None
        if key in _STRINGS:
            if len(word) < 2 or word[0] != word[-1] or word[0] not in "\"'":
                return None
            word = word[1:-1]
            if key == "log_level" and word not in _LEVELS:
                return None
            if key != "log_level" and not _normal_path(word):
                return None
            document[key] = word
        elif not _positive_number(word):
            return None
        else:
            document[key] = _number(word)
        found[key] = word
    return found, document


class _NotPlain:
    """The answer for a value this reader does not read (``None`` is not: it is no value)."""


_NOT_PLAIN = _NotPlain()


def _bare(key: str) -> bool:
    return bool(key) and all(ch in _BARE_KEY for ch in key)


def _without_comment(value: str) -> "str | None":
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


def _one_line_value(value: str) -> object:
    """A one-line TOML value of a kind flexhub's tables hold, as TOML reads it: a string, a
    number, a boolean, or an array of those (with a trailing comment or none);
    :data:`_NOT_PLAIN` for anything else."""
    if value.startswith("["):
        items: list[object] = []
        end = _array_end(value, items)
        if end < 0:
            return _NOT_PLAIN
        rest = value[end + 1 :].strip(" \t")
        return items if not rest or rest.startswith("#") else _NOT_PLAIN
    plain = _without_comment(value)
    return _NOT_PLAIN if plain is None else _scalar(plain)


def _array_end(value: str, items: "list[object]") -> int:
    """The index of the ``]`` closing the one-line array ``value``, or -1; its items are
    appended to ``items``."""
    index = 1
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
        parsed = _scalar(item)
        if parsed is _NOT_PLAIN:
            return -1
        items.append(parsed)
        while index < len(value) and value[index] in " \t":
            index += 1
        if index < len(value) and value[index] == ",":
            index += 1
        elif index < len(value) and value[index] == "]":
            return index
        else:
            return -1


def _scalar(word: str) -> object:
    """A string, boolean or plain decimal as TOML reads it, or :data:`_NOT_PLAIN`."""
    if word[:1] in ("'", '"'):
        if len(word) >= 2 and word[-1] == word[0] and word[0] not in word[1:-1]:
            return word[1:-1]
        return _NOT_PLAIN
    if word in ("true", "false"):
        return word == "true"
    digits = word[1:] if word[:1] in "+-" else word
    if _positive_number(digits) or digits == "0":
        number = _number(digits)
        return -number if word[:1] == "-" else number
    return _NOT_PLAIN


def _number(word: str) -> "int | float":
    """A plain decimal as TOML reads it: an integer without a point, else a float."""
    return float(word) if "." in word else int(word)


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
