"""Kubernetes quantities (``512Mi``, ``10Gi``, ``1G``, ``1073741824``) as byte counts."""

from __future__ import annotations

import re

__all__ = ["MAX_BYTES", "parse_quantity", "quantity"]

#: The largest size accepted: 1 EiB (anything larger is a typo, not a disk).
MAX_BYTES = 1 << 60

_MULTIPLIERS: dict[str, int] = {
    "": 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
    "Ki": 1 << 10,
    "Mi": 1 << 20,
    "Gi": 1 << 30,
    "Ti": 1 << 40,
    "Pi": 1 << 50,
    "Ei": 1 << 60,
}

# The same shape as common.json#/$defs/quantity: the schema is checked first, this is the
# second line of defence (and what the unit tests pin).
_QUANTITY = re.compile(r"^([0-9]{1,19}(?:\.[0-9]{1,9})?)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")


def quantity(size: int) -> str:
    """``size`` bytes as the plainest exact quantity (``64Mi``, ``10Gi``, ``1000``)."""
    for suffix, unit in (("Ei", 1 << 60), ("Pi", 1 << 50), ("Ti", 1 << 40), ("Gi", 1 << 30),
                         ("Mi", 1 << 20), ("Ki", 1 << 10)):  # fmt: skip
        if size and size % unit == 0:
            return f"{size // unit}{suffix}"
    return str(size)


def parse_quantity(text: str) -> int:
    """Return the number of bytes ``text`` stands for, rounded up to a whole byte.

    :param text: plain bytes, or a number with a decimal (``k M G T P E``) or binary
        (``Ki Mi Gi Ti Pi Ei``) suffix; a decimal fraction is allowed (``1.5Gi``).
    :raises ValueError: ``text`` is not a quantity, is zero, or is larger than 1 EiB.
    """
    match = _QUANTITY.fullmatch(text)
    if match is None:
        raise ValueError(f"{text!r} is not a quantity such as 512Mi, 10Gi, 1G or 1073741824")
    number, suffix = str(match.group(1)), str(match.group(2) or "")
    # Exact in integers (no decimal module on the mount path): W.F is int(WF) / 10**len(F),
    # and the bytes are that times the multiplier, rounded up.
    whole, _, fraction = number.partition(".")
    scale: int = 10 ** len(fraction)
    value = -(-int(whole + fraction) * _MULTIPLIERS[suffix] // scale)
    if value <= 0:
        raise ValueError(f"{text!r} is zero bytes")
    if value > MAX_BYTES:
        raise ValueError(f"{text!r} is larger than 1Ei")
    return value
