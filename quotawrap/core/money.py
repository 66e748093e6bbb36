"""Money, exactly: a cost is an ``int`` of micro-CNY (1e-6 CNY), with its format and parse.

Integers add exactly and atomically in any ledger, and a price per million tokens times a token
count *is* micro-CNY, so the only rounding is one ceiling per call (never in the caller's favour).
Pure: the limit math (``quota``) and the price table (``prices``) both build on it. The
policy for a model without a price lives here too, so checking ``--unknown-price`` at start
does not build the price table.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from decimal import ROUND_DOWN, Decimal, InvalidOperation
from typing import Final, Literal, get_args

from .errors import ConfigError

__all__ = ["UNKNOWN_PRICE_POLICIES", "Cost", "UnknownPricePolicy", "format_cny", "micro_cny", "parse_cny"]

# "conservative": the table's dearest prices, flagged estimated; "error": refuse the call (UnknownPrice)
UnknownPricePolicy = Literal["conservative", "error"]
UNKNOWN_PRICE_POLICIES: Final = get_args(UnknownPricePolicy)


class Cost(int):
    """An amount in micro-CNY (1e-6 CNY). It *is* an ``int``: store it, add it, compare it.

    ``estimated`` is True when the price behind it was a default or an unverified estimate
    rather than a known list price. Adding costs keeps the flag if either side had it; any
    other arithmetic gives a plain ``int``.
    """

    estimated: bool

    def __new__(cls, micro_cny: int = 0, *, estimated: bool = False) -> Cost:
        self = super().__new__(cls, micro_cny)
        self.estimated = estimated
        return self

    def __add__(self, other: object) -> Cost:
        if not isinstance(other, int) or isinstance(other, bool):
            return NotImplemented
        flagged = self.estimated or bool(getattr(other, "estimated", False))
        return Cost(int(self) + int(other), estimated=flagged)

    __radd__ = __add__

    @property
    def cny(self) -> Decimal:
        return Decimal(int(self)).scaleb(-6)

    def format(self) -> str:
        """``¥0.0123``, or ``~¥0.0123`` when estimated."""
        return format_cny(self)


def format_cny(micro_cny: int, *, estimated: bool | None = None) -> str:
    """Render micro-CNY exactly as CNY: ``¥0.000047``, ``¥1,234.500000`` (``~¥…`` when estimated, ``-¥…`` when
    negative).

    One rule everywhere (summary, report, sessions, step summary, refusals): all six decimals, never
    rounded, so a total reads as the sum of its rows and equals the JSON's ``cost_micro_cny`` / 1e6.
    ``estimated`` defaults to the value's own flag when it is a :class:`Cost`.
    """
    if estimated is None:
        estimated = bool(getattr(micro_cny, "estimated", False))
    whole, micro = divmod(abs(int(micro_cny)), 1_000_000)
    sign = "-" if int(micro_cny) < 0 else ""
    return f"{'~' if estimated else ''}{sign}¥{whole:,}.{micro:06d}"


def parse_cny(text: str | int | float | Decimal) -> int:
    """An amount of CNY (``5``, ``"0.50"``, ``"¥2"``) as micro-CNY, for caps like ``--cap-cost``.

    Digits beyond a micro-CNY are dropped: a cap never grows by rounding.
    """
    raw = text.strip().lstrip("¥").strip() if isinstance(text, str) else text
    if isinstance(raw, bool):
        raise ConfigError(f"not an amount of CNY: {text!r}")
    try:
        amount = Decimal(str(raw)) if isinstance(raw, float) else Decimal(raw)
    except (InvalidOperation, ValueError, TypeError):
        raise ConfigError(f"not an amount of CNY: {text!r}") from None
    if not amount.is_finite() or amount < 0:
        raise ConfigError(f"an amount of CNY must be a non-negative number, got {text!r}")
    return int(amount.scaleb(6).to_integral_value(rounding=ROUND_DOWN))


def micro_cny(parts: Iterable[tuple[int, Decimal]]) -> int:
    """Tokens times CNY-per-million is micro-CNY; round the sum up once, so no call is undercharged."""
    total = _ZERO  # a loop, not sum() over a generator: half the cost, and every reserve and settle asks
    for tokens, price in parts:
        total += Decimal(tokens) * price
    return math.ceil(total)


_ZERO: Final = Decimal(0)
