"""Package expiry advice: pure functions, no I/O.

Free packages are consumed FIFO and each lives 30 days (§1.2, §1.3 of the VolcEngine quota
notes): what a model must use a day to save the packages about to expire, what expires anyway
when the daily cap cannot, and which packages leave the pool before the next sync.
``docs/quota-math.md`` derives the formulas; the section numbers point into the notes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .quota import DAY_S, Package
from .records import Record

__all__ = [
    "KEEP_ALIVE_WINDOW_DAYS",
    "ExpiryAdvice",
    "days_to_expiry",
    "drain_daily_usage",
    "expiring_at_rate",
    "expiring_before",
    "keep_alive_daily_usage",
]

KEEP_ALIVE_WINDOW_DAYS = 9  # §1.3: below 2M/30 a day, the consumption task works the last 9 days


class ExpiryAdvice(Record, frozen=True):
    model: str
    expiring: tuple[Package, ...]  # the model's packages expiring within the window, soonest first
    expiring_tokens: int
    first_expiry_at: float
    daily_usage: int  # tokens a day that use every package up before it expires (FIFO)
    daily_cap: int = 2_000_000
    # what still expires at the most one day may collect: 0 when daily_usage <= daily_cap
    shortfall: int = 0

    @property
    def advised_daily_usage(self) -> int:
        """The daily usage to aim for: what saves every package, but never past the collection cap."""
        return min(self.daily_usage, self.daily_cap)

    def text(self) -> str:
        """The advice in one sentence, the shortfall said plainly."""
        if self.shortfall:
            return (
                f"use {self.advised_daily_usage:,} a day (the daily cap; {self.daily_usage:,} would be needed):"
                f" even so {self.shortfall:,} tokens expire unused"
            )
        return f"use {self.daily_usage:,} a day to consume them before they expire"


def days_to_expiry(package: Package, now: float) -> float:
    return (package.expires_at - now) / DAY_S


def drain_daily_usage(packages: Sequence[Package], now: float) -> int:
    """Tokens a day that consume these packages (one model's) before each expires.

    Consumption is FIFO and every package lives 30 days, so a package is used only after all
    that expire before it: package k survives iff usage by its expiry covers everything due by
    then. One 2M package with 30 days left needs 2M/30 = 66,667 a day (§1.3).
    """
    live = sorted((p for p in packages if p.expires_at > now and p.available > 0), key=lambda p: p.expires_at)
    due = 0
    rate = 0.0
    for package in live:
        due += package.available
        rate = max(rate, due / days_to_expiry(package, now))
    return math.ceil(rate - 1e-9)


def expiring_at_rate(packages: Sequence[Package], now: float, daily_rate: int) -> int:
    """Tokens that expire unused when one model's packages are drawn FIFO at ``daily_rate`` a day.

    A package is drawn after every package expiring before it; what a package still holds at its
    expiry is lost and takes no capacity from the ones after it.
    """
    live = sorted((p for p in packages if p.expires_at > now and p.available > 0), key=lambda p: p.expires_at)
    drawn = 0.0
    lost = 0
    for package in live:
        take = min(float(package.available), max(0.0, daily_rate * days_to_expiry(package, now) - drawn))
        drawn += take
        lost += package.available - math.floor(take)
    return lost


def expiring_before(packages: Sequence[Package], now: float, until: float) -> list[Package]:
    """Packages still live at ``now`` that expire by ``until``: the pool loses them before the next sync."""
    return [p for p in packages if now < p.expires_at <= until]


def keep_alive_daily_usage(
    packages: Sequence[Package],
    now: float,
    window_days: float = KEEP_ALIVE_WINDOW_DAYS,
    daily_cap: int = 2_000_000,
) -> list[ExpiryAdvice]:
    """Per model with a package expiring within ``window_days``: what expires, the daily usage saving it.

    Usage above the daily cap is not returned (§1.2), so the advice never asks for more than the
    cap; when even the cap cannot save everything, ``shortfall`` says how much expires anyway.
    """
    advice = []
    for model in sorted({p.model for p in packages}):
        own = [p for p in packages if p.model == model]
        expiring = tuple(
            sorted(
                (p for p in own if p.available > 0 and 0 < days_to_expiry(p, now) <= window_days),
                key=lambda p: p.expires_at,
            )
        )
        if not expiring:
            continue
        # only what must go before the last expiring package counts; later packages can wait
        horizon = expiring[-1].expires_at
        due = [p for p in own if p.expires_at <= horizon]
        needed = drain_daily_usage(due, now)
        advice.append(
            ExpiryAdvice(
                model=model,
                expiring=expiring,
                expiring_tokens=sum(p.available for p in expiring),
                first_expiry_at=expiring[0].expires_at,
                daily_usage=needed,
                daily_cap=daily_cap,
                shortfall=expiring_at_rate(due, now, daily_cap) if needed > daily_cap else 0,
            )
        )
    return advice
