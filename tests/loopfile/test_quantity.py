"""Kubernetes quantities as byte counts."""

from __future__ import annotations

import pytest
from flexhub_loopfile._quantity import MAX_BYTES, parse_quantity


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1", 1),
        ("1073741824", 1 << 30),
        ("512Mi", 512 << 20),
        ("10Gi", 10 << 30),
        ("1G", 10**9),
        ("1k", 1000),
        ("1Ki", 1024),
        ("2T", 2 * 10**12),
        ("1Ti", 1 << 40),
        ("1P", 10**15),
        ("1Pi", 1 << 50),
        ("1E", 10**18),
        ("1Ei", 1 << 60),
        ("1.5Gi", 3 << 29),
        ("1.5G", 1_500_000_000),
        ("0.5Ki", 512),
        ("0.001k", 1),
        ("0.0001k", 1),  # 0.1 byte rounds up to a whole byte
        ("1.1", 2),
        ("0.000000001Ei", 1_152_921_505),  # 1152921504.606846976 rounded up, exactly
        ("007", 7),
    ],
)
def test_parses(text: str, expected: int) -> None:
    assert parse_quantity(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "",
        "0",
        "0Gi",
        "0.0",
        "-1",
        "+1",
        "1gi",
        "1g",
        "1K",  # Kubernetes' decimal kilo is lower-case k
        "1 Gi",
        " 1Gi",
        "1Gi ",
        "1e3",
        "1.Gi",
        ".5Gi",
        "1.5.5",
        "Gi",
        "1Bi",
        "1m",  # milli-bytes make no sense for a file size
        "1.0000000001",  # more than 9 fraction digits
        "12345678901234567890",  # more than 19 digits
        "2Ei",
        "1.0000001Ei",
        "1152921504606846977",
        "٣",  # non-ASCII digit
    ],
)
def test_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_quantity(text)


def test_upper_bound_is_inclusive() -> None:
    assert parse_quantity(str(MAX_BYTES)) == MAX_BYTES
    assert parse_quantity("1024Pi") == MAX_BYTES


def test_integer_arithmetic_agrees_with_decimal() -> None:
    """The parser works in integers (no ``decimal`` import on the mount path); on every shape
    the pattern admits it gives what exact decimal arithmetic rounded up gives."""
    import random
    from decimal import ROUND_CEILING, Decimal, localcontext

    from flexhub_loopfile._quantity import _MULTIPLIERS

    rng = random.Random(23)
    for _ in range(20000):
        whole = str(rng.randrange(10 ** rng.randrange(1, 20)))
        digits = rng.randrange(0, 10)
        number = whole + (
            "." + "".join(rng.choice("0123456789") for _ in range(digits)) if digits else ""
        )
        suffix = rng.choice(sorted(_MULTIPLIERS))
        with localcontext(prec=60):
            exact = Decimal(number) * _MULTIPLIERS[suffix]
            expected = int(exact.to_integral_value(rounding=ROUND_CEILING))
        if 0 < expected <= MAX_BYTES:
            assert parse_quantity(number + suffix) == expected, number + suffix
        else:
            with pytest.raises(ValueError):
                parse_quantity(number + suffix)
