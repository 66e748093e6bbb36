"""Limit math: pure functions, no I/O.

Every backend (SQLite, Redis) asks this module which limits apply to a call and evaluates
them with the same rule, so a 429, ``status`` and the live line all explain themselves from
one source.

A limit is data, independent of the live counters:

* ``kind="hold"``  -- settled + in flight + reserve must be <= cap (the pre-gate);
* ``kind="wall"``  -- settled must be < cap (the seed's soft-evict lines: once crossed the
  model is evicted and answered 429 before any token counting).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "Counters",
    "Limit",
    "LimitKind",
    "Scope",
    "Verdict",
    "verdict",
]

Scope = Literal["run", "model_day"]
LimitKind = Literal["hold", "wall"]


@dataclass(frozen=True)
class Limit:
    name: str  # "run_cap", "daily_cap", "snapshot", "usage_wall", "balance_wall"
    scope: Scope
    cap: int
    kind: LimitKind = "hold"
    detail: str = ""  # how the cap was derived, for messages


@dataclass(frozen=True)
class Counters:
    settled: int = 0
    in_flight: int = 0


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    blocking: Limit | None = None  # the first limit that refused the call

    @property
    def reason(self) -> str:
        if self.blocking is None:
            return "fits"
        return "evicted" if self.blocking.kind == "wall" else "over_limit"


def verdict(limits: Sequence[Limit], counters: Mapping[str, Counters], reserve: int) -> Verdict:
    """Decide one call. Walls are checked first: an evicted model is refused whatever it asks."""
    ordered = sorted(limits, key=lambda limit: limit.kind != "wall")
    for limit in ordered:
        c = counters.get(limit.scope, Counters())
        if limit.kind == "wall":
            if c.settled >= limit.cap:
                return Verdict(False, limit)
        elif c.settled + c.in_flight + reserve > limit.cap:
            return Verdict(False, limit)
    return Verdict(True)
