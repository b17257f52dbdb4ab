"""Kubernetes quantities (``512Mi``, ``10Gi``, ``1G``, ``1073741824``) as byte counts."""

from __future__ import annotations

import re
from decimal import ROUND_CEILING, Decimal, InvalidOperation, localcontext

__all__ = ["MAX_BYTES", "parse_quantity"]

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


def parse_quantity(text: str) -> int:
    """Return the number of bytes ``text`` stands for, rounded up to a whole byte.

    :param text: plain bytes, or a number with a decimal (``k M G T P E``) or binary
        (``Ki Mi Gi Ti Pi Ei``) suffix; a decimal fraction is allowed (``1.5Gi``).
    :raises ValueError: ``text`` is not a quantity, is zero, or is larger than 1 EiB.
    """
    match = _QUANTITY.fullmatch(text)
    if match is None:
        raise ValueError(f"{text!r} is not a quantity such as 512Mi, 10Gi, 1G or 1073741824")
    number, suffix = match.group(1), match.group(2) or ""
    # 19 + 9 digits times a 19-digit multiplier: 60 digits keep every product exact.
    with localcontext(prec=60):
        try:
            exact = Decimal(number) * _MULTIPLIERS[suffix]
        except InvalidOperation:  # pragma: no cover - the pattern only lets digits through
            raise ValueError(f"{text!r} is not a quantity") from None
        value = int(exact.to_integral_value(rounding=ROUND_CEILING))
    if value <= 0:
        raise ValueError(f"{text!r} is zero bytes")
    if value > MAX_BYTES:
        raise ValueError(f"{text!r} is larger than 1Ei")
    return value
